"""BCAST as the server stored it, and a scripted run watched through it: what the cut-through and the
speculative-merge kill tests share (tests/test_syncer_cut_through.py, tests/test_syncer_speculate_kill.py).
No tests here.

`watched_run` starts the real `yeto syncer` with two scripted islands on `LAYOUT` (fragment 1 large enough
for its merge and broadcast to be caught in the middle), an independent `Reference` of the outer step and a
`BcastLog` of every BCAST message; it closes the run whatever the test did.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal

import torch

from yeto.schemas import codec, subjects as S
from yeto.schemas.chunks import chunk_plan
from tests.scripted import LR, MU, Reference, close_run, start_run, tiny_layout

# P = 2: fragment 0 = embed (3 chunks of 1 KiB), fragment 1 = layers (~66k f32 values, ~258 chunks): the
# merge and broadcast of fragment 1 take long enough to be caught in the middle.
LAYOUT = tiny_layout(4, 128)
RUN_ARGS = ("--islands", "2", "--fragments", "2", "--sync-every", "2", "--strict", "--outer-lr", str(LR),
            "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.5")
TOKENS = {"a": 200, "b": 100}


class BcastLog:
    """Every BCAST message of a run as the server stored it (ordered consumer): (fragment, version,
    chunk) -> the chunk digests seen (must stay one), the server timestamps of each version's chunk 0
    and seal, and an optional hook called on each message (the kill)."""

    def __init__(self, js, run: str):
        self.js, self.run = js, run
        self.chunk_digests: dict[tuple[int, int, int], set[str]] = {}
        self.first: dict[tuple[int, int], float] = {}     # (fragment, version) -> chunk 0's timestamp
        self.sealed: dict[tuple[int, int], float] = {}    # (fragment, version) -> the seal's timestamp
        self.hook = None
        self.sub = None

    async def start(self) -> "BcastLog":
        self.sub = await self.js.subscribe(S.bcast(self.run, 0, 0).rsplit(".", 2)[0] + ".>",
                                           stream=S.stream(self.run, "BCAST"), ordered_consumer=True, cb=self._on)
        return self

    async def _on(self, msg) -> None:
        meta = codec.decode_header("bcast_chunk", msg.headers[codec.CHUNK_HEADER])
        key = (meta["fragment"], meta["version"])
        self.chunk_digests.setdefault((*key, meta["chunk"]), set()).add(meta["digest"])
        ts = msg.metadata.timestamp.timestamp()
        if meta["chunk"] == 0:
            self.first.setdefault(key, ts)
        if "version_digest" in meta:
            self.sealed.setdefault(key, ts)
        if self.hook is not None:
            self.hook(meta)

    async def kill_mid_broadcast(self, syncer, fid: int, version: int, play) -> bool:
        """Run `play()` (a round) with a hook that SIGKILLs `syncer` once chunk 3 of `version` of `fid` is
        in BCAST; wait for that kill or the version's seal. True when the syncer was killed (reaped)."""
        def hook(meta):
            if (meta["fragment"], meta["version"]) == (fid, version) and meta["chunk"] >= 3 \
                    and syncer.proc.poll() is None:
                syncer.proc.send_signal(signal.SIGKILL)
        self.hook = hook
        try:
            await play()
            for _ in range(200):
                if syncer.proc.poll() is not None or (fid, version) in self.sealed:
                    break
                await asyncio.sleep(0.05)
        finally:
            self.hook = None
        if syncer.proc.poll() is None:
            return False
        syncer.proc.wait()
        return True

    def two_digests(self) -> list:
        return [(k, sorted(v)) for k, v in self.chunk_digests.items() if len(v) > 1]

    async def stop(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()


async def bcast_state(js, run: str, session: dict, fid: int) -> list[tuple[dict, bytes, int]]:
    """(header, payload, stream sequence) on each of the fragment's chunk subjects, in chunk order."""
    f = next(f for f in session["fragments"] if f["id"] == fid)
    out = []
    for s in chunk_plan(f["numel"], session["bulk_dtype"], session["chunk_bytes"]):
        m = await js.get_msg(S.stream(run, "BCAST"), subject=S.bcast(run, fid, s.index), direct=True)
        out.append((codec.decode_header("bcast_chunk", m.headers[codec.CHUNK_HEADER]), m.data, m.seq))
    return out


@contextlib.asynccontextmanager
async def watched_run(nats_url: str, run_id: str, ckpt, *args: str, seed: int):
    """(syncer, islands, reference, generator, BCAST log) of a run started with `args` on `LAYOUT`."""
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *args, layout=LAYOUT)
    log = await BcastLog(isls[0].js, run_id).start()
    try:
        yield syncer, isls, Reference(init), torch.Generator().manual_seed(seed), log
    finally:
        await log.stop()
        await close_run(isls, syncer, run_id)
