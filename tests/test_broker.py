"""The embedded broker, the shipped config and the compose file (no Docker engine runs here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nats
import pytest
import yaml

from services.broker import Broker, check_config, default_config_path, nats_server_binary

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_config_is_valid_and_allows_8mib():
    check_config(default_config_path())
    text = default_config_path().read_text()
    assert "max_payload: 8MB" in text


async def test_embedded_broker_announces_8mib_and_jetstream(tmp_path):
    with Broker(store_dir=tmp_path) as b:
        nc = await nats.connect(b.url)
        try:
            assert nc.max_payload == 8 * 1024 * 1024
            js = nc.jetstream()
            info = await js.account_info()
            assert info.limits is not None
        finally:
            await nc.close()
    assert not (tmp_path / "missing").exists()


def test_compose_file_mounts_the_shipped_config():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = compose["services"]["nats"]
    assert svc["image"].startswith("nats:")
    mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in svc["volumes"]]
    conf_mounts = [m for m in mounts if m.split(":")[0].endswith("nats.conf")]
    assert conf_mounts, f"nats.conf not mounted: {mounts}"
    host_path = (ROOT / conf_mounts[0].split(":")[0]).resolve()
    assert host_path == default_config_path().resolve()
    target = conf_mounts[0].split(":")[1]
    command = svc["command"] if isinstance(svc["command"], list) else svc["command"].split()
    assert "-js" in command and target in command
    assert "healthcheck" in svc and "8222" in " ".join(map(str, svc.get("ports", [])))
    # The same file, as the container would read it, passes the server's own config test.
    proc = subprocess.run([nats_server_binary(), "-t", "-c", str(host_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_yeto_broker_prints_url_and_stops_on_sigterm(tmp_path):
    import signal
    import time

    from services.broker import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "broker", "--port", str(port), "--store-dir", str(tmp_path / "s")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"nats://127.0.0.1:{port}" in line, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
