"""The syncer's round state machine: pure, deterministic, no I/O, no clock.

The I/O shell (services/syncer/service.py) turns what it reads from NATS into *events*, feeds them to
`RoundMachine.handle(event)` one at a time, and carries out the *actions* it gets back, in order.
Time comes only with events (`now`, seconds; use wall-clock `time.time()` so tape times and the members
KV read sensibly across restarts). A `now` older than one already seen is treated as the newest seen,
so a late event never moves the machine's clock backwards. Every event, whatever its kind, also runs
the time-driven checks (liveness, grace windows, deadlines, pacing, final timeout); `Tick(now)` carries
nothing else. `next_wakeup()` says when the next of those fires, so the shell can sleep until then
(but should still tick every second or so). Given the same events the machine emits the same actions:
no clock, no randomness, and every collection that reaches an action is iterated in sorted (or
arrival) order. The shell records its inputs so `yeto replay` can check exactly that
(services/syncer/recording.py, services/syncer/replay.py).

Lifecycle (`phase`, a `state.Phase`):
  pinning -> init -> committing_v0 -> running -> finalizing -> done

Where it lives: config.py (SyncerConfig, constants), events.py (inputs) and actions.py (outputs), both
with their JSON form; state.py (phase, members, rounds); this module (the machine: restore, handle,
the time-driven checks, pacing, launches, restarts, re-broadcasts) and its parts membership.py
(hellos, session, generations, heartbeats), init_rules.py (INIT, version 0), pushes.py (dispositions,
quarantine, merges), finalize.py (final cut, manifests, acks) and sharding.py (what a machine that is one
of several syncer shards adds: followers mirroring the coordinator's records, per-shard final cuts). The rules of each part are in its
module docstring.

Choices the design leaves open, decided here (the parts' modules decide the rest):
- **Attempts are 1-based, pull `seq` and push `try` 0-based** (as the schemas say).
- **Commit order**: at most one `Merge` is outstanding; it is emitted for the lowest in-flight step
  only once that round is complete, and the next one only after its `MergeDone`. Rounds that complete
  early wait (they stop accepting pushes). A round stays in flight (holding a pipeline slot and its
  fragment) until its `MergeDone`, so the next round on that fragment always has the new base version.
- **Pacing outside strict mode** (round t, due H/P inner steps after round t-1): launch when the
  pipeline and the fragment allow AND either
    (time)     now >= previous launch (or V0Done) + (H/P) · slowest live member's EMA step time, or
    (progress) every live member's estimated progress reached its due point:
               est_local(now) >= ref_local + (t - ref_step)·H/P - launch_lead_steps,
  where a member's (ref_step, ref_local) is (0, its estimated local step) at V0Done, and
  (last launched step, 0) when it is admitted later or returns with a new generation (its local
  step restarts at 0). est_local extrapolates the last reported local step with the EMA step time.
  The time rule alone always makes progress once step times are known; the progress rule lets the
  syncer catch up when islands are ahead (e.g. after a slow merge) and never waits on a newcomer's
  load time. Without any step-time report and no progress, no round launches (islands heartbeat
  every few seconds, so this only delays the first round). `launch_lead_steps` (default 1) makes the
  pull arrive one step before the boundary it is due at.
- **Strict (lockstep)**: launch as soon as pipeline and fragment allow; a round completes only when
  every expected member answered (no quorum, no grace); a passed deadline tapes an error and moves
  the deadline one timeout on (no attempt bump).
- **Restart with no live member** keeps the attempt and moves the deadline on (nobody to ask); a round
  with no live member is never hopeless: it waits for a hello or a heartbeat, and time only ever moves
  its due time forward (`next_wakeup()` is never in the past after a Tick).
- **Hopeless attempts restart early** (not strict): while the answers still possible (slots not answered,
  not refused as stale/future/invalid, member still live) cannot reach quorum, the attempt restarts
  `HOPELESS_RESTART_S` after that began (counted `restart_early`), not at its deadline.
- **Re-broadcast**: BCAST keeps one message per chunk subject, so a forged chunk, a purge or a broker
  that lost its last writes can leave a fragment's committed version incomplete there for good: the
  islands stay on an older version, push stale bases, and no round of that fragment commits again.
  The machine emits `Rebroadcast(fragment, version)` of the committed version when a round of that
  fragment passes its deadline below quorum (restart, or strict deadline) or a push of it is
  `stale_base`; at most once per `quorum_timeout_s` per fragment, and never while that fragment's
  merge is due or under way (its params are changing and the next broadcast comes anyway).
- **Release**: the machine tells the shell which push payloads it may delete from the PUSH stream at
  once (rejected pushes, pushes discarded by a restart). It never releases the identity of a push that
  a pending merge still needs; the shell deletes accepted pushes after `MergeDone` itself. Release may
  repeat for the same identity: make deletion idempotent.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

from yeto.schemas.errors import ConfigError

from yeto.services.syncer.actions import (
    Action, AdoptSession, CommitV0, Done, InitDrop, InitStore, Merge, MergeInput, PublishFinal, PublishPull,
    PublishShardFinal, Rebroadcast, RecordFinal, Release, SendError, SendManifest, Shutdown, Tape, WriteMember,
    WriteSession,
)
from yeto.services.syncer.config import (
    BULK_DTYPES, DISPOSITIONS, FIRST_ATTEMPT, HOPELESS_RESTART_S, OUTLIER_MIN_PUSHES, PUSH_DTYPES, SyncerConfig,
)
from yeto.services.syncer.events import (
    Event, FinalAck, FinalPublished, Heartbeat, Hello, InitChunk, InitComplete, MemberSeen, MergeDone, PushComplete,
    SessionSeen, ShardFinal, Tick, V0Done,
)
from yeto.services.syncer.finalize import Finalization
from yeto.services.syncer.init_rules import InitRules
from yeto.services.syncer.membership import Membership
from yeto.services.syncer.pushes import Pushes
from yeto.services.syncer.sharding import Sharding
from yeto.services.syncer.state import Member, Phase, Round, _Final, _Slot

__all__ = [
    "SyncerConfig", "RoundMachine", "Member", "Round", "Phase",
    # events
    "Event", "Hello", "InitComplete", "PushComplete", "Heartbeat", "MergeDone", "V0Done", "Tick", "FinalAck",
    "FinalPublished", "InitChunk", "SessionSeen", "MemberSeen", "ShardFinal",
    # actions
    "Action", "WriteSession", "WriteMember", "PublishPull", "SendError", "MergeInput", "Merge", "Release",
    "Tape", "CommitV0", "InitStore", "InitDrop", "PublishFinal", "SendManifest", "RecordFinal", "Shutdown", "Done",
    "Rebroadcast", "PublishShardFinal", "AdoptSession",
    "PUSH_DTYPES", "BULK_DTYPES", "FIRST_ATTEMPT", "DISPOSITIONS", "OUTLIER_MIN_PUSHES", "HOPELESS_RESTART_S",
]


class RoundMachine(Membership, InitRules, Pushes, Finalization, Sharding):
    """See the module docstring. Feed events with `handle`, carry out the returned actions in order."""

    def __init__(self, config: SyncerConfig, *, session_builder: Callable[..., dict] | None = None):
        self.config = config
        self.counters: Counter[str] = Counter()
        self._builder = session_builder
        self.phase = Phase.PINNING
        self.session: dict | None = None
        self.init_island: str | None = None
        self._layout_fp: str | None = None
        self.members: dict[str, Member] = {}
        self._queued: dict[str, Hello] = {}
        self._initialized: set[int] = set()
        self._held_init: dict[str, dict[int, InitComplete]] = {}   # unseen gen -> fragment -> event
        self._init_chunks: dict[int, tuple[str, int, set[int]]] = {}  # fragment -> (gen, chunks, indexes stored)
        self._held_chunks: dict[str, dict[tuple[int, int], InitChunk]] = {}  # unseen gen -> (fragment, chunk) -> event
        self.versions: dict[int, int] = {}
        self.committed_step = 0            # sharded: the highest of this shard's own steps committed
        self._next_step = config.next_own_step(0)   # the next round this shard launches (1 unsharded)
        self.rounds: dict[int, Round] = {}          # in flight (launched, not yet committed), by step
        self._merging: int | None = None
        self._last_launch_at: float | None = None
        self._last_launch_step = 0     # pacing: a shard's rounds are N apart (sharding.py)
        self._last_sync_cost_s = 0.0   # the last whole sync (Merge to MergeDone): adaptive grace subtracts it
        self._min_attempts: dict[int, int] = {}
        self._final: _Final | None = None
        self._hello_asked: dict[tuple[str, str], float] = {}
        self._rebroadcast_at: dict[int, float] = {}   # fragment -> when its last Rebroadcast went out
        self._restored_finished = False
        self._resend_manifests = False
        # sharded (services/syncer/sharding.py)
        self._unpinned_members: dict[str, dict] = {}    # follower: members records read before the session
        self._own_final_started = False                 # PublishShardFinal emitted
        self._own_final_out = False                     # ... and its FinalPublished seen
        self._shard_finals: dict[int, dict[int, int]] = {}   # coordinator: shard -> its final versions
        self._now = -math.inf
        self._out: list[Action] = []

    # -- public ------------------------------------------------------------------------------------

    @classmethod
    def restore(
        cls,
        config: SyncerConfig,
        session: Mapping[str, Any],
        versions: Mapping[Any, int],
        committed_step: int,
        members: Mapping[str, Mapping[str, Any]],
        *,
        now: float,
        min_attempts: Mapping[int, int] | None = None,
        session_builder: Callable[..., dict] | None = None,
        final: Mapping[str, Any] | None = None,
    ) -> "RoundMachine":
        """A machine that continues a run (`--resume`) from `committed_step` + 1 with `versions`
        (fragment -> committed version; JSON string keys accepted) and the members KV records.
        No version 0 again. Restored members count as heard from at `now` (each gets a full
        member_timeout_s to heartbeat). `min_attempts` (step -> lowest attempt) lets the shell make a
        relaunched round use an attempt above the ones already published for that step before the
        restart (e.g. the last pull per step in CTL + 1), so no pull id is reused with other members.
        Feed a Tick(now) right after: it launches rounds, or finalizes if every step is committed.
        `final` is the last RecordFinal record (the final cut is out): a finished run emits Done(True)
        at once; an unfinished one continues finalization, re-sending the manifest to every target
        that has not acked (targets that acked stay acked and get their Shutdown at the end).
        """
        cfg = config
        frags = session.get("fragments")
        if not isinstance(frags, Sequence) or len(frags) != cfg.fragments:
            raise ConfigError(f"--fragments {cfg.fragments} does not match the session's "
                              f"{len(frags) if isinstance(frags, Sequence) else frags!r} fragments",
                              field="--fragments", value=cfg.fragments)
        for key, flag in (("push_dtype", "--push-dtype"), ("bulk_dtype", "--bulk-dtype"), ("sync_every", "--sync-every")):
            if key in session and session[key] != getattr(cfg, key):
                raise ConfigError(f"{flag} {getattr(cfg, key)!r} does not match the session's {key} {session[key]!r}",
                                  field=flag, value=getattr(cfg, key))
        vers = {int(k): int(v) for k, v in versions.items()}
        own = list(cfg.own_fragments)
        if sorted(vers) != own or any(v < 0 for v in vers.values()):
            which = f"0..{cfg.fragments - 1}" if not cfg.sharded else f"{own} (shard {cfg.shard} of {cfg.shards})"
            raise ValueError(f"versions must give a version >= 0 for every fragment {which}, got {dict(versions)!r}")
        if not (0 <= committed_step <= cfg.total_steps):
            raise ValueError(f"committed step {committed_step} outside 0..--total-steps {cfg.total_steps}")
        m = cls(cfg, session_builder=session_builder)
        m.session = dict(session)
        m.init_island = session.get("init_island")
        m._layout_fp = session["layout_fingerprint"]
        m._initialized = set(own)
        m.versions = vers
        m.committed_step = committed_step
        m._next_step = cfg.next_own_step(committed_step)
        m._now = now
        m._last_launch_at = now
        m._last_launch_step = committed_step
        m._min_attempts = {int(k): int(v) for k, v in (min_attempts or {}).items()}
        for island, rec in sorted(members.items()):
            fp = rec.get("layout_fingerprint", m._layout_fp)
            if fp != m._layout_fp:
                raise ValueError(f"member {island!r} has layout_fingerprint {fp!r}, the session {m._layout_fp!r}")
            last = int(rec.get("last_step", 0))
            m.members[island] = Member(
                island=island, gen=str(rec["gen"]), layout_fingerprint=fp,
                admitted_at=float(rec.get("admitted_at", now)), last_heartbeat=now,
                live=bool(rec.get("live", True)), reported_step=last, reported_at=now,
                ref_step=committed_step, ref_local=float(last),
            )
        m.phase = Phase.RUNNING
        if final is not None and cfg.sharded and final.get("shard_final"):
            # This shard's final cut is out: a follower has nothing left to do; the coordinator waits
            # for the other shards' (their ShardFinal) before it sends the manifests.
            m._own_final_started = m._own_final_out = True
            if cfg.coordinator:
                m._shard_finals[cfg.shard] = dict(vers)
            else:
                m._restored_finished = True
        elif final is not None:
            if cfg.sharded:
                m._own_final_started = m._own_final_out = True
            if final.get("finished"):
                m._restored_finished = True
            else:
                targets = {str(i): str(g) for i, g in (final.get("targets") or {}).items()}
                # sharded: the record holds every shard's fragments, the checkpoint only this shard's
                all_vers = {int(k): int(v) for k, v in (final.get("versions") or {}).items()} if cfg.sharded else vers
                m._final = _Final(final_step=int(final.get("final_step", committed_step)), started_at=now,
                                  targets=targets, versions=dict(all_vers), cut_out=True,
                                  acked={str(i) for i in final.get("acked") or () if str(i) in targets})
                m.phase = Phase.FINALIZING
                m._resend_manifests = True
        return m

    def handle(self, event: Event) -> list[Action]:
        if self.phase == Phase.DONE:
            self.counters["ignored.after_done"] += 1
            return []
        now = max(float(event.now), self._now)
        handler = self._HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event {type(event).__name__}")
        self._out = []
        getattr(self, handler)(event, now)   # may raise on a shell contract violation, before any change
        self._now = now
        self._pump(now)
        out, self._out = self._out, []
        return out

    def next_wakeup(self) -> float | None:
        """The earliest time at which a Tick would change something (None: nothing pending)."""
        cfg, cands = self.config, []
        if self.phase == Phase.DONE:
            return None
        for m in self.members.values():
            if m.live and cfg.coordinator:      # a follower shard never judges liveness (sharding.py)
                cands.append(m.last_heartbeat + cfg.member_timeout_s)
        for r in self.rounds.values():
            if r.accepting:
                cands.append(self._due(r))
                if not cfg.strict and r.quorum_at is not None:
                    cands.append(r.quorum_at + r.grace_s)
        cap = self._can_launch_now() if self.phase == Phase.RUNNING and not cfg.strict else None
        if cap is not None:
            cands.append(self._launch_time(*cap))
        if self._final is not None:
            cands.append(self._final.started_at + cfg.final_timeout_s)
        cands = [c for c in cands if math.isfinite(c)]
        return min(cands) if cands else None

    @property
    def next_step(self) -> int:
        return self._next_step

    # -- helpers for actions -----------------------------------------------------------------------

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    def _tape(self, kind: str, now: float, **fields: Any) -> None:
        self._emit(Tape({"kind": kind, "t": now, **{k: v for k, v in fields.items() if v is not None}}))

    def _write_member(self, m: Member) -> None:
        self._emit(WriteMember(m.island, m.record(pacing=self.config.sharded)))

    def _reject(self, island: str, gen: str, code: str, message: str, now: float, *,
                fatal: bool, field: str | None = None) -> None:
        self.counters[f"rejected.{code}"] += 1
        self._emit(SendError(island, gen, code, message, fatal, field))
        self._tape("error", now, island=island, gen=gen, reason=f"{code}: {message}",
                   detail={"code": code, "field": field})

    def _any_live(self) -> bool:
        return any(m.live for m in self.members.values())

    def _live(self) -> list[Member]:
        return [self.members[i] for i in sorted(self.members) if self.members[i].live]

    # -- time-driven -------------------------------------------------------------------------------

    def _pump(self, now: float) -> None:
        cfg = self.config
        if self.phase == Phase.DONE:
            return
        if self._restored_finished:
            self._tape("final", now, step=self.committed_step, reason="run already finished: nothing to do")
            self._emit(Done(True, ()))
            self.phase = Phase.DONE
            return
        if self._resend_manifests:
            self._resend_manifests = False
            f = self._final
            self._tape("final", now, step=f.final_step, reason="finalization resumed: manifest sent again",
                       detail={"targets": [{"island": i, "gen": g} for i, g in sorted(f.targets.items())],
                               "acked": sorted(f.acked)})
            for island, gen in sorted(f.targets.items()):
                if island not in f.acked:
                    self._emit(SendManifest(island, gen, f.final_step, dict(f.versions)))
            if f.acked >= set(f.targets):
                self._finish(True, now)
                return
        for m in (self._live() if cfg.coordinator else ()):
            if now - m.last_heartbeat >= cfg.member_timeout_s:
                m.live = False
                self.counters["leave"] += 1
                self._write_member(m)
                self._tape("leave", now, island=m.island, gen=m.gen,
                           reason=f"no heartbeat for {now - m.last_heartbeat:.1f}s")
        if self.phase == Phase.INIT and len(self._initialized) == len(cfg.own_fragments) \
                and len(self._live()) >= cfg.islands:
            self.phase = Phase.COMMITTING_V0
            for g in sorted(self._held_chunks):   # INIT is over: unseen generations' chunks never count
                self._drop_held_chunks(g, "version 0 decided")
            self._emit(CommitV0(tuple(cfg.own_fragments)))
        for step in sorted(self.rounds):
            r = self.rounds[step]
            if r.accepting:
                self._check_round(r, now)
        self._emit_merge(now)
        if not cfg.sharded and self.phase == Phase.RUNNING and self.committed_step >= cfg.total_steps:
            self._start_final(now)          # after the last MergeDone, or at once after restore
        if cfg.sharded and self.phase == Phase.RUNNING and not self._own_final_started and self._own_rounds_done():
            self._start_shard_final(now)
        if cfg.sharded and cfg.coordinator and self.phase == Phase.RUNNING and len(self._shard_finals) == cfg.shards:
            self._start_manifests(now)
        if self.phase == Phase.RUNNING:
            self._launch(now)
        if self._final is not None and self.phase == Phase.FINALIZING and now - self._final.started_at >= cfg.final_timeout_s:
            self._finish(False, now)

    def _due(self, r: Round) -> float:
        """When an attempt below quorum restarts: its deadline, or soon after it became hopeless."""
        if r.hopeless_at is None:
            return r.deadline
        return min(r.deadline, r.hopeless_at + min(self.config.quorum_timeout_s, HOPELESS_RESTART_S))

    def _hopeful(self, r: Round) -> int:
        """Slots that may still answer this attempt: not answered, not refused, member still live."""
        return sum(1 for i, s in r.slots.items()
                   if s.answer is None and s.refused is None and i in self.members and self.members[i].live)

    def _check_round(self, r: Round, now: float) -> None:
        cfg = self.config
        # Outliers are judged when the round would complete; removing one re-judges the round below.
        if r.answered == len(r.slots) and not self._screen_outliers(r, now):
            self._complete(r, now)
            return
        # Quorum out of reach (pushes refused as stale after a broker restart, a member gone): waiting for
        # the deadline only wastes a quorum timeout (60 s per such round was measured by bench/chaos.py).
        # Restart soon instead, leaving a moment for the re-broadcast that the refusals triggered to land
        # before the new pull (islands apply broadcasts before answering pulls). Re-judged at every event:
        # a member that comes back makes the attempt hopeful again.
        # With no live member at all a restart has nobody to ask: the round waits for a hello or a
        # heartbeat (which re-judge it), not for a restart time that would already be past.
        if not cfg.strict and r.quorum_at is None and r.answered + self._hopeful(r) < r.quorum and self._any_live():
            r.hopeless_at = now if r.hopeless_at is None else r.hopeless_at
        else:
            r.hopeless_at = None
        if not cfg.strict and r.quorum_at is not None and now >= r.quorum_at + r.grace_s \
                and not self._screen_outliers(r, now):
            self._complete(r, now)
        elif now >= self._due(r) and (cfg.strict or r.quorum_at is None):
            self.counters["restart_early" if r.hopeless_at is not None else "quorum_timeout"] += 1
            if cfg.strict:
                r.deadline = now + cfg.quorum_timeout_s
                self._tape("error", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                           reason=f"quorum_timeout (strict: attempt stands): {r.answered}/{len(r.slots)} answered")
                self._rebroadcast(r.fragment, now, f"round {r.step} passed its deadline below quorum (strict)")
            else:
                self._restart(r, now)

    def _restart(self, r: Round, now: float) -> None:
        cfg = self.config
        live = self._live()
        old_responded, old_attempt = r.responded(), r.attempt
        if not live:
            # Time only moves a due time forward: the next look is one quorum timeout on (or at the first
            # hello or heartbeat, which re-judges the round), never a hopeless time already past. Kept,
            # that past time made next_wakeup() stay in the past and the shell's loop spin.
            r.deadline = now + cfg.quorum_timeout_s
            r.hopeless_at = None
            self._tape("error", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                       reason="deadline passed below quorum and no member is live: attempt stands")
            return
        for island, slot in sorted(r.slots.items()):
            if slot.answer is not None:
                self._emit(Release(island, slot.answer.gen, r.step, r.fragment, old_attempt, slot.answer.try_, "restart"))
        # Before the new pull: islands that missed the base version can read it before they answer.
        self._rebroadcast(r.fragment, now, f"round {r.step} restarts below quorum (attempt {old_attempt})")
        r.attempt += 1
        r.seq = 0
        r.slots = {m.island: _Slot(m.gen) for m in live}
        r.quorum = self._quorum_for(len(live))
        r.launched_at = now
        r.deadline = now + cfg.quorum_timeout_s
        r.quorum_at = r.grace_s = r.hopeless_at = None
        r.norms = {}
        self.counters["restart"] += 1
        self._emit(PublishPull(r.pull()))
        self._tape("restart", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                   base_version=r.base_version, expected=r.members(), responded=old_responded, quorum=r.quorum,
                   reason=f"deadline passed below quorum: {len(old_responded)} of {r.quorum} needed answered attempt {old_attempt}")

    def _rebroadcast(self, fragment: int, now: float, reason: str) -> None:
        if self.phase != Phase.RUNNING or fragment not in self.versions:
            return
        if any(r.fragment == fragment and not r.accepting for r in self.rounds.values()):
            self.counters["rebroadcast.merge_due"] += 1
            return
        last = self._rebroadcast_at.get(fragment)
        if last is not None and now - last < self.config.quorum_timeout_s:
            self.counters["rebroadcast.rate_limited"] += 1
            return
        self._rebroadcast_at[fragment] = now
        self.counters["rebroadcast"] += 1
        self._emit(Rebroadcast(fragment, self.versions[fragment], reason))

    def _quorum_for(self, expected: int) -> int:
        k = self.config.quorum if self.config.quorum is not None else expected
        return max(1, min(k, expected))

    def _emit_merge(self, now: float) -> None:
        if self._merging is not None or not self.rounds:
            return
        r = self.rounds[min(self.rounds)]
        if not r.accepting:
            self._merging = r.step
            r.merge_at = now
            self._emit(r.merge)

    def _can_launch_now(self) -> tuple[int, list[Member]] | None:
        """(step, live members) if capacity allows launching the next round; pacing aside."""
        cfg = self.config
        t = self._next_step
        if t > cfg.total_steps or len(self.rounds) >= cfg.pipeline:
            return None
        if any(r.fragment == cfg.fragment_of(t) for r in self.rounds.values()):
            return None
        live = self._live()
        return (t, live) if live else None

    def _launch_time(self, t: int, live: list[Member]) -> float:
        """Earliest time the pacing rules allow round t (outside strict mode)."""
        cfg = self.config
        spr = cfg.steps_per_round
        emas = [m.ema_step_s for m in live if m.ema_step_s]
        # A shard's consecutive rounds are (t - its last launched step) rounds apart (1 unsharded).
        by_time = self._last_launch_at + (t - self._last_launch_step) * spr * max(emas) if emas else math.inf
        by_progress = -math.inf
        for m in live:
            due = m.ref_local + (t - m.ref_step) * spr - cfg.launch_lead_steps
            if m.reported_step >= due:
                continue
            if not m.ema_step_s:
                by_progress = math.inf
                break
            by_progress = max(by_progress, m.reported_at + (due - m.reported_step) * m.ema_step_s)
        return min(by_time, by_progress)

    def _launch(self, now: float) -> None:
        cfg = self.config
        while (cap := self._can_launch_now()) is not None:
            t, live = cap
            if not cfg.strict and now < self._launch_time(t, live):
                return
            frag = cfg.fragment_of(t)
            attempt = max(FIRST_ATTEMPT, self._min_attempts.get(t, FIRST_ATTEMPT))
            r = Round(step=t, fragment=frag, attempt=attempt, base_version=self.versions[frag],
                      launched_at=now, deadline=now + cfg.quorum_timeout_s, quorum=self._quorum_for(len(live)),
                      slots={m.island: _Slot(m.gen) for m in live})
            self.rounds[t] = r
            self._next_step = cfg.next_own_step(t)
            self._last_launch_at = now
            self._last_launch_step = t
            self.counters["launch"] += 1
            self._emit(PublishPull(r.pull()))

    # event type -> handler method (defined here or in a part's mixin)
    _HANDLERS: dict[type, str] = {
        Hello: "_on_hello",
        InitComplete: "_on_init",
        InitChunk: "_on_init_chunk",
        PushComplete: "_on_push",
        Heartbeat: "_on_heartbeat",
        MergeDone: "_on_merge_done",
        V0Done: "_on_v0_done",
        Tick: "_on_tick",
        FinalAck: "_on_final_ack",
        FinalPublished: "_on_final_published",
        SessionSeen: "_on_session_seen",
        MemberSeen: "_on_member_seen",
        ShardFinal: "_on_shard_final",
    }

    def _on_tick(self, ev: Tick, now: float) -> None:
        pass   # a Tick carries only time: the time-driven checks run after every event
