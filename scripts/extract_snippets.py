#!/usr/bin/env python3
"""Extracts every C++ snippet of the documentation into translation units that compile.

    python3 scripts/extract_snippets.py --source ROOT --list
    python3 scripts/extract_snippets.py --source ROOT --out DIR

--list prints one line per snippet (what CMake makes targets of, at configure time);
--out writes DIR/<name>.cpp for each snippet to compile (a file only when its text changed,
so an unchanged snippet is not recompiled; a .cpp of a snippet that is gone is removed) and
DIR/snippets.txt, the same listing.
Listing lines are tab-separated: KIND NAME ORIGIN NOTE, where KIND is
  fragment  compiled under the project's precompiled header (tests/snippets/CMakeLists.txt);
  program   a whole program: compiled on its own, linked, and run by tests/scripts/test_snippets.sh;
  skipped   marked not compiled (NOTE says why): counted and reported, never compiled;
NAME is the generated file's name without .cpp (<file>_<n>: README_2, trainer_trainer_1 for the
first snippet of include/fsdp/trainer/trainer.h; n counts every C++ snippet of the file, so the
names stay put when one is marked), ORIGIN is FILE:LINE of the snippet's first line.

Where snippets are:
  * README.md: fenced blocks whose info string starts with cpp or c++ (```cpp).
  * include/fsdp/**/*.h: indented code blocks inside /// comments, as Markdown defines them:
    lines indented by at least 4 spaces past "/// ", after a blank "///" line or the start of
    the comment, up to the first less-indented text line or the end of the comment. An indented
    line that continues a paragraph or a list item is text, not code.

Marking a snippet that is deliberately not compilable: make its first line
    // not compiled: <why>
It is then listed as skipped with the reason, and the test reports it. Nothing else is skipped.

How a snippet becomes a translation unit:
  1. A program is a snippet that defines `int main(`. It is compiled as it stands, without the
     precompiled header, so that it needs exactly the #includes it shows (a reader copies it
     whole). One change: `.devices(N)` becomes `.devices(1)`, so that the test runs a Trainer
     program as one process (its other options, data and steps as written).
  2. Every other snippet is a fragment: code that assumes a context. It is compiled under the
     precompiled header (<torch/torch.h>), after
       - the header it is documented in (for a header snippet),
       - tests/snippets/snippet_fixtures.h: the names the documentation uses without declaring
         them (pg, model, optimizer, x, y, MyNet, NetImpl, BlockImpl, MyDataset, ...),
       - the snippet's own #include lines, moved to the top,
     inside `namespace snippet_<NAME>`, so that a snippet's own declaration of a fixture's name
     hides the fixture, and so that fragments compiled together in one translation unit (CMake
     batches them, tests/snippets/CMakeLists.txt) keep their declarations apart. In it, top-level declarations (lines at brace depth 0 that start `struct`,
     `class`, `enum`, `union`, `template`, `namespace`, `using` or `TORCH_MODULE(`, up to the
     end of that declaration) stay at namespace scope; every other line becomes, in order, the
     body of the function `snippet_body()`.
  3. Two pieces of pseudo-code a reader knows are given meaning: a line that is only `...`
     (and perhaps a comment) stands for omitted code and is dropped; `for (...)` stands for the
     reader's loop and becomes a loop that runs once.
  4. Every line keeps its origin through #line directives, so a compile error names the
     documentation file and line (README.md:75), not the generated file.
"""
import argparse
import os
import re
import sys

NOT_COMPILED_RE = re.compile(r"^\s*//\s*not compiled:\s*(.*\S)")
MAIN_RE = re.compile(r"^\s*int\s+main\s*\(", re.M)
DECL_RE = re.compile(r"^\s*(?:(?:struct|class|enum|union|template|namespace|using)\b|TORCH_MODULE\s*\()")
ELISION_RE = re.compile(r"^\s*\.\.\.\s*(//.*)?$")
LOOP_RE = re.compile(r"\bfor\s*\(\s*\.\.\.\s*\)")
ONCE_LOOP = "for (int snippet_once_ = 0; snippet_once_ < 1; ++snippet_once_)"
DEVICES_RE = re.compile(r"\.devices\(\s*\d+\s*\)")
INCLUDE_RE = re.compile(r"^\s*#\s*include\b")
FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
DOC_RE = re.compile(r"^\s*///(.*)$")


class Snippet:
    def __init__(self, origin, first_line, lines):
        self.origin = origin          # path relative to the source root
        self.first_line = first_line  # 1-based line of lines[0] in origin
        self.lines = lines            # the code, without comment prefix or indentation
        self.name = ""
        self.kind = ""
        self.note = ""


def readme_snippets(path, rel):
    snippets, block, start, fence, indent = [], None, 0, "", 0
    for number, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
        if block is None:
            m = FENCE_RE.match(line)
            if m:
                fence, indent = m.group(2), len(m.group(1))
                lang = m.group(3).lower()
                block, start = ([] if lang in ("cpp", "c++") else False), number + 1
            continue
        if line.strip().startswith(fence[0] * len(fence)) and line.strip().strip(fence[0]) == "":
            if block:
                snippets.append(Snippet(rel, start, block))
            block = None
            continue
        if block is not False:
            block.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
    return snippets


def header_snippets(path, rel):
    """Indented code blocks inside runs of /// lines (see the module docstring)."""
    snippets = []
    code, start = None, 0
    blank_before = True  # the start of a comment counts as a blank line

    def close():
        nonlocal code
        if code:
            while code and code[-1].strip() == "":
                code.pop()
            snippets.append(Snippet(rel, start, code))
        code = None

    for number, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
        m = DOC_RE.match(line)
        if not m:
            close()
            blank_before = True
            continue
        text = m.group(1)
        text = text[1:] if text.startswith(" ") else text
        if text.strip() == "":
            if code is not None:
                code.append("")
            blank_before = True
            continue
        indent = len(text) - len(text.lstrip(" "))
        if indent >= 4 and (code is not None or blank_before):
            if code is None:
                code, start = [], number
            code.append(text[4:])
        else:
            close()
        blank_before = False
    close()
    return snippets


def find_snippets(root):
    found = []
    readme = os.path.join(root, "README.md")
    if os.path.exists(readme):
        found.append(("README", readme_snippets(readme, "README.md")))
    include = os.path.join(root, "include", "fsdp")
    headers = []
    for dirpath, _, files in os.walk(include):
        headers += [os.path.join(dirpath, f) for f in files if f.endswith(".h")]
    for path in sorted(headers):
        rel = os.path.relpath(path, root)
        stem = os.path.splitext(os.path.relpath(path, include))[0].replace(os.sep, "_")
        found.append((stem, header_snippets(path, rel)))
    snippets = []
    for stem, group in found:
        for n, s in enumerate(group, 1):
            s.name = f"{stem}_{n}"
            first = next((l for l in s.lines if l.strip()), "")
            m = NOT_COMPILED_RE.match(first)
            if m:
                s.kind, s.note = "skipped", m.group(1)
            elif MAIN_RE.search("\n".join(s.lines)):
                s.kind = "program"
            else:
                s.kind = "fragment"
            snippets.append(s)
    return snippets


def strip_code(line):
    """The line without string/char literals and comments (for counting brackets)."""
    out, i, quote = [], 0, None
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif line.startswith("//", i):
            break
        else:
            out.append(c)
        i += 1
    return "".join(out)


def line_directive(number, origin):
    return f'#line {number} "{origin}"'


def fragment_source(s):
    """The translation unit of a fragment (rules 2-4 of the module docstring)."""
    includes, scope, body = [], [], []
    depth = 0             # brace depth at the start of the line
    paren = 0             # parenthesis depth at the start of the line
    in_decl = False
    statement_open = False  # the previous code line at depth 0 did not end a statement
    for offset, raw in enumerate(s.lines):
        number = s.first_line + offset
        line = "" if ELISION_RE.match(raw) else LOOP_RE.sub(ONCE_LOOP, raw)
        code = strip_code(line).strip()
        if not line.strip():
            continue  # blank lines carry nothing; #line keeps the numbering
        if depth == 0 and paren == 0 and not in_decl and INCLUDE_RE.match(line):
            includes.append((number, line))
            continue
        if depth == 0 and paren == 0 and not in_decl and not statement_open and DECL_RE.match(line):
            in_decl = True
        target = scope if in_decl else body
        target.append((number, line))
        depth += code.count("{") - code.count("}")
        paren += code.count("(") - code.count(")")
        if code:
            ended = depth == 0 and paren == 0 and (code.endswith(";") or code.endswith("}"))
            if in_decl and ended:
                in_decl = False
            statement_open = not ended and depth == 0
    out = [f"// Generated by scripts/extract_snippets.py from {s.origin}:{s.first_line} (a fragment): do not edit."]
    if s.origin.startswith("include/"):
        out.append(f'#include "{s.origin[len("include/"):]}"')
    out.append('#include "snippets/snippet_fixtures.h"')
    out += emit(includes, s.origin)
    out += [f"namespace snippet_{s.name} {{", "using namespace snippet_fixtures;"]
    out += emit(scope, s.origin)
    out.append("void snippet_body() {")
    out += emit(body, s.origin)
    out += ["}", f"}}  // namespace snippet_{s.name}", ""]
    return "\n".join(out)


def emit(numbered, origin):
    """Lines with a #line directive wherever the numbering jumps."""
    out, expected = [], None
    for number, line in numbered:
        if number != expected:
            out.append(line_directive(number, origin))
        out.append(line)
        expected = number + 1
    return out


def program_source(s):
    out = [f"// Generated by scripts/extract_snippets.py from {s.origin}:{s.first_line} (a program): do not edit.",
           line_directive(s.first_line, s.origin)]
    out += [DEVICES_RE.sub(".devices(1)", l) for l in s.lines]
    out.append("")
    return "\n".join(out)


def listing(snippets):
    return "".join(f"{s.kind}\t{s.name}\t{s.origin}:{s.first_line}\t{s.note}\n" for s in snippets)


def write_if_changed(path, text):
    try:
        if open(path, encoding="utf-8").read() == text:
            return
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="the source root (holds README.md and include/fsdp)")
    parser.add_argument("--out", help="directory to write the translation units and snippets.txt into")
    parser.add_argument("--list", action="store_true", help="print the listing only")
    args = parser.parse_args()
    snippets = find_snippets(args.source)
    if args.list:
        sys.stdout.write(listing(snippets))
        return 0
    if not args.out:
        parser.error("--out DIR or --list")
    os.makedirs(args.out, exist_ok=True)
    # A snippet that is gone (or marked since) leaves no translation unit behind.
    current = {s.name + ".cpp" for s in snippets if s.kind != "skipped"}
    for name in os.listdir(args.out):
        if name.endswith(".cpp") and name not in current:
            os.remove(os.path.join(args.out, name))
    for s in snippets:
        if s.kind == "fragment":
            write_if_changed(os.path.join(args.out, s.name + ".cpp"), fragment_source(s))
        elif s.kind == "program":
            write_if_changed(os.path.join(args.out, s.name + ".cpp"), program_source(s))
    write_if_changed(os.path.join(args.out, "snippets.txt"), listing(snippets))
    counts = {k: sum(s.kind == k for s in snippets) for k in ("fragment", "program", "skipped")}
    print(f"extract_snippets: {len(snippets)} C++ snippets: {counts['fragment']} fragments, "
          f"{counts['program']} programs, {counts['skipped']} marked not compiled")
    for s in snippets:
        if s.kind == "skipped":
            print(f"extract_snippets: not compiled: {s.origin}:{s.first_line}: {s.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
