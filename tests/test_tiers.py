"""The test tiers (README "Tests"): tests/conftest.py marks every test `pure` or `e2e`, and a pure test that
starts a process or connects to a NATS server fails, even when it swallows the refusal or skips on it; CI
lints with ruff before the tests.

The e2e tests run pytest in a child process on a scratch test directory that uses this repository's
conftest.py and marker configuration, so a broken guard shows up as a test that passes there."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.scripted import ROOT

SCRATCH_TESTS = '''
import subprocess
import sys

import pytest


def test_plain_logic():
    assert sum(range(4)) == 6


def test_starts_a_process_and_swallows_the_refusal():
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pass


def test_skips_when_the_process_is_refused():
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pytest.skip("no tool here")


def test_forks_a_multiprocessing_child():
    import multiprocessing
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


async def test_connects_to_a_nats_server():
    import nats
    await nats.connect("nats://127.0.0.1:9", connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False)


@pytest.mark.e2e
def test_marked_e2e_may_start_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_with_a_broker_fixture_is_e2e(nats_url):
    pass
'''


def _scratch(tmp_path, tests: str):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = "\n".join(f"    {m}" for m in ini["markers"])
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = {ini['addopts']}\nasyncio_mode = auto\n"
                                         f"markers =\n{markers}\n")
    (tmp_path / "test_scratch.py").write_text(tests)


def _pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                           "-rA", *args], cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
def test_pure_tests_that_start_processes_or_connect_fail_and_the_rest_pass(tmp_path):
    _scratch(tmp_path, SCRATCH_TESTS)
    proc = _pytest(tmp_path, "-m", "pure")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    for name in ("test_starts_a_process_and_swallows_the_refusal", "test_skips_when_the_process_is_refused",
                 "test_forks_a_multiprocessing_child", "test_connects_to_a_nats_server"):
        assert f"FAILED test_scratch.py::{name}" in out, out
    assert "PASSED test_scratch.py::test_plain_logic" in out, out
    assert "is marked pure but started a subprocess: mark it e2e" in out, out
    assert "is marked pure but connected to a NATS server" in out, out
    # Explicit marks and broker fixtures make a test e2e: deselected here.
    assert "4 failed, 1 passed, 2 deselected" in out, out


@pytest.mark.e2e
def test_every_test_gets_exactly_one_tier_and_soak_is_e2e(tmp_path):
    _scratch(tmp_path, SCRATCH_TESTS + '''

@pytest.mark.soak
def test_soak():
    pass
''')
    e2e = _pytest(tmp_path, "--collect-only", "-m", "e2e")
    assert "3/8 tests collected" in e2e.stdout, e2e.stdout
    for name in ("test_marked_e2e_may_start_a_process", "test_with_a_broker_fixture_is_e2e", "test_soak"):
        assert f"test_scratch.py::{name}" in e2e.stdout, e2e.stdout
    pure = _pytest(tmp_path, "--collect-only", "-m", "pure")
    assert "5/8 tests collected" in pure.stdout, pure.stdout
    neither = _pytest(tmp_path, "--collect-only", "-m", "not pure and not e2e")
    assert "no tests collected (8 deselected)" in neither.stdout, neither.stdout


@pytest.mark.e2e
def test_a_thread_the_pure_test_starts_is_guarded_one_running_before_it_is_not(tmp_path):
    _scratch(tmp_path, '''
import subprocess
import sys
import threading

import pytest

go = threading.Event()
results = []
threads = []


def _later():
    go.wait(30)
    results.append(subprocess.run([sys.executable, "-c", "pass"]).returncode)


@pytest.mark.e2e
def test_e2e_leaves_a_thread_behind():
    threads.append(threading.Thread(target=_later, daemon=True))
    threads[0].start()


def test_pure_while_an_earlier_thread_starts_a_process():
    go.set()
    threads[0].join(30)
    assert results == [0]


def test_pure_whose_own_thread_starts_a_process():
    t = threading.Thread(target=lambda: subprocess.run([sys.executable, "-c", "pass"]))
    t.start()
    t.join()
''')
    proc = _pytest(tmp_path)
    out = proc.stdout + proc.stderr
    assert "PASSED test_scratch.py::test_e2e_leaves_a_thread_behind" in out, out
    assert "PASSED test_scratch.py::test_pure_while_an_earlier_thread_starts_a_process" in out, out
    assert "FAILED test_scratch.py::test_pure_whose_own_thread_starts_a_process" in out, out
    assert "1 failed, 2 passed" in out, out


@pytest.mark.e2e
def test_cuda_tests_skip_with_the_reason_without_a_device_and_keep_their_tier(tmp_path):
    _scratch(tmp_path, '''
import subprocess
import sys

import pytest
import torch


@pytest.mark.cuda
def test_on_the_gpu():
    assert torch.zeros(2, device="cuda").sum().item() == 0


@pytest.mark.cuda
@pytest.mark.e2e
def test_on_the_gpu_with_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_on_the_cpu():
    pass
''')
    import torch

    e2e = _pytest(tmp_path, "--collect-only", "-m", "cuda and e2e")
    assert "1/3 tests collected" in e2e.stdout, e2e.stdout
    proc = _pytest(tmp_path, "-m", "cuda")
    out = proc.stdout + proc.stderr
    if torch.cuda.is_available():
        assert "2 passed, 1 deselected" in out, out
    else:  # skipped, never run on a stand-in, and the reason says what is missing
        assert proc.returncode == 0 and "2 skipped, 1 deselected" in out, out
        assert f"needs a CUDA device: torch {torch.__version__} sees none" in out, out


@pytest.mark.e2e
def test_a_pure_mark_on_a_broker_test_is_refused(tmp_path):
    _scratch(tmp_path, '''
import pytest


@pytest.mark.pure
def test_claims_pure(nats_url):
    pass
''')
    proc = _pytest(tmp_path, "--collect-only")
    assert proc.returncode != 0
    assert "marked pure but marked e2e/soak/docker or uses a broker fixture" in proc.stdout + proc.stderr, proc.stdout


def test_the_markers_are_registered_strictly_and_documented():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in ini["addopts"].split()
    names = {m.split(":", 1)[0] for m in ini["markers"]}
    assert names == {"pure", "e2e", "soak", "docker", "cuda"}
    readme = (ROOT / "README.md").read_text()
    assert "`./run test -m pure`" in readme
    for name in names:
        assert f"| `{name}` |" in readme, f"README's tier table lacks {name}"


def _commands(path):
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_ruff_then_the_device_dry_run_before_the_tests():
    ci = _commands(ROOT / ".ci" / "run")
    tests = [i for i, line in enumerate(ci) if "./run test" in line]
    assert "./run lint" in ci and tests and ci.index("./run lint") < tests[0]
    # the whole suite: everything but the docker tier, then the docker tier, whose failure fails CI too
    assert [ci[i].split(" || ")[0].split("./run test ", 1)[1] for i in tests] == ['-m "not docker"', "-m docker"]
    assert all(ci[i].endswith("|| rc=$?") for i in tests) and ci[-1] == 'exit "$rc"'
    assert "YETO_DOCKER_REQUIRED=1" in ci[tests[1]]
    # the README's first command after the suite, and the installed `yeto demo` from outside the checkout
    demo = [i for i, line in enumerate(ci) if line.startswith("./run demo")]
    assert demo and tests[0] < demo[0] and ci[demo[0]].endswith("|| rc=$?"), ci
    assert any('yeto" demo' in c and c.startswith("(cd / &&") and c.endswith("|| rc=$?") for c in ci), ci
    assert ci.index("./run lint") < ci.index("device/check --dry-run || rc=$?") < tests[0]
    check = ROOT / "device" / "check"
    assert check.stat().st_mode & 0o111, "device/check must be executable (CI runs it by path)"
    run = (ROOT / "run").read_text()
    assert 'exec "$VENV/bin/ruff" check . "$@"' in run
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(r.startswith("ruff") for r in project["project"]["optional-dependencies"]["test"])
    assert project["tool"]["ruff"]["lint"]["select"]
