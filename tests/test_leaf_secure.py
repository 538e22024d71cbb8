"""docs/design.md §12: secured leaf links. A hub and a leaf node of datacenter dc1, both real nats-servers
serving one `yeto auth init --tls --datacenters dc1` directory (services/leaf_auth.py): the leaf dials
the hub with dc1's leaf identity over TLS, and serves islands a, b and c their own keys.

Every refusal below has its allowed twin on the same connection, so a refusal can only come from the
permissions; refusals are the servers' own "Permissions Violation" (the client's error callback, the
leaf's log).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.errors import NotFoundError

from yeto.schemas import subjects as S
from yeto.schemas.conn import ConnectOptions, connect, nkey_inbox_prefix
from yeto.schemas.provision import CUT_KINDS, RunLimits, ensure_cut_mirrors, kv, kv_put, provision_run
from yeto.services import leaf as L
from yeto.services.auth import init_auth
from yeto.services.broker import Broker, free_port
from tests.auth_support import connect_as, violations, wait_violation
from tests.e2e_procs import clean_env, wait_until

DC = "dc1"
REFUSED_TIMEOUT = 0.5   # a refused JetStream request gets no answer: don't wait long for it


@dataclass
class Pair:
    work: Path
    auth: Path
    run: str
    hub: Broker
    leaf: Broker

    @property
    def ca(self) -> str:
        return str(self.auth / "tls" / "ca.pem")

    async def conn(self, where: str, who: str, errors: list | None = None):
        """A connection as identity `who` to the hub or the leaf; server errors go to `errors`."""
        b = self.hub if where == "hub" else self.leaf
        return await connect_as(b.url.replace("nats://", "tls://"), str(self.auth / f"{who}.creds"), tls_ca=self.ca,
                                errors=errors, name=f"test-{where}-{who}")

    def violations(self) -> list[str]:
        return violations(self.work / "hub.log", self.work / f"{DC}.log")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("leaf-secure")
    run = f"ls_{uuid.uuid4().hex[:8]}"
    auth = work / "auth"
    init_auth(run, ["a", "b", "c"], auth, init_island="a", tls=True, datacenters=[DC])
    hub, leaf = L.start_hub_and_leaf(work, DC, auth_dir=auth)
    p = Pair(work, auth, run, hub, leaf)
    try:
        async def provision():
            nc = await p.conn("hub", "syncer")
            try:
                await provision_run(nc.jetstream(timeout=10), run, RunLimits.small())
            finally:
                await nc.close()

        asyncio.run(provision())
        yield p
    finally:
        leaf.stop()
        hub.stop()
        for b in (hub, leaf):
            b.served.cleanup()


async def _no_msg(js, stream: str, subject: str) -> bool:
    try:
        await js.get_last_msg(stream, subject)
    except NotFoundError:
        return True
    return False


@pytest.mark.e2e
async def test_island_b_behind_the_leaf_reaches_the_hub_as_itself_and_never_as_island_a(pair):
    run, errors = pair.run, []
    b = await pair.conn("leaf", "b", errors)
    hub = await pair.conn("hub", "syncer")
    try:
        js = b.jetstream(domain=L.HUB_DOMAIN, timeout=10)
        # its own hello and push land in the hub's streams (through the link, by subject interest)
        ack = await js.publish(S.hello(run, "b"), b"hello from b")
        assert (ack.stream, ack.domain) == (S.stream(run, "CTL"), L.HUB_DOMAIN)
        ack = await js.publish(S.push(run, "b", 0), b"push from b")
        assert ack.stream == S.stream(run, "PUSH")
        hub_js = hub.jetstream(timeout=10)
        assert (await hub_js.get_last_msg(S.stream(run, "PUSH"), S.push(run, "b", 0))).data == b"push from b"
        # as island a: refused by the leaf, where b is connected; nothing of it reaches the hub
        for subject in (S.hello(run, "a"), S.push(run, "a", 0), S.heartbeat(run, "a"), S.init_all(run).replace("*", "0")):
            await b.publish(subject, b"forged by b")
            await b.flush()
            await wait_violation(errors, "publish", subject)
        assert await _no_msg(hub_js, S.stream(run, "CTL"), S.hello(run, "a"))
        assert await _no_msg(hub_js, S.stream(run, "PUSH"), S.push(run, "a", 0))
        # nor may it read a's push on the hub through the hub's domain
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await b.jetstream(domain=L.HUB_DOMAIN, timeout=REFUSED_TIMEOUT).get_msg(S.stream(run, "PUSH"), seq=1)
        await wait_violation(errors, "publish", f"$JS.hub.API.STREAM.MSG.GET.{S.stream(run, 'PUSH')}")
        leaf_log = (pair.work / f"{DC}.log").read_text(errors="replace")
        assert f'Publish Violation - Subject "{S.push(run, "a", 0)}"' in leaf_log
    finally:
        await b.close()
        await hub.close()


@pytest.mark.e2e
async def test_the_datacenter_mirrors_bcast_through_the_link(pair):
    """Island c creates dc1's mirrors of BCAST and FINAL (in the leaf's own domain, sourced through
    $JS.hub.API); a chunk the syncer broadcasts on the hub reaches the mirror, and c reads it there.
    Neither server logs a violation for any of it (the leaf identity sources the mirror)."""
    run = pair.run
    before = len(pair.violations())
    c = await pair.conn("leaf", "c")
    hub = await pair.conn("hub", "syncer")
    try:
        dc_js = c.jetstream(domain=DC, timeout=10)
        rep = await ensure_cut_mirrors(dc_js, run, L.HUB_DOMAIN, log=lambda _: None)
        assert sorted(rep.created) == sorted(f"mirror {S.stream(run, k)}" for k in CUT_KINDS), rep
        await hub.jetstream(timeout=10).publish(S.bcast(run, 0, 0), b"chunk 0 of fragment 0", headers={"Nats-Msg-Id": "t1"})
        name = S.stream(run, "BCAST")

        async def mirrored():
            return (await dc_js.stream_info(name)).state.messages == 1

        await wait_until(mirrored, 60, "the dc1 mirror of BCAST to hold the hub's chunk")
        info = await dc_js.stream_info(name)
        assert info.config.mirror.external.api == "$JS.hub.API", info.config
        assert (await dc_js.get_last_msg(name, S.bcast(run, 0, 0))).data == b"chunk 0 of fragment 0"
        assert pair.violations()[before:] == []
    finally:
        await c.close()
        await hub.close()


@pytest.mark.e2e
async def test_islands_behind_the_leaf_read_the_hubs_kv_and_write_none(pair):
    """The state KV through the hub's domain: island b on the leaf reads what the syncer wrote on the
    hub; a write (islands write no KV key anywhere) is refused at the leaf, as at the hub."""
    run, errors = pair.run, []
    hub = await pair.conn("hub", "syncer")
    b = await pair.conn("leaf", "b", errors)
    try:
        await kv_put(hub.jetstream(timeout=10), run, "state", "probe", b"from the syncer")
        got = await (await kv(b.jetstream(domain=L.HUB_DOMAIN, timeout=10), run, "state")).get("probe")
        assert got.value == b"from the syncer"
        with pytest.raises(Exception):
            await kv_put(b.jetstream(domain=L.HUB_DOMAIN, timeout=REFUSED_TIMEOUT), run, "state", "probe", b"b", attempts=1)
        await wait_violation(errors, "publish", f"$JS.hub.API.{S.kv_key(run, 'state', 'probe')}")
    finally:
        await b.close()
        await hub.close()


@pytest.mark.e2e
async def test_a_kv_writer_behind_a_leaf_writes_the_hubs_bucket(tmp_path, run_id):
    """yeto.schemas.provision.kv_put through the hub's domain from a client of the leaf node: the put goes
    as $JS.hub.API.$KV.<bucket>.<key> (a bare $KV.> never crosses a link between two domains) and lands
    in the hub's bucket. Unsecured pair: no identity a secured leaf serves may write KV."""
    hub, leaf = L.start_hub_and_leaf(tmp_path, "dc7")
    try:
        h = await nats.connect(hub.url)
        lf = await nats.connect(leaf.url)
        try:
            await provision_run(h.jetstream(timeout=10), run_id, RunLimits.small())
            ack = await kv_put(lf.jetstream(domain=L.HUB_DOMAIN, timeout=10), run_id, "state", "k", b"from dc7")
            assert ack.domain == L.HUB_DOMAIN
            assert (await (await kv(h.jetstream(), run_id, "state")).get("k")).value == b"from dc7"
        finally:
            await h.close()
            await lf.close()
    finally:
        leaf.stop()
        hub.stop()


@pytest.mark.parametrize("who", [None, "b"])
@pytest.mark.e2e
def test_a_leaf_without_a_leaf_identity_is_refused_by_the_hub(pair, tmp_path, who):
    """A leaf node that dials the hub's leaf port over TLS with no key, or with an island's key (a client
    identity, not a leaf one), is refused: the hub keeps its one link, dc1's."""
    seed = (pair.auth / f"{who}.creds").read_text().strip() if who else None
    text = L.leaf_config_text(domain="dc9", leaf_of=f"127.0.0.1:{pair.hub.leaf_port}", seed=seed,
                              ca_file=pair.auth / "tls" / "ca.pem")
    log = tmp_path / "rogue.log"
    rogue = Broker(store_dir=tmp_path / "rogue", config=L.write_config(tmp_path, "leaf", text), log_file=log).start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "Authorization Violation" not in log.read_text(errors="replace"):
            time.sleep(0.2)
        assert "Authorization Violation" in log.read_text(errors="replace"), log.read_text()[-2000:]
        leafs = L.leafz(pair.hub.http_port).get("leafs") or []
        with urllib.request.urlopen(f"http://127.0.0.1:{pair.leaf.http_port}/varz", timeout=5) as r:
            dc1 = json.loads(r.read())["server_id"]
        assert [lf["name"] for lf in leafs] == [dc1], leafs
    finally:
        rogue.stop()


@pytest.mark.e2e
async def test_the_leaf_identity_carries_only_what_islands_and_mirrors_need(pair, tmp_path):
    """A leaf node that holds dc1's key but serves anyone (its own config, no users): what its clients
    send still passes the hub's check of the leaf identity. An island's hello crosses (its answer only to
    an island's inbox); a broadcast chunk (the syncer's) and a KV write do not, and nothing of them
    lands on the hub."""
    from yeto.services.leaf_auth import link_permissions

    run, errors = pair.run, []
    seed = (pair.auth / "leaf-dc1.creds").read_text().strip()
    text = L.leaf_config_text(domain="dc8", leaf_of=f"127.0.0.1:{pair.hub.leaf_port}", seed=seed,
                              ca_file=pair.auth / "tls" / "ca.pem")
    open_leaf = Broker(store_dir=tmp_path / "dc8", config=L.write_config(tmp_path, "leaf", text),
                       log_file=tmp_path / "dc8.log").start()
    hub = await pair.conn("hub", "syncer")
    try:
        await asyncio.to_thread(L.wait_leaf_link, pair.hub.http_port, 2)

        async def on_error(exc):
            errors.append(str(exc))

        # replies cross back only to the islands' inboxes: use b's prefix (its key's, as schemas.conn does)
        b_key = json.loads((pair.auth / "identities.json").read_text())["identities"]["b"]["public_key"]
        nc = await nats.connect(open_leaf.url, error_cb=on_error, inbox_prefix=nkey_inbox_prefix(b_key))
        try:
            js = nc.jetstream(domain=L.HUB_DOMAIN, timeout=10)
            assert (await js.publish(S.hello(run, "c"), b"via the open leaf")).stream == S.stream(run, "CTL")
            hub_js = hub.jetstream(timeout=10)
            for subject in (S.bcast(run, 1, 0), f"$JS.hub.API.{S.kv_key(run, 'state', 'forged')}"):
                with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError)):
                    await nc.request(subject, b"forged", timeout=2)
            assert await _no_msg(hub_js, S.stream(run, "BCAST"), S.bcast(run, 1, 0))
            with pytest.raises(Exception):
                await (await kv(hub_js, run, "state")).get("forged")
        finally:
            await nc.close()
    finally:
        await hub.close()
        open_leaf.stop()
    # and, pure: the link's rules name no syncer subject, no KV write and no other reader's inbox
    perms = link_permissions(run, [("UKEYB", {"publish": {"allow": [S.hello(run, "b")]},
                                              "subscribe": {"allow": ["_INBOX_UKEYB.>"]}})])
    assert perms["subscribe"]["allow"] == ["_INBOX_UKEYB.>", "$JS.M.*", "$JSC.R.*"]
    assert not [x for x in perms["publish"]["allow"] if "bcast" in x or "$KV" in x or x.endswith(".>") and "yeto" in x
                and "push" not in x]


@pytest.mark.e2e
def test_yeto_broker_runs_a_secured_hub_and_leaf(tmp_path):
    """`yeto broker --auth DIR --leaf-port P` and `yeto broker --auth DIR --leaf-of 127.0.0.1:P --domain
    dc1`: the leaf links with its identity over TLS and island b, connected to the leaf with its own key,
    reaches the hub's JetStream (domain hub) with what its role may ask."""
    auth = tmp_path / "auth"
    init = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "auth", "init", "--run", "sec1", "--islands", "a,b",
                           "--out", str(auth), "--tls", "--datacenters", DC], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert init.returncode == 0 and "leaf-dc1.creds" in init.stdout, init.stdout + init.stderr
    hub_port, leaf_port, lp, hub_mon = free_port(), free_port(), free_port(), free_port()
    cmds = {"hub": ["--port", str(hub_port), "--leaf-port", str(lp), "--http-port", str(hub_mon)],
            "leaf": ["--port", str(leaf_port), "--leaf-of", f"127.0.0.1:{lp}", "--domain", DC]}
    procs = {}
    try:
        for name, args in cmds.items():
            procs[name] = subprocess.Popen([sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--auth", str(auth),
                                            "--store-dir", str(tmp_path / name), *args], env=clean_env(),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            line = procs[name].stdout.readline()
            assert "yeto broker ready: tls://" in line, line
        assert "leaf node of datacenter dc1" in line and "over TLS" in line, line
        L.wait_leaf_link(hub_mon)

        async def hub_answers():
            nc = await connect(ConnectOptions(url=f"tls://127.0.0.1:{leaf_port}", creds=str(auth / "b.creds"),
                                              tls_ca=str(auth / "tls" / "ca.pem")))
            try:
                # an island's first call (check_run): the hub's JetStream answers "no such stream" (the run
                # is not provisioned), so b's request crossed the link and its answer came back
                with pytest.raises(NotFoundError):
                    await nc.jetstream(domain="hub", timeout=10).stream_info(S.stream("sec1", "CTL"))
            finally:
                await nc.close()

        asyncio.run(hub_answers())
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)


def _broker(capsys, tmp_path, *args) -> tuple[int, str]:
    from yeto.services.cli import main

    rc = main(["broker", "--port", str(free_port()), "--store-dir", str(tmp_path / "s"), *args])
    return rc, capsys.readouterr().err


def test_bad_secured_leaf_options_exit_2_naming_flag_and_value(tmp_path, capsys):
    auth = tmp_path / "auth"
    init_auth("bad1", ["a"], auth, datacenters=["dc1"])
    plain = tmp_path / "plain"
    init_auth("bad2", ["a"], plain)
    for args, words in (
        (["--auth", str(auth), "--leaf-of", "127.0.0.1:7422", "--domain", "dc2"],
         ["no leaf credentials for datacenter 'dc2'", "--datacenters dc2", str(auth)]),
        (["--auth", str(plain), "--leaf-port", "7422"], ["--leaf-port", "no leaf credentials", "--datacenters"]),
        (["--auth", str(auth), "--leaf-port", "7422", "--domain", "other"], ["--domain 'other'", "'hub'"]),
        (["--auth", str(tmp_path), "--leaf-port", "7422"], [f"--auth {tmp_path}", "identities.json"]),
        (["--leaf-port", "7422", "--leaf-host", "0.0.0.0"], ["0.0.0.0", "--leaf-host", "--insecure"]),
        (["--leaf-host", "127.0.0.1"], ["--leaf-host '127.0.0.1'", "--leaf-port"]),
    ):
        rc, err = _broker(capsys, tmp_path, *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), (args, rc, err)


@pytest.mark.e2e
def test_bad_datacenters_exit_2_naming_flag_and_value(tmp_path):
    from tests.test_auth_init import yeto_auth

    for args, word in ((["--datacenters", "hub"], "'hub' is the hub's JetStream domain"),
                       (["--datacenters", "d.c"], "--datacenters: 'd.c'"),
                       (["--datacenters", "dc1,dc1"], "repeated datacenter"),
                       (["--islands", "leaf-x"], "--islands: 'leaf-x'")):
        islands = [] if "--islands" in args else ["--islands", "a"]
        r = yeto_auth("--run", "r", *islands, "--out", str(tmp_path / "o"), *args)
        assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


@pytest.mark.timeout(150)
@pytest.mark.e2e
def test_demo_secure_two_datacenters_ends_on_the_final_cut_with_no_violation(tmp_path):
    """`yeto demo --secure --datacenters 2`: a secured hub (syncer, island a) and dc1's secured leaf
    (islands b and c with their own keys, linked with dc1's leaf identity over TLS): every island on the
    final cut, and neither server logged a permission violation."""
    work = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--secure", "--datacenters", "2", "--rounds", "4",
                        "--workdir", str(work), "--timeout", "110"], capture_output=True, text=True,
                       env=clean_env(), timeout=140)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["rounds"] == 4 and s["max_abs_diff_vs_final_cut"] == 0.0 and set(s["final_loss"]) == {"a", "b", "c"}
    assert s["secure"]["identities"] == ["a", "admin", "b", "c", "leaf-dc1", "observer", "syncer"]
    assert "leaf node tls://127.0.0.1:" in p.stdout and s["wan"]["hub_to_dc_bytes"] > 0
    for log in ("hub.log", "dc1.log"):
        text = (work / log).read_text(errors="replace")
        assert "Violation" not in text, (log, [ln for ln in text.splitlines() if "Violation" in ln])
    # the datacenter's islands read the cut from dc1's mirrors, made in the leaf's own JetStream
    for kind in CUT_KINDS:
        assert (work / DC / "jetstream" / "$G" / "streams" / S.stream(s["run"], kind)).is_dir(), kind
