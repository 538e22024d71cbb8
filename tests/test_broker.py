"""The embedded broker, the shipped config and the compose file (no Docker engine runs here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nats
import pytest
import yaml

from yeto.services.broker import Broker, check_config, default_config_path, nats_server_binary

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_shipped_config_is_valid_and_allows_8mib():
    check_config(default_config_path())
    text = default_config_path().read_text()
    assert "max_payload: 8MB" in text


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_compose_file_mounts_the_shipped_config():
    from tests.test_broker_auth import compose_interpolate

    # as compose renders it without YETO_BROKER_AUTH (the secured variant: tests/test_broker_auth.py)
    compose = compose_interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {})
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


@pytest.mark.e2e
def test_yeto_broker_prints_url_and_stops_on_sigterm(tmp_path):
    import signal

    from yeto.services.broker import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--port", str(port), "--store-dir", str(tmp_path / "s")],
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


# ---- production templates (docs/design.md §7, §12): deploy/nats/ -------------------------------------

NATS_DEPLOY = ROOT / "deploy" / "nats"


@pytest.mark.parametrize("name", ["hub-1.conf", "hub-2.conf", "hub-3.conf", "leaf.conf"])
@pytest.mark.e2e
def test_deploy_templates_pass_the_servers_own_config_test(name):
    check_config(NATS_DEPLOY / name)


@pytest.mark.e2e
def test_check_config_reports_the_servers_words(tmp_path):
    bad = tmp_path / "bad.conf"
    bad.write_text("jetstream { domain: two words }\n")
    from yeto.services.broker import BrokerError

    with pytest.raises(BrokerError) as e:
        check_config(bad)
    assert str(bad) in str(e.value) and "line 1" in str(e.value)


@pytest.mark.e2e
def test_a_server_that_exits_at_start_says_why_in_the_error(tmp_path):
    # with no log file its output went to /dev/null: a soak's cluster node "exited with 1 at start" and nothing
    # said why; now its last lines are in the error (here: the monitoring port another process holds)
    import socket

    from yeto.services.broker import BrokerError, free_port

    with socket.socket() as held:
        port = free_port()
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(BrokerError) as e:
            Broker(store_dir=tmp_path / "s", http_port=port).start(10)
    msg = str(e.value)
    assert "exited with 1 at start" in msg and f"127.0.0.1:{port}" in msg and "address already in use" in msg, msg
    # with a log file the error names it, and the output is there
    log = tmp_path / "server.log"
    with pytest.raises(BrokerError) as e:
        Broker(store_dir=tmp_path / "t", log_file=log, extra_args=["--no_such_flag"]).start(10)
    assert f"its output: {log}" in str(e.value) and "no_such_flag" in log.read_text(), str(e.value)


def _conf_values(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def test_hub_templates_form_one_cluster_and_the_leaf_dials_out():
    common = _conf_values((NATS_DEPLOY / "hub-common.conf").read_text())
    names = []
    for i in (1, 2, 3):
        text = _conf_values((NATS_DEPLOY / f"hub-{i}.conf").read_text())
        assert "include ./hub-common.conf" in text
        names.append(text.split("server_name:", 1)[1].split()[0])
    assert names == ["hub-1", "hub-2", "hub-3"]
    for n in names:  # every node routes to every node
        assert f"nats-route://{n}:6222" in common
    assert "domain: hub" in common and "leafnodes" in common and "listen: 0.0.0.0:7422" in common
    assert "max_payload: 8MB" in common
    leaf = _conf_values((NATS_DEPLOY / "leaf.conf").read_text())
    assert "remotes" in leaf and "listen" not in leaf.split("leafnodes", 1)[1]  # dials out, never listens
    for n in names:
        assert f"nats-leaf://{n}:7422" in leaf
    domain = leaf.split("domain:", 1)[1].split()[0]
    assert domain != "hub" and "max_payload: 8MB" in leaf


@pytest.mark.e2e
def test_hub_and_leaf_templates_run_as_a_cluster_with_a_leaf_node(tmp_path):
    """The templates as shipped, with only host names, ports and store directories made local: the
    three hubs elect a JetStream meta leader, and the leaf node connects out to them with its own
    JetStream domain."""
    import asyncio
    import json
    import time
    import urllib.request

    from yeto.services.broker import free_port_block, wait_jetstream

    client, route, mon, leafp = (free_port_block(4) for _ in range(4))
    common = (NATS_DEPLOY / "hub-common.conf").read_text()
    procs = []
    try:
        for i in (1, 2, 3):
            d = tmp_path / f"hub-{i}"
            d.mkdir()
            text = common.replace("port: 4222", f"port: {client + i}").replace("http_port: 8222", f"http_port: {mon + i}")
            text = text.replace("store_dir: /data", f"store_dir: {d / 'data'}")
            text = text.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{route + i}")
            text = text.replace("listen: 0.0.0.0:7422", f"listen: 127.0.0.1:{leafp + i}")
            for j in (1, 2, 3):
                text = text.replace(f"hub-{j}:6222", f"127.0.0.1:{route + j}")
            (d / "hub-common.conf").write_text(text)
            (d / f"hub-{i}.conf").write_text((NATS_DEPLOY / f"hub-{i}.conf").read_text())
            procs.append(subprocess.Popen([nats_server_binary(), "-c", str(d / f"hub-{i}.conf")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        d = tmp_path / "leaf"
        d.mkdir()
        text = (NATS_DEPLOY / "leaf.conf").read_text().replace("port: 4222", f"port: {client}")
        text = text.replace("http_port: 8222", f"http_port: {mon}").replace("store_dir: /data", f"store_dir: {d / 'data'}")
        for j in (1, 2, 3):
            text = text.replace(f"hub-{j}:7422", f"127.0.0.1:{leafp + j}")
        (d / "leaf.conf").write_text(text)
        check_config(d / "leaf.conf")
        procs.append(subprocess.Popen([nats_server_binary(), "-c", str(d / "leaf.conf")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

        wait_jetstream([f"nats://127.0.0.1:{client + i}" for i in (1, 2, 3)], 60)

        def get(port, path):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return json.loads(r.read())

        deadline = time.monotonic() + 30
        while True:
            leafz = get(mon, "/leafz")
            if leafz.get("leafnodes"):
                break
            assert time.monotonic() < deadline, f"the leaf node never connected to the hub: {leafz}"
            time.sleep(0.2)
        jsz_hub = get(mon + 1, "/jsz")
        assert jsz_hub["meta_cluster"]["cluster_size"] == 3 and jsz_hub["config"]["domain"] == "hub"
        assert get(mon, "/jsz")["config"]["domain"] == "dc1"
        assert get(mon, "/varz")["server_name"] == "dc1-leaf-1"

        async def leaf_js_is_its_own():
            nc = await nats.connect(f"nats://127.0.0.1:{client}")
            try:
                local = await nc.jetstream(timeout=10).account_info()
                hub = await nc.jetstream(domain="hub", timeout=10).account_info()
                return local.domain, hub.domain
            finally:
                await nc.close()

        assert asyncio.run(leaf_js_is_its_own()) == ("dc1", "hub")
    finally:
        for p in procs:
            p.kill()
            p.wait()
