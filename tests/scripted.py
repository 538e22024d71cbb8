"""Scripted islands for syncer tests: they speak only the `schemas` package and nats-py (not the learner).

Each ScriptedIsland plays one island's side of the protocol by hand, so a test decides exactly what
arrives at the syncer (good pushes, duplicates, stale attempts, malformed bytes) and reads back what the
syncer published (session, pulls, broadcasts, errors, manifest, final cut, tape).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import orjson
import torch
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects as S
from schemas.chunks import digest, push_digest
from schemas.dtypes import pack, unpack
from schemas.ids import new_generation
from schemas.layout import chunk_plan, layout_fingerprint
from schemas.provision import ensure_island_consumers

ROOT = Path(__file__).resolve().parents[1]


def tiny_layout(layers: int = 4, d: int = 16) -> list[dict]:
    lay = [{"name": "embed.weight", "shape": [10, d], "dtype": "float32"}]
    for i in range(layers):
        lay.append({"name": f"layers.{i}.w", "shape": [d, d], "dtype": "float32"})
        lay.append({"name": f"layers.{i}.b", "shape": [d], "dtype": "float32"})
    return lay


class SyncerProc:
    """`yeto syncer` as a child process (so a test can SIGKILL it)."""

    def __init__(self, url: str, run: str, ckpt: Path, *args: str, log: Path | None = None):
        self.cmd = [sys.executable, "-m", "services.cli", "syncer", "--nats", url, "--run", run,
                    "--checkpoint-dir", str(ckpt), "--small-limits", *args]
        self.log = log or ckpt.parent / f"syncer-{run}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> "SyncerProc":
        self.logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd + list(extra), stdout=self.logf, stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ScriptedIsland:
    def __init__(self, nc, run: str, island: str, layout: list[dict] | None = None):
        self.nc, self.js, self.run, self.island = nc, nc.jetstream(timeout=20), run, island
        self.gen = new_generation()
        self.layout = layout or tiny_layout()
        self.sub = None
        self.session: dict | None = None

    async def connect_consumer(self) -> None:
        await ensure_island_consumers(self.js, self.run, self.island, self.gen)
        self.sub = await self.js.pull_subscribe_bind(S.island_pull_consumer(self.island, self.gen),
                                                     stream=S.stream(self.run, "CTL"))

    async def new_generation(self) -> None:
        self.gen = new_generation()
        await self.connect_consumer()

    async def hello(self, *, fingerprint: str | None = None, layout=None, push_dtype="auto", bulk_dtype="auto") -> None:
        lay = layout or self.layout
        msg = codec.make("hello", run=self.run, island=self.island, gen=self.gen, layout=lay,
                         layout_fingerprint=fingerprint or layout_fingerprint(lay), push_dtype=push_dtype,
                         bulk_dtype=bulk_dtype, world={"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1},
                         host="test")
        await self.js.publish(S.hello(self.run, self.island), codec.encode("hello", msg),
                              headers={S.MSG_ID: S.hello_msg_id(self.island, self.gen)})

    async def heartbeat(self, local_step: int, step_time_s: float | None = 0.05, seq: int = 0) -> None:
        msg = codec.make("heartbeat", run=self.run, island=self.island, gen=self.gen, local_step=local_step,
                         step_time_s=step_time_s)
        await self.js.publish(S.heartbeat(self.run, self.island), codec.encode("heartbeat", msg),
                              headers={S.MSG_ID: S.heartbeat_msg_id(self.island, self.gen, seq or int(time.time() * 1e6))})

    async def wait_session(self, timeout: float = 20) -> dict:
        kv = await self.js.key_value(S.kv_bucket(self.run, "state"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                e = await kv.get("session")
                if e and e.value:
                    self.session = codec.decode("session", e.value)
                    return self.session
            except KeyNotFoundError:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError("no session record")

    def frag(self, fid: int) -> dict:
        return self.session["fragments"][fid]

    async def send_init(self, values: dict[int, torch.Tensor]) -> None:
        dtype = self.session["bulk_dtype"]
        for fid, flat in values.items():
            spans = chunk_plan(flat.numel(), dtype, self.session["chunk_bytes"])
            total = sum(s.nbytes for s in spans)
            for s in spans:
                buf = pack(flat[s.elem_offset: s.elem_offset + s.elem_count], dtype).numpy().tobytes()
                meta = {"v": 1, "run": self.run, "fragment": fid, "dtype": dtype, "chunk": s.index, "chunks": len(spans),
                        "offset": s.byte_offset, "nbytes": s.nbytes, "total": total, "digest": digest(buf)}
                await self.js.publish(S.init(self.run, fid), buf, headers={
                    S.MSG_ID: S.init_msg_id(fid, s.index, self.gen),
                    codec.CHUNK_HEADER: codec.encode_header("init_chunk", meta)})

    async def messages(self, timeout: float = 1.0) -> list[tuple[str, dict]]:
        """Everything on this island's consumer (pulls and to-island messages), decoded."""
        out = []
        try:
            msgs = await self.sub.fetch(50, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return out
        for m in msgs:
            await m.ack()
            out.append(codec.decode_typed(m.data, allowed=("pull", "manifest", "error", "shutdown")))
        return out

    async def wait_for(self, pred, timeout: float = 30.0, keep: list | None = None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for kind, m in await self.messages(timeout=0.5):
                if keep is not None:
                    keep.append((kind, m))
                if pred(kind, m):
                    return kind, m
        raise TimeoutError(f"{self.island}: no matching message in {timeout}s")

    async def push(self, pull: dict, delta: torch.Tensor, *, c_tokens: int = 100, try_: int = 0,
                   base_version: int | None = None, corrupt: str | None = None, local_step: int = 1,
                   gen: str | None = None) -> None:
        dtype = self.session["push_dtype"]
        fid = pull["fragment"]
        spans = chunk_plan(delta.numel(), dtype, self.session["chunk_bytes"])
        total = sum(s.nbytes for s in spans)
        digests = []
        for s in spans:
            buf = bytearray(pack(delta[s.elem_offset: s.elem_offset + s.elem_count].contiguous(), dtype).numpy().tobytes())
            d = digest(bytes(buf))
            if corrupt == "digest" and s.index == 0:
                buf[0] ^= 0xFF  # bytes no longer match the digest
            digests.append(d)
            meta = {"v": 1, "run": self.run, "island": self.island, "gen": gen or self.gen, "fragment": fid,
                    "step": pull["step"], "attempt": pull["attempt"], "try": try_,
                    "base_version": pull["base_version"] if base_version is None else base_version,
                    "local_step": local_step, "c_steps": 1, "c_tokens": c_tokens, "dtype": dtype, "chunk": s.index,
                    "chunks": len(spans), "offset": s.byte_offset, "nbytes": s.nbytes, "total": total, "digest": d}
            if s.index == len(spans) - 1:
                meta["push_digest"] = push_digest(digests)
            await self.js.publish(S.push(self.run, self.island, fid), bytes(buf), headers={
                S.MSG_ID: S.push_msg_id(self.island, gen or self.gen, fid, pull["step"], pull["attempt"], try_, s.index),
                codec.CHUNK_HEADER: codec.encode_header("push_chunk", meta)})

    async def read_cut(self, fid: int, *, final: bool = False) -> tuple[int, torch.Tensor, dict]:
        """The newest complete version of a fragment from BCAST (or FINAL), by direct get per chunk subject."""
        kind = "FINAL" if final else "BCAST"
        dtype = "f32" if final else self.session["bulk_dtype"]
        numel = self.frag(fid)["numel"]
        spans = chunk_plan(numel, dtype, self.session["chunk_bytes"])
        out = torch.empty(numel)
        version = None
        meta = None
        for s in spans:
            subj = S.final(self.run, fid, s.index) if final else S.bcast(self.run, fid, s.index)
            m = await self.js.get_msg(S.stream(self.run, kind), subject=subj, direct=True)
            meta = codec.decode_header("final_chunk" if final else "bcast_chunk", m.headers[codec.CHUNK_HEADER])
            assert digest(m.data) == meta["digest"]
            if version is None:
                version = meta["version"]
            elif meta["version"] != version:
                return await self.read_cut(fid, final=final)  # a newer version landed mid-read
            out[s.elem_offset: s.elem_offset + s.elem_count] = unpack(m.data, dtype, s.elem_count)
        return version, out, meta

    async def wait_version(self, fid: int, version: int, timeout: float = 30.0) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                v, vals, _ = await self.read_cut(fid)
                if v >= version:
                    return vals
            except nats.js.errors.NotFoundError:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError(f"fragment {fid} never reached version {version}")

    async def ack(self, final_step: int) -> None:
        msg = codec.make("ack", run=self.run, island=self.island, gen=self.gen, final_step=final_step)
        await self.js.publish(S.ack(self.run, self.island), codec.encode("ack", msg),
                              headers={S.MSG_ID: S.ack_msg_id(self.island, self.gen, final_step)})


async def tape(js, run: str, kind: str | None = None) -> list[dict]:
    """Every record on the syncer's EVENTS tape so far (optionally one kind)."""
    info = await js.stream_info(S.stream(run, "EVENTS"))
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(S.stream(run, "EVENTS"), seq=seq)
        except Exception:
            continue
        rec = orjson.loads(m.data)
        if kind is None or rec["kind"] == kind:
            out.append(rec)
    return out
