"""The island's sync core: start-up (hello, session, INIT, initial cut) and the step boundary
(DESIGN §3.2, §5). Pure decisions live in `pulls.PullBook` and `fragments.SyncState` /
`BcastAssembly`; the network lives in `client.IslandClient`; this module sequences them.

Use:

    island = Island(TorchModuleAdapter(model), IslandConfig.from_env()).start()
    while island.boundary(tokens=n_tokens, loss=loss):   # after every optimizer step, on every rank
        ... one training step ...
    island.close()

Boundary order (sync rank): health → control messages (a manifest finalizes now) → count the step →
drain broadcasts (chunks fetched by direct get in bounded batches; each complete version applied at
once: the first version of a fragment overwrites, later ones blend θ = α·θ_local + (1−α)·Θ; the raw
Θ becomes the anchor) → take the pulls that arrived → (lockstep: block for the due round) → answer
ready pulls (d = local − anchor in the session push dtype, chunks streamed while produced; `sent`
once every chunk is acked, `failed` otherwise: the next boundary retries with try + 1) → step-log
event. Bad input is counted (`rejected`) and training goes on; a broken protocol invariant (one
version, two digests) raises ProtocolError and stops the island.

Multi-rank (data-parallel) islands: every rank calls `start` and `boundary`; rank 0 of `group` (the
sync rank) does all NATS I/O and writes applied values through the adapter; its decision (which
tensors changed, whether to stop, or an error) is sent to the other ranks with
`broadcast_object_list`, and the values reach them through `adapter.sync_replicas(names)`. The
adapter must be built on the same group. `tokens` is the island's token count for the step (pass
the same value on every rank: the sync rank's is used).

Decisions beyond DESIGN:
* The island's CTL consumer delivers from its hello's stream timestamp (see IslandClient.provision).
* The INIT island skips INIT when the state KV already holds `commit` (v0 exists: it is a restart),
  then waits up to `init_v0_timeout_s` for v0 of every fragment before its first step (its weights
  would be overwritten by v0 anyway); what has not landed by then overwrites at a boundary.
* Lockstep mode also waits (up to `lockstep_timeout_s`, then fails) for the whole cut before the
  first step: otherwise the step at which v0 lands, and so the run, would depend on timing.
* A manifest seen while a lockstep boundary is blocked finalizes at that boundary.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

import nats.errors
import torch.distributed as dist

from schemas import codec
from schemas import subjects as S
from schemas.chunks import Chunker, iter_chunks, push_digest
from schemas.dtypes import pack, pack_stream, packed_nbytes, wire_align
from schemas.errors import WireError
from schemas.layout import chunk_plan, layout_fingerprint
from schemas.publish import PublishFailed

from .adapters import ModelAdapter, fragment_names, gather_fragment, scatter_fragment
from .client import ChunkNotice, IslandClient, IslandUnhealthy, NotConnected
from .config import IslandConfig
from .fragments import BcastAssembly, Completed, ProtocolError, SyncState
from .pulls import PullBook, due_round, max_due_step

log = logging.getLogger("yeto.island")

# Errors that mean "this push / fetch did not get through now": retried at a later boundary.
TRANSIENT = (NotConnected, TimeoutError, PublishFailed, nats.errors.Error, ConnectionError, OSError)
POLL_S = 0.005  # sleep between polls while blocked (lockstep, cut, finalization)


class LockstepTimeout(TimeoutError):
    pass


@dataclass
class _Stats:
    """What one boundary did (the step-log event's counters)."""

    export_s: float = 0.0
    apply_s: float = 0.0
    pushes: int = 0
    applies: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    rejected: int = 0


def _progress(total: int, desc: str, enabled: bool, unit: str = "B"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not enabled, leave=False)


def _batches(notices: Iterable[ChunkNotice], limit: int) -> Iterable[list[ChunkNotice]]:
    """Group notices so one batch fetches at most `limit` bytes (one oversized chunk goes alone)."""
    batch: list[ChunkNotice] = []
    size = 0
    for n in notices:
        if batch and size + n.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(n)
        size += n.nbytes
    if batch:
        yield batch


class Island:
    def __init__(self, adapter: ModelAdapter, config: IslandConfig, *, group: "dist.ProcessGroup | None" = None):
        self.adapter = adapter
        self.config = config
        self.group = group
        if group is not None:
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            self._src = dist.get_global_rank(group, 0)
        else:
            self.rank, self.world, self._src = 0, 1, 0
        self.sync_rank = self.rank == 0
        self.client: IslandClient | None = IslandClient(config) if self.sync_rank else None
        self.gen: str | None = self.client.gen if self.client else None
        self.session: dict | None = None
        self.frags: dict[int, dict] = {}
        self.state: SyncState | None = None
        self.book: PullBook | None = None
        self.asm: BcastAssembly | None = None
        self.local_step = 0
        self.should_stop = False
        self.finalized = False  # the final cut is installed and acknowledged
        self.final_step: int | None = None
        self._counters: Counter[str] = Counter()
        self._notices: dict[tuple[int, int], ChunkNotice] = {}  # BCAST chunks noticed, not yet fetched
        self._seen_rounds: dict[tuple[int, int], int] = {}  # lockstep: (fragment, step) -> base_version
        self._manifest: dict | None = None
        self._shutdown: dict | None = None
        self._rejected_seen = 0
        self._last_t: float | None = None
        self._step_ema: float | None = None
        self._started = False
        self._closed = False

    # ---- public -----------------------------------------------------------------------------------

    def start(self) -> "Island":
        """Connect, check the run, say hello, wait for the session, stream INIT (INIT island only),
        install the initial cut (see the module doc). Collective over `group`."""
        if self._started:
            return self
        dec = None
        if self.sync_rank:
            try:
                dec = self._start_sync_rank()
            except BaseException as exc:
                self._share_error(exc)
                raise
        dec = self._share(dec)
        self._raise_shared(dec)
        self.gen = dec["gen"]
        if dec["names"]:
            self.adapter.sync_replicas(dec["names"])
        self._started = True
        return self

    def boundary(self, tokens: int | None = None, loss: float | None = None, *, step_tokens: int | None = None) -> bool:
        """Call after every optimizer step, on every rank. Returns True to keep training, False once
        the island must stop (final cut installed and acknowledged, or a shutdown)."""
        if tokens is None:
            tokens = step_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise WireError("tokens must be a non-negative integer", field="tokens", value=tokens)
        if not self._started:
            raise RuntimeError("Island.start() must be called before the first boundary")
        if self.should_stop:
            return False
        self.local_step += 1
        dec = None
        if self.sync_rank:
            try:
                dec = self._boundary_sync_rank(tokens, loss)
            except BaseException as exc:
                self._share_error(exc)
                raise
        dec = self._share(dec)
        self._raise_shared(dec)
        if dec["names"]:
            self.adapter.sync_replicas(dec["names"])
        if dec.get("final") is not None:
            # Every replica holds the final cut now: only then may the syncer hear it is installed.
            self.final_step = dec["final"]
            if self.sync_rank:
                self._ack_and_wait_shutdown(dec["final"])
            self.finalized = True
        if dec["stop"]:
            self.should_stop = True
        return not dec["stop"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.client is not None:
            self.client.close()

    def __enter__(self) -> "Island":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def counters(self) -> Counter:
        """Totals since start: pushes, applies, bytes, rejected, retries, pull-book and assembly
        dispositions (prefixed pull. / bcast.), step-log drops."""
        c = Counter(self._counters)
        if self.client is not None:
            c.update(self.client.counters)
            c["steplog_dropped"] = self.client.steplog.dropped
        if self.book is not None:
            c.update({f"pull.{k}": v for k, v in self.book.counts.items()})
        if self.asm is not None:
            c.update({f"bcast.{k}": v for k, v in self.asm.counts.items()})
        return c

    # ---- rank coordination ------------------------------------------------------------------------

    def _share(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def _share_error(self, exc: BaseException) -> None:
        if self.world > 1:
            try:
                self._share({"error": f"{type(exc).__name__}: {exc}"})
            except Exception:  # the group itself may be what failed
                pass

    def _raise_shared(self, dec: dict) -> None:
        if dec.get("error") and not self.sync_rank:
            raise IslandUnhealthy(f"sync rank failed: {dec['error']}")

    def _names(self, fids: Iterable[int]) -> list[str]:
        return [n for fid in sorted(set(fids)) for n in fragment_names(self.frags[fid])]

    # ---- start ------------------------------------------------------------------------------------

    def _start_sync_rank(self) -> dict:
        cfg, c = self.config, self.client
        c.start()
        layout = self.adapter.layout()
        fp = layout_fingerprint(layout)
        world = cfg.world or {"ranks": self.world, "tp": 1, "pp": 1, "ep": 1, "dp": self.world, "nodes": 1}
        c.provision({"layout": layout, "layout_fingerprint": fp, "push_dtype": cfg.push_dtype,
                     "bulk_dtype": cfg.bulk_dtype, "world": world, "host": cfg.host})
        session = c.wait_session()
        self._check_session(session, fp)
        self.session = session
        self.frags = {f["id"]: f for f in session["fragments"]}
        self.state = SyncState(session, cfg.island, c.gen, cfg.alpha)
        self.book = PullBook(cfg.island, c.gen, fragments=len(self.frags))
        self.asm = BcastAssembly(session)
        log.info("island %s (gen %s): session %s… with %d fragments, push %s, bulk %s, H=%d, INIT island %s",
                 cfg.island, c.gen, session["session_fingerprint"][:12], len(self.frags), session["push_dtype"],
                 session["bulk_dtype"], session["sync_every"], session["init_island"])
        init = session["init_island"] == cfg.island
        if init:
            if c.state_key("commit") is None:
                self._stream_init()
            else:
                log.warning("island %s: the run already has committed versions: INIT skipped", cfg.island)
        if cfg.lockstep:
            installed = self._install_cut(cfg.lockstep_timeout_s, strict=True)
        elif init:
            installed = self._install_cut(cfg.init_v0_timeout_s, strict=False)
        elif cfg.initial_cut_timeout > 0:
            installed = self._install_cut(cfg.initial_cut_timeout, strict=False)
        else:
            installed = []
        return {"gen": c.gen, "names": self._names(installed)}

    def _check_session(self, session: dict, fp: str) -> None:
        cfg = self.config
        if session["layout_fingerprint"] != fp:
            raise IslandUnhealthy(f"island {cfg.island}: this model's layout fingerprint {fp[:12]}… differs from the "
                                  f"session's {session['layout_fingerprint'][:12]}… (another model, or other "
                                  f"trainable parameters, than the INIT island {session['init_island']})")
        for name in ("push_dtype", "bulk_dtype"):
            want = getattr(cfg, name)
            if want != "auto" and want != session[name]:
                raise IslandUnhealthy(f"island {cfg.island}: configured {name}={want} but the session uses "
                                      f"{session[name]} (set it to auto or match the syncer)")

    def _chunk_bytes(self, dtype: str) -> int:
        unit = wire_align(dtype)[1]
        return (self.session["chunk_bytes"] // unit) * unit  # what schemas.layout.chunk_plan cuts

    def _stream_init(self) -> None:
        """INIT: every fragment in the bulk dtype on init.F; fragment k is sent on a background
        thread while fragment k+1 is gathered (at most two fragments' wire bytes held)."""
        dtype = self.session["bulk_dtype"]
        cb = self._chunk_bytes(dtype)
        total = sum(packed_nbytes(dtype, f["numel"]) for f in self.frags.values())
        bar = _progress(total, f"INIT {self.config.island}", self.config.progress)
        t0 = time.monotonic()
        sent = 0
        pool = ThreadPoolExecutor(1, thread_name_prefix="yeto-init")
        try:
            prev = None
            for fid in sorted(self.frags):
                packed = pack(gather_fragment(self.adapter, self.frags[fid]), dtype)
                if prev is not None:
                    sent += prev.result()
                prev = pool.submit(self._send_init_fragment, fid, packed, dtype, cb, bar.update)
            if prev is not None:
                sent += prev.result()
        finally:
            pool.shutdown(wait=True)
            bar.close()
        self._counters["init_bytes"] += sent
        log.info("island %s: INIT sent %d bytes in %d fragments in %.1fs", self.config.island, sent, len(self.frags),
                 time.monotonic() - t0)

    def _send_init_fragment(self, fid: int, packed, dtype: str, cb: int, progress: Callable[[int], object]) -> int:
        run, gen = self.config.run, self.gen

        def items():
            for ch in iter_chunks(packed, cb):
                meta = {"v": codec.PROTOCOL_VERSION, "run": run, "fragment": fid, "dtype": dtype, **ch.header()}
                yield (S.init(run, fid), ch.payload, S.init_msg_id(fid, ch.index, gen),
                       {codec.CHUNK_HEADER: codec.encode_header("init_chunk", meta)})
                progress(ch.nbytes)

        return self.client.publish_stream(items(), timeout=self.config.push_timeout_s)

    def _install_cut(self, timeout: float, *, strict: bool) -> list[int]:
        """Before the first step: install each fragment's first version as it lands (overwrite),
        until every fragment has one or `timeout` passes (strict: then raise)."""
        t0 = time.monotonic()
        missing = lambda: [f for f in self.frags if self.state.version(f) is None]  # noqa: E731
        bar = _progress(len(self.frags), f"cut {self.config.island}", self.config.progress, unit="frag")
        installed: list[int] = []
        stats = _Stats()
        try:
            while missing():
                self.client.check_health()
                applied = self._drain_broadcasts(stats)
                installed += applied
                bar.update(len(applied))
                if not missing():
                    break
                if time.monotonic() - t0 >= timeout:
                    what = f"fragments {missing()} have no version after {timeout:.0f}s"
                    if strict:
                        raise LockstepTimeout(f"island {self.config.island}: {what}")
                    log.warning("island %s: %s; they will be installed at a step boundary", self.config.island, what)
                    break
                if not applied:
                    time.sleep(POLL_S)
        finally:
            bar.close()
        self._counters["applies"] += stats.applies
        self._counters["bytes_in"] += stats.bytes_in
        self._counters["rejected"] += stats.rejected
        return installed

    # ---- boundary ---------------------------------------------------------------------------------

    def _boundary_sync_rank(self, tokens: int, loss: float | None) -> dict:
        t0 = time.perf_counter()
        c = self.client
        c.check_health()
        now = time.monotonic()
        if self._last_t is not None:
            dt = now - self._last_t
            self._step_ema = dt if self._step_ema is None else 0.9 * self._step_ema + 0.1 * dt
        self._last_t = now
        c.local_step, c.step_time_s = self.local_step, self._step_ema
        self.state.note_step(tokens)
        stats = _Stats()
        self._read_control()
        applied: list[int] = []
        if self._manifest is None and self._shutdown is None:
            ta = time.perf_counter()
            applied = self._drain_broadcasts(stats)
            stats.apply_s += time.perf_counter() - ta
            self._take_pulls(stats)
            if self.config.lockstep:
                applied += self._lockstep(stats)
            if self._manifest is None and self._shutdown is None:
                self._answer_pulls(stats)
        if self._manifest is not None:
            ta = time.perf_counter()
            final = self._install_final(stats)
            stats.apply_s += time.perf_counter() - ta
            dec = {"names": self._names(final), "final": self._manifest["final_step"], "stop": True}
            versions = {str(k): v for k, v in self._manifest["versions"].items()}
        else:
            dec = {"names": self._names(applied), "stop": self._shutdown is not None}
            versions = None
            if self._shutdown is not None:
                log.warning("island %s: shutdown from the syncer: %s", self.config.island, self._shutdown["reason"])
        self._emit(stats, loss, t0, versions)
        return dec

    def _read_control(self) -> None:
        for kind, msg in self.client.control.drain():
            if kind == "manifest":
                if self._manifest is None or msg["final_step"] > self._manifest["final_step"]:
                    self._manifest = msg
                    log.warning("island %s: manifest for final step %d: finalizing", self.config.island, msg["final_step"])
            elif kind == "shutdown":
                self._shutdown = msg
            elif kind == "error":  # fatal ones already made check_health raise
                self._counters["syncer_errors"] += 1

    def _reject(self, stats: _Stats, what: str, exc: Exception) -> None:
        stats.rejected += 1
        self._counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        log.warning("island %s: rejected %s: %s", self.config.island, what, exc)

    # broadcasts

    def _drain_broadcasts(self, stats: _Stats) -> list[int]:
        """Fetch the noticed BCAST chunks and apply every version that completes. Returns the
        fragments applied. Notices whose fetch fails stay for the next boundary."""
        for n in self.client.bcast.drain():
            try:
                # Monotonic versions; one version with two digests is fatal (ProtocolError).
                if self.state.accept_version(n.fragment, n.version, n.meta["version_digest"]) != "new":
                    continue
            except ProtocolError:
                raise
            except WireError as exc:
                self._reject(stats, f"bcast notice {n.subject}", exc)
                continue
            self._notices[(n.fragment, n.chunk)] = n
        applied: list[int] = []
        if not self.client.connected:
            return applied  # a request now would only wait out its timeout: fetch after the reconnect
        for batch in _batches([self._notices[k] for k in sorted(self._notices)], self.config.fetch_batch_bytes):
            try:
                msgs = self.client.fetch_last("BCAST", [n.subject for n in batch])
            except TRANSIENT as exc:
                log.warning("island %s: fetching broadcast chunks: %r (retried at the next boundary)",
                            self.config.island, exc)
                break
            for n, m in zip(batch, msgs):
                del self._notices[(n.fragment, n.chunk)]
                comp = self._take_chunk("bcast_chunk", self.asm, n, m, stats)
                if comp is not None and self._apply(comp):
                    stats.applies += 1
                    applied.append(comp.fragment)
        return applied

    def _take_chunk(self, kind: str, asm: BcastAssembly, n: ChunkNotice, m, stats: _Stats) -> Completed | None:
        """One fetched chunk into an assembly; bad chunks are counted and dropped."""
        if m is None:  # gone meanwhile (stream purged): a newer notice will come if it matters
            self._counters[f"{kind}.missing"] += 1
            return None
        data = m.data or b""
        stats.bytes_in += len(data)
        try:
            hdr = (m.headers or {}).get(codec.CHUNK_HEADER)
            if hdr is None:
                raise WireError("chunk message without its header", field=codec.CHUNK_HEADER, value=None)
            meta = codec.decode_header(kind, hdr)
            if meta["run"] != self.config.run or (meta["fragment"], meta["chunk"]) != (n.fragment, n.chunk):
                raise WireError("chunk header does not match its subject", field="subject", value=n.subject)
            return asm.add(meta, data)
        except ProtocolError:
            raise
        except WireError as exc:
            self._reject(stats, f"{kind} {n.subject}", exc)
            return None

    def _apply(self, comp: Completed) -> bool:
        fid = comp.fragment
        if self.state.accept_version(fid, comp.version, comp.version_digest) != "new":
            return False
        frag = self.frags[fid]
        local = gather_fragment(self.adapter, frag) if self.state.needs_local(fid) else None
        out = self.state.apply(fid, comp.version, comp.version_digest, comp.values, local)
        scatter_fragment(self.adapter, frag, out)
        self.book.committed(fid, comp.version)
        return True

    # pulls

    def _take_pulls(self, stats: _Stats) -> None:
        for p in self.client.pulls.drain():
            try:
                self.book.offer(p)
            except WireError as exc:
                self._reject(stats, f"pull {p.get('fragment')}/{p.get('step')}", exc)
                continue
            if self.config.lockstep:
                key = (p["fragment"], p["step"])
                self._seen_rounds[key] = max(self._seen_rounds.get(key, -1), p["base_version"])

    def _answer_pulls(self, stats: _Stats) -> None:
        if not self.client.connected:
            return  # pulls stay pending (no try is spent): answered at a later boundary
        max_step = max_due_step(self.local_step, self.session["sync_every"], len(self.frags)) if self.config.lockstep else None
        for p in self.book.take_ready(self.state.ready, max_step=max_step):
            t0 = time.perf_counter()
            try:
                nbytes = self._push(p)
            except TRANSIENT as exc:
                self.book.failed(p.fragment, p.step, p.attempt, p.try_)
                self._counters["push_failed"] += 1
                log.warning("island %s: push of fragment %d round %d (attempt %d, try %d) failed: %r; retried "
                            "at the next boundary", self.config.island, p.fragment, p.step, p.attempt, p.try_, exc)
                continue
            finally:
                stats.export_s += time.perf_counter() - t0
            self.book.sent(p.fragment, p.step, p.attempt, p.try_)
            stats.pushes += 1
            stats.bytes_out += nbytes

    def _push(self, p) -> int:
        """Stream d = local − anchor in the session push dtype; returns the bytes sent once every
        chunk is acked. q4 keeps its error-feedback residual only once the push got through."""
        fid = p.fragment
        st = self.state.states[fid]
        dtype = self.session["push_dtype"]
        run, island, gen = self.config.run, self.config.island, self.gen
        d = self.state.delta(fid, gather_fragment(self.adapter, self.frags[fid]), inplace=True)
        residual = self.state.push_residual(fid) if dtype == "q4" else None
        spans = chunk_plan(st.numel, dtype, self.session["chunk_bytes"])
        chunker = Chunker(packed_nbytes(dtype, st.numel), self._chunk_bytes(dtype))
        base = {"v": codec.PROTOCOL_VERSION, "run": run, "island": island, "gen": gen, "fragment": fid,
                "step": p.step, "attempt": p.attempt, "try": p.try_, "base_version": st.version,
                "local_step": self.local_step, "c_steps": st.c_steps, "c_tokens": st.c_tokens, "dtype": dtype}
        subject = S.push(run, island, fid)
        digests: list[str] = []

        def items():
            pieces = (d[s.elem_offset : s.elem_offset + s.elem_count] for s in spans)
            for packed in pack_stream(pieces, dtype, residual=residual):
                for ch in chunker.feed(packed):
                    digests.append(ch.digest)
                    meta = dict(base, **ch.header())
                    if ch.index == ch.chunks - 1:
                        meta["push_digest"] = push_digest(digests)
                    yield (subject, ch.payload, S.push_msg_id(island, gen, fid, p.step, p.attempt, p.try_, ch.index),
                           {codec.CHUNK_HEADER: codec.encode_header("push_chunk", meta)})
            chunker.close()

        sent = self.client.publish_stream(items(), timeout=self.config.push_timeout_s)
        if residual is not None:
            self.state.keep_residual(fid, residual)
        return sent

    # lockstep

    def _lockstep(self, stats: _Stats) -> list[int]:
        """At the boundary of local step t·H/P: block until round t's pull is held, answer it, and
        block until a version of its fragment newer than the pull's base is applied."""
        H, P = self.session["sync_every"], len(self.frags)
        due = due_round(self.local_step, H, P)
        if due is None:
            return []
        fid = (due - 1) % P
        applied: list[int] = []
        if not self._block(lambda: (fid, due) in self._seen_rounds, f"the pull of round {due}", stats, applied):
            return applied
        self._answer_pulls(stats)
        base = self._seen_rounds[(fid, due)]
        held = lambda: -1 if self.state.version(fid) is None else self.state.version(fid)  # noqa: E731
        self._block(lambda: held() > base, f"the broadcast of round {due} (fragment {fid} newer than v{base})", stats, applied)
        for key in [k for k in self._seen_rounds if k[1] <= due]:
            del self._seen_rounds[key]
        return applied

    def _block(self, done: Callable[[], bool], what: str, stats: _Stats, applied: list[int]) -> bool:
        """Poll until `done()`; False when a manifest or shutdown arrived instead (finalize now)."""
        deadline = time.monotonic() + self.config.lockstep_timeout_s
        while not done():
            self.client.check_health()
            self._read_control()
            if self._manifest is not None or self._shutdown is not None:
                return False
            if time.monotonic() > deadline:
                raise LockstepTimeout(f"island {self.config.island} (lockstep, local step {self.local_step}): "
                                      f"{what} did not come within {self.config.lockstep_timeout_s:.0f}s")
            ta = time.perf_counter()
            got = self._drain_broadcasts(stats)
            stats.apply_s += time.perf_counter() - ta
            applied += got
            self._take_pulls(stats)
            self._answer_pulls(stats)  # a restarted attempt of a round is answered while blocked
            if not got:
                time.sleep(POLL_S)
        return True

    # finalization

    def _install_final(self, stats: _Stats) -> list[int]:
        """Install the manifest's exact f32 versions from FINAL (any arrival order), without blending."""
        m = self._manifest
        want = {int(k): (v, m["version_digests"][k]) for k, v in m["versions"].items()}
        unknown = sorted(set(want) - set(self.frags))
        if unknown:
            raise ProtocolError("manifest names fragments the session does not have", field="versions", value=unknown)
        missing = sorted(set(self.frags) - set(want))
        if missing:
            log.warning("island %s: the manifest leaves fragments %s out: they keep their values",
                        self.config.island, missing)
        asm = BcastAssembly(self.session, dtype="f32")
        pending: dict[tuple[int, int], ChunkNotice] = {}
        got: list[int] = []
        deadline = time.monotonic() + self.config.final_timeout_s
        bar = _progress(len(want), f"final {self.config.island}", self.config.progress, unit="frag")
        try:
            while len(got) < len(want):
                self.client.check_health()
                for n in self.client.final.drain():
                    if n.fragment in want and n.fragment not in got and n.meta["final_step"] == m["final_step"] \
                            and n.version == want[n.fragment][0]:
                        pending[(n.fragment, n.chunk)] = n
                    else:
                        self._counters["final_chunk.ignored"] += 1
                progressed = False
                batches = _batches([pending[k] for k in sorted(pending)], self.config.fetch_batch_bytes)
                for batch in batches if self.client.connected else ():
                    try:
                        msgs = self.client.fetch_last("FINAL", [n.subject for n in batch])
                    except TRANSIENT as exc:
                        log.warning("island %s: fetching the final cut: %r", self.config.island, exc)
                        break
                    for n, msg in zip(batch, msgs):
                        del pending[(n.fragment, n.chunk)]
                        comp = self._take_chunk("final_chunk", asm, n, msg, stats)
                        progressed = True
                        if comp is None or comp.fragment in got:
                            continue
                        version, digest = want[comp.fragment]
                        if comp.version != version:
                            self._counters["final_chunk.ignored"] += 1
                            continue
                        if comp.version_digest != digest:
                            raise ProtocolError(f"final cut of fragment {comp.fragment} v{version} does not match "
                                                f"the manifest's digest {digest}", field="version_digest",
                                                value=comp.version_digest)
                        scatter_fragment(self.adapter, self.frags[comp.fragment], comp.values)
                        got.append(comp.fragment)
                        stats.applies += 1
                        bar.update(1)
                if len(got) < len(want):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"island {self.config.island}: final cut incomplete after "
                                           f"{self.config.final_timeout_s:.0f}s: fragments "
                                           f"{sorted(set(want) - set(got))} missing")
                    if not progressed:
                        time.sleep(POLL_S)
        finally:
            bar.close()
        log.warning("island %s: final cut of step %d installed (%d fragments)", self.config.island, m["final_step"], len(got))
        return got

    def _ack_and_wait_shutdown(self, final_step: int) -> None:
        self.client.send_ack(final_step)
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while self._shutdown is None:
            self._read_control()
            if self._shutdown is not None:
                break
            if time.monotonic() > deadline:
                log.warning("island %s: no shutdown from the syncer within %.0fs after the final ack; stopping anyway",
                            self.config.island, self.config.shutdown_timeout_s)
                return
            time.sleep(0.02)
        log.warning("island %s: shutdown: %s", self.config.island, self._shutdown["reason"])

    # step log

    def _emit(self, stats: _Stats, loss: float | None, t0: float, versions: dict | None) -> None:
        client_rejected = self.client.rejected_total()
        rejected = stats.rejected + client_rejected - self._rejected_seen
        self._rejected_seen = client_rejected
        for key in ("pushes", "applies", "bytes_out", "bytes_in", "rejected"):
            self._counters[key] += getattr(stats, key)
        self.client.steplog.emit(
            step=self.local_step, boundary_s=time.perf_counter() - t0, export_s=stats.export_s,
            apply_s=stats.apply_s, pushes=stats.pushes, applies=stats.applies, bytes_out=stats.bytes_out,
            bytes_in=stats.bytes_in, versions=self.state.versions() if versions is None else versions,
            pending_pulls=self.book.pending(), rejected=rejected, loss=loss)


__all__ = ["Island", "LockstepTimeout"]
