#!/usr/bin/env python3
"""Checks that a target list (scripts/gpu_targets.txt) is exactly what the gpu-labelled tests of
a configured build need.

    python3 scripts/check_gpu_targets.py BUILD_DIR [TARGETS_FILE]

`scripts/gpu_check.sh -L gpu` builds only the listed targets: a gpu test whose executable is not
among them fails for a missing file on the GPU machine, and a listed target that no gpu test needs
costs build time there. What a test needs: its command's executable when that lies in the build's
bin folder, and its REQUIRED_FILES there. A script test's command is `bash script.sh`, so it must
name the tools it runs in REQUIRED_FILES (tests/CMakeLists.txt); a gpu test that needs nothing
visible is reported too. Our executables are named after their targets.

The tests and their properties come from `ctest -L gpu --show-only=json-v1`, run on a copy of the
build's test files (ctest_listing.py says why).

Prints one line per problem and exits 1 if there is any; else one "ok:" line.
"""

import os
import sys

from ctest_listing import list_tests


def read_targets(path):
    """The file's targets: one a line, `#` starts a comment."""
    with open(path) as f:
        return [t for t in (line.split("#", 1)[0].strip() for line in f) if t]


def gpu_tests(build):
    """The gpu-labelled tests: [(name, executable, required files)]."""
    return [(name, executable, props.get("REQUIRED_FILES", []))
            for name, executable, props in list_tests(build, "-L", "gpu")]


def main(build, targets_file):
    build = os.path.realpath(build)
    bin_dir = os.path.join(build, "bin")
    listed = read_targets(targets_file)
    tests = gpu_tests(build)
    if not tests:
        print("FAIL: %s has no gpu-labelled tests (is it configured, with FSDP_BUILD_TESTS on?)" % build)
        return 1
    problems = []
    needed = set()
    for name, executable, required in tests:
        needs = {os.path.basename(f) for f in [executable] + required
                 if f and os.path.dirname(os.path.realpath(f)) == bin_dir}
        if not needs:
            problems.append("FAIL: gpu test %s runs nothing from %s that this check can see: name the "
                            "tools it runs in its REQUIRED_FILES (tests/CMakeLists.txt)" % (name, bin_dir))
        for exe in sorted(needs - set(listed)):
            problems.append("FAIL: gpu test %s needs %s, which %s does not list" % (name, exe, targets_file))
        needed |= needs
    for target in listed:
        if target not in needed:
            problems.append("FAIL: %s lists %s, which no gpu test needs" % (targets_file, target))
    if problems:
        print("\n".join(problems))
        return 1
    print("ok: the %d targets of %s are what the %d gpu tests need" % (len(listed), targets_file, len(tests)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets.txt")
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else default))
