"""The tests of a configured build, as `ctest --show-only=json-v1` lists them, for the checks that
read the build's tests (check_gpu_targets.py, check_test_lanes.py).

ctest runs on a copy of the build's CTestTestfile.cmake files, for two reasons: every ctest call in
a build folder rewrites its Testing/Temporary/LastTest.log, which a test run there may be writing;
and the JSON leaves out the command of a test whose executable is not built yet, so the executable
is read from the test's add_test line, which names it from the configure on.

Python 3 standard library only.
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


def list_tests(build, *ctest_args):
    """The build's tests that ctest_args select (e.g. "-L", "gpu"): [(name, executable,
    {property: value})], a list-valued property (LABELS, REQUIRED_FILES) as a list. Exits with a
    FAIL line when ctest cannot list them."""
    with tempfile.TemporaryDirectory(prefix="fsdp-ctest-listing-") as copy:
        commands = copy_test_files(build, copy)
        cmd = ["ctest", "--test-dir", copy, *ctest_args, "--show-only=json-v1"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit("FAIL: %s exited %d: %s" % (" ".join(cmd), run.returncode, run.stderr.strip()[:500]))
    tests = []
    for test in json.loads(run.stdout)["tests"]:
        props = {}
        for prop in test.get("properties", []):
            value = prop["value"]
            if prop["name"] in ("LABELS", "REQUIRED_FILES") and isinstance(value, str):
                value = value.split(";")
            props[prop["name"]] = value
        tests.append((test["name"], commands.get(test["name"], ""), props))
    return tests
