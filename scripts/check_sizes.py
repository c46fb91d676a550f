#!/usr/bin/env python3
"""Finds library code too long to read in one sitting.

    python3 scripts/check_sizes.py DIR...

Prints one line per file of more than 600 lines and per function body of more than 80
lines (C++ sources and headers under the DIRs), as FILE:LINE: what. Nothing printed: every
file and function is within bounds. A function is a brace block opened at namespace or
class scope by something other than namespace/class/struct/union/enum; string and
character literals and // comments are ignored when counting braces.

Known exceptions would be listed in ALLOWED (file and first line of the signature), each with
the reason it stays; there are none.
"""
from __future__ import annotations

import os
import re
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
ALLOWED: set = set()
SCOPE_RE = re.compile(r"^\s*(?:template\s*<.*>\s*)?(namespace|extern|class|struct|union|enum)\b")


def code_of(line: str) -> str:
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//")[0]


def signature_start(lines: list[str], i: int) -> int:
    """The first line of the declaration whose body opens on line i."""
    j = i
    while j > 0 and lines[j - 1].strip() and not re.search(r"[;{}]\s*$", code_of(lines[j - 1])) \
            and not lines[j - 1].lstrip().startswith(("//", "#")):
        j -= 1
    return j


def check(path: str, rel: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    out = []
    if len(lines) > MAX_FILE_LINES:
        out.append(f"{rel}:1: {len(lines)} lines (at most {MAX_FILE_LINES}): split it along its concepts")
    stack: list[str] = []
    start = None
    for i, raw in enumerate(lines):
        code = code_of(raw)
        for ch in code:
            if ch == "{":
                kind = "scope" if SCOPE_RE.match(code) else "body"
                if kind == "body" and start is None and all(k == "scope" for k in stack):
                    start, depth = i, len(stack)
                stack.append(kind)
            elif ch == "}":
                if stack:
                    stack.pop()
                if start is not None and len(stack) == depth:
                    n = i - start + 1
                    first = signature_start(lines, start)
                    sig = lines[first].strip()
                    if n > MAX_FUNCTION_LINES and not any(rel == f and sig.startswith(s) for f, s in ALLOWED):
                        out.append(f"{rel}:{first + 1}: a function of {n} lines (at most {MAX_FUNCTION_LINES}): "
                                   f"{sig[:70]}: cut it into named phases")
                    start = None
    return out


def main(argv: list[str]) -> int:
    found = []
    for top in argv[1:]:
        for root, _, files in os.walk(top):
            for name in sorted(files):
                if name.endswith((".cpp", ".h")):
                    path = os.path.join(root, name)
                    found += check(path, os.path.relpath(path))
    print("\n".join(found)) if found else None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
