"""The island against a real nats-server with the syncer's side played by hand: what the island test files
share (tests/test_island_local.py, test_island_reliability.py, test_island_background.py,
test_island_wire.py). No tests here.

`island_env` (the fixture is tests/conftest.py's) provisions a run on the session's broker and makes
Islands with a hand-played `Syncer` (broadcasts, pulls, final cuts, manifests; pushes read back);
`own_broker` is an island on a broker of its own, with file storage, that a test can stop and restart.
The island runs its blocking calls in a worker thread (`asyncio.to_thread`), so the test's own event loop
keeps serving the syncer's side.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import orjson
import torch
from torch import nn

from yeto.learner.adapters import TorchModuleAdapter, gather_fragment
from yeto.learner.config import IslandConfig
from yeto.learner.island import Island
from yeto.schemas import codec
from yeto.schemas import subjects as S
from yeto.schemas.chunks import check_chunk, chunk_header, chunk_plan, push_digest, version_digest
from yeto.schemas.conn import ConnectOptions
from yeto.schemas.dtypes import as_bytes_view, pack, wire_align
from yeto.schemas.layout import build_session
from yeto.schemas.provision import RunLimits, kv, provision_run, remove_run

CHUNK_BYTES = 1024
ISLAND = "a"


class Net(nn.Module):
    """Two fragments with P=2: the embedding alone (1 chunk in f32), the layers (4 chunks in f32)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(32, 24), nn.Linear(24, 8)])


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


class Syncer:
    """The syncer's side of the wire, by hand."""

    def __init__(self, js, run: str, session: dict):
        self.js, self.run, self.session = js, run, session

    def numel(self, fid: int) -> int:
        return self.session["fragments"][fid]["numel"]

    def values(self, fid: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.numel(fid), generator=g)

    async def _chunks(self, kind: str, fid: int, version: int, flat: torch.Tensor, dtype: str, extra: dict,
                      subject, msg_id, corrupt: bool = False, only: set[int] | None = None) -> str:
        packed = pack(flat, dtype)
        vdig = version_digest(packed)
        spans = chunk_plan(flat.numel(), dtype, self.session["chunk_bytes"])
        mv = as_bytes_view(packed)
        for sp in spans:
            if only is not None and sp.index not in only:
                continue
            payload = bytes(mv[sp.byte_offset: sp.byte_offset + sp.nbytes])
            meta = {"v": 1, "run": self.run, "fragment": fid, "version": version, "dtype": dtype,
                    **chunk_header(spans, sp.index, payload), **extra}
            if kind == "final_chunk" or sp.index == len(spans) - 1:  # BCAST: on the seal only
                meta["version_digest"] = vdig
            if corrupt:
                meta["digest"] = "0" * 16
            await self.js.publish(subject(fid, sp.index), payload,
                                  headers={S.MSG_ID: msg_id(fid, version, sp.index),
                                           codec.CHUNK_HEADER: codec.encode_header(kind, meta)})
        return vdig

    async def bcast(self, fid: int, version: int, flat: torch.Tensor, *, corrupt: bool = False,
                    msg_id=S.bcast_msg_id, only: set[int] | None = None) -> str:
        """Publish a version in the session bulk dtype (`only`: just those chunks); returns its
        version digest."""
        return await self._chunks("bcast_chunk", fid, version, flat, self.session["bulk_dtype"], {},
                                  lambda f, k: S.bcast(self.run, f, k), msg_id, corrupt, only)

    def bcast_chunks(self, fid: int) -> int:
        unit = wire_align(self.session["bulk_dtype"])[1]
        total = self.numel(fid) * (4 if self.session["bulk_dtype"] == "f32" else 2)
        return -(-total // ((self.session["chunk_bytes"] // unit) * unit))

    async def final(self, fid: int, version: int, flat: torch.Tensor, final_step: int) -> str:
        return await self._chunks("final_chunk", fid, version, flat, "f32", {"final_step": final_step},
                                  lambda f, k: S.final(self.run, f, k), S.final_msg_id)

    async def pull(self, fid: int, step: int, base: int, members: list[tuple[str, str]], attempt: int = 1, seq: int = 0):
        msg = codec.make("pull", run=self.run, fragment=fid, step=step, attempt=attempt, seq=seq, base_version=base,
                         members=[{"island": i, "gen": g} for i, g in members])
        await self.js.publish(S.pull(self.run), codec.encode("pull", msg),
                              headers={S.MSG_ID: S.pull_msg_id(fid, step, attempt, seq)})

    async def to_island(self, kind: str, island: str, **fields):
        msg = codec.make(kind, run=self.run, **fields)
        await self.js.publish(S.to_island(self.run, island), codec.encode(kind, msg),
                              headers={S.MSG_ID: S.to_island_msg_id(island, kind, str(time.monotonic_ns()))})

    async def pushes(self, island: str, fid: int, count: int, timeout: float = 10.0) -> list[tuple[dict, bytes]]:
        """The first `count` push chunks on push.I.F, decoded headers and payloads."""
        sub = await self.js.subscribe(S.push(self.run, island, fid), stream=S.stream(self.run, "PUSH"),
                                      ordered_consumer=True)
        try:
            out = []
            for _ in range(count):
                m = await sub.next_msg(timeout=timeout)
                out.append((codec.decode_header("push_chunk", m.headers[codec.CHUNK_HEADER]), m.data))
            return out
        finally:
            await sub.unsubscribe()

    async def push_count(self, island: str, fid: int) -> int:
        info = await self.js.stream_info(S.stream(self.run, "PUSH"), subjects_filter=S.push(self.run, island, fid))
        return sum((info.state.subjects or {}).values())


def assemble(chunks: list[tuple[dict, bytes]], numel: int, chunk_bytes: int = CHUNK_BYTES) -> bytes:
    """Check a fragment's chunks against the session's chunk plan like the syncer would (every chunk
    once, each checked by `check_chunk`); return the fragment's bytes in chunk order."""
    chunks = sorted(chunks, key=lambda c: c[0]["chunk"])
    spans = chunk_plan(numel, chunks[0][0]["dtype"], chunk_bytes)
    assert [m["chunk"] for m, _ in chunks] == list(range(len(spans)))
    for meta, data in chunks:
        check_chunk(spans, meta, data)
    return b"".join(bytes(d) for _, d in chunks)


def assemble_push(chunks: list[tuple[dict, bytes]], numel: int) -> tuple[dict, bytes]:
    """Check one push try's chunks like the syncer would; return the last header and the payload."""
    chunks = sorted(chunks, key=lambda c: c[0]["chunk"])
    last = chunks[-1][0]
    assert last["push_digest"] == push_digest([m["digest"] for m, _ in chunks])
    return last, assemble(chunks, numel)


@contextlib.asynccontextmanager
async def island_env(nc, run_id: str, nats_url: str, tmp_path):
    """The `island_env` fixture's body (tests/conftest.py): `make(model, ...)` -> (Island, session, Syncer)
    on a provisioned run (memory storage); `make.write_session(session)`; `make.js`, `make.nats_url`."""
    js = nc.jetstream()
    await provision_run(js, run_id, RunLimits.small(storage="memory"), log=lambda _: None)
    made: list[Island] = []

    def make(model: nn.Module, *, push_dtype="f32", bulk_dtype="f32", init_island="syncer-side", sync_every=2,
             fragments=2, store_dir=None, **cfg) -> tuple[Island, dict, Syncer]:
        adapter = TorchModuleAdapter(model)
        session = build_session(adapter.layout(), fragments, run=run_id, push_dtype=push_dtype, bulk_dtype=bulk_dtype,
                                chunk_bytes=CHUNK_BYTES, init_island=init_island, sync_every=sync_every,
                                created=time.time())
        kw = dict(heartbeat_s=0.5, progress=False, session_timeout_s=20, lockstep_timeout_s=20, final_timeout_s=20,
                  shutdown_timeout_s=10, push_timeout_s=20, fetch_timeout_s=10, connect_timeout_s=10,
                  step_log=str(tmp_path / f"steplog-{len(made)}.jsonl"),
                  # these tests read what one boundary does; the worker thread's own tests pass background=True
                  background=False)
        kw.update(cfg)
        island = Island(adapter, IslandConfig(run=run_id, island=ISLAND, nats=ConnectOptions(url=nats_url), **kw),
                        anchor_dir=store_dir)  # the keyword; cfg's anchor_dir is YETO_ANCHOR_DIR's field
        made.append(island)
        return island, session, Syncer(js, run_id, session)

    async def write_session(session: dict):
        await (await kv(js, run_id, "state")).put("session", codec.encode("session", session))

    make.write_session = write_session
    make.js = js
    make.nats_url = nats_url
    yield make
    for island in made:
        await asyncio.to_thread(island.close)
    await remove_run(js, run_id)


async def until(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def started(make, island: Island, session: dict) -> Island:
    await make.write_session(session)
    await asyncio.to_thread(island.start)
    return island


async def boundary(island: Island, tokens: int = 1, loss=None) -> bool:
    return await asyncio.to_thread(island.boundary, tokens, loss)


async def publish_v(syncer: Syncer, island: Island, version: int, values: dict[int, torch.Tensor],
                    **kw) -> dict[int, str]:
    """Broadcast a version of each fragment given and wait until the island holds the notices."""
    before = len(island.client.bcast)
    digests = {fid: await syncer.bcast(fid, version, v, **kw) for fid, v in values.items()}
    if island.worker is not None:   # the worker drains the notices: wait until it has read the versions whole
        await until(lambda: all(island.wire.ready.get(f, (None,))[0] == version for f in values),
                    what="versions read whole by the sync worker")
        return digests
    n = sum(syncer.bcast_chunks(fid) for fid in values)
    await until(lambda: len(island.client.bcast) >= before + n, what="broadcast notices")
    return digests


def frag_values(island: Island, fid: int) -> torch.Tensor:
    return gather_fragment(island.adapter, island.frags[fid])


def anchor_flat(island: Island, fid: int) -> torch.Tensor:
    """The island's anchor of a fragment (a single process owns every piece), in layout order."""
    pieces = island.anchor(fid)
    return torch.cat([pieces[t["name"]] for t in island.frags[fid]["tensors"]])


def residual_flat(island: Island, fid: int) -> torch.Tensor:
    pieces = island.residual(fid)
    return torch.cat([pieces[t["name"]] for t in island.frags[fid]["tensors"]])


def steplog_lines(island: Island) -> list[dict]:
    with open(island.config.step_log, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]


def dp_island(model: nn.Module, url: str, run: str, **cfg) -> Island:
    """A rank's Island "dp" of a data-parallel island over the whole gloo world (not started)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    return Island(TorchModuleAdapter(model, group=group),
                  IslandConfig(run=run, island="dp", nats=ConnectOptions(url=url), heartbeat_s=0.5, progress=False,
                               session_timeout_s=30, final_timeout_s=30, shutdown_timeout_s=30, connect_timeout_s=10,
                               **cfg), group=group)


async def dp_hello(js, run: str) -> dict:
    """The syncer's side: the first hello on CTL."""
    ctl = await js.pull_subscribe_bind(durable=S.SYNCER_CTL_CONSUMER, stream=S.stream(run, "CTL"))
    while True:
        for m in await ctl.fetch(10, timeout=30):
            await m.ack()
            kind, msg = codec.decode_typed(m.data, ("hello", "heartbeat", "ack"))
            if kind == "hello":
                return msg


async def dp_finish(js, syncer: "Syncer", gen: str, final: dict[int, torch.Tensor], final_step: int,
                    versions: dict[str, int]) -> None:
    """The syncer's side of the end: the final cut, the manifest, the island's ack, then shutdown."""
    digests = {str(fid): await syncer.final(fid, fid + 1, v, final_step=final_step) for fid, v in final.items()}
    await syncer.to_island("manifest", "dp", final_step=final_step, versions=versions, version_digests=digests, gen=gen)
    acked, deadline = False, time.monotonic() + 60
    hb = await js.pull_subscribe_bind(durable=S.SYNCER_HB_CONSUMER, stream=S.stream(syncer.run, "HB"))  # acks: HB
    while not acked:
        assert time.monotonic() < deadline, "no final ack"
        for m in await hb.fetch(10, timeout=30):
            await m.ack()
            kind, msg = codec.decode_typed(m.data, ("hello", "heartbeat", "ack"))
            acked = acked or (kind == "ack" and msg["final_step"] == final_step and msg["gen"] == gen)
    await syncer.to_island("shutdown", "dp", reason="done", gen=gen)


async def dp_join(ctx, timeout: float = 60) -> None:
    """Every rank process exited cleanly within `timeout`."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(ctx.join, 5):  # True once every worker exited cleanly
        assert time.monotonic() < deadline, "the ranks did not finish"


async def streams_back(js, run: str, timeout: float) -> None:
    """Wait until the run's streams answer again after a broker restart."""
    deadline = time.monotonic() + timeout
    while True:  # JetStream recovers its streams a moment after the server accepts connections
        try:
            await js.stream_info(S.stream(run, "PUSH"))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@dataclass
class OwnBroker:
    """An island (`ISLAND`, on `net()`) on a broker of its own that the test stops and restarts."""

    broker: object
    store: object
    nc: object
    js: object
    run: str
    island: Island | None = None
    syncer: Syncer | None = None

    def stop(self) -> None:
        self.broker.stop()

    async def restart(self, timeout: float) -> None:
        """The broker again on the same port and store; returns once the island and the test's own
        connection are back and the run's streams answer."""
        from yeto.services.broker import Broker

        self.broker = Broker(port=self.broker.port, store_dir=self.store).start()
        await until(lambda: self.island.client.connected and self.nc.is_connected, timeout=timeout, what="reconnect")
        await streams_back(self.js, self.run, timeout)


@contextlib.asynccontextmanager
async def own_broker(tmp_path, run: str, limits: RunLimits, **cfg):
    """A broker with file storage (the run survives a restart), the run provisioned with a session, and a
    started Island that reconnects every 0.2 s for ever; `cfg` adds to the island's config."""
    import nats

    from yeto.services.broker import Broker

    store = tmp_path / "store"
    broker = Broker(store_dir=store).start()
    nc = await nats.connect(broker.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    own = OwnBroker(broker, store, nc, nc.jetstream(), run)
    try:
        await provision_run(own.js, run, limits, log=lambda _: None)
        adapter = TorchModuleAdapter(net())
        session = build_session(adapter.layout(), 2, run=run, push_dtype="f32", bulk_dtype="f32",
                                chunk_bytes=CHUNK_BYTES, init_island="syncer-side", sync_every=2, created=time.time())
        await (await kv(own.js, run, "state")).put("session", codec.encode("session", session))
        own.island = Island(adapter, IslandConfig(run=run, island=ISLAND, nats=ConnectOptions(url=broker.url),
                                                  reconnect_wait_s=0.2, max_reconnects=-1, progress=False,
                                                  connect_timeout_s=10, heartbeat_s=0.5, **cfg))
        await asyncio.to_thread(own.island.start)
        own.syncer = Syncer(own.js, run, session)
        yield own
    finally:
        if own.island is not None:
            await asyncio.to_thread(own.island.close)
        try:
            await remove_run(own.js, run)
        except Exception:
            pass
        await nc.close()
        own.broker.stop()
