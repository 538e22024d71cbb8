"""docs/design.md §12: island datacenters as NATS leaf nodes (services/leaf.py). One hub + one leaf-node
datacenter per module, all real: the hub nats-server (JetStream domain `hub`, leafnode listener), a
leaf nats-server (domain `dc1`) dialling it through a test TCP proxy (tests/tcp_proxy.py, so a test can
cut the link), the real `yeto syncer` on the hub, real `python -m yeto.learner.demo` islands: `a` on the
hub, `b` and `c` in the datacenter (YETO_DOMAIN=dc1, connected to the leaf node).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from yeto.schemas import subjects as S
from yeto.schemas.provision import CUT_KINDS, ProvisionConflict, ensure_cut_mirrors, remove_run
from yeto.services import leaf as L
from yeto.services.broker import Broker, free_port
from tests.e2e_procs import IslandProc, assert_islands_hold_the_final_cut, kv_json, merges, tails, wait_exit, wait_until
from tests.scripted import SyncerProc
from tests.tcp_proxy import TcpProxy

DC = "dc1"
H, P, ROUNDS = 8, 2, 20


@dataclass
class Topo:
    hub: Broker
    leaf: Broker
    proxy: TcpProxy


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    work = tmp_path_factory.mktemp("leaf-topo")
    lp = free_port()
    hub = L.hub_broker(leaf_port=lp, store_dir=work / "hub", log_file=work / "hub.log").start()
    proxy = TcpProxy("127.0.0.1", lp).start()
    leaf = None
    try:
        leaf = L.leaf_broker(leaf_of=f"127.0.0.1:{proxy.port}", domain=DC, store_dir=work / DC,
                             log_file=work / f"{DC}.log").start()
        L.wait_leaf_link(hub.http_port)
        yield Topo(hub, leaf, proxy)
    finally:
        if leaf is not None:
            leaf.stop()
        proxy.stop()
        hub.stop()


def _island(topo: Topo, run: str, name: str, work: Path, *, dc: bool, args=()) -> IslandProc:
    if dc:
        return IslandProc(topo.leaf.url, run, name, work, env={"YETO_DOMAIN": DC}, args=args)
    return IslandProc(topo.hub.url, run, name, work, args=args)


def _check_final(ckpt: Path, work: Path, run: str, islands, commit: dict, tape: list[dict]) -> None:
    """Each round committed once, in order; every island saved exactly the exported final cut."""
    assert commit["committed_step"] == ROUNDS
    assert [m["step"] for m in tape] == list(range(1, ROUNDS + 1)), [m["step"] for m in tape]
    for f in range(P):
        assert [m["version"] for m in tape if m["fragment"] == f] == list(range(1, ROUNDS // P + 1))
    assert_islands_hold_the_final_cut(ckpt, work / "final.safetensors", run, islands)


def test_yeto_broker_leaf_options_are_checked(tmp_path, capsys):
    """Bad leaf options exit 2 naming the option, before any server starts."""
    from yeto.services.cli import main

    for args, word in ((["--leaf-of", "127.0.0.1:7422"], "--domain"),
                       (["--leaf-of", "127.0.0.1:7422", "--domain", "d.c"], "domain"),
                       (["--leaf-of", "127.0.0.1", "--domain", "dc1"], "--leaf-of"),
                       (["--leaf-port", "7422", "--leaf-of", "127.0.0.1:7422", "--domain", "x"], "either a leaf or a hub"),
                       (["--leaf-port", "7422", "--cluster", "3"], "--cluster"),
                       (["--domain", "dc1"], "--leaf-port"),
                       # a secured hub with leaf nodes needs DIR's leaf identities (tests/test_leaf_secure.py)
                       (["--leaf-port", "7422", "--auth", str(tmp_path)], "--auth")):
        rc = main(["broker", "--port", str(free_port()), "--store-dir", str(tmp_path / "s"), *args])
        err = capsys.readouterr().err
        assert rc == 2 and word in err, (args, rc, err)


@pytest.mark.e2e
def test_yeto_broker_runs_a_hub_and_a_leaf_that_dials_it(tmp_path):
    """`yeto broker --leaf-port P` (domain hub) and `yeto broker --leaf-of 127.0.0.1:P --domain dc9`:
    the leaf links to the hub (the hub's /leafz lists it), each answers JetStream in its own domain,
    and the hub's domain is reachable through the leaf."""
    hub_port, leaf_port, lp, hub_mon = free_port(), free_port(), free_port(), free_port()
    cmds = {"hub": ["--port", str(hub_port), "--leaf-port", str(lp), "--http-port", str(hub_mon),
                    "--store-dir", str(tmp_path / "hub")],
            "leaf": ["--port", str(leaf_port), "--leaf-of", f"127.0.0.1:{lp}", "--domain", "dc9",
                     "--store-dir", str(tmp_path / "dc9")]}
    procs = {}
    try:
        for name, args in cmds.items():
            procs[name] = subprocess.Popen([sys.executable, "-P", "-m", "yeto.services.cli", "broker", *args],
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert "yeto broker ready" in procs[name].stdout.readline()
        assert (tmp_path / "hub" / "hub.conf").exists() and (tmp_path / "dc9" / "leaf.conf").exists()
        L.wait_leaf_link(hub_mon)

        async def domains():
            nc = await nats.connect(f"nats://127.0.0.1:{leaf_port}")
            try:
                return ((await nc.jetstream().account_info()).domain,
                        (await nc.jetstream(domain="hub", timeout=10).account_info()).domain)
            finally:
                await nc.close()

        assert asyncio.run(domains()) == ("dc9", "hub")
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)


def test_island_domain_settings_are_checked():
    from yeto.learner.config import IslandConfig
    from yeto.schemas.errors import ConfigError

    cfg = IslandConfig.from_env({"YETO_RUN": "r", "YETO_ISLAND": "b", "YETO_DOMAIN": "dc1"})
    assert (cfg.domain, cfg.hub_domain) == ("dc1", "hub")
    for env, field in (({"YETO_DOMAIN": "dc.1"}, "domain"), ({"YETO_HUB_DOMAIN": ""}, "hub_domain")):
        with pytest.raises(ConfigError) as ei:
            IslandConfig.from_env({"YETO_RUN": "r", "YETO_ISLAND": "b", **env})
        assert ei.value.field == field, ei.value


@pytest.mark.e2e
def test_generated_configs_pass_nats_server_t(tmp_path):
    from yeto.services.broker import check_config

    check_config(L.write_config(tmp_path, "hub", L.hub_config_text(leaf_port=7422)))
    check_config(L.write_config(tmp_path, "leaf", L.leaf_config_text(domain="dc7", leaf_of="hub-1:7422,hub-2:7422")))


@pytest.mark.e2e
async def test_mirror_conflict_is_reported_and_left_alone(topo, run_id):
    """A stream of the mirror's name in the datacenter that is not that mirror: reported, unchanged."""
    from nats.js import api

    nc = await nats.connect(topo.leaf.url)
    js = nc.jetstream(domain=DC)
    name = S.stream(run_id, "BCAST")
    try:
        await js.add_stream(api.StreamConfig(name=name, subjects=[f"x.{run_id}.>"], storage=api.StorageType.MEMORY))
        with pytest.raises(ProvisionConflict) as ei:
            await ensure_cut_mirrors(js, run_id, "hub", log=lambda _: None)
        assert "mirror" in str(ei.value)
        info = await js.stream_info(name)
        assert info.config.mirror is None and info.config.subjects == [f"x.{run_id}.>"]
    finally:
        for k in CUT_KINDS:
            try:
                await js.delete_stream(S.stream(run_id, k))
            except Exception:
                pass
        await nc.close()


CUT_S = 30.0


async def _committed(js, run: str) -> int:
    try:
        c = await kv_json(js, run, "commit")
    except nats.js.errors.NotFoundError:
        return 0
    return c["committed_step"] if c else 0


@pytest.mark.timeout(300)
@pytest.mark.e2e
async def test_datacenter_reads_the_local_mirror_and_rides_out_a_30s_link_cut(topo, run_id, tmp_path):
    """Islands b and c in dc1 create the run's mirrors of BCAST and FINAL in their domain and read the
    cut from them: while they train, the mirror (not the hub's stream) carries their two ordered
    consumers. Then the WAN link (the proxy between leaf and hub) is cut for 30 s: the hub sees no leaf
    connection, b and c keep training (their step logs grow), and once the link is back sync resumes.
    The run finishes with every island on the final cut bitwise and each version committed once."""
    hub_nc = await nats.connect(topo.hub.url)
    leaf_nc = await nats.connect(topo.leaf.url)
    hub_js, dc_js = hub_nc.jetstream(timeout=10), leaf_nc.jetstream(domain=DC, timeout=10)
    ckpt = tmp_path / "syncer"
    # Members and rounds outlast the cut: b and c stay in the run, rounds wait for their pushes.
    syncer = SyncerProc(topo.hub.url, run_id, ckpt, "--islands", "3", "--fragments", str(P), "--sync-every", str(H),
                        "--total-steps", str(ROUNDS), "--init-island", "a", "--quorum-timeout", "120",
                        "--member-timeout", "120", "--final-timeout", "60", log=tmp_path / "syncer.log").start()
    args = ("--step-delay", "0.1")
    a = _island(topo, run_id, "a", tmp_path, dc=False, args=args).start()
    b = _island(topo, run_id, "b", tmp_path, dc=True, args=args).start()
    c = _island(topo, run_id, "c", tmp_path, dc=True, args=args).start()
    procs = {"syncer": syncer, "a": a, "b": b, "c": c}
    try:
        async def consumers(js, kind):
            try:
                return (await js.stream_info(S.stream(run_id, kind))).state.consumer_count
            except nats.js.errors.NotFoundError:
                return None

        def alive():
            for n, p in procs.items():
                assert p.proc.poll() is None, f"{n} exited early:\n{tails(procs)}"

        async def both_on_the_mirror():
            alive()
            return await consumers(dc_js, "BCAST") == 2 and await consumers(dc_js, "FINAL") == 2

        await wait_until(both_on_the_mirror, 120, "islands b and c consuming the dc1 mirrors")
        for kind in CUT_KINDS:
            cfg = (await dc_js.stream_info(S.stream(run_id, kind))).config
            assert cfg.mirror.name == S.stream(run_id, kind) and cfg.mirror.external.api == "$JS.hub.API", cfg
            # On the hub: at most island a's ordered consumer (the mirror's own consumer is internal).
            assert await consumers(hub_js, kind) in (0, 1), kind

        async def rounds(n):
            alive()
            return await _committed(hub_js, run_id) >= n

        await wait_until(lambda: rounds(2), 120, "two rounds committed")
        before = await _committed(hub_js, run_id)
        assert before < ROUNDS - 4, f"the run was nearly over ({before} of {ROUNDS}) before the cut: make it longer"
        topo.proxy.cut()
        t_cut = time.monotonic()
        await wait_until(lambda: asyncio.to_thread(lambda: L.leaf_link_bytes(topo.hub.http_port)["links"] == 0),
                         10, "the hub to lose its leaf connection")
        steps = {i.island: len(i.steplog_rows()) for i in (b, c)}
        while time.monotonic() - t_cut < CUT_S:
            alive()
            await asyncio.sleep(1)
        # The datacenter trained on, on its own, while it could reach nothing of the hub.
        for i in (b, c):
            assert len(i.steplog_rows()) >= steps[i.island] + 20, (i.island, steps, len(i.steplog_rows()))
        during = await _committed(hub_js, run_id)
        topo.proxy.restore()
        await asyncio.to_thread(L.wait_leaf_link, topo.hub.http_port, 1, 30)

        rcs = await wait_exit(procs, 180)
        assert rcs == {"syncer": 0, "a": 0, "b": 0, "c": 0}, tails(procs)
        # The mirror holds the whole final cut, as the hub's FINAL does.
        hub_final = (await hub_js.stream_info(S.stream(run_id, "FINAL"))).state
        await wait_until(lambda: _same_last(dc_js, run_id, hub_final.last_seq), 30, "the mirror caught up")
        commit = await kv_json(hub_js, run_id, "commit")
        tape = await merges(hub_js, run_id)
        # `yeto run rm --domain dc1` through the leaf node removes the datacenter's mirrors.
        rm = await asyncio.to_thread(subprocess.run, [sys.executable, "-P", "-m", "yeto.services.cli", "run", "rm", run_id, "--nats",
                                                      topo.leaf.url, "--domain", DC], capture_output=True, text=True, timeout=60)
        assert rm.returncode == 0 and S.stream(run_id, "BCAST") in rm.stdout, rm.stdout + rm.stderr
        for k in CUT_KINDS:
            with pytest.raises(nats.js.errors.NotFoundError):
                await dc_js.stream_info(S.stream(run_id, k))
        assert (await hub_js.stream_info(S.stream(run_id, "BCAST"))).config.name  # the hub's stays
    finally:
        topo.proxy.restore()
        for p in procs.values():
            p.stop()
        await remove_run(hub_js, run_id)
        for k in CUT_KINDS:
            try:
                await dc_js.delete_stream(S.stream(run_id, k))
            except Exception:
                pass
        await hub_nc.close()
        await leaf_nc.close()
    assert during <= before + 1, (before, during)  # rounds waited for the datacenter's pushes
    _check_final(ckpt, tmp_path, run_id, (a, b, c), commit, tape)


async def _same_last(js, run: str, last_seq: int) -> bool:
    return (await js.stream_info(S.stream(run, "FINAL"))).state.last_seq == last_seq


@pytest.mark.timeout(200)
@pytest.mark.e2e
def test_demo_two_datacenters_crosses_the_wan_once_per_cut(tmp_path):
    """`yeto demo --datacenters 2`: islands b and c in the leaf datacenter, a 2 MiB model. Every island
    ends on the final cut, and the hub sent over the leaf link at most 1.25x the cut bytes it
    broadcast (two islands each pulling from the hub would need >= 2x)."""
    p = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--datacenters", "2", "--model-mib", "2",
                        "--rounds", "8", "--workdir", str(tmp_path / "demo"), "--timeout", "150"],
                       capture_output=True, text=True, timeout=190)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["rounds"] == 8 and s["max_abs_diff_vs_final_cut"] == 0.0 and set(s["final_loss"]) == {"a", "b", "c"}
    wan = s["wan"]
    # each round broadcasts one fragment of the 2 MiB model (half of it): the cut is MiBs, not control
    assert wan["bcast_bytes"] >= 8 * (1 << 20), wan
    assert wan["ratio"] == pytest.approx(wan["hub_to_dc_bytes"] / wan["bcast_bytes"], abs=1e-3)
    assert 0.5 <= wan["ratio"] <= 1.25, wan
