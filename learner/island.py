"""The island's sync core: start-up (layout, hello, session, INIT, initial cut) and the step boundary
(DESIGN §3.2, §5, §6). Pure decisions live in `pulls.PullBook`, `fragments.SyncState` /
`CutReader` and `layout_map`; the network lives in `client.IslandClient`; the sync rank's reading
of cuts and its exports in `island_wire` (mixed in); the ranks' share of the work in
`island_ranks.RankOps` over `shard_io`; this module sequences them.

Use (every rank of the island group calls every method; `group` None: a single process):

    island = Island(adapter, IslandConfig.from_env(), group=group).start()
    while island.boundary(tokens=n_tokens, loss=loss):   # after every optimizer step, on every rank
        ... one training step ...
    island.close()

Ranks. Rank 0 of `group` (the sync rank) does all NATS I/O and all deciding; the others follow.
Every step that needs the other ranks is announced with a small dict (broadcast_object_list) and
then run by every rank (`RankOps`): the others loop on announcements until rank 0 says "end" (with
its decision: stop, final) or "error". At start every rank's pieces are gathered once
(`layout_map`); the hello announces the island's canonical layout, whatever its TP/PP/DP layout.

Where things live. Rank 0: versions, digests, counters, pull book, the readers' positions — and at
most one fetch batch of wire bytes (`fetch_batch_bytes`) or a few export chunks, never a fragment.
Every rank: its own pieces' staging (the version arriving), anchor (raw Θ of the version held, owner
pieces) and q4 residual (owner pieces), in `anchors.AnchorStore` (memory, or files under
`YETO_ANCHOR_DIR` / `Island(..., anchor_dir=...)`: page cache instead of process memory).

Boundary order (rank 0): health → control messages (a manifest finalizes now) → count the step →
read broadcasts: chunks fetched in order by direct get in bounded batches and scattered to the
ranks' staging as they arrive; when a version's last chunk passes and its whole digest matches,
every rank commits (the first version of a fragment overwrites, later ones blend
θ = α·θ_local + (1−α)·Θ; the staged Θ becomes the anchor) — a version overwritten mid-read is
dropped and read again, never half-applied → take the pulls that arrived → (lockstep: block for the
due round) → answer ready pulls (the owners' d = local − anchor gathered to rank 0 chunk by chunk,
packed in the session push dtype and streamed while produced; `sent` once every chunk is acked,
`failed` otherwise: a later boundary retries with try + 1. Acks not in within `ACK_WAIT_S`, or
when the connection drops, are awaited in the background: the pull stays in flight, the boundary
returns, and the boundary after the outcome reports it; one push per fragment at a time) →
step-log event (with the bytes rank 0
moved to and from the other ranks: scatter_bytes, gather_bytes). Bad input is counted (`rejected`)
and training goes on: that includes chunks that claim a version held or being read with another
version digest (until #17 anyone on the bus may publish them); the cut is read again when new
messages land.

Decisions beyond DESIGN:
* The island's CTL consumers deliver from its hello's stream sequence (see IslandClient.provision).
* The INIT island skips INIT when the state KV already holds `commit` (v0 exists: it is a restart),
  then waits up to `init_v0_timeout_s` for v0 of every fragment before its first step (its weights
  would be overwritten by v0 anyway); what has not landed by then overwrites at a boundary.
* Lockstep mode also waits (up to `lockstep_timeout_s`, then fails) for the whole cut before the
  first step: otherwise the step at which v0 lands, and so the run, would depend on timing.
* A manifest seen while a lockstep boundary is blocked finalizes at that boundary.
* INIT: rank 0 publishes on a background thread from a queue of `INIT_QUEUE_CHUNKS` packed chunks
  while the island gathers the next ones (fragment k is on the wire while k+1 is gathered).
* A fragment is fetched again only after a new notice for it (or a failed fetch): a reader that
  waits for a version still being published does not poll the broker.
* A run that finished without this process (the syncer wrote its final record, state KV `final`, and
  exited): found at start (INIT and the initial cut are skipped) or while training (the client
  looks every few seconds), it is offered like a manifest — checked against FINAL's chunk headers,
  then the f32 cut is installed, digests verified, at the next boundary — and the island stops:
  `boundary()` returns False, no ack is sent and no shutdown awaited (nobody is left to send one);
  the step-log event of that boundary carries `extra.final_after_run`. `run_finished` tells.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from concurrent.futures import CancelledError
from typing import Callable

import torch.distributed as dist

from schemas import codec
from schemas import subjects as S
from schemas.errors import WireError
from schemas.layout import layout_fingerprint

from .adapters import ModelAdapter
from .anchors import AnchorStore
from .client import IslandClient, IslandUnhealthy
from .config import IslandConfig
from .fragments import CutReader, SyncState
from .island_ranks import RankOps
from .island_wire import POLL_S, TRANSIENT, IslandWire, _progress, _Stats
from .layout_map import IslandLayout, describe
from .pulls import PullBook, due_round, max_due_step
from .shard_io import Comm

# After the final ack, re-send it this often until the shutdown comes (see _ack_and_wait_shutdown).
ACK_RESEND_S = 5.0

log = logging.getLogger("yeto.island")

class LockstepTimeout(TimeoutError):
    pass


def _world_of(layout: IslandLayout, world: int) -> dict:
    """The hello's informational `world`, read off the gathered layout: TP = most owner boxes of one
    tensor, DP = most holders of one box."""
    tp = max((sum(p.owner for p in ps) for ps in layout.pieces.values()), default=1)
    dp = max((sum(q.box == p.box for q in ps) for ps in layout.pieces.values() for p in ps), default=1)
    return {"ranks": world, "tp": tp, "pp": max(1, world // max(1, tp * dp)), "ep": 1, "dp": dp, "nodes": 1}


def rank_anchor_dir(base: str | os.PathLike | None, island: str, rank: int) -> str | None:
    """This rank's own directory under `base`, emptied of a previous process's files: one process per
    (island, rank) runs at a time, and a SIGKILLed one cannot remove its files itself."""
    if base is None:
        return None
    d = os.path.join(os.fspath(base), f"{island}-rank{rank}")
    if os.path.isdir(d):
        for name in os.listdir(d):
            if ".f32" in name:
                os.unlink(os.path.join(d, name))
    return d


class Island(IslandWire):
    def __init__(self, adapter: ModelAdapter, config: IslandConfig, *, group: "dist.ProcessGroup | None" = None,
                 anchor_dir: str | os.PathLike | None = None):
        self.adapter = adapter
        self.config = config
        self.group = group
        self.comm = Comm(group)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.sync_rank = self.rank == 0
        self.client: IslandClient | None = IslandClient(config) if self.sync_rank else None
        self.gen: str | None = self.client.gen if self.client else None
        # Where each rank keeps its pieces' staging/anchors/residuals: memory, or files under
        # <anchor_dir>/<island>-rank<r>/ (YETO_ANCHOR_DIR; the keyword wins), see anchors.py.
        self.store = AnchorStore(rank_anchor_dir(anchor_dir if anchor_dir is not None else config.anchor_dir,
                                                 config.island, self.rank))
        self.layout: IslandLayout | None = None
        self.ops: RankOps | None = None
        self.session: dict | None = None
        self.frags: dict[int, dict] = {}
        self.state: SyncState | None = None
        self.book: PullBook | None = None
        self.reader: CutReader | None = None
        self.local_step = 0
        self.should_stop = False
        self.finalized = False  # the final cut is installed (and acknowledged, unless run_finished)
        self.run_finished = False  # the run had finished (syncer exited) when this island finalized
        self._run_finished = False  # rank 0: the run's final record was seen
        self.final_step: int | None = None
        self._counters: Counter[str] = Counter()
        self._dirty: set[int] = set()  # fragments with BCAST notices since their last read
        self._noticed: dict[int, dict[int, int]] = {}  # fragment -> {chunk: version} those notices claim
        self._staged: dict[int, int] = {}  # fragment -> version the ranks are staging (rank 0's view)
        self._pushing: dict[int, tuple] = {}  # fragment -> (PendingPull, PublishHandle) awaiting acks
        self._seen_rounds: dict[tuple[int, int], int] = {}  # lockstep: (fragment, step) -> base_version
        self._manifest: dict | None = None  # verified (backed by the final cut): finalize now
        self._offered: tuple[dict, float] | None = None  # a manifest not verified yet, and since when
        self._ctl_rejected = 0
        self._shutdown: dict | None = None
        self._rejected_seen = 0
        self._bytes_seen: Counter[str] = Counter()
        self._last_t: float | None = None
        self._step_ema: float | None = None
        self._started = False
        self._closed = False

    # ---- public -----------------------------------------------------------------------------------

    def start(self) -> "Island":
        """Gather the layout, connect, check the run, say hello, wait for the session, stream INIT
        (INIT island only), install the initial cut (see the module doc). Collective over `group`."""
        if self._started:
            return self
        # Every rank's pieces, once: rank 0 announces the union, every rank maps fragments with it.
        self.layout = IslandLayout(self.comm.all_gather(describe(self.adapter.shards())))
        dec = self._lead_or_follow(self._start_sync_rank)
        self.gen = dec["gen"]
        if dec.get("run_finished") is not None:
            self.run_finished = True  # the first boundary installs the final cut and returns False
        self._bytes_seen = Counter(self.comm.bytes)  # the step log counts per step from here
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
        dec = self._lead_or_follow(lambda: self._boundary_sync_rank(tokens, loss))
        if dec.get("final") is not None:
            # Every rank holds the final cut now: only then may the syncer hear it is installed.
            self.final_step = dec["final"]
            if dec.get("after_run"):
                self.run_finished = True  # the syncer has exited: nobody to acknowledge to
            elif self.sync_rank:
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
        self.store.close()

    def __enter__(self) -> "Island":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def counters(self) -> Counter:
        """Totals since start: pushes, applies, bytes (incl. scatter_bytes / gather_bytes moved by rank
        0 to and from the other ranks), rejected, retries, pull-book and reader dispositions
        (prefixed pull. / bcast.), step-log drops."""
        c = Counter(self._counters)
        c["scatter_bytes"] = self.comm.bytes["scatter"]
        c["gather_bytes"] = self.comm.bytes["gather"]
        if self.client is not None:
            c.update(self.client.counters)
            c["steplog_dropped"] = self.client.steplog.dropped
        if self.book is not None:
            c.update({f"pull.{k}": v for k, v in self.book.counters.items()})
        if self.reader is not None:
            c.update({f"bcast.{k}": v for k, v in self.reader.counters.items()})
        return c

    def anchor(self, fid: int) -> dict:
        """{tensor name: this rank's anchor of its owner piece (flat float32)} of a fragment (tests)."""
        fm = self.ops.maps[fid]
        return {p.name: self.store.anchor(fid, p.name, 0, p.numel).clone()
                for p in fm.pieces(self.rank) if p.owner}

    def residual(self, fid: int) -> dict | None:
        """{tensor name: this rank's q4 residual (flat float32)} of a fragment, None before a q4 push."""
        fm = self.ops.maps[fid]
        out = {}
        for p in fm.pieces(self.rank):
            if p.owner:
                r = self.store.committed_residual(fid, p.name, 0, p.numel)
                if r is None:
                    return None
                out[p.name] = r.clone()
        return out

    # ---- rank coordination ------------------------------------------------------------------------

    def _lead_or_follow(self, work: Callable[[], dict]) -> dict:
        """Rank 0 runs `work` (announcing its collective steps) and then shares its decision; the
        others run what is announced until that decision arrives."""
        if not self.sync_rank:
            return self._follow()
        try:
            dec = work()
        except BaseException as exc:
            if self.world > 1:
                try:
                    self.comm.share({"op": "error", "error": f"{type(exc).__name__}: {exc}"})
                except Exception:  # the group itself may be what failed
                    pass
            raise
        self.comm.share({"op": "end", **dec})
        return dec

    def _follow(self) -> dict:
        while True:
            op = self.comm.share(None)
            kind = op["op"]
            if kind == "end":
                return op
            if kind == "error":
                raise IslandUnhealthy(f"sync rank failed: {op['error']}")
            if kind == "session":
                self._setup(op)
                continue
            out = self.ops.run(op)
            if kind == "export":
                for _ in out:
                    pass
            elif kind == "commit" and op["mode"] != "final":
                self.state.installed(op["fid"], op["version"], op["digest"])

    def _lead(self, op: dict, payloads=None):
        """Announce one collective step and run rank 0's part of it."""
        self.comm.share(op)
        return self.ops.run(op, payloads)

    def _setup(self, op: dict) -> None:
        """Every rank: the session's fragments over the island layout, and the version bookkeeping."""
        session = op["session"]
        self.session = session
        self.frags = {f["id"]: f for f in session["fragments"]}
        self.ops = RankOps(self.adapter, self.comm, self.layout, session, self.store, op["alpha"])
        self.state = SyncState(session, self.config.island, op["gen"], op["alpha"])

    # ---- start ------------------------------------------------------------------------------------

    def _start_sync_rank(self) -> dict:
        cfg, c = self.config, self.client
        c.start()
        layout = self.layout.layout()
        fp = layout_fingerprint(layout)
        world = cfg.world or _world_of(self.layout, self.world)
        c.provision({"layout": layout, "layout_fingerprint": fp, "push_dtype": cfg.push_dtype,
                     "bulk_dtype": cfg.bulk_dtype, "world": world, "host": cfg.host})
        session = c.wait_session()
        self._check_session(session, fp)
        op = {"op": "session", "session": session, "gen": c.gen, "alpha": cfg.alpha}
        self.comm.share(op)
        self._setup(op)
        self.book = PullBook(cfg.island, c.gen, fragments=len(self.frags))
        self.reader = CutReader(session)
        log.info("island %s (gen %s, %d ranks): session %s… with %d fragments, push %s, bulk %s, H=%d, INIT island %s",
                 cfg.island, c.gen, self.world, session["session_fingerprint"][:12], len(self.frags),
                 session["push_dtype"], session["bulk_dtype"], session["sync_every"], session["init_island"])
        init = session["init_island"] == cfg.island
        final = self._final_record()
        if final is not None:
            # The run is over: no INIT, no cut to wait for; the first boundary installs the final cut.
            log.warning("island %s: run %s already finished at step %d (the syncer has exited): the final cut "
                        "is installed at the first boundary, then the island stops", cfg.island, cfg.run,
                        final["final_step"])
            self._offer_final(final)
            return {"gen": c.gen, "installed": [], "stop": False, "run_finished": final["final_step"]}
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
        return {"gen": c.gen, "installed": sorted(installed), "stop": False}

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
        if self._manifest is None and self._shutdown is None:
            ta = time.perf_counter()
            self._drain_broadcasts(stats)
            stats.apply_s += time.perf_counter() - ta
            self._take_pulls(stats)
            if self.config.lockstep:
                self._lockstep(stats)
            if self._manifest is None and self._shutdown is None:
                self._answer_pulls(stats)
        if self._manifest is not None:
            ta = time.perf_counter()
            self._install_final(stats)
            stats.apply_s += time.perf_counter() - ta
            dec = {"final": self._manifest["final_step"], "stop": True, "after_run": self._run_finished}
            versions = {str(k): v for k, v in self._manifest["versions"].items()}
            if self._run_finished:
                log.warning("island %s: the run had finished (the syncer has exited): final cut of step %d "
                            "installed, stopping without an ack", self.config.island, self._manifest["final_step"])
        else:
            dec = {"final": None, "stop": self._shutdown is not None}
            versions = None
            if self._shutdown is not None:
                log.warning("island %s: shutdown from the syncer: %s", self.config.island, self._shutdown["reason"])
        self._emit(stats, loss, t0, versions, extra={"final_after_run": True, "final_step": dec["final"]}
                   if dec.get("after_run") and dec["final"] is not None else None)
        return dec

    def _final_record(self) -> dict | None:
        """The run's final record (see the module doc) if the syncer left one; a bad one is refused."""
        try:
            return self.client.final_record()
        except WireError as exc:
            self._reject_ctl("final record in the state KV", exc)
            return None

    def _offer_final(self, msg: dict) -> None:
        """The run's final record: the run is over. Offered like a manifest (verified against FINAL)."""
        self._run_finished = True
        try:
            self._check_manifest(msg)
        except WireError as exc:
            self._reject_ctl(f"final record for final step {msg.get('final_step')}", exc)
            return
        cur = self._offered
        if self._manifest is None and (cur is None or msg["final_step"] > cur[0]["final_step"]):
            self._offered = (msg, time.monotonic())

    def _read_control(self) -> None:
        for kind, msg in self.client.control.drain():
            if kind == "final":
                self._offer_final(msg)
            elif kind == "manifest":
                try:
                    self._check_manifest(msg)
                except WireError as exc:
                    self._reject_ctl(f"manifest for final step {msg.get('final_step')}", exc)
                    continue
                cur = self._offered
                if cur is None or msg["final_step"] > cur[0]["final_step"]:
                    self._offered = (msg, time.monotonic())
            elif kind == "shutdown":
                self._shutdown = msg
            elif kind == "error":  # fatal ones already made check_health raise
                self._counters["syncer_errors"] += 1
        if self._manifest is None and self._offered is not None:
            self._verify_manifest()

    def _check_manifest(self, msg: dict) -> None:
        unknown = sorted(int(k) for k in msg["versions"] if int(k) not in self.frags)
        if unknown:
            raise WireError("manifest names fragments the session does not have", field="versions", value=unknown)

    def _verify_manifest(self) -> None:
        """Finalize only once the manifest is backed by the final cut: the syncer publishes FINAL
        before any manifest, so chunk 0 of every fragment it names already carries its version, digest
        and final step. Until then (a lagging replica, a fetch that failed) the island trains on and
        looks again at the next boundary; a manifest still unbacked after `final_timeout_s` (forged:
        until #17 anyone may publish one) is dropped and counted, instead of stopping the island to
        wait for a cut that never comes."""
        msg, since = self._offered
        want = sorted((int(k), v) for k, v in msg["versions"].items())
        backed = False
        if self.client.connected:
            try:
                got = self.client.fetch_last("FINAL", [S.final(self.config.run, fid, 0) for fid, _ in want])
            except TRANSIENT as exc:
                log.warning("island %s: checking the final cut of a manifest: %r", self.config.island, exc)
                got = None
            if got is not None:
                backed = True
                for (fid, v), m in zip(want, got):
                    try:
                        meta = None if m is None else codec.decode_header(
                            "final_chunk", (m.headers or {}).get(codec.CHUNK_HEADER, b""))
                    except WireError:
                        meta = None
                    if meta is None or (meta["version"], meta["version_digest"], meta["final_step"]) != \
                            (v, msg["version_digests"][str(fid)], msg["final_step"]):
                        backed = False
                        break
        if backed:
            self._manifest, self._offered = msg, None
            log.warning("island %s: manifest for final step %d: finalizing", self.config.island, msg["final_step"])
        elif time.monotonic() - since > self.config.final_timeout_s:
            self._offered = None
            self._reject_ctl(f"manifest for final step {msg['final_step']}", WireError(
                f"no final cut on FINAL matches it after {self.config.final_timeout_s:.0f}s", field="versions",
                value=msg["versions"], code="manifest_unbacked"))

    def _reject_ctl(self, what: str, exc: Exception) -> None:
        """A control message refused outside a boundary's stats: counted into the next step-log event."""
        self._ctl_rejected += 1
        self._counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        log.warning("island %s: rejected %s: %s", self.config.island, what, exc)

    def _reject(self, stats: _Stats, what: str, exc: Exception) -> None:
        stats.rejected += 1
        self._counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        log.warning("island %s: rejected %s: %s", self.config.island, what, exc)

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
        self._reap_pushes(stats)
        if not self.client.connected:
            return  # pulls stay pending (no try is spent): answered at a later boundary
        max_step = max_due_step(self.local_step, self.session["sync_every"], len(self.frags)) if self.config.lockstep else None
        # One push per fragment at a time: a push still awaiting its acks (see _push) keeps its
        # fragment's next pull waiting, so q4's working residual and the try numbers stay one per push.
        ready = lambda fid: self.state.ready(fid) and fid not in self._pushing  # noqa: E731
        for p in self.book.take_ready(ready, max_step=max_step):
            t0 = time.perf_counter()
            try:
                handle = self._push(p)
            except TRANSIENT as exc:
                self._push_failed(p, exc)
                continue
            finally:
                stats.export_s += time.perf_counter() - t0
            self._pushing[p.fragment] = (p, handle)
            self._reap_pushes(stats)

    def _reap_pushes(self, stats: _Stats) -> None:
        """Report the pushes whose acks all arrived (sent) or that failed (the pull is pending
        again, its next push is try + 1); the others stay in flight without blocking the boundary."""
        for fid in [f for f, (_, h) in self._pushing.items() if h.done()]:
            p, h = self._pushing.pop(fid)
            try:
                nbytes = h.result()
            except (*TRANSIENT, CancelledError) as exc:
                self._settle_push(p, False)
                self._push_failed(p, exc)
                continue
            self._settle_push(p, True)
            self.book.sent(p.fragment, p.step, p.attempt, p.try_)
            stats.pushes += 1
            stats.bytes_out += nbytes

    def _push_failed(self, p, exc: BaseException) -> None:
        self.book.failed(p.fragment, p.step, p.attempt, p.try_)
        self._counters["push_failed"] += 1
        log.warning("island %s: push of fragment %d round %d (attempt %d, try %d) failed: %r; retried "
                    "at a later boundary", self.config.island, p.fragment, p.step, p.attempt, p.try_, exc)

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

    def _ack_and_wait_shutdown(self, final_step: int) -> None:
        self.client.send_ack(final_step)
        now = time.monotonic()
        deadline, resend_at, resends = now + self.config.shutdown_timeout_s, now + ACK_RESEND_S, 0
        while self._shutdown is None:
            self._read_control()
            if self._shutdown is not None:
                break
            if self._run_finished:
                # The syncer wrote the run's final record and exited: no shutdown will come.
                log.warning("island %s: the syncer has exited (final record): not waiting for a shutdown",
                            self.config.island)
                return
            if time.monotonic() >= resend_at:
                # A syncer killed after our ack but before it recorded it would, once resumed, wait for
                # this ack until its final timeout: say it again until the shutdown comes (duplicates are
                # ignored by the syncer).
                resends += 1
                try:
                    self.client.send_ack(final_step, resend=resends)
                except Exception as exc:  # the broker may be down too: the next re-send tries again
                    log.warning("island %s: re-sending the final ack failed: %r", self.config.island, exc)
                resend_at = time.monotonic() + ACK_RESEND_S
            if time.monotonic() > deadline:
                log.warning("island %s: no shutdown from the syncer within %.0fs after the final ack; stopping anyway",
                            self.config.island, self.config.shutdown_timeout_s)
                return
            time.sleep(0.02)
        log.warning("island %s: shutdown: %s", self.config.island, self._shutdown["reason"])

    # step log

    def _emit(self, stats: _Stats, loss: float | None, t0: float, versions: dict | None,
              extra: dict | None = None) -> None:
        stats.rejected += self._ctl_rejected
        self._ctl_rejected = 0
        client_rejected = self.client.rejected_total()
        rejected = stats.rejected + client_rejected - self._rejected_seen
        self._rejected_seen = client_rejected
        for key in ("pushes", "applies", "bytes_out", "bytes_in", "rejected"):
            self._counters[key] += getattr(stats, key)
        moved = {k: self.comm.bytes[k] - self._bytes_seen[k] for k in ("scatter", "gather")}
        self._bytes_seen = Counter(self.comm.bytes)
        self.client.steplog.emit(
            step=self.local_step, boundary_s=time.perf_counter() - t0, export_s=stats.export_s,
            apply_s=stats.apply_s, pushes=stats.pushes, applies=stats.applies, bytes_out=stats.bytes_out,
            bytes_in=stats.bytes_in, scatter_bytes=moved["scatter"], gather_bytes=moved["gather"],
            versions=self.state.versions() if versions is None else versions,
            pending_pulls=self.book.pending(), rejected=rejected, loss=loss, extra=extra)


__all__ = ["Island", "LockstepTimeout"]
