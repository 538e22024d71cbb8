"""A scripted island: one island's side of the wire protocol played by hand, speaking only the `schemas`
package and nats-py (no learner, no model), so a caller decides exactly what reaches the syncer (good pushes,
duplicates, stale attempts, malformed bytes) and reads back what the syncer published (session, pulls,
broadcasts, errors, manifest, final cut).

The syncer tests drive their runs with it (tests/scripted.py), and bench/syncer_memory.py loads a syncer with
two of them: a 1 GiB run then fits beside the syncers on a small machine, with no island model in memory.
"""
from __future__ import annotations

import asyncio
import time

import nats
import torch
from nats.js.errors import KeyNotFoundError

from yeto.schemas import codec, subjects as S
from yeto.schemas.chunks import chunk_plan, digest
from yeto.schemas.dtypes import pack, unpack
from yeto.schemas.ids import new_generation
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.messages import Ack, BcastChunk, FinalChunk, Heartbeat, Hello, PushStream, init_chunk
from yeto.schemas.provision import ensure_island_consumers
from yeto.schemas.versions import software


def tiny_layout(layers: int = 4, d: int = 16) -> list[dict]:
    """A small f32 layout (an embedding and `layers` square layers with biases) for a scripted run."""
    lay = [{"name": "embed.weight", "shape": [10, d], "dtype": "float32"}]
    for i in range(layers):
        lay.append({"name": f"layers.{i}.w", "shape": [d, d], "dtype": "float32"})
        lay.append({"name": f"layers.{i}.b", "shape": [d], "dtype": "float32"})
    return lay


class ScriptedIsland:
    """One island of a run, played by hand over its own NATS connection `nc`."""

    def __init__(self, nc, run: str, island: str, layout: list[dict] | None = None):
        self.nc, self.js, self.run, self.island = nc, nc.jetstream(timeout=20), run, island
        self.gen = new_generation()
        self.layout = layout or tiny_layout()
        self.sub = None
        self.session: dict | None = None

    async def connect_consumer(self) -> None:
        """The island's two CTL consumers (pulls, messages to it), taken over by this generation."""
        await ensure_island_consumers(self.js, self.run, self.island, self.gen)
        self.sub = [await self.js.pull_subscribe_bind(S.island_consumer(self.island, kind), stream=S.stream(self.run, "CTL"))
                    for kind in S.ISLAND_CONSUMER_KINDS]

    async def new_generation(self) -> None:
        self.gen = new_generation()
        await self.connect_consumer()

    async def hello(self, *, fingerprint: str | None = None, layout=None, push_dtype="auto", bulk_dtype="auto") -> None:
        lay = layout or self.layout
        msg = Hello(run=self.run, island=self.island, gen=self.gen, layout=lay,
                    layout_fingerprint=fingerprint or layout_fingerprint(lay), push_dtype=push_dtype,
                    bulk_dtype=bulk_dtype, world={"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1},
                    host="test", software=software())
        await self.js.publish(S.hello(self.run, self.island), msg.encode(),
                              headers={S.MSG_ID: S.hello_msg_id(self.island, self.gen)})

    async def heartbeat(self, local_step: int, step_time_s: float | None = 0.05, seq: int = 0) -> None:
        msg = Heartbeat(run=self.run, island=self.island, gen=self.gen, local_step=local_step, step_time_s=step_time_s)
        await self.js.publish(S.heartbeat(self.run, self.island), msg.encode(),
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

    async def send_init(self, values: dict[int, torch.Tensor], *, chunks=None, gen: str | None = None,
                        island: str | None = None) -> int:
        """INIT chunks of `values` (fragment -> flat values). `chunks` (a set of chunk indexes) sends only
        those; `gen` / `island` put another generation / island id in the headers (and the msg id).
        Returns the number of chunks sent."""
        dtype = self.session["bulk_dtype"]
        gen = gen or self.gen
        sent = 0
        for fid, flat in values.items():
            spans = chunk_plan(flat.numel(), dtype, self.session["chunk_bytes"])
            for s in spans:
                if chunks is not None and s.index not in chunks:
                    continue
                buf = pack(flat[s.elem_offset: s.elem_offset + s.elem_count], dtype).numpy().tobytes()
                meta = init_chunk(spans, s.index, buf, run=self.run, island=island or self.island, gen=gen,
                                  fragment=fid, dtype=dtype)
                await self.js.publish(S.init(self.run, fid), buf, headers={
                    S.MSG_ID: S.init_msg_id(fid, s.index, gen) + ("" if island is None else f".{island}"),
                    codec.CHUNK_HEADER: meta.header()})
                sent += 1
        return sent

    async def messages(self, timeout: float = 1.0) -> list[tuple[str, dict]]:
        """Everything on this island's consumer (pulls and to-island messages), decoded."""
        out = []

        async def fetch(sub):
            try:
                return await sub.fetch(50, timeout=timeout)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return []

        got = await asyncio.gather(*(fetch(sub) for sub in self.sub))
        # both consumers read one stream: its order is the order the syncer sent them in
        for m in sorted((m for batch in got for m in batch), key=lambda m: m.metadata.sequence.stream):
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
                   gen: str | None = None, fragment: int | None = None, only=None, dtype: str | None = None) -> None:
        """Push `delta` for `pull`. `corrupt` spoils chunk 0: "digest" (bytes no longer match the digest),
        "size" (4 payload bytes short of its nbytes), "nan" (a NaN and an Inf in the values, digest
        of the bad bytes). `fragment` publishes on push.I.<fragment> with that fragment in the header.
        `only`: publish just these chunk indices (a push caught half way, as an island killed mid-push).
        `dtype`: the pull's push_dtype (`yeto run set`), else the session's, unless given."""
        dtype = dtype or pull.get("push_dtype", self.session["push_dtype"])
        fid = pull["fragment"] if fragment is None else fragment
        spans = chunk_plan(delta.numel(), dtype, self.session["chunk_bytes"])
        stream = PushStream(spans, run=self.run, island=self.island, gen=gen or self.gen, fragment=fid,
                            step=pull["step"], attempt=pull["attempt"], try_=try_,
                            base_version=pull["base_version"] if base_version is None else base_version,
                            local_step=local_step, c_steps=1, c_tokens=c_tokens, dtype=dtype)
        for s in spans:
            part = delta[s.elem_offset: s.elem_offset + s.elem_count].contiguous()
            if corrupt == "nan" and s.index == 0:
                part = part.clone()
                part[0], part[-1] = float("nan"), float("inf")
            buf = bytearray(pack(part, dtype).numpy().tobytes())
            meta = stream.chunk(s.index, bytes(buf))  # the digest of the bytes before any corruption
            if corrupt == "digest" and s.index == 0:
                buf[0] ^= 0xFF  # bytes no longer match the digest
            if corrupt == "size" and s.index == 0:
                del buf[-4:]  # header still claims the full nbytes
            if only is not None and s.index not in only:
                continue
            await self.js.publish(S.push(self.run, self.island, fid), bytes(buf), headers={
                S.MSG_ID: S.push_msg_id(self.island, gen or self.gen, fid, pull["step"], pull["attempt"], try_, s.index),
                codec.CHUNK_HEADER: meta.header()})

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
            meta = (FinalChunk if final else BcastChunk).from_header(m.headers[codec.CHUNK_HEADER])
            assert digest(m.data) == meta.digest
            if version is None:
                version = meta.version
            elif meta.version != version:
                return await self.read_cut(fid, final=final)  # a newer version landed mid-read
            out[s.elem_offset: s.elem_offset + s.elem_count] = unpack(m.data, dtype, s.elem_count)
        return version, out, meta.to_wire()   # the last chunk's header, as its schema's dict

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

    async def expect(self, pred, timeout: float = 30.0) -> tuple[str, dict]:
        """Like wait_for, but messages that do not match stay in an inbox for later calls (pipelined
        rounds deliver several pulls in one fetch)."""
        inbox = self.__dict__.setdefault("_inbox", [])
        deadline = time.monotonic() + timeout
        while True:
            for i, (kind, m) in enumerate(inbox):
                if pred(kind, m):
                    del inbox[i]
                    return kind, m
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.island}: no matching message in {timeout}s; inbox holds "
                                   f"{[(k, m.get('step'), m.get('attempt'), m.get('code')) for k, m in inbox]}")
            inbox.extend(await self.messages(timeout=0.3))

    async def expect_pull(self, step: int, attempt: int | None = None, timeout: float = 30.0) -> dict:
        return (await self.expect(lambda k, m: k == "pull" and m["step"] == step
                                  and (attempt is None or m["attempt"] == attempt), timeout))[1]

    async def publish_raw(self, subject: str, data: bytes, headers: dict | None = None, msg_id: str | None = None):
        """Publish arbitrary bytes (bad-input tests); a fresh Nats-Msg-Id unless one is given."""
        hdrs = dict(headers or {})
        hdrs[S.MSG_ID] = msg_id or f"raw.{self.island}.{time.time_ns()}"
        return await self.js.publish(subject, data, headers=hdrs)

    async def ack(self, final_step: int) -> None:
        msg = Ack(run=self.run, island=self.island, gen=self.gen, final_step=final_step)
        await self.js.publish(S.ack(self.run, self.island), msg.encode(),
                              headers={S.MSG_ID: S.ack_msg_id(self.island, self.gen, final_step)})
