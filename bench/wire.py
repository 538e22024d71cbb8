#!/usr/bin/env python
"""Wire benchmark: a fragment's bytes through JetStream vs through a raw loopback TCP socket.

    python bench/wire.py --size-mb 512 [--chunk-mb 1] [--repeat 3] [--nats URL] [--explore]

A publisher PROCESS and a consumer PROCESS run at the same time. The publisher sends an N MiB f32
fragment the way the syncer broadcasts one (docs/design.md §3.6), through the production code: the chunk plan
(`schemas.chunks.chunk_plan`), the `bcast_chunk` header (`chunk_header` + `codec.encode_header`, which
validates it), the subjects and `Nats-Msg-Id`s of `schemas.subjects`, and `schemas.publish.Pipeline`
(bounded bytes in flight, docs/design.md §15.5, §15.9; refusals retried with the same id). The consumer is a
durable pull consumer that keeps bounded pull requests outstanding (≤ 32 MiB each, docs/design.md §15.4), decodes
every header (`codec.decode_header`), checks each chunk against its own plan (`check_chunk`: offset,
size, xxh3 digest) and acks. The baseline moves the same chunk buffers between two processes over a
blocking loopback socket (sendall / recv_into).

Timing runs from the first byte sent to the last byte received (CLOCK_MONOTONIC is system-wide, so the
two processes' clocks compare); each figure is the median of --repeat runs. The last line is
`wire ratio_vs_raw_tcp=<x>` (JetStream e2e MB/s over raw TCP MB/s, FILE storage). MB here means MiB.

Without --nats the embedded broker (services.broker.Broker) runs on a temporary store directory.
`--explore` also runs the variants (chunk size, memory storage, ack style, stock fetch(), two
publisher/consumer processes, a larger nats-py read size) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import queue
import resource
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from yeto.schemas import codec  # noqa: E402
from yeto.schemas import subjects as S  # noqa: E402
from yeto.schemas.chunks import ChunkSpan, VersionDigest, check_chunk, chunk_header, chunk_plan, max_chunk_bytes  # noqa: E402
from yeto.schemas.errors import WireError  # noqa: E402
from yeto.schemas.publish import Pipeline  # noqa: E402
from yeto.services.run_harness import peak_rss_self, vm_hwm  # noqa: E402  (peak RSS as every bench reads it)

MiB = 1 << 20
WIRE_DTYPE = "f32"  # the fragment is f32 values, as a broadcast in the default bulk dtype
VERSION = 1
POOL_BUFFERS = 4  # distinct payload buffers cycled through, so consecutive digests differ
ACK_TIMEOUT_S = 30.0
CHILD_TIMEOUT_S = 600.0
WARMUP_MB = 128


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    size_mb: int = 512
    chunk_mb: float = 1.0
    storage: str = "file"  # file | memory
    ack: str = "all"  # all: AckAll policy, one ack per batch_mb received; explicit: ack every message
    pull: str = "pipelined"  # pipelined: own MSG.NEXT requests kept outstanding; fetch: stock fetch()
    pulls_outstanding: int = 2
    batch_mb: int = 16  # bytes per pull request (≤ 32 MiB, docs/design.md §15.4)
    inflight_mb: int = 16  # publisher: bytes published but not yet acknowledged by JetStream
    procs: int = 1  # publisher processes (the fragment split in contiguous parts); as many consumers
    read_kb: int = 0  # 0: stock nats-py socket reads (32 KiB); else patch its read size (experiment only)
    loop: str = "asyncio"  # asyncio | uvloop (event loop of the publisher and consumer processes)

    @property
    def total_bytes(self) -> int:
        return int(self.size_mb * MiB)

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * MiB)

    def plan(self, part: int = 0) -> list[ChunkSpan]:
        """Fragment `part`'s chunks, cut by the production plan (f32 values: 4 bytes each)."""
        return chunk_plan(split_numel(self.total_bytes // 4, self.procs)[part], WIRE_DTYPE, self.chunk_bytes)

    def label(self) -> str:
        parts = [f"{self.storage}", f"chunk {self.chunk_mb:g} MiB", f"ack {self.ack}", f"pull {self.pull}"]
        if self.procs > 1:
            parts.append(f"{self.procs} pub + {self.procs} con procs")
        if self.loop != "asyncio":
            parts.append(self.loop)
        if self.read_kb:
            parts.append(f"read {self.read_kb} KiB (patched)")
        return ", ".join(parts)


def split_numel(n: int, parts: int) -> list[int]:
    """Nearly equal sizes (in values) of `parts` fragments holding n values: with --procs P each publisher
    process sends one fragment, as a syncer spread over P connections would."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [bounds[k + 1] - bounds[k] for k in range(parts)]


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds if seconds > 0 else float("inf")


# --------------------------------------------------------------------------- child-process helpers


def _peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM; ru_maxrss as fallback), MiB."""
    return (vm_hwm("self") or peak_rss_self()) / MiB


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _payload_pool(chunk: int, seed: int) -> list[bytes]:
    """A few distinct random chunk buffers; the publisher cycles through them (RSS stays small)."""
    import random

    rng = random.Random(seed)
    return [rng.randbytes(chunk) for _ in range(POOL_BUFFERS)]


def _payload(pool: list[bytes], index: int, nbytes: int):
    buf = pool[index % len(pool)]
    return buf if nbytes == len(buf) else memoryview(buf)[:nbytes]


def _patch_read_size(read_kb: int) -> None:
    """EXPERIMENT ONLY (never in the product): nats-py reads its socket DEFAULT_BUFFER_SIZE at a time,
    and the same constant is its StreamReader limit (it pauses the socket above twice that)."""
    if read_kb:
        import nats.aio.client

        nats.aio.client.DEFAULT_BUFFER_SIZE = read_kb * 1024


def _run_async(coro_fn, a, ready, go):
    """Run a role's coroutine on the configured event loop."""
    if a["cfg"]["loop"] == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro_fn(a, ready, go))
    return asyncio.run(coro_fn(a, ready, go))


def _child(fn, args, ready, go, results):
    """Run one benchmark role; report ('ok', role, dict) or ('error', role, text) on `results`."""
    role = args.get("role", fn.__name__)
    try:
        out = fn(args, ready, go)
        out.setdefault("peak_rss_mb", _peak_rss_mb())
        out.setdefault("cpu_s", _cpu_s())
        results.put(("ok", role, out))
    except BaseException as exc:  # report every failure to the parent instead of hanging it
        import traceback

        ready.put(role)  # unblock a parent waiting for readiness
        results.put(("error", role, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --------------------------------------------------------------------------- raw TCP roles


def _raw_receiver(a, ready, go):
    chunk, total = a["chunk"], a["total"]
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a["port_q"].put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(chunk)
            view = memoryview(buf)
            ready.put("raw-recv")
            cpu0 = _cpu_s()
            got = 0
            while got < total:
                want = min(chunk, total - got)
                pos = 0
                while pos < want:
                    n = conn.recv_into(view[pos:want])
                    if n == 0:
                        raise ConnectionError(f"raw sender closed early after {got + pos} of {total} bytes")
                    pos += n
                got += want
            t_last = time.monotonic()
            m1 = _machine_cpu()
    return {"t_last": t_last, "bytes": got, "cpu_s": _cpu_s() - cpu0, "m1": m1}


def _raw_sender(a, ready, go):
    chunk, total = a["chunk"], a["total"]
    pool = _payload_pool(chunk, a["seed"])
    plan = chunk_plan(total // 4, WIRE_DTYPE, chunk)
    with socket.create_connection(("127.0.0.1", a["port"])) as s:
        ready.put("raw-send")
        go.wait()
        cpu0 = _cpu_s()
        m0 = _machine_cpu()
        t_first = time.monotonic()
        for span in plan:
            s.sendall(_payload(pool, span.index, span.nbytes))
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the receiver closes once it holds every byte
    return {"t_first": t_first, "cpu_s": _cpu_s() - cpu0, "m0": m0}


# --------------------------------------------------------------------------- JetStream roles


def _bcast_meta(run: str, part: int, spans: list[ChunkSpan], idx: int, payload, version_digest: str) -> dict:
    """The header fields of a broadcast chunk, as the syncer's broadcast builds them: the version digest
    seals the version on its last chunk only."""
    meta = {"v": codec.PROTOCOL_VERSION, "run": run, "fragment": part, "version": VERSION, "dtype": WIRE_DTYPE,
            **chunk_header(spans, idx, payload)}
    if idx == len(spans) - 1:
        meta["version_digest"] = version_digest
    return meta


def _warm_codec() -> None:
    """Compile the header's schema validator before the clock starts (a process in service did long ago)."""
    spans = chunk_plan(1, WIRE_DTYPE, 4)
    codec.decode_header("bcast_chunk", codec.encode_header("bcast_chunk", _bcast_meta("w", 0, spans, 0, b"abcd", "0" * 64)))


def _version_digest(cfg: Config, part: int, seed: int) -> str:
    """sha256 of fragment `part` as its publisher sends it (the header's version_digest), computed untimed."""
    pool = _payload_pool(cfg.chunk_bytes, seed)
    vd = VersionDigest()
    for span in cfg.plan(part):
        vd.update(_payload(pool, span.index, span.nbytes))
    return vd.hexdigest()


async def _publish_part(a, ready, go) -> dict:
    import nats

    cfg = Config(**a["cfg"])
    _patch_read_size(cfg.read_kb)
    nc = await nats.connect(a["url"], max_reconnect_attempts=0)
    js = nc.jetstream()
    if cfg.chunk_bytes > max_chunk_bytes(nc.max_payload):
        raise ValueError(f"chunk_mb={cfg.chunk_mb} leaves no header room under max_payload={nc.max_payload}")
    pool = _payload_pool(cfg.chunk_bytes, a["seed"])
    run, part = a["run"], a["part"]
    spans = cfg.plan(part)
    counters: Counter = Counter()
    pipe = Pipeline(js, max_bytes=max(cfg.inflight_mb * MiB, cfg.chunk_bytes), timeout=ACK_TIMEOUT_S,
                    counters=counters)
    _warm_codec()

    ready.put(a["role"])
    go.wait()  # blocks the loop on purpose: nothing is in flight yet
    cpu0 = _cpu_s()
    m0 = _machine_cpu()
    t_first = time.monotonic()
    for span in spans:
        # What the syncer's broadcast does per chunk (services/syncer: _broadcast), less the packing.
        idx = span.index
        payload = _payload(pool, idx, span.nbytes)
        meta = _bcast_meta(run, part, spans, idx, payload, a["version_digest"])
        await pipe.put(S.bcast(run, part, idx), payload, S.bcast_msg_id(part, VERSION, idx),
                       {codec.CHUNK_HEADER: codec.encode_header("bcast_chunk", meta)})
    await pipe.flush()
    t_acked = time.monotonic()
    m1 = _machine_cpu()
    cpu = _cpu_s() - cpu0
    await nc.close()
    return {"t_first": t_first, "t_acked": t_acked, "retries": sum(counters.values()), "cpu_s": cpu, "m0": m0,
            "m1": m1}


def _publisher(a, ready, go):
    return _run_async(_publish_part, a, ready, go)


class _ChunkTally:
    """What a consumer has verified: every chunk of its fragment exactly once, each header a valid
    `bcast_chunk` of this run, fragment and version, each chunk matching the consumer's own plan
    (`check_chunk`: index, count, total, offset, size, xxh3 digest). A refusal raises the WireError
    naming the field."""

    def __init__(self, spans: list[ChunkSpan], run: str, part: int):
        self.spans, self.run, self.part = spans, run, part
        self.seen: set[int] = set()
        self.bytes = 0
        self.duplicates = 0

    def add(self, headers: dict, data: bytes) -> None:
        meta = codec.decode_header("bcast_chunk", headers.get(codec.CHUNK_HEADER, ""))
        for field, want in (("run", self.run), ("fragment", self.part), ("version", VERSION), ("dtype", WIRE_DTYPE)):
            if meta[field] != want:
                raise WireError(f"this consumer reads {field} {want!r}", field=field, value=meta[field])
        span = check_chunk(self.spans, meta, data)
        if span.index in self.seen:  # at-least-once delivery: a redelivery is counted, not an error
            self.duplicates += 1
            return
        self.seen.add(span.index)
        self.bytes += len(data)

    @property
    def done(self) -> bool:
        return len(self.seen) == len(self.spans)


async def _consume_pipelined(nc, a, cfg, tally) -> float:
    """Keep about `pulls_outstanding` pull requests (each ≤ batch_mb) open on the durable consumer, the
    way nats.go's Consume() does: the server streams the next batch while this one is being verified.

    Delivered messages carry their stream subject, not the request's reply subject, so the bookkeeping
    is a count of messages still owed by all open requests; a 408/409 status (request expired or
    ended) says in Nats-Pending-Messages how many of its messages will never come."""
    import orjson

    per_req = max(1, (cfg.batch_mb * MiB) // cfg.chunk_bytes)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, pending_bytes_limit=512 * MiB, pending_msgs_limit=1 << 20)
    next_subject = S.consumer_msg_next(a["stream"], a["durable"])
    body = orjson.dumps({"batch": per_req, "expires": int(5e9)})
    owed = 0
    received = 0

    async def top_up():
        nonlocal owed
        while owed <= (cfg.pulls_outstanding - 1) * per_req:
            owed += per_req
            await nc.publish(next_subject, body, reply=inbox)

    await top_up()
    last = None
    while not tally.done:
        try:
            msg = await sub.next_msg(timeout=30)
        except Exception as exc:
            raise TimeoutError(f"no message for 30 s: verified {len(tally.seen)} of {len(tally.spans)} chunks, {owed} owed") from exc
        hdrs = msg.headers or {}
        status = hdrs.get("Status")
        if status:
            if status in ("408", "409"):  # that request is over; heartbeats (100) owe nothing
                owed -= int(hdrs.get("Nats-Pending-Messages", "0") or 0)
                await top_up()
            continue
        tally.add(hdrs, msg.data)
        owed -= 1
        received += 1
        if cfg.ack == "explicit":
            await msg.ack()
        else:
            last = msg
            if received % per_req == 0:
                await msg.ack()  # AckAll: one ack covers everything delivered before it
                last = None
        await top_up()
    t_last = time.monotonic()
    if last is not None:
        await last.ack()
    await sub.unsubscribe()
    return t_last


async def _consume_fetch(js, a, cfg, tally) -> float:
    """Stock nats-py: psub.fetch(batch) in a loop (one request at a time)."""
    import nats.errors

    per_req = max(1, (cfg.batch_mb * MiB) // cfg.chunk_bytes)
    psub = await js.pull_subscribe_bind(a["durable"], a["stream"])
    while not tally.done:
        try:
            msgs = await psub.fetch(per_req, timeout=5)
        except nats.errors.TimeoutError:
            continue
        for msg in msgs:
            tally.add(msg.headers or {}, msg.data)
            if cfg.ack == "explicit":
                await msg.ack()
        if cfg.ack == "all" and msgs:
            await msgs[-1].ack()
    t_last = time.monotonic()
    await psub.unsubscribe()
    return t_last


async def _consume_part(a, ready, go) -> dict:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    cfg = Config(**a["cfg"])
    _patch_read_size(cfg.read_kb)
    nc = await nats.connect(a["url"], max_reconnect_attempts=0)
    js = nc.jetstream()
    await js.add_consumer(
        a["stream"],
        ConsumerConfig(
            durable_name=a["durable"],
            filter_subject=a["filter"],
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.ALL if cfg.ack == "all" else AckPolicy.EXPLICIT,
            ack_wait=60,
            max_ack_pending=-1 if cfg.ack == "all" else 10_000,
        ),
    )
    tally = _ChunkTally(cfg.plan(a["part"]), a["run"], a["part"])
    _warm_codec()
    ready.put(a["role"])
    go.wait()
    cpu0 = _cpu_s()
    m0 = _machine_cpu()
    t_go = time.monotonic()
    if cfg.pull == "fetch":
        t_last = await _consume_fetch(js, a, cfg, tally)
    else:
        t_last = await _consume_pipelined(nc, a, cfg, tally)
    m1 = _machine_cpu()
    cpu = _cpu_s() - cpu0
    await nc.flush()
    await nc.close()
    return {"t_go": t_go, "t_last": t_last, "bytes": tally.bytes, "duplicates": tally.duplicates, "cpu_s": cpu, "m0": m0, "m1": m1}


def _consumer(a, ready, go):
    return _run_async(_consume_part, a, ready, go)


# --------------------------------------------------------------------------- orchestration (parent)

_ctx = mp.get_context("spawn")


class _Roles:
    """Start role processes, wait until all are ready, release them together, collect results.

    Every wait polls the children too, so one that dies hard (killed, out of memory) fails the run at
    once instead of leaving the parent blocked on a queue."""

    def __init__(self):
        self.ready = _ctx.Queue()
        self.results = _ctx.Queue()
        self.go = _ctx.Event()
        self.procs: list = []
        self.errors: list[str] = []

    def start(self, fn, args: dict):
        p = _ctx.Process(target=_child, args=(fn, args, self.ready, self.go, self.results), daemon=True, name=args["role"])
        p.start()
        self.procs.append(p)

    def _get(self, q, deadline: float, what: str):
        while True:
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                pass
            dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode not in (None, 0)]
            if dead and q is self.ready:
                raise RuntimeError(f"benchmark process died before it was ready: {', '.join(dead)}{self._drain()}")
            if dead and self.results.empty():
                raise RuntimeError(f"benchmark process died: {', '.join(dead)}{self._drain()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within the time limit{self._drain()}")

    def _drain(self) -> str:
        msgs = []
        with contextlib.suppress(queue.Empty):
            while True:
                kind, role, payload = self.results.get_nowait()
                if kind != "ok":
                    msgs.append(f"{role}: {payload}")
        return ("\n" + "\n".join(msgs)) if msgs else ""

    def wait_ready(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(n):
            self._get(self.ready, deadline, "readiness report")

    def release(self) -> None:
        self.go.set()

    def collect(self, timeout: float = CHILD_TIMEOUT_S) -> dict:
        out, errors = {}, []
        deadline = time.monotonic() + timeout
        for _ in self.procs:
            kind, role, payload = self._get(self.results, deadline, "result")
            if kind == "ok":
                out[role] = payload
            else:  # the others would only wait for bytes that will never come
                errors.append(f"{role}: {payload}")
                self.abort()
                break
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        if errors:
            raise RuntimeError("benchmark role failed:\n" + "\n".join(errors))
        return out

    def abort(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)


def _machine_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat): other tenants show up as
    busy time that none of our processes account for."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tck = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / tck, sum(vals[:8]) / tck


def _busy_delta(m0, m1) -> float | None:
    if m0 is None or m1 is None:
        return None
    return m1[0] - m0[0]


def run_raw_tcp(cfg: Config, seed: int) -> dict:
    roles = _Roles()
    port_q = _ctx.Queue()
    try:
        roles.start(_raw_receiver, {"role": "recv", "chunk": cfg.chunk_bytes, "total": cfg.total_bytes, "port_q": port_q})
        port = port_q.get(timeout=120)
        roles.start(_raw_sender, {"role": "send", "chunk": cfg.chunk_bytes, "total": cfg.total_bytes, "port": port, "seed": seed})
        roles.wait_ready(2)
        roles.release()
        r = roles.collect()
    except BaseException:
        roles.abort()
        raise
    secs = r["recv"]["t_last"] - r["send"]["t_first"]
    return {"mbps": mbps(cfg.total_bytes, secs), "secs": secs, "rss": {k: v["peak_rss_mb"] for k, v in r.items()},
            "cpu": {k: v["cpu_s"] for k, v in r.items()}, "machine_busy": _busy_delta(r["send"]["m0"], r["recv"]["m1"])}


async def _js_admin(url: str, fn):
    import nats

    nc = await nats.connect(url, max_reconnect_attempts=0)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


def _create_stream(url: str, name: str, subjects: list[str], storage: str) -> None:
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    async def go(js):
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=subjects,
                storage=StorageType.FILE if storage == "file" else StorageType.MEMORY,
                retention=RetentionPolicy.LIMITS,
                discard=DiscardPolicy.NEW,
                duplicate_window=60.0,
            )
        )

    asyncio.run(_js_admin(url, go))


def _delete_stream(url: str, name: str) -> None:
    async def go(js):
        with contextlib.suppress(Exception):
            await js.delete_stream(name)

    asyncio.run(_js_admin(url, go))


def _server_cpu_s(pid: int | None) -> tuple[float, float] | None:
    """(user, system) CPU seconds of the server process so far."""
    if not pid:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tck, int(fields[12]) / tck
    except (OSError, IndexError, ValueError):
        return None


def _server_hwm_mb(pid: int | None) -> float:
    hwm = vm_hwm(pid) if pid else None
    return hwm / MiB if hwm else float("nan")


def run_jetstream(url: str, cfg: Config, seed: int, mode: str = "both", server_pid: int | None = None, stream: str | None = None) -> dict:
    """One JetStream pass. mode: both (publisher and consumer at once), pub (publisher alone, stream
    kept for a following `con` pass), con (consumer alone on an already filled stream)."""

    # The run id names the subjects (schemas.subjects, as in a real run); a `con` pass reads the stream a
    # `pub` pass filled, so it takes the run id back from the stream's name.
    run = stream.removeprefix("BENCH_") if stream else uuid.uuid4().hex[:10]
    stream = f"BENCH_{run}"
    parts = range(cfg.procs)
    if mode in ("both", "pub"):
        _create_stream(url, stream, [S.bcast_all(run)], cfg.storage)
    roles = _Roles()
    common = {"url": url, "stream": stream, "run": run, "cfg": asdict(cfg), "seed": seed}
    n = 0
    cpu0 = _server_cpu_s(server_pid)
    try:
        for k in parts:
            if mode in ("both", "con"):
                roles.start(_consumer, {**common, "role": f"con{k}", "durable": f"con{k}_{run}", "part": k,
                                        "filter": S.bcast_fragment(run, k)})
                n += 1
        if mode == "both":  # consumers exist before the first publish
            roles.wait_ready(n)
        for k in parts:
            if mode in ("both", "pub"):
                roles.start(_publisher, {**common, "role": f"pub{k}", "part": k,
                                         "version_digest": _version_digest(cfg, k, seed)})
                n += 1
        roles.wait_ready(n - (cfg.procs if mode == "both" else 0))
        cpu0 = _server_cpu_s(server_pid)
        roles.release()
        r = roles.collect()
    except BaseException:
        roles.abort()
        _delete_stream(url, stream)
        raise
    cpu1 = _server_cpu_s(server_pid)
    if mode != "pub":
        _delete_stream(url, stream)
    pubs = [v for k, v in r.items() if k.startswith("pub")]
    cons = [v for k, v in r.items() if k.startswith("con")]
    first = min(pubs, key=lambda v: v["t_first"]) if pubs else min(cons, key=lambda v: v["t_go"])
    last = max(cons, key=lambda v: v["t_last"]) if cons else max(pubs, key=lambda v: v["t_acked"])
    t0 = first.get("t_first", first.get("t_go"))
    t1 = last.get("t_last", last.get("t_acked"))
    if cons and sum(v["bytes"] for v in cons) != cfg.total_bytes:
        raise RuntimeError(f"consumers verified {sum(v['bytes'] for v in cons)} of {cfg.total_bytes} bytes")
    secs = t1 - t0
    return {
        "mbps": mbps(cfg.total_bytes, secs),
        "secs": secs,
        "stream": stream,
        "rss": {k: v["peak_rss_mb"] for k, v in r.items()},
        "cpu": {k: v["cpu_s"] for k, v in r.items()} | (
            {"server": cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1], "server-sys": cpu1[1] - cpu0[1]} if cpu0 and cpu1 else {}),
        "machine_busy": _busy_delta(first["m0"], last["m1"]),
        "retries": sum(v.get("retries", 0) for v in pubs),
        "duplicates": sum(v.get("duplicates", 0) for v in cons),
    }


def xxh3_mbps(chunk: int, seconds: float = 0.3) -> float:
    import xxhash

    buf = os.urandom(chunk)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        xxhash.xxh3_64_hexdigest(buf)
        n += 1
    return mbps(n * chunk, time.monotonic() - t0)


# --------------------------------------------------------------------------- reporting


def _fmt_rss(rss: dict) -> str:
    return " ".join(f"{k}={v:.0f}MiB" for k, v in sorted(rss.items()))


def _others(run: dict) -> float | None:
    """Share of the machine's cores busy with work none of our processes (nor the embedded server)
    did during the timed span: other tenants of the 2 cores."""
    if run.get("machine_busy") is None:
        return None
    ours = sum(v for k, v in run["cpu"].items() if not k.endswith("-sys"))
    return max(0.0, (run["machine_busy"] - ours) / run["secs"] / (os.cpu_count() or 1))


def _fmt_cpu(run: dict, nbytes: int) -> str:
    """CPU milliseconds per MiB moved, per process (server-sys: the server's kernel share), and how
    busy other tenants kept the machine meanwhile."""
    mib = nbytes / MiB
    out = " ".join(f"{k}={v / mib * 1e3:.2f}" for k, v in sorted(run["cpu"].items()))
    others = _others(run)
    if others is not None:
        out += f"; others busy {others:.0%} of {os.cpu_count()} cores"
    return out


def _cpu_total_ms_per_mib(run: dict, nbytes: int) -> float:
    return sum(v for k, v in run["cpu"].items() if not k.endswith("-sys")) / (nbytes / MiB) * 1e3


def _pick_median(runs: list[dict]) -> dict | None:
    return sorted(runs, key=lambda r: r["mbps"])[len(runs) // 2] if runs else None


def _runs(runs: list[dict]) -> str:
    return ", ".join(f"{r['mbps']:.0f}" for r in runs)


def measure_head(url: str, cfg: Config, repeat: int, server_pid: int | None, breakdown: bool) -> dict:
    """Raw TCP, JetStream with both at once, and (breakdown) the publisher alone then the consumer alone
    on the stream it filled; interleaved round by round so drift in the machine's load hits all."""
    out: dict[str, list] = {"raw": [], "js": [], "pub": [], "con": []}
    # One untimed pass first: a fresh server (and this VM, whose untouched memory is slow to fault in)
    # pays for growing its heap and page cache once; a broker in service has done so long ago.
    warm = replace(cfg, size_mb=min(cfg.size_mb, WARMUP_MB))
    run_raw_tcp(warm, seed=99)
    run_jetstream(url, warm, seed=99, server_pid=server_pid)
    for i in range(repeat):
        out["raw"].append(run_raw_tcp(cfg, seed=i))
        out["js"].append(run_jetstream(url, cfg, seed=i, server_pid=server_pid))
        if breakdown:
            p = run_jetstream(url, cfg, seed=i, mode="pub", server_pid=server_pid)
            out["pub"].append(p)
            out["con"].append(run_jetstream(url, cfg, seed=i, mode="con", server_pid=server_pid, stream=p["stream"]))
    return out


EXPLORE = [
    ("chunk 2 MiB", dict(chunk_mb=2)),
    ("chunk 4 MiB", dict(chunk_mb=4)),
    ("memory storage", dict(storage="memory")),
    ("explicit ack per message", dict(ack="explicit")),
    ("stock fetch(), 1 pull at a time", dict(pull="fetch")),
    ("1 pull outstanding", dict(pulls_outstanding=1)),
    ("2 pub + 2 con processes", dict(procs=2)),
    ("uvloop", dict(loop="uvloop")),
    ("nats-py read 1 MiB (PATCHED)", dict(read_kb=1024)),
]


def explore(url: str, cfg: Config, repeat: int, server_pid: int | None, raw_mbps: float) -> None:
    variants = []
    for name, change in EXPLORE:
        v = replace(cfg, **change)
        if v == cfg or (v.loop == "uvloop" and not _have("uvloop")):
            continue
        variants.append((name, v))
    results: dict[str, list] = {name: [] for name, _ in variants}
    failed: dict[str, str] = {}
    for i in range(repeat):  # round by round, like the headline
        for name, v in variants:
            if name in failed:
                continue
            try:
                results[name].append(run_jetstream(url, v, seed=i, server_pid=server_pid))
            except Exception as exc:  # one failing variant should not hide the others
                failed[name] = str(exc).splitlines()[0]
    print(f"variants (JetStream e2e, both at once, median of {repeat}; ratio vs the raw tcp median above; CPU ms/MiB):")
    for name, v in variants:
        if name in failed:
            print(f"  {name:34s} failed: {failed[name]}")
            continue
        m = _pick_median(results[name])
        print(f"  {name:34s} {m['mbps']:5.0f} MB/s ratio {m['mbps'] / raw_mbps:.3f} (runs {_runs(results[name])}); "
              f"CPU {_fmt_cpu(m, v.total_bytes)}; RSS {_fmt_rss(m['rss'])}", flush=True)


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    ap.add_argument("--size-mb", type=int, default=d.size_mb, help="MiB moved per run (default %(default)s)")
    ap.add_argument("--chunk-mb", type=float, default=d.chunk_mb, help="chunk size, MiB (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, the median is reported (default 3)")
    ap.add_argument("--nats", default=None, help="NATS URL; default: start the embedded broker on a temp store")
    ap.add_argument("--storage", choices=["file", "memory"], default=d.storage)
    ap.add_argument("--ack", choices=["all", "explicit"], default=d.ack)
    ap.add_argument("--pull", choices=["pipelined", "fetch"], default=d.pull)
    ap.add_argument("--pulls-outstanding", type=int, default=d.pulls_outstanding)
    ap.add_argument("--batch-mb", type=int, default=d.batch_mb, help="bytes per pull request, ≤ 32 (default %(default)s)")
    ap.add_argument("--inflight-mb", type=int, default=d.inflight_mb, help="publisher bytes in flight (default %(default)s)")
    ap.add_argument("--procs", type=int, default=d.procs, help="publisher (and consumer) processes (default %(default)s)")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default=d.loop, help="client event loop")
    ap.add_argument("--read-kb", type=int, default=0, help="EXPERIMENT: patch nats-py's 32 KiB read size")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the publisher-alone / consumer-alone passes")
    ap.add_argument("--explore", action="store_true", help="also measure the variants and print a table")
    args = ap.parse_args(argv)
    if not 0 < args.batch_mb <= 32:
        ap.error(f"--batch-mb={args.batch_mb}: must be 1..32 (a bigger pull gets the client cut off as a slow consumer)")
    for name in ("size_mb", "chunk_mb", "repeat", "pulls_outstanding", "inflight_mb", "procs"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be positive")
    if args.procs > args.size_mb / args.chunk_mb:
        ap.error(f"--procs={args.procs}: more processes than the {int(args.size_mb / args.chunk_mb)} chunks")
    cfg = Config(
        size_mb=args.size_mb, chunk_mb=args.chunk_mb, storage=args.storage, ack=args.ack, pull=args.pull,
        pulls_outstanding=args.pulls_outstanding, batch_mb=args.batch_mb, inflight_mb=args.inflight_mb,
        procs=args.procs, read_kb=args.read_kb, loop=args.loop,
    )
    with contextlib.ExitStack() as stack:
        url, server_pid = args.nats, None
        if url is None:
            from yeto.services.broker import Broker

            store = stack.enter_context(tempfile.TemporaryDirectory(prefix="yeto-wire-"))
            broker = stack.enter_context(Broker(store_dir=store))
            url, server_pid = broker.url, broker.proc.pid
        print(f"wire bench: {cfg.size_mb} MiB, {os.cpu_count()} CPUs, server {url}{' (embedded)' if server_pid else ''}", flush=True)
        print(f"config: {cfg.label()}, pulls {cfg.pulls_outstanding} x {cfg.batch_mb} MiB outstanding, "
              f"publisher {cfg.inflight_mb} MiB in flight, median of {args.repeat}", flush=True)
        head = measure_head(url, cfg, args.repeat, server_pid, breakdown=not args.no_breakdown)
        raw, js = _pick_median(head["raw"]), _pick_median(head["js"])
        nb = cfg.total_bytes
        print(f"raw tcp: {raw['mbps']:.0f} MB/s (runs {_runs(head['raw'])}); peak RSS {_fmt_rss(raw['rss'])}; "
              f"CPU ms/MiB {_fmt_cpu(raw, nb)}")
        print(f"jetstream {cfg.storage}: {js['mbps']:.0f} MB/s e2e (runs {_runs(head['js'])}); peak RSS {_fmt_rss(js['rss'])}; "
              f"CPU ms/MiB {_fmt_cpu(js, nb)}; publish retries {js['retries']}, duplicate deliveries {js['duplicates']}", flush=True)
        if head["pub"]:
            pub, con = _pick_median(head["pub"]), _pick_median(head["con"])
            print("where the time goes (same config, medians):")
            print(f"  publisher alone, until every publish is acked: {pub['mbps']:.0f} MB/s (runs {_runs(head['pub'])}); "
                  f"CPU ms/MiB {_fmt_cpu(pub, nb)}")
            print(f"  consumer alone, stream already filled: {con['mbps']:.0f} MB/s (runs {_runs(head['con'])}); "
                  f"CPU ms/MiB {_fmt_cpu(con, nb)}")
            print(f"  xxh3_64 digest alone: {xxh3_mbps(cfg.chunk_bytes):.0f} MB/s")
            seq = 1 / (1 / pub["mbps"] + 1 / con["mbps"])
            print(f"  one after the other would give {seq:.0f} MB/s; both at once gave {js['mbps']:.0f} MB/s")
            if "server" in js["cpu"]:
                total = _cpu_total_ms_per_mib(js, nb)
                cores = os.cpu_count() or 1
                srv = js["cpu"]["server"] / (nb / MiB) * 1e3
                print(f"  both at once cost {total:.2f} CPU ms per MiB (publisher + consumer + server): "
                      f"on {cores} otherwise idle cores that caps e2e at ~{cores * 1000 / total:.0f} MB/s "
                      f"(ratio ~{cores * 1000 / total / raw['mbps']:.2f})")
                print(f"  the server's share alone is {srv:.2f} ms/MiB: even clients that cost nothing would stop at "
                      f"~{cores * 1000 / srv:.0f} MB/s (ratio ~{cores * 1000 / srv / raw['mbps']:.2f}); server peak RSS "
                      f"{_server_hwm_mb(server_pid):.0f} MiB")
        if args.explore:
            explore(url, cfg, args.repeat, server_pid, raw["mbps"])
        ratio = js["mbps"] / raw["mbps"]
        if not math.isfinite(ratio) or ratio <= 0:
            raise SystemExit(f"bad ratio {ratio}")
    print(f"wire ratio_vs_raw_tcp={ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
