#!/usr/bin/env python3
"""Checks every quoted #include of fsdp-cpp against the layer map in cmake/layers.cmake.

    python3 scripts/check_layers.py [SOURCE_ROOT]

Rules (docs/architecture.md, "Layers"):
  1. No include climbs with "../": a path names its layer ("core/unit.h" from src/,
     "fsdp/core/options.h" from include/) or is a file beside the includer.
  2. A file of layer L (src/L/**, include/fsdp/L/**) includes only files of L and of the
     layers L may use: those named after DEPENDS in L's line, and theirs in turn.
  3. A public header (include/fsdp/**) includes no internal header (src/**): installed
     programs cannot see them.
  4. Tools (tools/**) and examples (examples/**) use the public headers only.
  5. An include in the library that resolves to no file of the tree is an error, so no path
     slips in through another include directory.
Exit status 0 when every include keeps the rules; 1 with one line per violation otherwise.
"""
import os
import re
import sys

INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
LAYER_RE = re.compile(r'^\s*fsdp_layer\(\s*(\w+)((?:\s+DEPENDS(?:\s+\w+)+)?)\s*\)', re.M)
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc")


def read_layers(root):
    path = os.path.join(root, "cmake", "layers.cmake")
    direct = {}
    for name, deps in LAYER_RE.findall(open(path).read()):
        names = deps.split()[1:]
        unknown = [d for d in names if d not in direct]
        if unknown:
            sys.exit(f"check_layers: {path}: layer {name} names {', '.join(unknown)} before "
                     "their own lines (list layers lowest first)")
        direct[name] = names
    allowed = {}
    for name, deps in direct.items():
        allowed[name] = {name}.union(*(allowed[d] for d in deps)) if deps else {name}
    return allowed


def layer_of(rel):
    m = re.match(r"(?:src|include/fsdp)/(\w+)/", rel)
    return m.group(1) if m else None


def source_files(root, top):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in files:
            if f.endswith(SOURCE_SUFFIXES):
                yield os.path.relpath(os.path.join(dirpath, f), root)


def resolve(root, rel, inc):
    """The tree-relative file an include names, or None."""
    here = os.path.dirname(rel)
    for cand in (os.path.join(here, inc), os.path.join("include", inc), os.path.join("src", inc)):
        cand = os.path.normpath(cand)
        if os.path.isfile(os.path.join(root, cand)):
            return cand
    return None


def check(root):
    allowed = read_layers(root)
    errors = []
    for top in ("src", "include", "tools", "examples", "tests", "bench"):
        for rel in sorted(source_files(root, top)):
            text = open(os.path.join(root, rel), errors="replace").read()
            for m in INCLUDE_RE.finditer(text):
                inc = m.group(1)
                line = text.count("\n", 0, m.start()) + 1
                where = f"{rel}:{line}: #include \"{inc}\""
                if inc.startswith("../") or "/../" in inc:
                    errors.append(f"{where}: climbs with '../'; name the path from src/ or include/")
                    continue
                if top in ("tests", "bench"):
                    continue
                target = resolve(root, rel, inc)
                if top in ("tools", "examples"):
                    if target and target.startswith("src/"):
                        errors.append(f"{where}: {top}/ uses public headers only (include/fsdp/)")
                    continue
                if target is None:
                    errors.append(f"{where}: names no file of the tree (beside it, include/ or src/)")
                    continue
                if rel.startswith("include/") and target.startswith("src/"):
                    errors.append(f"{where}: a public header includes an internal one ({target})")
                    continue
                mine, theirs = layer_of(rel), layer_of(target)
                if mine is None or theirs is None:
                    continue
                if mine not in allowed:
                    errors.append(f"{rel}: layer '{mine}' is not in cmake/layers.cmake")
                elif theirs not in allowed[mine]:
                    errors.append(f"{where}: layer '{mine}' may not use layer '{theirs}' "
                                  f"(cmake/layers.cmake: {mine} uses {', '.join(sorted(allowed[mine] - {mine})) or 'nothing'})")
    return errors


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} include(s) break the layer map (cmake/layers.cmake)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
