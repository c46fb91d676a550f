#!/usr/bin/env python3
"""Checks the sources of fsdp-cpp against the layer map in cmake/layers.cmake.

    python3 scripts/check_layers.py [SOURCE_ROOT]

Why: the layers are static libraries, but every layer compiles with all of src/ and include/ on
its include path, so the compiler alone lets any file include any other. This check is what
makes the map true (docs/architecture.md, "Layers"); it runs before any layer compiles (target
fsdp_layer_check), and tests/scripts/test_layer_check.sh plants one violation of each rule.

An include is either quoted ("core/unit.h") or angled (<fsdp/core/options.h>). An angled one
counts as the project's when it starts with the folder `fsdp/` or a layer's (`core/`), or it
climbs with "../"; every other angled include (<memory>, <torch/torch.h>) is a system or library
header and is not checked.

Rules:
  1. No include climbs with "../": a path names its layer ("core/unit.h" from src/,
     "fsdp/core/options.h" from include/) or is a file beside the includer.
  2. A file of layer L (src/L/**, include/fsdp/L/**) includes only files of L and of the
     layers L may use: those named after DEPENDS in L's line, and theirs in turn.
  3. A public header (include/fsdp/**) includes no internal header (src/**): installed
     programs cannot see them.
  4. Tools (tools/**) and examples (examples/**) use the public headers only.
  5. An include in the library that resolves to no file of the tree is an error, so no path
     slips in through another include directory.
  6. Every source and header under src/ and include/ lies in a layer folder (src/L/,
     include/fsdp/L/ for a layer L of the map): a file anywhere else belongs to no library
     (or to one no rule covers) and could include, and be included by, anything.
  7. No layer declares a dependency it does not use: for each X after DEPENDS in L's line,
     some file of L includes a file of X. The map says no more than the code does.
Exit status 0 when the tree keeps every rule; 1 with one line per violation otherwise, each
saying what is wrong, where (file and line), and how to fix it.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set, Tuple

MAP = os.path.join("cmake", "layers.cmake")
INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)', re.M)
LAYER_RE = re.compile(r'^\s*fsdp_layer\(\s*(\w+)((?:\s+DEPENDS(?:\s+\w+)+)?)\s*\)', re.M)
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc")
LIBRARY_TOPS = ("src", "include")
CHECKED_TOPS = ("src", "include", "tools", "examples", "tests", "bench")


@dataclass(frozen=True)
class Layer:
    """One fsdp_layer(...) line of the map."""
    name: str
    depends: Tuple[str, ...]  # as written after DEPENDS, not the layers below them
    line: int                 # in cmake/layers.cmake


@dataclass(frozen=True)
class Include:
    """One #include of the project's, as written."""
    file: str   # the includer, relative to the source root
    line: int
    path: str   # between the quotes or brackets
    angled: bool

    def __str__(self) -> str:
        spelled = f"<{self.path}>" if self.angled else f'"{self.path}"'
        return f"{self.file}:{self.line}: #include {spelled}"


def read_layers(root: str) -> Dict[str, Layer]:
    """The map's layers by name, lowest first; exits if a layer names one listed after it."""
    path = os.path.join(root, MAP)
    text = open(path).read()
    layers: Dict[str, Layer] = {}
    for m in LAYER_RE.finditer(text):
        name, deps = m.group(1), tuple(m.group(2).split()[1:])
        unknown = [d for d in deps if d not in layers]
        if unknown:
            sys.exit(f"check_layers: {path}: layer {name} names {', '.join(unknown)} before "
                     "their own lines (list layers lowest first)")
        layers[name] = Layer(name, deps, text.count("\n", 0, m.start()) + 1)
    return layers


def usable(layers: Dict[str, Layer]) -> Dict[str, Set[str]]:
    """For each layer, the layers its files may include: itself, its DEPENDS and theirs."""
    allowed: Dict[str, Set[str]] = {}
    for layer in layers.values():
        allowed[layer.name] = {layer.name}.union(*(allowed[d] for d in layer.depends))
    return allowed


def layer_of(rel: str) -> Optional[str]:
    """The layer folder a tree-relative path lies in (declared or not), or None."""
    m = re.match(r"(?:src|include/fsdp)/(\w+)/", rel)
    return m.group(1) if m else None


def source_files(root: str, top: str) -> Iterator[str]:
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in files:
            if f.endswith(SOURCE_SUFFIXES):
                yield os.path.relpath(os.path.join(dirpath, f), root)


def climbs(path: str) -> bool:
    return path.startswith("../") or "/../" in path


def is_project_include(path: str, angled: bool, layers: Dict[str, Layer]) -> bool:
    """Quoted includes are all the project's; angled ones when they name a folder fsdp/ or a
    layer's (<memory> is the standard header, <memory/buffer_pool.h> the layer's)."""
    if not angled:
        return True
    first, slash, _ = path.partition("/")
    return (bool(slash) and (first == "fsdp" or first in layers)) or climbs(path)


def read_includes(root: str, rel: str, layers: Dict[str, Layer]) -> List[Include]:
    text = open(os.path.join(root, rel), errors="replace").read()
    found = []
    for m in INCLUDE_RE.finditer(text):
        quoted, angled = m.group(1), m.group(2)
        path = quoted if quoted is not None else angled
        if is_project_include(path, angled is not None, layers):
            found.append(Include(rel, text.count("\n", 0, m.start()) + 1, path, angled is not None))
    return found


def resolve(root: str, inc: Include) -> Optional[str]:
    """The tree-relative file an include names, or None. A quoted include is looked up beside
    its includer first, as the compiler does; then include/ and src/ (the include path)."""
    here = [os.path.join(os.path.dirname(inc.file), inc.path)] if not inc.angled else []
    for cand in here + [os.path.join("include", inc.path), os.path.join("src", inc.path)]:
        cand = os.path.normpath(cand)
        if os.path.isfile(os.path.join(root, cand)):
            return cand
    return None


# --- rules -----------------------------------------------------------------------------

def check_outside_layer(rel: str, layers: Dict[str, Layer]) -> Optional[str]:
    """Rule 6: a library source or header lies in the folder of a declared layer."""
    folder = layer_of(rel)
    if folder in layers:
        return None
    why = (f"'{folder}' is no layer of {MAP}" if folder is not None
           else f"{os.path.dirname(rel)}/ is no layer folder")
    return (f"{rel}: outside a layer folder ({why}); move it into a layer folder "
            f"(src/<layer>/ or include/fsdp/<layer>/ for a layer of {MAP})")


def check_include(root: str, top: str, inc: Include,
                  allowed: Dict[str, Set[str]]) -> Tuple[Optional[str], Optional[str]]:
    """Rules 1-5 for one include: (the violation or None, the file it names or None)."""
    if climbs(inc.path):
        return f"{inc}: climbs with '../'; name the path from src/ or include/", None
    if top in ("tests", "bench"):
        return None, None
    target = resolve(root, inc)
    if top in ("tools", "examples"):
        if target and target.startswith("src/"):
            return (f"{inc}: {top}/ uses public headers only (include/fsdp/); "
                    f"use the public API instead of {target}"), target
        return None, target
    if target is None:
        return (f"{inc}: names no file of the tree (beside it, include/ or src/); "
                "spell its path from src/ or include/, or add the file"), None
    if inc.file.startswith("include/") and target.startswith("src/"):
        return (f"{inc}: a public header includes an internal one ({target}); "
                "move what it needs into a public header, or include it from the .cpp"), target
    mine, theirs = layer_of(inc.file), layer_of(target)
    if mine not in allowed or theirs not in allowed:
        return None, target  # a file outside the layers: check_outside_layer reports it
    if theirs not in allowed[mine]:
        uses = ", ".join(sorted(allowed[mine] - {mine})) or "nothing"
        return (f"{inc}: layer '{mine}' may not use layer '{theirs}' ({MAP}: {mine} uses {uses}); "
                f"move the code into a layer that may use '{theirs}', or turn the call around "
                "(an interface in the lower layer)"), target
    return None, target


def check_unused_depends(layers: Dict[str, Layer], used: Set[Tuple[str, str]]) -> List[str]:
    """Rule 7: each X after DEPENDS in L's line is used by an include from L into X."""
    errors = []
    for layer in layers.values():
        for dep in layer.depends:
            if (layer.name, dep) not in used:
                errors.append(
                    f"{MAP}:{layer.line}: layer '{layer.name}' declares DEPENDS {dep}, but no file "
                    f"of {layer.name} (src/{layer.name}/, include/fsdp/{layer.name}/) includes a "
                    f"file of {dep}; remove {dep} from {layer.name}'s DEPENDS")
    return errors


def check(root: str) -> List[str]:
    layers = read_layers(root)
    allowed = usable(layers)
    errors: List[str] = []
    used: Set[Tuple[str, str]] = set()  # (L, X): a file of layer L includes a file of layer X
    for top in CHECKED_TOPS:
        for rel in sorted(source_files(root, top)):
            if top in LIBRARY_TOPS:
                outside = check_outside_layer(rel, layers)
                if outside:
                    errors.append(outside)
            for inc in read_includes(root, rel, layers):
                error, target = check_include(root, top, inc, allowed)
                if error:
                    errors.append(error)
                if top in LIBRARY_TOPS and target is not None:
                    used.add((layer_of(rel), layer_of(target)))
    errors += check_unused_depends(layers, used)
    return errors


def main() -> int:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} violation(s) of the layer map ({MAP}; rules in "
              "scripts/check_layers.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
