#!/usr/bin/env python3
"""Checks that every test of a configured build carries exactly one lane label.

    python3 scripts/check_test_lanes.py BUILD_DIR

The lanes (tests/CMakeLists.txt gives each test its lane):
  quick      one process, a few seconds: `ctest -L quick` after every change
  multirank  starts rank processes (the multi-rank harness, fsdp-run, torchrun)
  slow       long: over a minute, simulated hosts, or a build of its own
A test that needs a GPU also carries `gpu`. A test with no lane would run in no lane, and one with
two would run twice in a full pass and mislead who picks a lane; any other label is a typo.

The tests and their labels come from `ctest --show-only=json-v1`, run on a copy of the build's test
files (ctest_listing.py says why). Prints one line per problem and exits 1 if there is any; else
one "ok:" line with the count of each lane.
"""

import sys

from ctest_listing import list_tests

LANES = ("quick", "multirank", "slow")
OTHER_LABELS = ("gpu",)


def main(build):
    tests = list_tests(build)
    if not tests:
        print("FAIL: %s has no tests (is it configured, with FSDP_BUILD_TESTS on?)" % build)
        return 1
    problems = []
    counts = {lane: 0 for lane in LANES + OTHER_LABELS}
    for name, _, props in tests:
        labels = props.get("LABELS", [])
        lanes = sorted({label for label in labels if label in LANES})
        for label in labels:
            if label not in LANES + OTHER_LABELS:
                problems.append("FAIL: test %s has the label '%s', which is no lane (%s) and not %s"
                                % (name, label, ", ".join(LANES), " or ".join(OTHER_LABELS)))
            elif label in counts:
                counts[label] += 1
        if not lanes:
            problems.append("FAIL: test %s has no lane: give it one of %s in tests/CMakeLists.txt"
                            % (name, ", ".join(LANES)))
        elif len(lanes) > 1:
            problems.append("FAIL: test %s is in %d lanes (%s): it belongs in one"
                            % (name, len(lanes), ", ".join(lanes)))
    if problems:
        print("\n".join(problems))
        return 1
    print("ok: each of the %d tests is in one lane: %s" % (
        len(tests), ", ".join("%s %d" % (label, counts[label]) for label in LANES + OTHER_LABELS)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
