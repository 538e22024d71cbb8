"""`yeto broker --auth DIR`, the loopback rule and reload on SIGHUP (docs/design.md §13), against the real
`yeto broker` command (its nats-server child serving what it generated from a `yeto auth init` dir).

One secured broker (TLS, run r with island a) is shared by the module; the SIGHUP test adds island c
to its DIR, so it runs on that broker last and nothing else depends on c's absence.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import pytest

from yeto.schemas.conn import ConnectOptions, connect
from yeto.services.auth import init_auth
from yeto.services.broker import free_port, free_port_block
from yeto.services.cmd_broker import exposure_refusal, is_loopback

ROOT = Path(__file__).resolve().parents[1]
NO_RETRY = {"allow_reconnect": False, "max_reconnect_attempts": 0, "connect_timeout": 5}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update(extra)
    return env


class YetoBroker:
    """`yeto broker ARGS` as a child process; `ready` is its first stdout line."""

    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "yeto.services.cli", "broker", *args],
                                     env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self.proc.stdout.readline()
        if "yeto broker ready" not in self.ready:
            self.stop()
            raise AssertionError(f"yeto broker did not start: {self.ready!r}\n{self.proc.stderr.read()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    base = tmp_path_factory.mktemp("broker-auth")
    auth = base / "auth"
    init_auth("r", ["a"], auth, tls=True)
    port = free_port()
    b = YetoBroker("--auth", str(auth), "--port", str(port), "--store-dir", str(base / "store"))
    b.auth, b.port, b.ca = auth, port, str(auth / "tls" / "ca.pem")
    b.url = f"tls://127.0.0.1:{port}"
    try:
        yield b
    finally:
        assert b.stop() == 0


def _opts(b, name: str, ca: str | None = "default") -> ConnectOptions:
    return ConnectOptions(url=b.url, creds=str(b.auth / f"{name}.creds"), tls_ca=b.ca if ca == "default" else ca)


@pytest.mark.e2e
def test_ready_line_says_tls_and_where_the_ca_is(secured):
    assert f"tls://127.0.0.1:{secured.port}" in secured.ready, secured.ready
    assert f"--tls-ca {secured.ca}" in secured.ready and "run r" in secured.ready, secured.ready


@pytest.mark.e2e
async def test_anonymous_is_refused_and_an_island_identity_connects(secured):
    tls = ssl.create_default_context(cafile=secured.ca)
    with pytest.raises(Exception) as anon:
        await nats.connect(secured.url, tls=tls, **NO_RETRY)
    assert "authorization" in repr(anon.value).lower(), repr(anon.value)
    # positive control: the same TLS, island a's key
    nc = await connect(_opts(secured, "a"), **NO_RETRY)
    try:
        assert nc.is_connected
        assert nc.max_payload == 8 * 1024 * 1024  # the shipped services/nats.conf settings are kept
        await nc.publish("yeto.r.ctl.hb.a", b"{}")  # one of its own subjects
        await nc.flush(timeout=5)
    finally:
        await nc.close()


@pytest.mark.e2e
async def test_clients_verify_the_server_with_the_runs_ca(secured, tmp_path):
    other = tmp_path / "other"
    init_auth("r", ["a"], other, tls=True)  # another CA: the server's certificate is not signed by it
    with pytest.raises(Exception) as wrong_ca:
        await connect(_opts(secured, "a", ca=str(other / "tls" / "ca.pem")), **NO_RETRY)
    assert "certificate verify failed" in repr(wrong_ca.value).lower(), repr(wrong_ca.value)
    with pytest.raises(Exception) as plain:  # no CA at all: the system's trust store does not know it either
        await connect(_opts(secured, "a", ca=None), **NO_RETRY)
    assert "certificate" in repr(plain.value).lower() or "ssl" in repr(plain.value).lower(), repr(plain.value)
    nc = await connect(_opts(secured, "a"), **NO_RETRY)  # positive control
    await nc.close()


@pytest.mark.e2e
async def test_sighup_reloads_the_auth_dir_a_new_island_gets_in(secured):
    """Adding an island to a live run: `yeto auth init` again with island c, SIGHUP to `yeto broker`.
    Before the reload c's new key is refused; after it c connects, and island a's connection opened
    before the reload is still up."""
    a = await connect(_opts(secured, "a"), **NO_RETRY)
    try:
        init_auth("r", ["c"], secured.auth, tls=True)
        assert (secured.auth / "c.creds").exists()
        with pytest.raises(Exception) as before:
            await connect(_opts(secured, "c"), **NO_RETRY)
        assert "authorization" in repr(before.value).lower(), repr(before.value)
        secured.proc.send_signal(signal.SIGHUP)
        line = await asyncio.wait_for(asyncio.to_thread(secured.proc.stdout.readline), 30)
        assert line.startswith("yeto broker: reloaded") and "identities syncer, a, c" in line, line
        deadline = time.monotonic() + 15  # the server applies the reload just after the signal
        while True:
            try:
                c = await connect(_opts(secured, "c"), **NO_RETRY)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        try:
            await c.publish("yeto.r.ctl.hb.c", b"{}")
            await c.flush(timeout=5)
        finally:
            await c.close()
        assert a.is_connected
        await a.publish("yeto.r.ctl.hb.a", b"{}")
        await a.flush(timeout=5)
    finally:
        await a.close()
    assert secured.proc.poll() is None


# ---- the loopback rule ---------------------------------------------------------------------------

@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("broker.example.org", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback
    refusal = exposure_refusal(host, auth=None, insecure=False)
    assert (refusal is None) is loopback
    assert exposure_refusal(host, auth="DIR", insecure=False) is None
    assert exposure_refusal(host, auth=None, insecure=True) is None


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.e2e
def test_a_broker_beyond_loopback_without_auth_refuses_to_start(tmp_path, how):
    port = free_port()
    args = ["--port", str(port), "--store-dir", str(tmp_path / "s")]
    env = _env()
    if how == "flag":
        args += ["--host", "0.0.0.0"]
    else:
        env["YETO_BROKER_HOST"] = "0.0.0.0"
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "broker", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "0.0.0.0" in err and "--auth" in err and "--insecure" in err and "without authorization" in err, err
    assert "ready" not in proc.stdout and not (tmp_path / "s").exists()  # no server was started


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.e2e
async def test_insecure_lets_an_open_broker_listen_beyond_loopback(tmp_path, how):
    port = free_port()
    args = ["--host", "0.0.0.0", "--port", str(port), "--store-dir", str(tmp_path / "s")]
    env = _env()
    if how == "flag":
        args.append("--insecure")
    else:
        env["YETO_BROKER_INSECURE"] = "1"
    b = YetoBroker(*args, env=env)
    try:
        assert f"nats://0.0.0.0:{port}" in b.ready
        nc = await nats.connect(f"nats://127.0.0.1:{port}", **NO_RETRY)  # open: anonymous gets in
        await nc.close()
    finally:
        assert b.stop() == 0


@pytest.mark.e2e
def test_auth_that_is_not_an_auth_dir_is_refused(tmp_path):
    for bad, says in ((tmp_path / "missing", "is not a directory"), (tmp_path, "identities.json")):
        proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--auth", str(bad),
                               "--port", str(free_port()), "--store-dir", str(tmp_path / "s")], env=_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr and str(bad) in proc.stderr, proc.stderr


# ---- a secured cluster ---------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.e2e
async def test_auth_with_a_cluster_keeps_routes_on_loopback(tmp_path):
    """--auth --cluster 2 --host 0.0.0.0: every node serves the identities and TLS, clients may come
    from anywhere, but the routes (which carry no client authorization) listen on loopback only."""
    auth = tmp_path / "auth"
    init_auth("r", ["a"], auth, tls=True)
    port, http = free_port_block(2), free_port_block(2)
    b = YetoBroker("--auth", str(auth), "--cluster", "2", "--host", "0.0.0.0", "--port", str(port),
                   "--http-port", str(http), "--cluster-port", str(free_port_block(2)), "--store-dir", str(tmp_path / "s"))
    try:
        assert f"tls://0.0.0.0:{port},tls://0.0.0.0:{port + 1}" in b.ready, b.ready
        for i in range(2):
            url = f"tls://127.0.0.1:{port + i}"
            with pytest.raises(Exception) as anon:
                await nats.connect(url, tls=ssl.create_default_context(cafile=str(auth / "tls" / "ca.pem")), **NO_RETRY)
            assert "authorization" in repr(anon.value).lower()
            nc = await connect(ConnectOptions(url=url, creds=str(auth / "a.creds"), tls_ca=str(auth / "tls" / "ca.pem")),
                               **NO_RETRY)
            await nc.close()
            with urllib.request.urlopen(f"http://127.0.0.1:{http + i}/varz", timeout=5) as r:
                varz = json.loads(r.read())
            assert varz["host"] == "0.0.0.0" and varz["cluster"]["addr"] == "127.0.0.1", varz.get("cluster")
            assert varz["tls_required"] and varz["auth_required"]
    finally:
        assert b.stop() == 0


# ---- docker-compose.yml: the broker with a mounted auth directory (no Docker engine here) ---------

def compose_interpolate(value, env: dict):
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:+replacement}` (docs.docker.com/reference/
    compose-file/interpolation), applied to every string of a parsed compose file."""
    import re

    def one(m):
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        v = env.get(name, "")
        if op == ":-":
            return v or arg
        if op == ":+":
            return arg if v else ""
        return v

    if isinstance(value, str):
        return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\+)([^}]*))?\}", one, value)
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    return value


def _compose(env: dict) -> dict:
    import yaml

    return compose_interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env)


def _binds(svc: dict) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts (relative to the compose file)."""
    out = {}
    for v in svc.get("volumes", []):
        host, target = v.split(":")[:2]
        if host.startswith(("./", "/")):
            out[target] = (ROOT / host).resolve() if host.startswith("./") else Path(host)
    return out


def _in_container(binds: dict[str, Path], path: str) -> Path:
    for target, host in sorted(binds.items(), key=lambda kv: -len(kv[0])):
        if path == target or path.startswith(target + "/"):
            return host / path[len(target):].lstrip("/")
    raise AssertionError(f"{path} is not mounted: {binds}")


def test_compose_without_auth_is_the_open_broker_and_no_credentials():
    c = _compose({})
    assert c["services"]["nats"]["command"][:2] == ["-c", "/etc/nats/nats.conf"]
    for name in ("syncer", "exporter", "dashboard"):
        env = c["services"][name]["environment"]
        assert env["YETO_NATS_CREDS"] == "" and env["YETO_TLS_CA"] == "", name  # empty: no credentials (conn.py)


@pytest.mark.e2e
async def test_compose_with_yeto_broker_auth_serves_the_mounted_dir_with_tls(tmp_path):
    """YETO_BROKER_AUTH=DIR: the nats service's config, with its mounts laid out as the container sees
    them (only the /etc/nats prefix moved under tmp), passes nats-server's own test and serves DIR:
    anonymous refused, the syncer's and the observer's files as the compose services name them get in,
    verifying the certificate with the mounted CA; the certificate is valid for the service name `nats`."""
    import shutil

    from yeto.services.auth import cert_hosts
    from yeto.services.broker import Broker, check_config

    auth = tmp_path / "yeto-auth"
    init_auth("demo", ["a", "b"], auth, tls=True, hosts=["nats", "localhost", "127.0.0.1"])
    c = _compose({"YETO_BROKER_AUTH": str(auth)})
    nats_svc = c["services"]["nats"]
    conf_in_container = nats_svc["command"][1]
    assert conf_in_container == "/etc/nats/secure-nats.conf" and "-js" in nats_svc["command"]
    binds = _binds(nats_svc)
    assert binds["/etc/nats/auth"] == auth and binds["/etc/nats/nats.conf"] == ROOT / "services" / "nats.conf"
    root = tmp_path / "container"
    for target, host in binds.items():
        dest = root / target.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if host.is_dir() else shutil.copy)(host, dest)
    conf = root / conf_in_container.lstrip("/")
    conf.write_text(conf.read_text().replace('"/etc/nats/', f'"{root}/etc/nats/'))
    check_config(conf)
    assert "nats" in cert_hosts((auth / "tls" / "server.pem").read_bytes())
    with Broker(store_dir=tmp_path / "store", config=conf) as b:
        assert b.command()[1:3] == ["-c", str(conf)]
        with pytest.raises(Exception) as anon:
            await nats.connect(b.url, tls=ssl.create_default_context(cafile=str(auth / "tls" / "ca.pem")), **NO_RETRY)
        assert "authorization" in repr(anon.value).lower()
        for name, want in (("syncer", "syncer.creds"), ("exporter", "observer.creds"), ("dashboard", "observer.creds")):
            svc = c["services"][name]
            env, sb = svc["environment"], _binds(svc)
            creds, ca = _in_container(sb, env["YETO_NATS_CREDS"]), _in_container(sb, env["YETO_TLS_CA"])
            assert creds == auth / want and ca == auth / "tls" / "ca.pem", name
            nc = await connect(ConnectOptions(url=b.url, creds=str(creds), tls_ca=str(ca)), **NO_RETRY)
            assert nc.max_payload == 8 * 1024 * 1024
            await nc.close()
    # the syncer passes the INIT island through from the host (only that island may publish init)
    assert "YETO_INIT_ISLAND" in c["services"]["syncer"]["environment"]
