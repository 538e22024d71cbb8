"""docs/design.md §10, §11: a lease and a standby per shard, against a real nats-server.

Two shards (P = 2, `--shards 2`), each started twice with the same command and its own empty
`--checkpoint-dir` (as on two hosts: no shared files). The owner of one shard (the follower, then the
coordinator) is killed -9 with its round in flight and never restarted: that shard's standby takes the
lease `lease.<K>`, restores the committed state from the state KV into its empty directory, launches the
round again with a new attempt, and the run finishes: the merged values equal an independent reference,
every (fragment, version) is committed once with one digest, and the other shard's standby exits 0 once
its shard (or the run) is over, having written nothing.
"""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import torch

from tests.scripted import Reference, SyncerProc, tape
from tests.shard_support import RUN_ARGS, ShardedRun, finish, play_round

pytestmark = pytest.mark.timeout(240)

TTL = "3"


async def _lease_pid(js, run: str, shard: int, timeout: float = 30.0) -> int:
    kv = await js.key_value(f"yeto_{run}_state")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return orjson.loads((await kv.get(f"lease.{shard}")).value)["pid"]
        except Exception:  # noqa: BLE001 - not written yet
            await asyncio.sleep(0.1)
    raise AssertionError(f"lease.{shard} never written")


class TwinShards(ShardedRun):
    """ShardedRun with a second `yeto syncer` per shard (own directory), started right after the first."""

    def __init__(self, nats_url: str, run: str, tmp_path):
        super().__init__(nats_url, run, tmp_path)
        for p in self.shards:
            p.cmd = [*p.cmd, "--lease-ttl", TTL]
        self.twins = [SyncerProc(nats_url, run, tmp_path / f"s{k}-twin", *RUN_ARGS, "--shard", str(k),
                                 "--lease-ttl", TTL, log=tmp_path / f"shard{k}-twin.log") for k in range(2)]

    async def start(self, *, seed: int = 0):
        init = await super().start(seed=seed)
        for t in self.twins:
            t.start()
        return init

    async def owner(self, shard: int) -> tuple[SyncerProc, SyncerProc]:
        """(owner, standby) of a shard, by the pid in its lease."""
        pid = await _lease_pid(self.isls[0].js, self.run, shard)
        one, two = self.shards[shard], self.twins[shard]
        assert pid in (one.proc.pid, two.proc.pid), pid
        return (one, two) if one.proc.pid == pid else (two, one)

    async def close(self) -> None:
        for t in self.twins:
            t.stop()
        await super().close()


async def _final_cut_is_the_reference(a, ref: Reference, manifest: dict, js, run_id: str) -> None:
    """The final cut (versions 2 of both fragments) equals the independent reference, its digests are the
    manifest's, and every (fragment, version) 0..2 was committed with one digest."""
    assert manifest["versions"] == {"0": 2, "1": 2}
    for fid in (0, 1):
        _, vals, meta = await a.read_cut(fid, final=True)
        assert meta["version_digest"] == manifest["version_digests"][str(fid)]
        torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
    commits = [(r["fragment"], r["version"], r["detail"]["version_digest"]) for r in await tape(js, run_id, "commit")]
    assert sorted({(f, v) for f, v, _ in commits}) == sorted((f, v) for f in (0, 1) for v in (0, 1, 2))
    assert len({(f, v, d) for f, v, d in commits}) == 6, commits   # one digest per version


@pytest.mark.parametrize("killed", [1, 0], ids=["follower", "coordinator"])
async def test_a_shards_owner_killed_its_standby_on_an_empty_directory_takes_over(nats_url, run_id, tmp_path, killed):
    run = TwinShards(nats_url, run_id, tmp_path)
    try:
        init = await run.start(seed=7 + killed)
        a = run.isls[0]
        js = a.js
        ref = Reference(init)
        gen = torch.Generator().manual_seed(11)
        await play_round(run, ref, 1, gen)
        await play_round(run, ref, 2, gen)
        owners = {k: await run.owner(k) for k in (0, 1)}
        victim, standby = owners[killed]
        # the killed shard's next round is in flight (strict: launched right after the step before committed)
        t = 4 if killed == 1 else 3
        for isl in run.isls:
            await isl.expect_pull(t, attempt=1)
        victim.kill()
        t_kill = time.monotonic()
        # the other shard's round goes on meanwhile
        if killed == 1:
            await play_round(run, ref, 3, gen)
        # the standby takes the lease (a dead pid on this host: at once; the TTL otherwise), restores from
        # the state KV into its empty directory and launches the round again with a new attempt
        await play_round(run, ref, t, gen, attempt=2, timeout=60)
        took = time.monotonic() - t_kill
        if killed == 0:
            await play_round(run, ref, 4, gen)
        out = standby.output()
        assert "restored run" in out and "from the state KV" in out, out[-3000:]
        # (its lease may already be released: a follower exits right after its final cut)
        other_owner, other_standby = owners[1 - killed]
        manifest = await finish(run, [standby, other_owner, other_standby], manifest_timeout=60)
        print(f"shard {killed}: kill -> its round merged again by the standby in {took:.1f}s")
        await _final_cut_is_the_reference(a, ref, manifest, js, run_id)
        # the standby of the shard nobody killed stood by to the end and wrote nothing
        assert "finished while this syncer stood by" in other_standby.output(), other_standby.output()[-3000:]
        standby_dir = run.ckpt[1 - killed] if other_standby in run.shards else tmp_path / f"s{1 - killed}-twin"
        assert not (standby_dir / "checkpoint.json").exists()
        # a shard's final cut taken, it was never reported missing afterwards
        missing = [r for r in await tape(js, run_id, "error") if r["reason"].startswith("shard ")
                   and "missing" in r["reason"]]
        assert all(r["detail"]["fragments"] == [killed] for r in missing), missing
    finally:
        await run.close()


async def test_a_follower_covering_the_coordinator_takes_its_role_when_it_dies(nats_url, run_id, tmp_path):
    """`--cover-coordinator` (services/cmd_syncer.py): no dedicated standby for shard 0; shard 1's own
    process stands by for it (warm) and, when shard 0's owner is killed -9 with a round in flight, takes the
    coordinator's role and fragments over: the round is launched again, the run finishes (manifests, acks)
    with the reference values, and each (fragment, version) has one digest. The cover never took the lease
    at the start, though it started before anyone had held it for long."""
    run = ShardedRun(nats_url, run_id, tmp_path)
    run.shards[0].cmd = [*run.shards[0].cmd, "--lease-ttl", TTL]
    run.shards[1].cmd = [*run.shards[1].cmd, "--lease-ttl", TTL, "--cover-coordinator"]
    try:
        init = await run.start(seed=5)
        a = run.isls[0]
        js = a.js
        ref = Reference(init)
        gen = torch.Generator().manual_seed(13)
        await play_round(run, ref, 1, gen)
        await play_round(run, ref, 2, gen)
        assert await _lease_pid(js, run_id, 0) == run.shards[0].proc.pid   # the cover only stood by
        for isl in run.isls:
            await isl.expect_pull(3, attempt=1)
        run.shards[0].kill()
        t_kill = time.monotonic()
        await play_round(run, ref, 3, gen, attempt=2, timeout=60)
        took = time.monotonic() - t_kill
        await play_round(run, ref, 4, gen)
        cover = run.shards[1]
        assert await _lease_pid(js, run_id, 0) == cover.proc.pid
        out = cover.output()
        assert "[shard 0/2]" in out and "took over run lease.0" in out and "restored run" in out, out[-3000:]
        assert "fragments from the standby's warm copy" in out, out[-3000:]
        manifest = await finish(run, [cover], manifest_timeout=60)
        print(f"coordinator killed -> its round merged again by the covering follower in {took:.1f}s")
        await _final_cut_is_the_reference(a, ref, manifest, js, run_id)
        assert (tmp_path / "s1-cover-s0" / "checkpoint.json").exists()
    finally:
        await run.close()


@pytest.mark.e2e   # runs `yeto syncer` (a process)
def test_cover_coordinator_is_refused_where_it_cannot_work(tmp_path):
    import subprocess
    import sys


    base = [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--run", "r", "--nats", "nats://127.0.0.1:1",
            "--islands", "2", "--fragments", "2", "--checkpoint-dir", str(tmp_path), "--cover-coordinator"]
    for extra, says in ((["--shards", "2", "--shard", "0"], "--cover-coordinator is for a follower shard"),
                        ([], "--cover-coordinator is for a follower shard"),
                        (["--shards", "2", "--shard", "1", "--state-store", "local"], "needs --state-store jetstream")):
        p = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
