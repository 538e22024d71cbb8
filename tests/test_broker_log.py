"""docs/design.md §7: `yeto broker` keeps nats-server's log and says where, and prints the monitoring URL(s).

Real `yeto broker` processes: `--log FILE` (one server; with --cluster, one file per node), `--log -` (the
server's output on the command's stderr), and the default (nats-server.log in the store). Every monitoring
URL the ready line prints answers /healthz.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from yeto.services.broker import free_port, free_port_block
from tests.test_broker_nodes import _ready

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _broker(tmp_path, *args: str, name: str = "broker") -> tuple[subprocess.Popen, str]:
    log = tmp_path / f"{name}.out"
    with open(log, "ab") as out:
        p = subprocess.Popen([sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--store-dir", str(tmp_path / "store"),
                              *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return p, str(log)


def _stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0


def _monitoring(line: str) -> list[str]:
    urls = re.search(r"monitoring (\S+?)[;,)]?(?:\s|$)", line).group(1)
    return [u for u in urls.rstrip(";),").split(",") if u]


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
        return r.status == 200


def test_log_file_and_monitoring_url_of_one_server(tmp_path):
    mon = free_port()
    p, out = _broker(tmp_path, "--port", str(free_port()), "--http-port", str(mon), "--log", str(tmp_path / "n.log"))
    try:
        line = _ready(out, p)
        assert f"log {tmp_path / 'n.log'}" in line, line
        assert _monitoring(line) == [f"http://127.0.0.1:{mon}"], line
        assert _healthy(f"http://127.0.0.1:{mon}")
        assert "Server is ready" in (tmp_path / "n.log").read_text()
    finally:
        _stop(p)


def test_log_dash_sends_the_servers_output_to_stderr(tmp_path):
    p, out = _broker(tmp_path, "--port", str(free_port()), "--log", "-")
    try:
        line = _ready(out, p)
        assert "log stderr" in line, line
        assert "Server is ready" in open(out).read()     # the server's own lines, on the command's output
        assert not (tmp_path / "store" / "nats-server.log").exists()
    finally:
        _stop(p)


def test_default_log_is_in_the_store(tmp_path):
    p, out = _broker(tmp_path, "--port", str(free_port()))
    try:
        line = _ready(out, p)
        assert f"log {tmp_path / 'store' / 'nats-server.log'}" in line, line
        assert "Server is ready" in (tmp_path / "store" / "nats-server.log").read_text()
    finally:
        _stop(p)


def test_cluster_log_files_per_node_and_every_monitoring_url(tmp_path):
    port, route, mon = free_port_block(3), free_port_block(3), free_port_block(3)
    p, out = _broker(tmp_path, "--cluster", "3", "--port", str(port), "--cluster-port", str(route), "--http-port",
                     str(mon), "--log", str(tmp_path / "logs" / "hub.log"))
    try:
        line = _ready(out, p, timeout=90)
        assert _monitoring(line) == [f"http://127.0.0.1:{mon + i}" for i in range(3)], line
        assert all(_healthy(u) for u in _monitoring(line))
        for i in range(1, 4):
            f = tmp_path / "logs" / f"hub-yeto-{i}.log"
            assert str(f) in line, line
            assert "Server is ready" in f.read_text()
    finally:
        _stop(p)
