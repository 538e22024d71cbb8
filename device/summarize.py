"""device/check's reading of `pytest -m cuda` (its JUnit XML): `<passed> <total> <skipped> <cuda_bitwise>` on one line.

cuda_bitwise is true only when every test of BITWISE ran on the GPU and passed: the islands that train on the
device through the real broker and syncer and must end holding the syncer's final cut bit for bit. A missing
one (renamed, not collected, skipped) makes it false, never true by default.

    python device/summarize.py pytest.xml
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

BITWISE = (
    "tests.test_cuda_island::test_two_single_rank_islands_on_the_device_hold_the_final_cut_bitwise[cuda]",
    "tests.test_cuda_island::test_a_megatron_gpt_island_on_the_device_holds_the_final_cut_in_its_masters[cuda]",
)


def outcomes(xml_text: str) -> dict[str, str]:
    """classname::name -> passed, failure, error or skipped (the first that applies)."""
    got = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None), "passed")
        key = f"{case.get('classname')}::{case.get('name')}"
        if got.get(key, "passed") == "passed":  # a second record of a test (teardown) can only make it worse
            got[key] = kind
    return got


def summarize(xml_text: str) -> tuple[int, int, int, bool]:
    got = outcomes(xml_text)
    passed = sum(o == "passed" for o in got.values())
    skipped = sum(o == "skipped" for o in got.values())
    return passed, len(got), skipped, all(got.get(k) == "passed" for k in BITWISE)


def main(argv: list[str]) -> int:
    try:
        with open(argv[1]) as f:
            passed, total, skipped, bitwise = summarize(f.read())
    except (OSError, ET.ParseError, IndexError):
        passed, total, skipped, bitwise = 0, 0, 0, False  # no report: nothing passed
    print(passed, total, skipped, "true" if bitwise else "false")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
