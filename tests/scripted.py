"""Scripted islands for syncer tests: they speak only the `schemas` package and nats-py (not the learner).

Each ScriptedIsland plays one island's side of the protocol by hand, so a test decides exactly what
arrives at the syncer (good pushes, duplicates, stale attempts, malformed bytes) and reads back what the
syncer published (session, pulls, broadcasts, errors, manifest, final cut, tape).
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import orjson
import torch
from nats.js.errors import KeyNotFoundError

from yeto.schemas import codec, subjects as S
from yeto.schemas.chunks import chunk_header, digest, push_digest
from yeto.schemas.dtypes import pack, unpack
from yeto.schemas.ids import new_generation
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.chunks import chunk_plan
from yeto.schemas.provision import ensure_island_consumers, remove_run

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
        self.cmd = [sys.executable, "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run,
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
        """The island's two CTL consumers (pulls, messages to it), taken over by this generation."""
        await ensure_island_consumers(self.js, self.run, self.island, self.gen)
        self.sub = [await self.js.pull_subscribe_bind(S.island_consumer(self.island, kind), stream=S.stream(self.run, "CTL"))
                    for kind in S.ISLAND_CONSUMER_KINDS]

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
                meta = {"v": 1, "run": self.run, "island": island or self.island, "gen": gen, "fragment": fid,
                        "dtype": dtype, **chunk_header(spans, s.index, buf)}
                await self.js.publish(S.init(self.run, fid), buf, headers={
                    S.MSG_ID: S.init_msg_id(fid, s.index, gen) + ("" if island is None else f".{island}"),
                    codec.CHUNK_HEADER: codec.encode_header("init_chunk", meta)})
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
                   gen: str | None = None, fragment: int | None = None) -> None:
        """Push `delta` for `pull`. `corrupt` spoils chunk 0: "digest" (bytes no longer match the digest),
        "size" (4 payload bytes short of its nbytes), "nan" (a NaN and an Inf in the values, digest
        of the bad bytes). `fragment` publishes on push.I.<fragment> with that fragment in the header."""
        dtype = self.session["push_dtype"]
        fid = pull["fragment"] if fragment is None else fragment
        spans = chunk_plan(delta.numel(), dtype, self.session["chunk_bytes"])
        digests = []
        for s in spans:
            part = delta[s.elem_offset: s.elem_offset + s.elem_count].contiguous()
            if corrupt == "nan" and s.index == 0:
                part = part.clone()
                part[0], part[-1] = float("nan"), float("inf")
            buf = bytearray(pack(part, dtype).numpy().tobytes())
            framing = chunk_header(spans, s.index, bytes(buf))  # the digest of the bytes before any corruption
            d = framing["digest"]
            if corrupt == "digest" and s.index == 0:
                buf[0] ^= 0xFF  # bytes no longer match the digest
            if corrupt == "size" and s.index == 0:
                del buf[-4:]  # header still claims the full nbytes
            digests.append(d)
            meta = {"v": 1, "run": self.run, "island": self.island, "gen": gen or self.gen, "fragment": fid,
                    "step": pull["step"], "attempt": pull["attempt"], "try": try_,
                    "base_version": pull["base_version"] if base_version is None else base_version,
                    "local_step": local_step, "c_steps": 1, "c_tokens": c_tokens, "dtype": dtype, **framing}
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


async def wait_provisioned(js, run: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await js.stream_info(S.stream(run, "CTL"))
            await js.key_value(S.kv_bucket(run, "state"))
            return
        except Exception:
            await asyncio.sleep(0.1)
    raise TimeoutError("run never provisioned")


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


async def tape_of(js, run: str, kind: str) -> list[dict]:
    """The EVENTS tape's records of one kind, in order, through an ephemeral consumer filtered to
    the kind's subject (the whole tape holds every recorded input: thousands of records); [] before the
    run's streams exist."""
    import orjson
    from nats.js.errors import NotFoundError

    try:
        sub = await js.pull_subscribe(S.events(run, kind), stream=S.stream(run, "EVENTS"))
    except NotFoundError:
        return []
    out = []
    try:
        # fetch() waits out its timeout unless the batch fills: ask for exactly what is pending
        want = (await sub.consumer_info()).num_pending
        while len(out) < want:
            msgs = await sub.fetch(min(256, want - len(out)), timeout=10)
            out.extend(orjson.loads(m.data) for m in msgs)
    finally:
        await sub.unsubscribe()
    return out


async def syncer_status(js, run: str) -> dict | None:
    """The syncer's status record (state KV key `syncer`: phase, versions, counters), or None."""
    kv = await js.key_value(S.kv_bucket(run, "state"))
    try:
        e = await kv.get("syncer")
    except KeyNotFoundError:
        return None
    return orjson.loads(e.value) if e and e.value else None


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
    rp = subprocess.run([sys.executable, "-m", "yeto.services.cli", "replay", "--nats", nats_url, "--run", run],
                        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert rp.returncode == 0, rp.stdout + rp.stderr
    return [line for line in rp.stdout.splitlines() if line.startswith("syncer process ")]
