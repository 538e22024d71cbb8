"""`yeto auth init` (docs/design.md §13): the files it writes, their modes, re-running it, bad input, and
the generated config served by a real nats-server (with TLS, and reloaded after adding an island)."""
from __future__ import annotations

import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import nkeys
import pytest

from yeto.schemas.conn import ConnectOptions, connect, nkey_inbox_prefix
from yeto.services.auth import cert_hosts, load_identities, write_server_config
from yeto.services.broker import Broker, check_config
from tests.e2e_procs import clean_env


def yeto_auth(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "auth", "init", *args], capture_output=True,
                          text=True, env=clean_env(), timeout=120)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def public_of(creds: Path) -> str:
    kp = nkeys.from_seed(bytearray(creds.read_bytes().strip()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


@pytest.mark.e2e
def test_init_writes_one_private_identity_per_process_and_a_valid_config(tmp_path):
    out = tmp_path / "auth"
    r = yeto_auth("--run", "prod1", "--islands", "a,b", "--out", str(out), "--tls", "--hosts",
                  "localhost,127.0.0.1,nats.example.org")
    assert r.returncode == 0, r.stderr
    assert f"yeto broker --config {out}/server.conf" in r.stdout
    names = ["syncer", "a", "b", "observer", "admin"]
    assert mode(out) == 0o700
    pubs = {}
    for n in names:
        creds = out / f"{n}.creds"
        assert mode(creds) == 0o600, n
        pubs[n] = public_of(creds)
        assert pubs[n].startswith("U")
    assert len(set(pubs.values())) == len(names)
    conf = (out / "auth.conf").read_text()
    assert mode(out / "auth.conf") == 0o600 and mode(out / "identities.json") == 0o600
    for n, pub in pubs.items():
        assert f"nkey: {pub}" in conf
        # a seed never leaves its creds file
        assert (out / f"{n}.creds").read_text().strip() not in conf
    assert "no_auth_user" not in conf.replace("No no_auth_user", "")
    run, ids, init = load_identities(out)
    assert run == "prod1" and init == "a"  # the first island unless --init-island
    assert {i.name: i.role for i in ids} == {"syncer": "syncer", "a": "island", "b": "island",
                                              "observer": "observer", "admin": "admin"}
    # TLS: private keys 0600, the CA public; the server certificate covers the hosts and is signed by the CA
    tls = out / "tls"
    assert mode(tls / "ca-key.pem") == 0o600 and mode(tls / "server-key.pem") == 0o600
    assert sorted(cert_hosts((tls / "server.pem").read_bytes())) == sorted(["localhost", "127.0.0.1", "nats.example.org"])
    from cryptography import x509

    ca = x509.load_pem_x509_certificate((tls / "ca.pem").read_bytes())
    x509.load_pem_x509_certificate((tls / "server.pem").read_bytes()).verify_directly_issued_by(ca)
    # nats-server itself accepts the whole config (shipped settings + users + TLS)
    conf_file = out / "server.conf"
    assert mode(conf_file) == 0o600
    assert "tls {" in conf_file.read_text() and "max_payload: 8MB" in conf_file.read_text()
    check_config(conf_file)
    assert write_server_config([out], tmp_path / "again.conf").read_text() == conf_file.read_text()


@pytest.mark.e2e
def test_connect_options_hand_the_seed_to_nats_py_with_its_own_inbox(tmp_path):
    out = tmp_path / "auth"
    assert yeto_auth("--run", "r", "--islands", "a", "--out", str(out)).returncode == 0
    kw = ConnectOptions(creds=str(out / "a.creds")).kwargs()
    assert kw["nkeys_seed"] == str(out / "a.creds") and "user_credentials" not in kw
    assert kw["inbox_prefix"] == nkey_inbox_prefix(public_of(out / "a.creds"))
    jwt_creds = tmp_path / "user.creds"
    jwt_creds.write_text("-----BEGIN NATS USER JWT-----\neyJ0eXAi.x.y\n------END NATS USER JWT------\n\n"
                         "-----BEGIN USER NKEY SEED-----\nSUAXXX\n------END USER NKEY SEED------\n")
    kw = ConnectOptions(creds=str(jwt_creds)).kwargs()
    assert kw["user_credentials"] == str(jwt_creds) and "nkeys_seed" not in kw and "inbox_prefix" not in kw
    with pytest.raises(ValueError, match="YETO_NATS_CREDS: cannot read"):
        ConnectOptions(creds=str(tmp_path / "missing.creds")).kwargs()


@pytest.mark.parametrize("args, says", [
    (("--islands", "a.b"), "--islands: 'a.b'"),
    (("--islands", "a,syncer"), "--islands: 'syncer' is reserved"),
    (("--islands", "a,a"), "--islands: repeated"),
    (("--islands", ","), "--islands: give at least one"),
    (("--islands", "a,b", "--init-island", "z"), "--init-island: 'z' is not one of the islands"),
    (("--islands", "a", "--tls", "--hosts", ","), "--hosts: give at least one"),
    (("--islands", "a", "--run", "a.b"), "--run:"),
])
@pytest.mark.e2e
def test_bad_input_is_refused_naming_the_flag_and_value(tmp_path, args, says):
    out = tmp_path / "auth"
    r = yeto_auth("--run", "r", "--out", str(out), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


@pytest.mark.e2e
def test_rerun_adds_islands_and_keeps_every_existing_identity(tmp_path):
    out = tmp_path / "auth"
    assert yeto_auth("--run", "r", "--islands", "a,b", "--out", str(out), "--tls").returncode == 0
    before = {p.name: p.read_bytes() for p in out.glob("*.creds")}
    tls_before = {p.name: p.read_bytes() for p in (out / "tls").iterdir()}
    r = yeto_auth("--run", "r", "--islands", "b,c", "--out", str(out), "--tls")
    assert r.returncode == 0, r.stderr
    assert "new identities: c.creds" in r.stdout
    after = {p.name: p.read_bytes() for p in out.glob("*.creds")}
    assert set(after) == set(before) | {"c.creds"}
    assert all(after[n] == before[n] for n in before)  # same keys: running processes stay valid
    assert {p.name: p.read_bytes() for p in (out / "tls").iterdir()} == tls_before  # same CA, same cert
    run, ids, init = load_identities(out)
    assert [i.name for i in ids if i.role == "island"] == ["a", "b", "c"] and init == "a"
    conf = (out / "auth.conf").read_text()
    assert all(f"nkey: {public_of(out / n)}" in conf for n in after)
    # another run in the same directory is refused, and nothing in it changes
    r = yeto_auth("--run", "other", "--islands", "x", "--out", str(out))
    assert r.returncode == 2 and "--run:" in r.stderr and "'r'" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*.creds")} == after
    # a creds file that no longer matches its recorded key is refused, not silently re-keyed
    (out / "b.creds").write_bytes(before["a.creds"])
    r = yeto_auth("--run", "r", "--islands", "d", "--out", str(out))
    assert r.returncode == 2 and "b.creds" in r.stderr, r.stderr
    assert not (out / "d.creds").exists()


async def _connect_within(opts, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await connect(opts, allow_reconnect=False, max_reconnect_attempts=0)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.e2e
async def test_a_running_broker_reloaded_with_a_new_island_keeps_the_old_ones_and_rotates_one(tmp_path):
    """How to add an island to a live run: `yeto auth init` again, reload (SIGHUP). The new island gets
    in; island a's open connection and its key keep working. Rotating b: remove b.creds, `yeto auth
    init` again, reload: the new key gets in and the old one is refused."""
    out = tmp_path / "auth"
    assert yeto_auth("--run", "r", "--islands", "a,b", "--out", str(out), "--tls").returncode == 0
    conf = out / "server.conf"
    ca = str(out / "tls" / "ca.pem")
    with Broker(store_dir=tmp_path / "store", config=conf, log_file=tmp_path / "server.log") as broker:
        def opts(name):
            return ConnectOptions(url=broker.url, creds=str(out / f"{name}.creds"), tls_ca=ca)

        a = await connect(opts("a"), allow_reconnect=False)
        assert yeto_auth("--run", "r", "--islands", "c", "--out", str(out), "--tls").returncode == 0
        with pytest.raises(Exception, match="(?i)authorization"):  # not yet: the server has the old config
            await connect(opts("c"), allow_reconnect=False, max_reconnect_attempts=0)
        broker.proc.send_signal(signal.SIGHUP)
        c = await _connect_within(opts("c"))
        try:
            assert a.is_connected
            await a.publish("yeto.r.ctl.hb.a", b"still here")
            await a.flush()
            a2 = await connect(opts("a"), allow_reconnect=False)
            await a2.close()
        finally:
            await c.close()
        # rotate b
        old_b = tmp_path / "old-b.creds"
        old_b.write_bytes((out / "b.creds").read_bytes())
        (out / "b.creds").unlink()
        r = yeto_auth("--run", "r", "--islands", "b", "--out", str(out), "--tls")
        assert r.returncode == 0 and "new identities: b.creds" in r.stdout, r.stdout + r.stderr
        assert public_of(out / "b.creds") != public_of(old_b)
        broker.proc.send_signal(signal.SIGHUP)
        b = await _connect_within(opts("b"))
        await b.close()
        with pytest.raises(Exception, match="(?i)authorization"):
            await connect(ConnectOptions(url=broker.url, creds=str(old_b), tls_ca=ca), allow_reconnect=False,
                          max_reconnect_attempts=0)
        assert a.is_connected
        await a.close()


# ---- the rules themselves (pure): every case the server tests check, plus the ones they cannot reach quickly

def _match(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def _may(perms: dict, kind: str, subject: str) -> bool:
    rules = perms.get(kind, {})
    return (any(_match(p, subject) for p in rules.get("allow", []))
            and not any(_match(p, subject) for p in rules.get("deny", [])))


@pytest.mark.parametrize("who, kind, subject, allowed", [
    ("a", "publish", "yeto.r.push.a.0", True),
    ("a", "publish", "yeto.r.push.b.0", False),
    ("a", "publish", "yeto.r.init.0", True),          # a is the INIT island
    ("b", "publish", "yeto.r.init.0", False),
    ("b", "publish", "yeto.r.ctl.hello.b", True),
    ("b", "publish", "yeto.r.ctl.hello.a", False),
    ("b", "publish", "yeto.r.ctl.hb.a", False),
    ("b", "publish", "yeto.r.ctl.ack.a", False),
    ("b", "publish", "yeto.r.steplog.a", False),
    ("a", "publish", "yeto.r.ctl.pull", False),
    ("a", "publish", "yeto.r.ctl.to.a", False),
    ("a", "publish", "yeto.r.bcast.0.0", False),
    ("a", "publish", "yeto.r.final.0.0", False),
    ("a", "publish", "yeto.r.events.merge", False),
    ("a", "publish", "$KV.yeto_r_state.session", False),
    ("a", "publish", "$KV.yeto_r_members.a", False),
    ("a", "publish", "$JS.API.STREAM.DELETE.YETO_r_PUSH", False),
    ("a", "publish", "$JS.API.STREAM.PURGE.YETO_r_BCAST", False),
    ("a", "publish", "$JS.API.STREAM.MSG.DELETE.YETO_r_BCAST", False),
    ("a", "publish", "$JS.API.STREAM.INFO.YETO_r_CTL", True),
    # its two CTL consumers, by name and filter, and nothing else on CTL
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.isl-a.yeto.r.ctl.to.a", True),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.pull-a.yeto.r.ctl.pull", True),
    ("a", "publish", "$JS.API.CONSUMER.MSG.NEXT.YETO_r_CTL.isl-a", True),
    ("a", "publish", "$JS.API.CONSUMER.MSG.NEXT.YETO_r_CTL.pull-a", True),
    ("a", "publish", "$JS.API.CONSUMER.INFO.YETO_r_CTL.isl-a", True),
    ("a", "publish", "$JS.API.CONSUMER.DELETE.YETO_r_CTL.pull-a", True),
    ("a", "publish", "$JS.ACK.YETO_r_CTL.isl-a.1.7.3.1700000000000000000.0", True),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.isl-a", False),  # filter not in the subject
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.isl-a.yeto.r.ctl.to.b", False),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.isl-a.yeto.r.ctl.>", False),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.pull-a.yeto.r.ctl.to.b", False),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.isl-b.yeto.r.ctl.to.b", False),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL", False),  # unnamed: the body may name any consumer
    ("a", "publish", "$JS.API.CONSUMER.DURABLE.CREATE.YETO_r_CTL.isl-a", False),
    ("a", "publish", "$JS.API.CONSUMER.MSG.NEXT.YETO_r_CTL.isl-b", False),
    ("a", "publish", "$JS.API.CONSUMER.INFO.YETO_r_CTL.pull-b", False),
    ("a", "publish", "$JS.API.CONSUMER.DELETE.YETO_r_CTL.isl-b", False),
    ("a", "publish", "$JS.API.CONSUMER.DELETE.YETO_r_CTL.syncer-ctl", False),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_CTL.syncer-ctl.yeto.r.ctl.to.a", False),
    ("a", "publish", "$JS.API.CONSUMER.LIST.YETO_r_CTL", False),
    ("a", "publish", "$JS.ACK.YETO_r_CTL.isl-b.1.7.3.1700000000000000000.0", False),
    ("a", "publish", "$JS.ACK.YETO_r_CTL.syncer-ctl.1.7.3.1700000000000000000.0", False),
    ("a", "publish", "$JS.API.STREAM.MSG.GET.YETO_r_CTL", False),
    ("a", "publish", "$JS.API.DIRECT.GET.YETO_r_CTL", False),
    ("a", "publish", "$JS.API.DIRECT.GET.YETO_r_CTL.yeto.r.ctl.to.b", False),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_PUSH.peek.yeto.r.push.b.0", False),
    ("a", "publish", "$JS.API.DIRECT.GET.YETO_r_PUSH", False),
    ("a", "publish", "$JS.API.DIRECT.GET.YETO_r_BCAST", True),
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_BCAST", True),  # its ordered cut reader
    ("a", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_BCAST.keep", False),  # no named/durable ones
    ("a", "publish", "$JS.API.CONSUMER.DURABLE.CREATE.YETO_r_BCAST.keep", False),
    ("a", "publish", "$JS.API.DIRECT.GET.KV_yeto_r_state.$KV.yeto_r_state.session", True),
    ("a", "publish", "yeto.r2.push.a.0", False),
    ("a", "publish", "$JS.API.STREAM.INFO.YETO_r2_CTL", False),
    ("a", "subscribe", "_INBOX.abc", False),
    ("a", "subscribe", "yeto.r.ctl.to.b", False),
    ("syncer", "publish", "yeto.r.bcast.0.0", True),
    ("syncer", "publish", "yeto.r.ctl.to.a", True),
    ("syncer", "publish", "$KV.yeto_r_state.session", True),
    ("syncer", "publish", "$JS.API.STREAM.PURGE.YETO_r_PUSH", True),
    ("syncer", "publish", "$JS.API.STREAM.MSG.DELETE.YETO_r_PUSH", True),
    ("syncer", "publish", "$JS.API.STREAM.CREATE.KV_yeto_r_state", True),
    ("syncer", "publish", "$JS.API.STREAM.DELETE.YETO_r_CTL", False),
    ("syncer", "publish", "$JS.API.STREAM.UPDATE.YETO_r_PUSH", False),
    ("syncer", "publish", "yeto.r2.bcast.0.0", False),
    ("syncer", "publish", "$KV.yeto_r2_state.session", False),
    ("observer", "publish", "yeto.r.steplog.a", False),
    ("observer", "publish", "$KV.yeto_r_state.commit", False),
    ("observer", "publish", "$JS.API.DIRECT.GET.YETO_r_EVENTS", True),
    ("observer", "publish", "$JS.API.CONSUMER.CREATE.YETO_r_STEPLOG", True),
    ("observer", "publish", "$JS.API.DIRECT.GET.YETO_r_BCAST", False),
    ("observer", "publish", "$JS.API.STREAM.MSG.GET.YETO_r_PUSH", False),
    ("observer", "subscribe", "yeto.r.steplog.a", True),
    ("observer", "subscribe", "yeto.r.events.merge", True),
    ("observer", "subscribe", "yeto.r.push.a.0", False),
    ("admin", "publish", "$JS.API.STREAM.DELETE.YETO_r_CTL", True),
    ("admin", "publish", "$JS.API.STREAM.DELETE.KV_yeto_r_state", True),
    ("admin", "publish", "$JS.API.STREAM.DELETE.YETO_r2_CTL", False),
    ("admin", "publish", "yeto.r.ctl.pull", False),
    ("admin", "publish", "$KV.yeto_r_state.session", False),
    ("admin", "publish", "$JS.API.DIRECT.GET.YETO_r_BCAST", False),
    ("admin", "publish", "$JS.API.STREAM.LEADER.STEPDOWN.YETO_r_PUSH", True),        # a planned broker restart
    ("admin", "publish", "$JS.API.STREAM.LEADER.STEPDOWN.KV_yeto_r_state", True),
    ("admin", "publish", "$JS.API.STREAM.LEADER.STEPDOWN.YETO_r2_PUSH", False),
    ("a", "publish", "$JS.API.STREAM.LEADER.STEPDOWN.YETO_r_PUSH", False),
])
def test_rules(who, kind, subject, allowed):
    from yeto.services.auth import permissions

    role = {"a": "island", "b": "island"}.get(who, who)
    perms = permissions("r", who, role, "UPUB", init_island="a")
    assert _may(perms, kind, subject) is allowed


def test_every_key_subscribes_only_to_its_own_inbox():
    from yeto.services.auth import permissions

    for who, role in (("a", "island"), ("syncer", "syncer"), ("observer", "observer"), ("admin", "admin")):
        perms = permissions("r", who, role, "UKEY1", init_island="a")
        assert _may(perms, "subscribe", "_INBOX_UKEY1.x.y")
        assert not _may(perms, "subscribe", "_INBOX_UKEY2.x.y") and not _may(perms, "subscribe", "_INBOX.x")


@pytest.mark.e2e
def test_served_dir_points_tls_at_the_containers_mount(tmp_path):
    from yeto.services.auth import server_config_text

    out = tmp_path / "auth"
    assert yeto_auth("--run", "r", "--islands", "a", "--out", str(out), "--tls").returncode == 0
    text = server_config_text([out], served_dir="/etc/yeto-auth")
    assert 'cert_file: "/etc/yeto-auth/tls/server.pem"' in text and str(out) not in text
    assert f'cert_file: "{out.resolve()}/tls/server.pem"' in (out / "server.conf").read_text()
