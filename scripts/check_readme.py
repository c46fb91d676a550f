#!/usr/bin/env python3
"""Keeps the README's feature table well-formed and its local links alive.

    python3 scripts/check_readme.py [README] [--root DIR]

README defaults to the README.md next to this script's folder; links are resolved against
--root (default: the README's folder), so a copy of the README elsewhere can be checked
against the real tree. Prints one line per problem and exits 1 if there is any:

  - the feature table (the one whose header is `| feature | state | tested by | doc |`) has
    more than MAX_ROWS rows, or is missing;
  - a cell of it is longer than MAX_CELL characters (the README is read in five minutes; the
    evidence belongs in docs/status.md);
  - a row has another number of cells than the header: an unescaped `|` inside a cell cuts
    the row there when rendered (write `\\|`);
  - a link or image of the README points at a local file that does not exist.

Python 3 standard library only: .ci/run runs it before anything is built.
"""

import argparse
import os
import re
import sys

MAX_ROWS = 22
MAX_CELL = 120
HEADER = ["feature", "state", "tested by", "doc"]

# [text](target) and ![alt](target); the target ends at the first space (a title may follow).
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def split_cells(line):
    """The cells of a table row: split at every `|` not escaped by a backslash, with the
    row's leading and trailing pipe removed. Inline code does not protect a `|` in a GFM
    table either, so it is not treated specially."""
    s = line.strip()
    cells, cell, i = [], [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            cell.append(s[i : i + 2])
            i += 2
            continue
        if c == "|":
            cells.append("".join(cell))
            cell = []
        else:
            cell.append(c)
        i += 1
    cells.append("".join(cell))
    if s.startswith("|"):
        cells = cells[1:]
    if s.endswith("|") and not s.endswith("\\|"):
        cells = cells[:-1]
    return [c.strip() for c in cells]


def is_separator(cells):
    return bool(cells) and all(re.fullmatch(r":?-{3,}:?", c) for c in cells)


def unfenced_lines(text):
    """(line number, line) of every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def row_name(cells, number):
    first = cells[0] if cells else ""
    if len(first) > 40:
        first = first[:37] + "..."
    return f"row {number} ({first!r})"


def check_table(lines):
    problems = []
    start = None
    for i, (_, line) in enumerate(lines):
        if line.lstrip().startswith("|") and [c.lower() for c in split_cells(line)] == HEADER:
            start = i
            break
    if start is None:
        return ["feature table: none found (a table whose header is | " + " | ".join(HEADER) + " |)"]
    if start + 1 >= len(lines) or not is_separator(split_cells(lines[start + 1][1])):
        return [f"feature table (line {lines[start][0]}): the header is not followed by a | --- | line"]
    rows = []
    for number, line in lines[start + 2 :]:
        if not line.lstrip().startswith("|"):
            break
        rows.append((number, line))
    if len(rows) > MAX_ROWS:
        problems.append(f"feature table: {len(rows)} rows, at most {MAX_ROWS} (group related rows)")
    for k, (number, line) in enumerate(rows, start=1):
        cells = split_cells(line)
        name = f"feature table {row_name(cells, k)}, line {number}"
        if len(cells) != len(HEADER):
            problems.append(f"{name}: {len(cells)} cells, the header has {len(HEADER)} "
                            "(an unescaped | inside a cell? write \\|)")
        for j, cell in enumerate(cells):
            column = HEADER[j] if j < len(HEADER) else f"column {j + 1}"
            if len(cell) > MAX_CELL:
                problems.append(f"{name}: cell '{column}' has {len(cell)} characters, at most {MAX_CELL} "
                                "(move the evidence to docs/status.md)")
    return problems


def check_links(lines, root):
    problems = []
    for number, line in lines:
        targets = INLINE_LINK.findall(line)
        ref = REFERENCE_LINK.match(line)
        if ref:
            targets.append(ref.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http:, https:, mailto:, ... and anchors inside the README
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not path:
                continue
            if not os.path.exists(os.path.join(root, path)):
                problems.append(f"line {number}: link to a local file that does not exist: {target}")
    return problems


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("readme", nargs="?", default=os.path.relpath(os.path.join(here, "..", "README.md")))
    parser.add_argument("--root", help="folder the README's relative links start from (default: its own)")
    args = parser.parse_args(argv)
    try:
        with open(args.readme, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        print(f"check_readme: cannot read {args.readme}: {e.strerror}")
        return 1
    root = args.root or os.path.dirname(os.path.abspath(args.readme))
    lines = list(unfenced_lines(text))
    problems = check_table(lines) + check_links(lines, root)
    for p in problems:
        print(f"{args.readme}: {p}")
    if problems:
        return 1
    print(f"check_readme: {args.readme}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
