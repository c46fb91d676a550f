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
build's CTestTestfile.cmake files, for two reasons: every ctest call in a build folder rewrites its
Testing/Temporary/LastTest.log, which a test run there may be writing; and the JSON leaves out
the command of a test whose executable is not built yet, so the executable is read from the
test's add_test line, which names it from the configure on.

Prints one line per problem and exits 1 if there is any; else one "ok:" line.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# add_test([=[name]=] "command" ...) as CMake writes it into CTestTestfile.cmake.
ADD_TEST = re.compile(r'^add_test\(\[(=*)\[(.*?)\]\1\]\s+"((?:\\.|[^"\\])*)"', re.M)


def read_targets(path):
    """The file's targets: one a line, `#` starts a comment."""
    with open(path) as f:
        return [t for t in (line.split("#", 1)[0].strip() for line in f) if t]


def copy_test_files(build, into):
    """Copies every CTestTestfile.cmake under build to the same place under into; returns the
    executable of each test's add_test line, by test name."""
    commands = {}
    for folder, dirs, files in os.walk(build):
        dirs[:] = [d for d in dirs if d not in ("CMakeFiles", "Testing")]
        if "CTestTestfile.cmake" not in files:
            continue
        src = os.path.join(folder, "CTestTestfile.cmake")
        dst = os.path.join(into, os.path.relpath(folder, build))
        os.makedirs(dst, exist_ok=True)
        shutil.copy(src, dst)
        with open(src) as f:
            for m in ADD_TEST.finditer(f.read()):
                commands[m.group(2)] = re.sub(r"\\(.)", r"\1", m.group(3))
    return commands


def gpu_tests(build):
    """The gpu-labelled tests: [(name, executable, required files)]."""
    with tempfile.TemporaryDirectory(prefix="fsdp-gpu-targets-") as copy:
        commands = copy_test_files(build, copy)
        cmd = ["ctest", "--test-dir", copy, "-L", "gpu", "--show-only=json-v1"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit("FAIL: %s exited %d: %s" % (" ".join(cmd), run.returncode, run.stderr.strip()[:500]))
    tests = []
    for test in json.loads(run.stdout)["tests"]:
        required = []
        for prop in test.get("properties", []):
            if prop["name"] == "REQUIRED_FILES":
                value = prop["value"]
                required = value.split(";") if isinstance(value, str) else value
        tests.append((test["name"], commands.get(test["name"], ""), required))
    return tests


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
