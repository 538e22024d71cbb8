"""The sync rank's boundary as a pure state machine (docs/design.md §3.9, §5.2): no I/O, no clock, no
torch.distributed.

Owns `Boundary`: what happens at a step boundary and before the first step, and in which order (its doc
has the protocol and the rules). It holds the island's `SyncState` and `PullBook`; `Island`
(learner/island.py) is the shell that feeds it events and carries out the operations it returns
(learner/boundary_ops.py) with `IslandWire`, `RankOps` and `IslandClient`.
Invariants: broadcasts are applied before pulls are answered; one push per fragment at a time; a
manifest finalizes only once FINAL backs it; time comes only from the events' `now`, so a test drives it
by hand; a broken protocol (an event fed out of turn) is a `ProtocolError`, never a WireError.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Generator, Iterable, Mapping

from yeto.schemas.errors import WireError

from .boundary_ops import (Ack, Begin, BeginFinal, BroadcastsRead, CheckHealth, Commit, End, Fail, FinalRead,
                           FinalShared, Log, Progress, Push, ReadBroadcasts, ReadControl, ReadFinal, Reap, StepDone,
                           StepLog, StreamInit, TakePulls, VerifyManifest, VersionComplete, Wait)
from .sync_state import ProtocolError, SyncState
from .pulls import PendingPull, PullBook, due_round, max_due_step


class LockstepTimeout(TimeoutError):
    pass


class Phase(Enum):
    SETUP = "setup"  # Begin not fed yet
    STARTING = "starting"  # INIT, the initial cut
    TRAINING = "training"  # between boundaries
    BOUNDARY = "boundary"  # inside a boundary
    BLOCKED = "blocked"  # lockstep: waiting for the due round's pull or broadcast
    FINALIZING = "finalizing"  # installing the final cut
    AWAIT_SHUTDOWN = "await_shutdown"  # final cut acknowledged, waiting for the syncer's shutdown
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class Rules:
    """What the machine needs of the session and the island's configuration."""

    island: str
    gen: str
    fragments: tuple[int, ...]
    sync_every: int
    alpha: float
    init_island: bool
    lockstep: bool = False
    lockstep_timeout_s: float = 600.0
    init_v0_timeout_s: float = 600.0
    initial_cut_timeout: float = 0.0
    final_timeout_s: float = 600.0
    shutdown_timeout_s: float = 60.0
    # After the final ack, re-send it this often until the shutdown comes: a syncer killed after our
    # ack but before it recorded it would, once resumed, wait for it until its final timeout.
    ack_resend_s: float = 5.0

    @classmethod
    def of(cls, session: Mapping, config, gen: str, **over) -> "Rules":
        """From the session record and an IslandConfig."""
        kw = dict(island=config.island, gen=gen, fragments=tuple(sorted(f["id"] for f in session["fragments"])),
                  sync_every=session["sync_every"], alpha=config.alpha,
                  init_island=session["init_island"] == config.island, lockstep=config.lockstep,
                  lockstep_timeout_s=config.lockstep_timeout_s, init_v0_timeout_s=config.init_v0_timeout_s,
                  initial_cut_timeout=config.initial_cut_timeout, final_timeout_s=config.final_timeout_s,
                  shutdown_timeout_s=config.shutdown_timeout_s)
        kw.update(over)
        return cls(**kw)


Script = Generator[object, object, None]


class Boundary:
    """The boundary machine. `state` (SyncState) and `book` (PullBook) are its own.

    Protocol. `feed(event)` returns a list of operations (learner/boundary_ops.py). All but possibly the
    last are acts the shell just carries out (commit a version, send an ack, emit the step-log event, log
    a line); a last operation that is a *request* (ReadControl, ReadBroadcasts, TakePulls, Reap, Push,
    VerifyManifest, ReadFinal, Wait) asks for input, and the machine does nothing else until the shell feeds
    the matching answer (Control, BroadcastsRead, Pulls, Pushes, PushHanded, ManifestChecked, FinalRead,
    Tick). A list that ends with `End` closes what the shell started (Begin, StepDone, FinalShared); `Fail`
    carries the exception the shell must raise. While the shell carries out ReadBroadcasts or ReadFinal it
    feeds `VersionComplete` for each version whose digest matched and gets back the `Commit` to run on every
    rank before it reads on. Every answer carries `now` (the shell's monotonic clock): deadlines, step times
    and the manifest's patience are computed from it. Inside, what an event starts runs as a generator that
    yields its requests, so the rules below read top to bottom in the order they apply; `phase` names where
    it stands.

    The rules, in the order a boundary applies them:
    * count the step (every fragment's steps and tokens since its anchor), step time (EMA of `now`s);
    * control messages: a manifest (or the run's final record) is offered, checked to name only the
      session's fragments, and finalizes only once FINAL's chunk 0 headers back it (a manifest still
      unbacked after `final_timeout_s` is dropped and counted); a shutdown stops the island;
    * apply the broadcasts that arrived, *before* answering pulls: the first version of a fragment
      overwrites, later ones blend; each applied version supersedes the pulls of older rounds of its
      fragment (`PullBook.committed`);
    * take the pulls that arrived (the book keeps the newest attempt per round and one copy of each);
    * lockstep: at the boundary of local step t·H/P block until round t's pull is held, answer it, and
      block until a version of its fragment newer than the pull's base is applied (each block up to
      `lockstep_timeout_s`, then `LockstepTimeout`); a manifest or shutdown ends the block;
    * answer ready pulls (a version held and a local step since; one push per fragment at a time; none
      while disconnected): report pushes whose acks are all in (sent) or that failed (pending again, next
      try), then push each ready pull;
    * a verified manifest: install its f32 versions from FINAL (overwrite, up to `final_timeout_s`) and
      stop; after the shell shared that every rank holds it (`FinalShared`): ack, re-send the ack every
      `ack_resend_s` until the shutdown comes (up to `shutdown_timeout_s`) — unless the run had already
      finished (final record), when nobody is left to answer;
    * emit the step-log event.

    Before the first step (`Begin`): a run that already finished skips everything (its final cut is
    installed at the first boundary); the INIT island streams INIT unless versions were committed already;
    then lockstep waits for the whole cut (`lockstep_timeout_s`, else `LockstepTimeout`), the INIT island
    for up to `init_v0_timeout_s`, others for `initial_cut_timeout` (0: not at all).
    """

    def __init__(self, session: Mapping, rules: Rules):
        self.rules = rules
        self.state = SyncState(session, rules.island, rules.gen, rules.alpha)
        self.book = PullBook(rules.island, rules.gen, fragments=len(rules.fragments))
        self.phase = Phase.SETUP
        self.counters: Counter[str] = Counter()
        self.now = 0.0
        self.local_step = 0
        self.step_time_s: float | None = None
        self.manifest: dict | None = None  # verified (backed by the final cut): finalize now
        self.offered: tuple[dict, float] | None = None  # a manifest not verified yet, and since when
        self.shutdown: dict | None = None
        self.run_finished = False  # the run's final record was seen
        self.pushing: dict[int, PendingPull] = {}  # fragment -> push awaiting its acks
        self.seen_rounds: dict[tuple[int, int], int] = {}  # lockstep: (fragment, step) -> base_version
        self._last_t: float | None = None
        self._script: Script | None = None
        self._awaiting: type | None = None
        self._out: list = []
        self._final = False  # completions now are the final cut's
        self._b: Counter[str] = Counter()  # pushes, applies, bytes_out, rejected since the last step-log event

    # ---- the protocol ---------------------------------------------------------------------------

    def feed(self, event) -> list:
        """One event in, the operations it leads to out (see the module doc)."""
        if isinstance(event, VersionComplete):
            if self._awaiting not in (BroadcastsRead, FinalRead):
                raise ProtocolError("a version completed outside a reading", field="event", value=event)
            return [self._complete(event)]
        self._out = []
        if isinstance(event, (Begin, StepDone, FinalShared)):
            if self._script is not None:
                raise ProtocolError(f"{type(event).__name__} fed while awaiting {self._awaiting.__name__}",
                                    field="event", value=type(event).__name__)
            if isinstance(event, StepDone) and (isinstance(event.tokens, bool) or not isinstance(event.tokens, int)
                                                or event.tokens < 0):
                raise ValueError(f"tokens must be a non-negative integer, not {event.tokens!r}")  # the trainer's
            self.now = event.now
            script = {Begin: self._start, StepDone: self._boundary, FinalShared: self._ack_and_wait}[type(event)]
            self._script = script(event)
            return self._run(None)
        if self._awaiting is None or not isinstance(event, self._awaiting):
            raise ProtocolError(f"{type(event).__name__} fed while awaiting "
                                f"{getattr(self._awaiting, '__name__', 'nothing')}", field="event",
                                value=type(event).__name__)
        if getattr(event, "now", None) is not None:
            self.now = event.now
        return self._run(event)

    def _run(self, answer) -> list:
        try:
            request = self._script.send(answer)
        except StopIteration:
            self._script, self._awaiting = None, None
            if self.phase not in (Phase.STOPPED, Phase.FAILED):
                self.phase = Phase.TRAINING
            return self._out
        except (LockstepTimeout, TimeoutError, ProtocolError) as exc:
            self._script, self._awaiting = None, None
            self.phase = Phase.FAILED
            self._out.append(Fail(exc))
            return self._out
        self._awaiting = request.answer
        self._out.append(request)
        return self._out

    def _emit(self, op) -> None:
        self._out.append(op)

    # ---- start ----------------------------------------------------------------------------------

    def _start(self, ev: Begin) -> Script:
        r = self.rules
        self.phase = Phase.STARTING
        if ev.final_error is not None:
            self._reject("final record in the state KV", ev.final_error)
        if ev.final_record is not None:
            self._emit(Log("warning", f"island {r.island}: run already finished at step "
                                      f"{ev.final_record['final_step']} (the syncer has exited): the final cut is "
                                      f"installed at the first boundary, then the island stops"))
            self._offer_final(ev.final_record)
            self._emit(End({"gen": r.gen, "installed": [], "stop": False,
                            "run_finished": ev.final_record["final_step"]}))
            return
        if r.init_island:
            if not ev.committed:
                self._emit(StreamInit())
            else:
                self._emit(Log("warning", f"island {r.island}: the run already has committed versions: INIT skipped"))
        if r.lockstep:
            installed = yield from self._initial_cut(r.lockstep_timeout_s, strict=True)
        elif r.init_island:
            installed = yield from self._initial_cut(r.init_v0_timeout_s, strict=False)
        elif r.initial_cut_timeout > 0:
            installed = yield from self._initial_cut(r.initial_cut_timeout, strict=False)
        else:
            installed = []
        self._emit(End({"gen": r.gen, "installed": sorted(installed), "stop": False}))

    def _missing(self) -> list[int]:
        return [f for f in self.rules.fragments if self.state.version(f) is None]

    def _initial_cut(self, timeout: float, *, strict: bool) -> Script:
        """Install each fragment's first version as it lands, until every fragment has one or
        `timeout` passes (strict: then fail)."""
        t0, installed = self.now, []
        while self._missing():
            self._emit(CheckHealth())
            ev = yield ReadBroadcasts()
            installed += ev.applied
            if not self._missing():
                break
            if self.now - t0 >= timeout:
                what = f"fragments {self._missing()} have no version after {timeout:.0f}s"
                if strict:
                    raise LockstepTimeout(f"island {self.rules.island}: {what}")
                self._emit(Log("warning", f"island {self.rules.island}: {what}; they will be installed at a step "
                                          f"boundary"))
                break
            if not ev.applied:
                yield Wait("the initial cut", t0 + timeout, ("bcast",))
        return installed

    # ---- a boundary -----------------------------------------------------------------------------

    def _boundary(self, ev: StepDone) -> Script:
        self.phase = Phase.BOUNDARY
        self.local_step += 1
        if self._last_t is not None:
            dt = ev.now - self._last_t
            self.step_time_s = dt if self.step_time_s is None else 0.9 * self.step_time_s + 0.1 * dt
        self._last_t = ev.now
        self._emit(Progress(self.local_step, self.step_time_s))
        self.state.note_step(ev.tokens)
        yield from self._read_control()  # health first
        if self._live():
            yield from self._read_broadcasts()
            yield from self._take_pulls()
            if self.rules.lockstep:
                yield from self._lockstep()
            if self._live():
                yield from self._answer_pulls()
        extra = None
        if self.manifest is not None:
            m = self.manifest
            yield from self._install_final()
            dec = {"final": m["final_step"], "stop": True, "after_run": self.run_finished}
            versions = {str(k): v for k, v in m["versions"].items()}
            if self.run_finished:
                extra = {"final_after_run": True, "final_step": m["final_step"]}
                self._emit(Log("warning", f"island {self.rules.island}: the run had finished (the syncer has exited): "
                                          f"final cut of step {m['final_step']} installed, stopping without an ack"))
        else:
            dec = {"final": None, "stop": self.shutdown is not None}
            versions = self.state.versions()
            if self.shutdown is not None:
                self._emit(Log("warning", f"island {self.rules.island}: shutdown from the syncer: "
                                          f"{self.shutdown['reason']}"))
        b = self._b
        self._emit(StepLog(step=self.local_step, versions=versions, pending_pulls=self.book.pending(),
                           pushes=b["pushes"], applies=b["applies"], bytes_out=b["bytes_out"],
                           rejected=b["rejected"], loss=ev.loss, extra=extra))
        for key in ("pushes", "applies", "bytes_out", "rejected"):
            self.counters[key] += b[key]  # the key is there from the first event on, 0 or not
        self._b = Counter()  # rejections between boundaries (start, the ack wait) go into the next event
        if dec["stop"] and dec["final"] is None:
            self.phase = Phase.STOPPED
        self._emit(End(dec))

    def _live(self) -> bool:
        return self.manifest is None and self.shutdown is None

    # control

    def _read_control(self, *, health: bool = True) -> Script:
        ev = yield ReadControl(health)
        for kind, msg in ev.messages:
            if kind == "final":
                self._offer_final(msg)
            elif kind == "manifest":
                self._offer(msg, f"manifest for final step {msg.get('final_step')}")
            elif kind == "shutdown":
                self.shutdown = msg
            elif kind == "error":  # fatal ones already stopped the shell (health check)
                self.counters["syncer_errors"] += 1
        if self.manifest is None and self.offered is not None:
            yield from self._verify_manifest()

    def _offer(self, msg: dict, what: str) -> None:
        unknown = sorted(int(k) for k in msg["versions"] if int(k) not in self.rules.fragments)
        if unknown:
            self._reject(what, WireError("manifest names fragments the session does not have",
                                             field="versions", value=unknown))
            return
        cur = self.offered
        if self.manifest is None and (cur is None or msg["final_step"] > cur[0]["final_step"]):
            self.offered = (msg, self.now)

    def _offer_final(self, msg: dict) -> None:
        """The run's final record: the run is over. Offered like a manifest (verified against FINAL)."""
        self.run_finished = True
        self._offer(msg, f"final record for final step {msg.get('final_step')}")

    def _verify_manifest(self) -> Script:
        """Finalize only once the manifest is backed by the final cut: the syncer publishes FINAL
        before any manifest, so chunk 0 of every fragment it names already carries its version,
        digest and final step. Until then the island trains on; a manifest still unbacked after
        `final_timeout_s` (forged: without server permissions anyone may publish one) is dropped and counted."""
        msg, since = self.offered
        want = sorted((int(k), v) for k, v in msg["versions"].items())
        ev = yield VerifyManifest([fid for fid, _ in want])
        backed = ev.heads is not None and all(
            meta is not None and (meta.get("version"), meta.get("version_digest"), meta.get("final_step"))
            == (v, msg["version_digests"][str(fid)], msg["final_step"])
            for (fid, v), meta in zip(want, ev.heads))
        if backed:
            self.manifest, self.offered = msg, None
            self._emit(Log("warning", f"island {self.rules.island}: manifest for final step {msg['final_step']}: "
                                      f"finalizing"))
        elif self.now - since > self.rules.final_timeout_s:
            self.offered = None
            self._reject(f"manifest for final step {msg['final_step']}", WireError(
                f"no final cut on FINAL matches it after {self.rules.final_timeout_s:.0f}s", field="versions",
                value=msg["versions"], code="manifest_unbacked"))

    def _reject(self, what: str, exc: Exception) -> None:
        self._b["rejected"] += 1
        self.counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        self._emit(Log("warning", f"island {self.rules.island}: rejected {what}: {exc}"))

    # broadcasts

    def _read_broadcasts(self) -> Script:
        ev = yield ReadBroadcasts()
        return ev.applied

    def _complete(self, ev: VersionComplete) -> Commit:
        """A version read whole, digest matched: how every rank commits it."""
        if self._final:
            self._b["applies"] += 1
            return Commit(ev.fragment, ev.version, ev.digest, "final")
        mode = self.state.installed(ev.fragment, ev.version, ev.digest)
        self.book.committed(ev.fragment, ev.version)
        if self.phase == Phase.STARTING:
            self.counters["applies"] += 1
        else:
            self._b["applies"] += 1
        return Commit(ev.fragment, ev.version, ev.digest, mode)

    # pulls

    def _take_pulls(self) -> Script:
        ev = yield TakePulls()
        for p in ev.pulls:
            try:
                self.book.offer(p)
            except WireError as exc:
                self._reject(f"pull {p.get('fragment')}/{p.get('step')}", exc)
                continue
            if self.rules.lockstep:
                key = (p["fragment"], p["step"])
                self.seen_rounds[key] = max(self.seen_rounds.get(key, -1), p["base_version"])

    def _answer_pulls(self) -> Script:
        ev = yield Reap()
        self._settle(ev.settled)
        if not ev.connected:
            return  # pulls stay pending (no try is spent): answered at a later boundary
        r = self.rules
        max_step = max_due_step(self.local_step, r.sync_every, len(r.fragments)) if r.lockstep else None
        # One push per fragment at a time: a push still awaiting its acks keeps its fragment's next
        # pull waiting, so q4's working residual and the try numbers stay one per push.
        ready = lambda fid: self.state.ready(fid) and fid not in self.pushing  # noqa: E731
        for p in self.book.take_ready(ready, max_step=max_step):
            st = self.state.states[p.fragment]
            ev = yield Push(p, base_version=st.version, local_step=self.local_step, c_steps=st.c_steps,
                            c_tokens=st.c_tokens)
            if ev.error is not None:
                self._push_failed(p, ev.error)
                continue
            self.pushing[p.fragment] = p
            ev = yield Reap()
            self._settle(ev.settled)

    def _settle(self, settled: Iterable) -> None:
        """Pushes whose acks all arrived (sent) or that failed (pending again, next try + 1)."""
        for p, nbytes, error in settled:
            self.pushing.pop(p.fragment, None)
            if error is not None:
                self._push_failed(p, error)
                continue
            self.book.sent(p.fragment, p.step, p.attempt, p.try_)
            self._b["pushes"] += 1
            self._b["bytes_out"] += nbytes

    def _push_failed(self, p: PendingPull, error: str) -> None:
        self.book.failed(p.fragment, p.step, p.attempt, p.try_)
        self.counters["push_failed"] += 1
        self._emit(Log("warning", f"island {self.rules.island}: push of fragment {p.fragment} round {p.step} "
                                  f"(attempt {p.attempt}, try {p.try_}) failed: {error}; retried at a later boundary"))

    # lockstep

    def _lockstep(self) -> Script:
        r = self.rules
        due = due_round(self.local_step, r.sync_every, len(r.fragments))
        if due is None:
            return
        fid = (due - 1) % len(r.fragments)
        if not (yield from self._block(lambda: (fid, due) in self.seen_rounds, f"the pull of round {due}")):
            return
        yield from self._answer_pulls()
        base = self.seen_rounds[(fid, due)]
        held = lambda: -1 if self.state.version(fid) is None else self.state.version(fid)  # noqa: E731
        yield from self._block(lambda: held() > base, f"the broadcast of round {due} (fragment {fid} newer than v{base})")
        for key in [k for k in self.seen_rounds if k[1] <= due]:
            del self.seen_rounds[key]

    def _block(self, done, what: str) -> Script:
        """Until `done()`; False when a manifest or shutdown arrived instead (finalize now)."""
        self.phase = Phase.BLOCKED
        deadline = self.now + self.rules.lockstep_timeout_s
        try:
            while not done():
                yield from self._read_control()
                if not self._live():
                    return False
                if self.now > deadline:
                    raise LockstepTimeout(f"island {self.rules.island} (lockstep, local step {self.local_step}): "
                                          f"{what} did not come within {self.rules.lockstep_timeout_s:.0f}s")
                applied = yield from self._read_broadcasts()
                yield from self._take_pulls()
                yield from self._answer_pulls()  # a restarted attempt of a round is answered while blocked
                if not applied:
                    yield Wait(what, deadline, ("control", "bcast", "pulls", "pushes"))
            return True
        finally:
            self.phase = Phase.BOUNDARY

    # the final cut

    def _install_final(self) -> Script:
        """The manifest's exact f32 versions from FINAL (any arrival order), without blending."""
        self.phase = Phase.FINALIZING
        m = self.manifest
        want = {int(k): (v, m["version_digests"][k]) for k, v in m["versions"].items()}
        missing = sorted(set(self.rules.fragments) - set(want))
        if missing:
            self._emit(Log("warning", f"island {self.rules.island}: the manifest leaves fragments {missing} out: "
                                      f"they keep their values"))
        self._emit(BeginFinal(m["final_step"], want))
        deadline = self.now + self.rules.final_timeout_s
        got: set[int] = set()
        self._final = True
        try:
            while len(got) < len(want):
                self._emit(CheckHealth())
                ev = yield ReadFinal()
                got.update(ev.completed)
                if len(got) < len(want):
                    if self.now > deadline:
                        raise TimeoutError(f"island {self.rules.island}: final cut incomplete after "
                                           f"{self.rules.final_timeout_s:.0f}s: fragments "
                                           f"{sorted(set(want) - got)} missing")
                    if not ev.progressed:
                        yield Wait("the final cut", deadline, ("final",))
        finally:
            self._final = False
        self._emit(Log("warning", f"island {self.rules.island}: final cut of step {m['final_step']} installed "
                                  f"({len(got)} fragments)"))

    def _ack_and_wait(self, ev: FinalShared) -> Script:
        """Every rank holds the final cut: ack it, then wait for the syncer's shutdown."""
        r = self.rules
        final_step = self.manifest["final_step"]
        self.phase = Phase.AWAIT_SHUTDOWN
        self._emit(Ack(final_step, 0))
        deadline, resend_at, resends = self.now + r.shutdown_timeout_s, self.now + r.ack_resend_s, 0
        while self.shutdown is None:
            yield from self._read_control(health=False)
            if self.shutdown is not None:
                break
            if self.run_finished:
                self._emit(Log("warning", f"island {r.island}: the syncer has exited (final record): not waiting "
                                          f"for a shutdown"))
                break
            if self.now >= resend_at:
                resends += 1  # the syncer ignores duplicates
                self._emit(Ack(final_step, resends))
                resend_at = self.now + r.ack_resend_s
            if self.now > deadline:
                self._emit(Log("warning", f"island {r.island}: no shutdown from the syncer within "
                                          f"{r.shutdown_timeout_s:.0f}s after the final ack; stopping anyway"))
                break
            yield Wait("the shutdown", min(deadline, resend_at), ("control",))
        if self.shutdown is not None:
            self._emit(Log("warning", f"island {r.island}: shutdown: {self.shutdown['reason']}"))
        self.phase = Phase.STOPPED
        self._emit(End({"stop": True}))


__all__ = ["Boundary", "LockstepTimeout", "Phase", "Rules"]
