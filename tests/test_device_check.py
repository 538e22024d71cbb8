"""device/check's reading of the `cuda` tests' report (device/summarize.py): the counts, and cuda_bitwise true only
when every final-cut test ran on the GPU and passed. The dry run itself runs in .ci/run (tests/test_tiers.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import tests.test_cuda_island as cuda_island

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("device_summarize", ROOT / "device" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _xml(cases: dict[str, str]) -> str:
    body = ""
    for key, outcome in cases.items():
        cls, name = key.split("::")
        inner = "" if outcome == "passed" else f'<{outcome} message="x">x</{outcome}>'
        body += f'<testcase classname="{cls}" name="{name}" time="1">{inner}</testcase>'
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'


def test_counts_and_cuda_bitwise_only_when_every_final_cut_test_passed_on_the_gpu():
    s = _load()
    others = {"tests.test_device::test_a[cuda]": "passed", "tests.test_hybrid::test_b[cuda]": "passed"}
    everything = dict(others, **{k: "passed" for k in s.BITWISE})
    assert s.summarize(_xml(everything)) == (4, 4, 0, True)
    for bad in ("failure", "error", "skipped"):
        one = dict(everything, **{s.BITWISE[1]: bad})
        passed, total, skipped, bitwise = s.summarize(_xml(one))
        assert (passed, total, bitwise) == (3, 4, False) and skipped == (bad == "skipped"), bad
    assert s.summarize(_xml(dict(others, **{s.BITWISE[0]: "passed"})))[3] is False  # one missing: not true
    assert s.summarize(_xml({k: "skipped" for k in everything})) == (0, 4, 4, False)  # the dry run


def test_a_teardown_error_after_a_pass_counts_as_failed(tmp_path, capsys):
    s = _load()
    key = s.BITWISE[0]
    cls, name = key.split("::")
    xml = _xml({}).replace("</testsuite>", f'<testcase classname="{cls}" name="{name}"/>'
                           f'<testcase classname="{cls}" name="{name}"><error message="teardown">x</error></testcase>'
                           "</testsuite>")
    assert s.outcomes(xml) == {key: "error"}
    # no report at all (pytest killed): nothing passed, and the line still reads
    assert s.main(["summarize", str(tmp_path / "missing.xml")]) == 0
    assert capsys.readouterr().out.split() == ["0", "0", "0", "false"]


@pytest.mark.parametrize("key", range(2))
def test_the_final_cut_tests_it_names_exist_with_a_cuda_case(key):
    s = _load()
    module, test = s.BITWISE[key].split("::")
    name, param = test.rstrip("]").split("[")
    assert module == "tests.test_cuda_island" and callable(getattr(cuda_island, name))
    marks = getattr(cuda_island, name).pytestmark
    params = [p for m in marks if m.name == "parametrize" for p in m.args[1]]
    assert any(getattr(p, "values", (p,)) == (param,) and any(mk.name == "cuda" for mk in getattr(p, "marks", ()))
               for p in params), params
