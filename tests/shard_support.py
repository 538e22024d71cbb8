"""Syncer shards at the shell: two `yeto syncer --shards 2` processes of one run and scripted islands,
what the shard shell and shard standby tests share (tests/test_syncer_shard_shell.py,
tests/test_syncer_shard_standby.py). No tests here.

`ShardedRun` starts shard 0, the islands' hellos, then shard 1 once the session is pinned, and sends INIT;
`play_round` plays one round against an independent `Reference`; `finish` takes the manifest to both
islands and waits for the processes to exit 0.
"""
from __future__ import annotations

import asyncio
import time

import orjson
import torch

from yeto.schemas import subjects as S
from tests.scripted import (LR, MU, Reference, ScriptedIsland, SyncerProc, close_run, tiny_layout,
                            wait_provisioned)

LAYOUT = tiny_layout(4, 32)  # P=2: fragment 0 = embed, fragment 1 = layers
STEPS = 4
RUN_ARGS = ("--islands", "2", "--fragments", "2", "--sync-every", "2", "--total-steps", str(STEPS), "--strict",
            "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.5",
            "--shards", "2",
            # scripted islands send no heartbeats: on a loaded machine the run outlasted the default 30 s
            # member timeout and the coordinator marked both islands gone (no round could launch)
            "--member-timeout", "600")


async def state_value(js, run: str, key: str, timeout: float = 20.0):
    kv = await js.key_value(S.kv_bucket(run, "state"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            e = await kv.get(key)
            if e and e.value:
                return orjson.loads(e.value)
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"state KV {key} never written")


async def wait_status_key(js, run: str, key: str, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        st = await state_value(js, run, key)
        if pred(st):
            return st
        await asyncio.sleep(0.1)
    raise AssertionError(f"state KV {key} never matched; last: {st}")


async def wait_proc(proc: SyncerProc, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert proc.proc.poll() is not None, f"syncer still running:\n{proc.output()[-3000:]}"
    return proc.proc.returncode


class ShardedRun:
    """Shard 0 started first; the islands say hello; shard 1 (a fresh follower) starts once the session
    is pinned; the INIT island sends every fragment's INIT (shard 1's wait in its work queue)."""

    def __init__(self, nats_url: str, run: str, tmp_path):
        self.url, self.run, self.tmp = nats_url, run, tmp_path
        self.ckpt = [tmp_path / "s0", tmp_path / "s1"]
        self.shards = [SyncerProc(nats_url, run, self.ckpt[k], *RUN_ARGS, "--shard", str(k),
                                  log=tmp_path / f"shard{k}.log") for k in range(2)]
        self.isls: list[ScriptedIsland] = []

    async def start(self, *, seed: int = 0) -> dict[int, torch.Tensor]:
        import nats

        from yeto.schemas.dtypes import pack, unpack

        self.shards[0].start()
        for name in ("a", "b"):
            self.isls.append(ScriptedIsland(await nats.connect(self.url), self.run, name, LAYOUT))
        a = self.isls[0]
        await wait_provisioned(a.js, self.run)
        for isl in self.isls:
            await isl.connect_consumer()
        for isl in self.isls:
            await isl.hello()
            await asyncio.sleep(0.05)
        for isl in self.isls:
            await isl.wait_session()
        self.shards[1].start()
        gen = torch.Generator().manual_seed(seed)
        bulk = a.session["bulk_dtype"]
        init = {f["id"]: unpack(pack(torch.randn(f["numel"], generator=gen), bulk), bulk, f["numel"])
                for f in a.session["fragments"]}
        await a.send_init(init)
        return init

    async def close(self) -> None:
        for p in self.shards[1:]:
            p.stop()
        await close_run(self.isls, self.shards[0], self.run)


async def play_round(run: ShardedRun, ref: Reference, t: int, gen: torch.Generator, attempt: int | None = None,
                timeout: float = 30.0) -> None:
    a, b = run.isls
    fid = (t - 1) % 2
    tokens = {"a": 200, "b": 100}
    deltas = []
    for isl in run.isls:
        pull = await isl.expect_pull(t, attempt=attempt, timeout=timeout)
        assert pull["fragment"] == fid
        deltas.append(torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1)
        await isl.push(pull, deltas[-1], c_tokens=tokens[isl.island])
    ref.round(fid, deltas, [tokens["a"], tokens["b"]])
    torch.testing.assert_close(await a.wait_version(fid, (t + 1) // 2), ref.value(fid), rtol=1e-6, atol=1e-6)


async def finish(run: ShardedRun, procs: list[SyncerProc] | None = None, manifest_timeout: float = 30.0) -> dict:
    """Both islands get the manifest and ack; `procs` (default: the run's shards) exit 0. Returns the
    manifest."""
    manifests = {}
    for isl in run.isls:
        _, m = await isl.expect(lambda k, m: k == "manifest", timeout=manifest_timeout)
        manifests[isl.island] = m
        await isl.ack(m["final_step"])
    for p in run.shards if procs is None else procs:
        assert await wait_proc(p, 60) == 0, p.output()[-3000:]
    return manifests["a"]
