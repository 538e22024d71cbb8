"""The island's sync core (docs/design.md §3.9, §5, §6): `Island`, what a training loop calls on every rank of
the island — start-up (layout, hello, session, INIT, initial cut) and the step boundary.

    island = Island(adapter, IslandConfig.from_env(), group=group).start()   # group None: one process
    while island.boundary(tokens=n_tokens, loss=loss):   # after every optimizer step, on every rank
        ... one training step ...
    island.close()

Owns the shell around the pure `boundary.Boundary` machine (which decides what happens at a boundary and
in which order): it feeds it events (a step done, what the inboxes hold, a version read whole, the time)
and carries out the operations it returns with the parts that do I/O: `island_wire.IslandWire` (the
wire), `client.IslandClient` (the NATS thread), `island_ranks.RankOps` (each rank's share of a step).
Invariants: rank 0 of `group` (the sync rank) does all NATS I/O and all deciding and announces every step
the others run; rank 0 holds at most one fetch batch or a few export chunks, never a fragment; bad input
is counted (`rejected`) and training goes on; a version is installed whole or not at all.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from typing import Callable

import torch.distributed as dist

from yeto.schemas import outer_mode as OM
from yeto.schemas.errors import WireError
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.versions import software

from . import boundary_ops as O, sigterm
from .adapters import ModelAdapter
from .anchors import AnchorStore
from .background import SyncWorker
from .boundary import Boundary, LockstepTimeout, Rules
from .client import IslandClient
from .config import IslandConfig
from .errors import IslandUnhealthy
from .cut_reader import CutReader
from .sync_state import SyncState
from .island_modes import background_mode
from .island_ranks import RankOps
from .island_wire import IslandWire
from .progress import progress_bar
from .layout_map import IslandLayout, describe
from .pulls import PullBook
from .piece_io import Comm
from .rank_ops import CommitOp, EndOp, ErrorOp, ExportOp, RankOp, SessionOp
from .stager import STOP, Stager, can_stage_apart, open_staging
from .waiting import POLL_S, wait_until

# After the final ack, re-send it this often until the shutdown comes (see boundary.Rules).
ACK_RESEND_S = 5.0

log = logging.getLogger("yeto.island")


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


class Island:
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
        self.machine: Boundary | None = None  # sync rank: what to do, and when
        self.wire: IslandWire | None = None  # sync rank: reading cuts, exporting
        self.worker: SyncWorker | None = None  # reads cuts and sends pushes off the training thread
        # Several ranks: the staging group, its operations and (ranks but 0) the thread that runs them
        # while the ranks train (learner/stager.py); None where the worker defers staging to the boundary.
        self.staging: Comm | None = None
        self.staging_ops: RankOps | None = None
        self.stager: Stager | None = None
        self._staging_open = False
        self._rank_state: SyncState | None = None  # the other ranks' view of the versions installed
        self.local_step = 0
        self.should_stop = False
        self.finalized = False  # the final cut is installed (and acknowledged, unless run_finished)
        self.run_finished = False  # the run had finished (syncer exited) when this island finalized
        self.final_step: int | None = None
        self._rejected_seen = 0
        self._bytes_seen: Counter[str] = Counter()
        self._busy_seen = 0.0  # the sync worker's busy seconds already reported (step log extra.background_s)
        self._t0 = 0.0  # when the boundary being carried out began (perf_counter)
        self._bar = None  # the progress bar of the cut being installed (initial, final)
        self._started = False
        self._closed = False

    # ---- public -----------------------------------------------------------------------------------

    def start(self) -> "Island":
        """Gather the layout, connect, check the run, say hello, wait for the session, stream INIT
        (INIT island only), install the initial cut (see the module doc). Collective over `group`."""
        if self._started:
            return self
        # Every rank's pieces, once: rank 0 announces the union, every rank maps fragments with it.
        self.layout = IslandLayout(self.comm.all_gather(describe(self.adapter.pieces())))
        dec = self._lead_or_follow(self._start_sync_rank)
        self.gen = dec["gen"]
        if dec.get("run_finished") is not None:
            self.run_finished = True  # the first boundary installs the final cut and returns False
        self._bytes_seen = Counter(self.comm.bytes)  # the step log counts per step from here
        self._started = True
        if self.sync_rank:
            sigterm.say_then_die(self._say_leaving)
        return self

    def boundary(self, tokens: int | None = None, loss: float | None = None, *, step_tokens: int | None = None) -> bool:
        """Call after every optimizer step, on every rank. Returns True to keep training, False once
        the island must stop (final cut installed and acknowledged, or a shutdown)."""
        if tokens is None:
            tokens = step_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative integer, not {tokens!r}")  # the trainer's count
        if not self._started:
            raise RuntimeError("Island.start() must be called before the first boundary")
        if self.should_stop:
            return False
        self.local_step += 1
        dec = self._lead_or_follow(lambda: self._drive(O.StepDone(tokens, loss, time.monotonic())))
        if dec.get("final") is not None:
            # Every rank holds the final cut now: only then may the syncer hear it is installed.
            self.final_step = dec["final"]
            if dec.get("after_run"):
                self.run_finished = True  # the syncer has exited: nobody to acknowledge to
            elif self.sync_rank:
                self._drive(O.FinalShared(time.monotonic()))
            self.finalized = True
        if dec["stop"]:
            self.should_stop = True
        return not dec["stop"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._say_leaving()   # first: the worker may still be handing a push over for a while
        self._stop_worker()
        if self.stager is not None and not self.stager.join(10.0):
            log.warning("island %s rank %d: the staging thread did not end (rank 0 never said stop)",
                        self.config.island, self.rank)
        if self.client is not None:
            self.client.close()
        self.store.close()

    def _say_leaving(self) -> None:
        """Stopping before the run ends (SIGTERM, close() before the final cut, an error): the syncer hears it
        now (learner/sigterm.py, client.say_leaving) instead of at its member timeout."""
        if self.client is not None and self._started and not self.finalized and not self.run_finished:
            self.client.say_leaving()

    def __enter__(self) -> "Island":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def state(self) -> SyncState | None:
        """The versions this island holds (and the steps and tokens since)."""
        return self.machine.state if self.machine is not None else self._rank_state

    @property
    def book(self) -> PullBook | None:
        """Sync rank: the pulls this island owes."""
        return None if self.machine is None else self.machine.book

    @property
    def reader(self) -> CutReader | None:
        """Sync rank: the BCAST reader."""
        return None if self.wire is None else self.wire.reader

    @property
    def counters(self) -> Counter:
        """Totals since start: pushes, applies, bytes (incl. scatter_bytes / gather_bytes moved by rank
        0 to and from the other ranks), rejected, retries, pull-book and reader dispositions
        (prefixed pull. / bcast.), step-log drops."""
        c: Counter[str] = Counter()
        c["scatter_bytes"] = self.comm.bytes["scatter"]
        c["gather_bytes"] = self.comm.bytes["gather"]
        if self.machine is not None:
            c.update(self.machine.counters)
            c.update({f"pull.{k}": v for k, v in self.machine.book.counters.items()})
        if self.wire is not None:
            c.update(self.wire.counters_now())
        if self.client is not None:
            c.update(self.client.counters)
            c["steplog_dropped"] = self.client.steplog.dropped
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
                    self.comm.share(ErrorOp(f"{type(exc).__name__}: {exc}"))
                except Exception:  # the group itself may be what failed
                    pass
            raise
        self.comm.share(EndOp(dec))
        return dec

    def _follow(self) -> dict:
        while True:
            op = self.comm.share(None)
            if isinstance(op, EndOp):
                self.comm.settle()
                return op.decision
            if isinstance(op, ErrorOp):
                raise IslandUnhealthy(f"sync rank failed: {op.error}")
            if isinstance(op, SessionOp):
                self._setup(op)
                continue
            out = self.ops.run(op)
            if isinstance(op, ExportOp):
                for _ in out:
                    pass
            elif isinstance(op, CommitOp) and op.mode != "final":
                self._rank_state.installed(op.fid, op.version, op.digest)
            self.comm.settle()   # ran: the staging group's operations stamped after it may run

    def _lead(self, op: RankOp, payloads=None):
        """Announce one collective step and run rank 0's part of it."""
        self.comm.share(op)
        return self.ops.run(op, payloads)

    def _lead_staging(self, op: RankOp, payloads=None):
        """The worker's `_lead` for stage and abort operations: on the staging group."""
        self.staging.share(op)
        return self.staging_ops.run(op, payloads)

    def _setup(self, op: SessionOp) -> None:
        """Every rank: the session's fragments over the island layout, and the version bookkeeping."""
        session = op.session
        self.session = session
        self.frags = {f["id"]: f for f in session["fragments"]}
        self.ops = RankOps(self.adapter, self.comm, self.layout, session, self.store, op.alpha)
        if op.stage_apart:
            self.staging, _ = open_staging(self.comm)
            self.staging_ops = self.ops.over(self.staging)
            self._staging_open = True
            if not self.sync_rank:
                self.stager = Stager(self.staging, self.staging_ops.run,
                                     name=f"yeto-stage-{self.config.island}-{self.rank}")
        if not self.sync_rank:
            self._rank_state = SyncState(session, self.config.island, op.gen, op.alpha)

    # ---- start ------------------------------------------------------------------------------------

    def _start_sync_rank(self) -> dict:
        cfg, c = self.config, self.client
        c.start()
        layout = self.layout.layout()
        fp = layout_fingerprint(layout)
        world = cfg.world or _world_of(self.layout, self.world)
        c.provision({"layout": layout, "layout_fingerprint": fp, "push_dtype": cfg.push_dtype,
                     "bulk_dtype": cfg.bulk_dtype, "world": world, "host": cfg.host, "software": software()})
        session = c.wait_session()
        self._check_session(session, fp)
        op = SessionOp(session, c.gen, cfg.alpha,
                       bool(cfg.background and cfg.staging_group and can_stage_apart(self.group)))
        self.comm.share(op)
        self._setup(op)
        rules = Rules.of(session, cfg, c.gen, ack_resend_s=ACK_RESEND_S)
        self.machine = Boundary(session, rules)
        self.wire = IslandWire(client=c, config=cfg, session=session, gen=c.gen, ops=self.ops, lead=self._lead)
        log.info("island %s (gen %s, %d ranks): session %s… with %d fragments, push %s, bulk %s, H=%d, INIT island %s",
                 cfg.island, c.gen, self.world, session["session_fingerprint"][:12], len(self.frags),
                 session["push_dtype"], session["bulk_dtype"], session["sync_every"], session["init_island"])
        final = final_error = None
        try:
            final = c.final_record()
        except WireError as exc:
            final_error = exc
        # Only an unsharded syncer's `commit` key counts: with syncer shards (commit.<K>) one shard may have
        # committed version 0 while another still needs INIT, and islands do not know how many shards
        # there are, so a restarted INIT island sends INIT again (shards past version 0 drop it as late).
        committed = rules.init_island and final is None and c.state_key("commit") is not None
        if final is None and (cfg.lockstep or rules.init_island or cfg.initial_cut_timeout > 0):
            self._bar = progress_bar(len(self.frags), f"cut {cfg.island}", cfg.progress, unit="frag")
        dec = self._drive(O.Begin(time.monotonic(), final, final_error, committed))
        self.wire.take_stats()  # counted; the first step-log event counts from the first step
        if cfg.background and final is None and not dec.get("stop"):
            # From the first step on, pushes are sent and cuts read off the training thread
            # (learner/background.py); with several ranks the worker stages on the staging group
            # (learner/stager.py), or without one keeps the staging for the installing boundary
            # (StageDeferred: learner/island_modes.py picks the mode).
            # `pack` is looked up at each push: the demo's fault injector (learner/demo.py) replaces it later
            mode = functools.partial(
                background_mode, lead=self._lead, stage_lead=self._lead_staging if self.staging is not None else None,
                world=self.world, push_dtype=session["push_dtype"], pack=lambda op, values: self.ops.pack(op, values),
                publish=self.wire.publish)
            self.worker = SyncWorker(self.wire, mode, name=f"yeto-sync-{cfg.island}")
        return dec

    def _check_session(self, session: dict, fp: str) -> None:
        cfg = self.config
        if session["layout_fingerprint"] != fp:
            raise IslandUnhealthy(f"island {cfg.island}: this model's layout fingerprint {fp[:12]}… differs from the "
                                  f"session's {session['layout_fingerprint'][:12]}… (another model, or other "
                                  f"trainable parameters, than the INIT island {session['init_island']})")
        try:   # the outer mode the syncer pinned (absent: dense); a pin this release cannot follow stops here
            OM.from_session(session)
        except WireError as exc:
            raise IslandUnhealthy(f"island {cfg.island}: cannot follow the session's outer mode: {exc}") from None
        for name in ("push_dtype", "bulk_dtype"):
            want = getattr(cfg, name)
            if want != "auto" and want != session[name]:
                raise IslandUnhealthy(f"island {cfg.island}: configured {name}={want} but the session uses "
                                      f"{session[name]} (set it to auto or match the syncer)")

    # ---- carrying out the machine's operations (sync rank) ---------------------------------------

    def _drive(self, event) -> dict:
        """Feed `event` and carry out what follows until the machine says End; its decision."""
        self._t0 = time.perf_counter()
        ops = self.machine.feed(event)
        try:
            while True:
                answer = None
                for op in ops:
                    if isinstance(op, O.End):
                        return op.decision
                    if isinstance(op, O.Fail):
                        raise op.error
                    answer = self._carry_out(op)
                if answer is None:
                    raise RuntimeError(f"the boundary machine stopped without End: {ops!r}")
                ops = self.machine.feed(answer)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _carry_out(self, op):
        """One operation; a request's answer (an event), else None."""
        c, w = self.client, self.wire
        now = time.monotonic
        match op:
            case O.Progress():
                c.progress(op.local_step, op.step_time_s)
            case O.CheckHealth():
                c.check_health()
            case O.Log():
                getattr(log, op.level)("%s", op.text)
            case O.StreamInit():
                w.stream_init()
            case O.ReadControl():
                if op.health:
                    c.check_health()
                return O.Control(c.control.drain(), now())
            case O.VerifyManifest():
                return O.ManifestChecked(w.final_heads(op.fragments))
            case O.ReadBroadcasts():
                t = time.perf_counter()
                if self.worker is not None:
                    applied = self.worker.take_ready(self._commit)
                else:
                    applied = w.read_broadcasts(self._commit)
                w.add_time(apply_s=time.perf_counter() - t)
                return O.BroadcastsRead(applied, now())
            case O.TakePulls():
                return O.Pulls(c.pulls.drain())
            case O.Reap():
                return O.Pushes(w.reap(), c.connected)
            case O.Push():
                t = time.perf_counter()
                error = w.push(op)
                w.add_time(export_s=time.perf_counter() - t)
                return O.PushHanded(error)
            case O.BeginFinal():
                self._stop_worker()  # the final cut is read here, on the training thread
                w.begin_final(op.final_step, op.want)
                self._bar = progress_bar(len(op.want), f"final {self.config.island}", self.config.progress, unit="frag")
            case O.ReadFinal():
                t = time.perf_counter()
                completed, progressed = w.read_final(self._commit)
                w.add_time(apply_s=time.perf_counter() - t)
                return O.FinalRead(completed, progressed, now())
            case O.Wait():
                wait_until(lambda: w.has_input(op.on), min(op.deadline, now() + POLL_S), arrivals=c.arrivals)
                return O.Tick(now())
            case O.Ack():
                try:
                    c.send_ack(op.final_step, resend=op.resend)
                except Exception as exc:
                    if not op.resend:
                        raise
                    log.warning("island %s: re-sending the final ack failed: %r", self.config.island, exc)
            case O.StepLog():
                self._emit(op)
            case _:
                raise RuntimeError(f"unknown boundary operation {op!r}")
        return None

    def _stop_worker(self) -> None:
        still_sending = False
        if self.worker is not None:
            self.worker.stop()
            still_sending = self.worker.alive
            self.worker = None   # it gave the wire back its training-thread mode
        # Not while the worker may still gather a push on the staging group: two threads of rank 0 on one
        # group would mix their messages. The Stagers are left then (their ranks' close() waits, warns).
        if self.sync_rank and self._staging_open and not still_sending:
            self._staging_open = False   # the Stagers end; later staging runs on the island group
            try:
                self.staging.share(STOP)
            except Exception as exc:   # noqa: BLE001 - a rank gone already: its Stager went with it
                log.warning("island %s: could not tell the ranks' staging threads to stop: %r", self.config.island, exc)

    def _commit(self, fid: int, version: int, digest: str) -> None:
        """A version read whole: the machine says how, every rank installs it."""
        (op,) = self.machine.feed(O.VersionComplete(fid, version, digest))
        self.wire.commit(op)
        if self._bar is not None:
            self._bar.update(1)

    def _emit(self, op: "O.StepLog") -> None:
        stats = self.wire.take_stats()
        client_rejected = self.client.rejected_total()
        rejected = op.rejected + stats.rejected + client_rejected - self._rejected_seen
        self._rejected_seen = client_rejected
        moved = {k: self.comm.bytes[k] - self._bytes_seen[k] for k in ("scatter", "gather")}
        self._bytes_seen = Counter(self.comm.bytes)
        extra = op.extra
        if self.worker is not None:   # the sync work done off the training thread since the last event
            busy = self.worker.busy_s
            extra = {**(extra or {}), "background_s": round(busy - self._busy_seen, 6)}
            self._busy_seen = busy
        self.client.steplog.emit(
            step=op.step, boundary_s=time.perf_counter() - self._t0, export_s=stats.export_s,
            apply_s=stats.apply_s, pushes=op.pushes, applies=op.applies, bytes_out=op.bytes_out,
            bytes_in=stats.bytes_in, scatter_bytes=moved["scatter"], gather_bytes=moved["gather"],
            versions=op.versions, pending_pulls=op.pending_pulls, rejected=rejected, loss=op.loss, extra=extra)


__all__ = ["ACK_RESEND_S", "Island", "LockstepTimeout"]
