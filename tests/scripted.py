"""Scripted islands for syncer tests (services/scripted_island.py: they speak only the `schemas` package and
nats-py, not the learner) next to the real `yeto syncer` (SyncerProc, a services/run_harness.py Child), and the
helpers of the syncer e2e tests: the reference outer optimizer, a run's start and close, tape and status waits.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import nats
import torch

from yeto.schemas import codec, subjects as S
from yeto.schemas.dtypes import pack, unpack
from yeto.schemas.provision import remove_run
from yeto.services.run_harness import Child, kv_json, read_tape, tape_of, wait_provisioned  # noqa: F401
from yeto.services.scripted_island import ScriptedIsland, tiny_layout  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]

# Every record of the syncer's EVENTS tape so far (optionally one kind).
tape = read_tape


class SyncerProc(Child):
    """`yeto syncer` as a child process (so a test can SIGKILL it), logging to `log`."""

    def __init__(self, url: str, run: str, ckpt: Path, *args: str, log: Path | None = None):
        super().__init__("syncer", [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run,
                                    "--checkpoint-dir", str(ckpt), "--small-limits", *args],
                         log or ckpt.parent / f"syncer-{run}.log", group=False)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            super().kill()

    def stop(self) -> None:
        super().stop(grace=10)


# ---- helpers for the syncer e2e tests (rounds, bad input, resume) --------------------------------

LR, MU = 0.7, 0.9


async def push_round(isls, ref, gen: torch.Generator, t: int, tokens: dict[str, int], *,
                     attempt: int | None = None) -> int:
    """Every island answers round t's pull (P = 2 fragments: t targets (t-1) mod 2) with a random delta
    (0.1 x normal, from `gen`) claiming its `tokens`; the reference takes the same round. Returns the
    fragment."""
    fid = (t - 1) % 2
    deltas = []
    for isl in isls:
        pull = await isl.expect_pull(t, attempt=attempt)
        deltas.append(torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1)
        await isl.push(pull, deltas[-1], c_tokens=tokens[isl.island])
    ref.round(fid, deltas, [tokens[isl.island] for isl in isls])
    return fid


async def finish_on_reference(isls, syncer: "SyncerProc", ref, final_step: int) -> dict:
    """Finalization seen from the islands: each gets the manifest of `final_step`, the f32 final cut
    equals the reference, each acks, and the syncer exits 0. Returns the manifest."""
    for isl in isls:
        _, man = await isl.expect(lambda k, m: k == "manifest")
        assert man["final_step"] == final_step, man
    for fid in range(len(isls[0].session["fragments"])):
        _, vals, _ = await isls[0].read_cut(fid, final=True)
        torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
    for isl in isls:
        await isl.ack(final_step)
    assert syncer.wait(30) == 0, syncer.output()[-4000:]
    return man


class Reference:
    """The outer optimizer computed independently: torch.optim.SGD(nesterov) per fragment, on the
    float64 weighted mean of the deltas (c_tokens weights)."""

    def __init__(self, init: dict[int, torch.Tensor], lr: float = LR, mu: float = MU):
        self.p = {f: torch.nn.Parameter(v.clone()) for f, v in init.items()}
        self.opt = {f: torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=True) for f, p in self.p.items()}

    def round(self, fid: int, deltas: list[torch.Tensor], tokens: list[int]) -> None:
        w = torch.tensor(tokens, dtype=torch.float64)
        avg = sum(wi * d.double() for wi, d in zip(w, deltas)) / w.sum()
        self.p[fid].grad = (-avg).float()
        self.opt[fid].step()

    def value(self, fid: int) -> torch.Tensor:
        return self.p[fid].detach().clone()


async def start_run(nats_url: str, run: str, names: list[str], ckpt: Path, *syncer_args: str, layout=None,
                    init_seed: int = 0, before_init=None):
    """Start `yeto syncer`, connect scripted islands `names` (the first is the INIT island), say hello,
    wait for the session and send INIT (random values; `before_init(isls)` runs first). Returns
    (syncer, islands, init values per fragment as sent, i.e. rounded to the bulk dtype)."""
    syncer = SyncerProc(nats_url, run, ckpt, *syncer_args).start()
    isls = []
    try:
        for name in names:
            isls.append(ScriptedIsland(await nats.connect(nats_url), run, name, layout))
        await wait_provisioned(isls[0].js, run)
        for isl in isls:
            await isl.connect_consumer()
        for isl in isls:
            await isl.hello()
            await asyncio.sleep(0.05)  # the first hello pins the session and names the INIT island
        for isl in isls:
            await isl.wait_session()
        assert isls[0].session["init_island"] == names[0]
        if before_init is not None:
            await before_init(isls)
        gen = torch.Generator().manual_seed(init_seed)
        bulk = isls[0].session["bulk_dtype"]
        init = {f["id"]: unpack(pack(torch.randn(f["numel"], generator=gen), bulk), bulk, f["numel"])
                for f in isls[0].session["fragments"]}
        await isls[0].send_init(init)
    except BaseException:
        await close_run(isls, syncer, run)
        raise
    return syncer, isls, init


async def close_run(isls, syncer: SyncerProc | None, run: str, extra_nc=()) -> None:
    """Stop the syncer, remove the run's streams and buckets, close the islands' connections."""
    if syncer is not None:
        syncer.stop()
    try:
        if isls:
            await remove_run(isls[0].js, run)
    finally:
        for isl in isls:
            await isl.nc.close()
        for nc in extra_nc:
            await nc.close()


async def wait_tape(js, run: str, pred, timeout: float = 20.0, kind: str | None = None) -> dict:
    """The first tape record (of `kind`) matching pred, waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in await tape(js, run, kind):
            if pred(rec):
                return rec
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no tape record of kind {kind} matching in {timeout}s")


async def syncer_status(js, run: str) -> dict | None:
    """The syncer's status record (state KV key `syncer`: phase, versions, counters), or None."""
    return await kv_json(js, run, "syncer")


async def wait_status(js, run: str, pred, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        st = await syncer_status(js, run)
        if st is not None and pred(st):
            return st
        await asyncio.sleep(0.1)
    raise TimeoutError(f"syncer status never matched; last: {st}")


class Heartbeater:
    """Heartbeats for an island every `every_s` (local_step advancing one per beat) until stopped."""

    def __init__(self, isl: ScriptedIsland, every_s: float = 0.3, step_time_s: float = 0.05):
        self.isl, self.every_s, self.step_time_s = isl, every_s, step_time_s
        self.local_step = 0
        self.task: asyncio.Task | None = None

    def start(self) -> "Heartbeater":
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            try:
                await self.isl.heartbeat(self.local_step, self.step_time_s)
            except Exception:  # a test tearing down its connection
                return
            self.local_step += 1
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None


class CutWatcher:
    """Every BCAST chunk notice of a run (ordered headers-only consumer, last per subject then new):
    records (fragment, version) -> version_digest (carried by the version's seal, its last chunk, only)
    and each chunk subject's sequence of versions, so a test can assert that no version number is ever
    sealed with two digests and no version goes back."""

    def __init__(self, js, run: str):
        self.js, self.run = js, run
        self.digests: dict[tuple[int, int], str] = {}
        self.conflicts: list[tuple[int, int, str, str]] = []
        self.versions: dict[tuple[int, int], list[int]] = {}  # (fragment, chunk) -> versions in arrival order
        self.sub = None

    async def start(self) -> "CutWatcher":
        from yeto.schemas.provision import bcast_consumer_config

        cfg = bcast_consumer_config(self.run)
        self.sub = await self.js.subscribe(cfg.filter_subject, stream=S.stream(self.run, "BCAST"),
                                           ordered_consumer=True, config=cfg, cb=self._on_msg)
        return self

    async def _on_msg(self, msg) -> None:
        meta = codec.decode_header("bcast_chunk", msg.headers[codec.CHUNK_HEADER])
        key = (meta["fragment"], meta["version"])
        if "version_digest" in meta:  # the seal; the other chunks of a broadcast carry none
            seen = self.digests.setdefault(key, meta["version_digest"])
            if seen != meta["version_digest"]:
                self.conflicts.append((*key, seen, meta["version_digest"]))
        self.versions.setdefault((meta["fragment"], meta["chunk"]), []).append(meta["version"])

    def went_back(self) -> list[tuple[int, int, list[int]]]:
        return [(f, c, vs) for (f, c), vs in self.versions.items() if any(b < a for a, b in zip(vs, vs[1:]))]

    async def stop(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None


def snapshot_dir(path: Path) -> dict[str, bytes]:
    """Name -> bytes of every file in a directory (a checkpoint before/after comparison)."""
    return {q.name: q.read_bytes() for q in sorted(Path(path).iterdir()) if q.is_file()}


def replay_segments(nats_url: str, run: str) -> list[str]:
    """`yeto replay` of a run's tape (it must exit 0): its per-process lines ("syncer process ... identical")."""
    rp = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "replay", "--nats", nats_url, "--run", run],
                        capture_output=True, text=True, timeout=60)
    assert rp.returncode == 0, rp.stdout + rp.stderr
    return [line for line in rp.stdout.splitlines() if line.startswith("syncer process ")]
