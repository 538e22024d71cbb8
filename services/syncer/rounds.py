"""The syncer's round state machine: pure, deterministic, no I/O, no clock.

The I/O shell (services/syncer/service.py) turns what it reads from NATS into *events*, feeds them to
`RoundMachine.handle(event)` one at a time, and carries out the *actions* it gets back, in order. Time
comes only with events (`now`: wall-clock seconds, so tape times and the members KV read sensibly across
restarts); every event also runs the time-driven checks (liveness, grace windows, deadlines, pacing,
final timeout), `Tick(now)` carries nothing else, and `next_wakeup()` says when the next fires (the shell
should still tick every second or so). Owns `RoundMachine`: restore, `handle` with its handlers (one per
event type) and ticks (one per phase). Inputs: events.py, outputs: actions.py, state: machine_state.py;
the rules live in rule modules, each stating its own: membership.py, init_rules.py, round_rules.py,
rebroadcasts.py, pushes.py, finalize.py, sharding.py, settings_rules.py (no import cycle among them, and
none imports this module: tests/test_machine_state.py).
Invariants: given the same events the machine emits the same actions (no randomness; every collection
that reaches an action is iterated in sorted or arrival order; `yeto replay` checks it from the inputs
recording.py tapes); a `now` older than one already seen is taken as the newest seen.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from yeto.schemas.errors import ConfigError

from yeto.services.syncer import finalize, init_rules, membership, pushes, round_rules, settings_rules, sharding
from yeto.services.syncer.actions import Action, CommitV0, Done, SendManifest
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import (
    Event, FinalAck, FinalPublished, Heartbeat, Hello, InitChunk, InitComplete, MemberSeen, MergeDone, PushComplete,
    Reconfigure, SessionSeen, ShardFinal, Tick, V0Done,
)
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.state import Member, Phase, _Final


class RoundMachine:
    """See the module docstring. Feed events with `handle`, carry out the returned actions in order.
    Everything it knows is in `state` (a `MachineState`); `config` is the config in force (`base_config`,
    the flags, with `yeto run set`'s values); the rule modules work on both through `_rule`."""

    def __init__(self, config: SyncerConfig, *, session_builder: Callable[..., dict] | None = None,
                 state: MachineState | None = None):
        self.config = self.base_config = config   # base: the flags; config: with `yeto run set`'s values
        self.state = state if state is not None else MachineState(next_step=config.next_own_step(0))
        self.out = Output(self.state, config)
        self.session_builder = session_builder    # builds the session from the INIT island's hello (tests: a stub)
        # event type -> its rule (a function over state, config, output); `handle` runs the phase's tick after it
        self.handlers: dict[type, Callable[..., None]] = {
            Hello: self._on_hello,
            Heartbeat: membership.on_heartbeat,
            InitComplete: init_rules.on_init,
            InitChunk: init_rules.on_init_chunk,
            V0Done: init_rules.on_v0_done,
            PushComplete: pushes.on_push,
            MergeDone: pushes.on_merge_done,
            FinalPublished: self._on_final_published,
            FinalAck: finalize.on_final_ack,
            SessionSeen: sharding.on_session_seen,
            MemberSeen: sharding.on_member_seen,
            ShardFinal: sharding.on_shard_final,
            Reconfigure: self._on_reconfigure,
            Tick: self._on_tick,
        }
        # phase -> the time-driven checks of that phase (after every event)
        self.ticks: dict[Phase, Callable[[float], None]] = {
            Phase.PINNING: self._tick_waiting, Phase.INIT: self._tick_init, Phase.COMMITTING_V0: self._tick_waiting,
            Phase.RUNNING: self._tick_running, Phase.FINALIZING: self._tick_finalizing, Phase.DONE: self._tick_waiting,
        }

    def _rule(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return fn(self.state, self.config, self.out, *args, **kw)

    # -- read-only views of the state, for the shell (status record, logs) and tests -----------------

    phase = property(lambda self: self.state.phase, doc="the lifecycle (a state.Phase)")
    session = property(lambda self: self.state.session, doc="the pinned session record, or None")
    init_island = property(lambda self: self.state.init_island)
    members = property(lambda self: self.state.members, doc="island -> Member")
    versions = property(lambda self: self.state.versions, doc="own fragment -> committed version")
    committed_step = property(lambda self: self.state.committed_step)
    rounds = property(lambda self: self.state.rounds, doc="rounds in flight, by step")
    counters = property(lambda self: self.state.counters)
    next_step = property(lambda self: self.state.next_step, doc="the next round this shard launches")

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
        layout_fp = session["layout_fingerprint"]
        restored: dict[str, Member] = {}
        for island, rec in sorted(members.items()):
            fp = rec.get("layout_fingerprint", layout_fp)
            if fp != layout_fp:
                raise ValueError(f"member {island!r} has layout_fingerprint {fp!r}, the session {layout_fp!r}")
            last = int(rec.get("last_step", 0))
            restored[island] = Member(
                island=island, gen=str(rec["gen"]), layout_fingerprint=fp,
                admitted_at=float(rec.get("admitted_at", now)), last_heartbeat=now,
                live=bool(rec.get("live", True)), reported_step=last, reported_at=now,
                ref_step=committed_step, ref_local=float(last),
            )
        # A state built, not a transition taken: it starts running (or finalizing, below).
        s = MachineState(
            next_step=cfg.next_own_step(committed_step), phase=Phase.RUNNING, now=now,
            session=dict(session), init_island=session.get("init_island"), layout_fp=layout_fp, members=restored,
            initialized=set(own), versions=vers, committed_step=committed_step,
            last_launch_at=now, last_launch_step=committed_step,
            min_attempts={int(k): int(v) for k, v in (min_attempts or {}).items()},
        )
        if final is not None and cfg.sharded and final.get("shard_final"):
            # This shard's final cut is out: a follower has nothing left to do; the coordinator waits
            # for the other shards' (their ShardFinal) before it sends the manifests.
            s.own_final_started = s.own_final_out = True
            if cfg.coordinator:
                s.shard_finals[cfg.shard] = dict(vers)
            else:
                s.restored_finished = True
        elif final is not None:
            if cfg.sharded:
                s.own_final_started = s.own_final_out = True
            if final.get("finished"):
                s.restored_finished = True
            else:
                targets = {str(i): str(g) for i, g in (final.get("targets") or {}).items()}
                # sharded: the record holds every shard's fragments, the checkpoint only this shard's
                all_vers = {int(k): int(v) for k, v in (final.get("versions") or {}).items()} if cfg.sharded else vers
                f = _Final(final_step=int(final.get("final_step", committed_step)), started_at=now,
                           targets=targets, versions=dict(all_vers), cut_out=True,
                           acked={str(i) for i in final.get("acked") or () if str(i) in targets})
                s = dataclasses.replace(s, phase=Phase.FINALIZING, final=f, resend_manifests=True)
        return cls(cfg, session_builder=session_builder, state=s)

    # The event types the machine takes (a handler each: `handlers`, built per machine).
    EVENTS: tuple[type, ...] = (Hello, Heartbeat, InitComplete, InitChunk, V0Done, PushComplete, MergeDone,
                                FinalPublished, FinalAck, SessionSeen, MemberSeen, ShardFinal, Reconfigure, Tick)

    def handle(self, event: Event) -> list[Action]:
        s = self.state
        if s.phase == Phase.DONE:
            s.counters["ignored.after_done"] += 1
            return []
        now = max(float(event.now), s.now)
        handler = self.handlers.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event {type(event).__name__}")
        self.out.take()
        handler(s, self.config, self.out, event, now)   # may raise on a shell contract violation, before any change
        s.now = now
        self._pump(now)
        return self.out.take()

    def _on_hello(self, s: MachineState, cfg: SyncerConfig, out: Output, ev: Hello, now: float) -> None:
        membership.on_hello(s, cfg, out, ev, now, builder=self.session_builder)

    def _on_final_published(self, s: MachineState, cfg: SyncerConfig, out: Output, ev: FinalPublished,
                            now: float) -> None:
        if cfg.sharded:
            sharding.shard_final_published(s, cfg, out, now)   # this shard's cut; the coordinator waits for all
        else:
            finalize.on_final_published(s, cfg, out, ev, now)

    def _on_reconfigure(self, s: MachineState, cfg: SyncerConfig, out: Output, ev: Reconfigure, now: float) -> None:
        config = settings_rules.on_reconfigure(s, cfg, out, ev, now, base=self.base_config)
        if config is not None:
            self.config = self.out.config = config   # every rule reads it from the next call on

    def _on_tick(self, s: MachineState, cfg: SyncerConfig, out: Output, ev: Tick, now: float) -> None:
        pass   # a Tick carries only time: the time-driven checks run after every event

    def next_wakeup(self) -> float | None:
        """The earliest time at which a Tick would change something (None: nothing pending)."""
        cfg, s, cands = self.config, self.state, []
        if s.phase == Phase.DONE:
            return None
        for m in s.members.values():
            if m.live and cfg.coordinator:      # a follower shard never judges liveness (sharding.py)
                cands.append(m.last_heartbeat + cfg.member_timeout_s)
        for r in s.rounds.values():
            if r.accepting:
                cands.append(round_rules.due(s, cfg, self.out, r))
                if not cfg.strict and r.quorum_at is not None:
                    cands.append(r.quorum_at + r.grace_s)
        cap = round_rules.can_launch_now(s, cfg, self.out) if s.phase == Phase.RUNNING and not cfg.strict else None
        if cap is not None:
            cands.append(round_rules.launch_time(s, cfg, self.out, *cap))
        if s.final is not None:
            cands.append(s.final.started_at + cfg.final_timeout_s)
        cands = [c for c in cands if math.isfinite(c)]
        return min(cands) if cands else None

    # -- time-driven -------------------------------------------------------------------------------

    def _pump(self, now: float) -> None:
        """The time-driven checks after every event: what any phase checks, then the phase's own tick."""
        cfg, s, out = self.config, self.state, self.out
        if s.phase == Phase.DONE:
            return
        if s.restored_finished:
            out.tape("final", now, step=s.committed_step, reason="run already finished: nothing to do")
            out.emit(Done(True, ()))
            s.enter(Phase.DONE, "restored: the run had finished")
            return
        if s.resend_manifests:
            s.resend_manifests = False
            f = s.final
            out.tape("final", now, step=f.final_step, reason="finalization resumed: manifest sent again",
                     detail={"targets": [{"island": i, "gen": g} for i, g in sorted(f.targets.items())],
                             "acked": sorted(f.acked)})
            for island, gen in sorted(f.targets.items()):
                if island not in f.acked:
                    out.emit(SendManifest(island, gen, f.final_step, dict(f.versions)))
            if f.acked >= set(f.targets):
                self._rule(finalize.finish, True, now)
                return
        for m in (s.live() if cfg.coordinator else ()):
            if now - m.last_heartbeat >= cfg.member_timeout_s:
                self._rule(membership.leave, m, now, f"no heartbeat for {now - m.last_heartbeat:.1f}s")
        self.ticks[s.phase](now)

    def _tick_waiting(self, now: float) -> None:
        pass   # pinning, committing version 0: the next event, not time, moves these on

    def _tick_init(self, now: float) -> None:
        cfg, s = self.config, self.state
        if len(s.initialized) == len(cfg.own_fragments) and len(s.live()) >= cfg.islands:
            s.enter(Phase.COMMITTING_V0, "every fragment initialized and enough members live")
            for g in sorted(s.held_chunks):   # INIT is over: unseen generations' chunks never count
                self._rule(init_rules.drop_held_chunks, g, "version 0 decided")
            self.out.emit(CommitV0(tuple(cfg.own_fragments)))

    def _check_rounds(self, now: float) -> None:
        s = self.state
        for step in sorted(s.rounds):
            r = s.rounds[step]
            if r.accepting:
                self._rule(round_rules.check_round, r, now)
        self._rule(round_rules.emit_merge, now)

    def _tick_running(self, now: float) -> None:
        cfg, s = self.config, self.state
        self._check_rounds(now)
        if not cfg.sharded and s.committed_step >= cfg.total_steps:
            self._rule(finalize.start_final, now)          # after the last MergeDone, or at once after restore
        if cfg.sharded and s.phase == Phase.RUNNING and not s.own_final_started and sharding.own_rounds_done(s, cfg, self.out):
            self._rule(sharding.start_shard_final, now)
        if cfg.sharded and cfg.coordinator and s.phase == Phase.RUNNING and len(s.shard_finals) == cfg.shards:
            self._rule(sharding.start_manifests, now)
        if s.phase == Phase.RUNNING:
            self._rule(round_rules.launch, now)
        else:
            self._tick_finalizing(now, rounds_checked=True)   # the final cut just began: its timeout counts too

    def _tick_finalizing(self, now: float, *, rounds_checked: bool = False) -> None:
        cfg, s = self.config, self.state
        if not rounds_checked:
            self._check_rounds(now)
        if s.final is not None and s.phase == Phase.FINALIZING and now - s.final.started_at >= cfg.final_timeout_s:
            self._rule(finalize.finish, False, now)
