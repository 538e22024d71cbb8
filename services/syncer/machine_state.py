"""The round machine's whole state in one typed object, its phase transitions, and what its rule parts share.

`MachineState` holds everything the machine (services/syncer/rounds.py) knows between two events; the
rule modules (membership.py, init_rules.py, round_rules.py, pushes.py, finalize.py, sharding.py,
settings_rules.py, rebroadcasts.py) are functions over `(s, cfg, out, ...)`: the state, the config in
force and the `Output`; they read and write only the state, emit only through the output and keep
nothing of their own.
Invariants: the phase moves only through `MachineState.enter`, which checks `TRANSITIONS` and raises
`IllegalTransition` (a programming error, never an input error) on any other move:

    pinning -> init -> committing_v0 -> running -> finalizing -> done
                                                \\-> done   (a restored run that had finished)

`RoundMachine.restore` builds a state that starts in `running` or `finalizing` (a state built, not a
transition taken).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from yeto.services.syncer.actions import Action, SendError, Tape, WriteMember
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import Hello, InitChunk, InitComplete
from yeto.services.syncer.state import Member, Phase, Round, _Final

# phase -> the phases it may move to (every other move raises IllegalTransition)
TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.PINNING: frozenset({Phase.INIT}),                      # the session is pinned (or, a follower, seen)
    Phase.INIT: frozenset({Phase.COMMITTING_V0}),                # every fragment in, N members live: CommitV0
    Phase.COMMITTING_V0: frozenset({Phase.RUNNING}),             # V0Done
    Phase.RUNNING: frozenset({Phase.FINALIZING,                  # every (own) round committed: the final cut
                              Phase.DONE}),                      # restored after the run had finished
    Phase.FINALIZING: frozenset({Phase.DONE}),                   # all acked, final timeout, a follower's cut out
    Phase.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A phase move `TRANSITIONS` does not allow: a bug in the machine, not bad input."""


@dataclass
class MachineState:
    """Everything the round machine holds between events (see the module docstring)."""
    next_step: int                       # the next round this shard launches (1 unsharded; config.next_own_step)
    phase: Phase = Phase.PINNING         # the lifecycle; moved only by enter()
    counters: Counter[str] = field(default_factory=Counter)   # what happened, by kind (the status record's `rounds`)
    now: float = -math.inf               # the newest event time seen: the machine's clock never moves back
    # -- session and membership (membership.py) --
    session: dict | None = None          # the pinned session record (None until a hello pins it / a follower sees it)
    init_island: str | None = None       # the island whose process makes version 0
    layout_fp: str | None = None         # the session's layout fingerprint: every member's must match
    members: dict[str, Member] = field(default_factory=dict)     # island -> member (live or not)
    queued: dict[str, Hello] = field(default_factory=dict)       # hellos waiting for the INIT island's to pin
    hello_asked: dict[tuple[str, str], float] = field(default_factory=dict)  # (island, gen) -> last unknown_member
    # -- INIT and version 0 (init_rules.py) --
    initialized: set[int] = field(default_factory=set)           # fragments whose version 0 is complete
    held_init: dict[str, dict[int, InitComplete]] = field(default_factory=dict)   # unseen gen -> fragment -> event
    init_chunks: dict[int, tuple[str, int, set[int]]] = field(default_factory=dict)  # fragment -> (gen, chunks, stored)
    held_chunks: dict[str, dict[tuple[int, int], InitChunk]] = field(default_factory=dict)  # unseen gen -> (frag, chunk) -> ev
    # -- rounds, commits and pacing (round_rules.py, pushes.py) --
    versions: dict[int, int] = field(default_factory=dict)       # own fragment -> committed version
    committed_step: int = 0              # the highest (own, when sharded) step committed
    rounds: dict[int, Round] = field(default_factory=dict)       # in flight (launched, not yet committed), by step
    merging: int | None = None           # the step whose Merge is out (at most one), until its MergeDone
    last_launch_at: float | None = None  # pacing: when the last round launched (or V0Done / restore)
    last_launch_step: int = 0            # ... and its step (a shard's rounds are N apart: sharding.py)
    last_sync_cost_s: float = 0.0        # the last whole sync (Merge to MergeDone): adaptive grace subtracts it
    min_attempts: dict[int, int] = field(default_factory=dict)   # restore: step -> lowest attempt a relaunch uses
    rebroadcast_at: dict[int, float] = field(default_factory=dict)   # fragment -> when its last Rebroadcast went out
    accepted_norms: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # fragment -> island -> merged norms
    norm_quarantined_at: dict[str, int] = field(default_factory=dict)  # island -> last step the norm bound quarantined it
    # -- finalization (finalize.py) --
    final: _Final | None = None          # the finalization in progress (targets, acks, versions, cut out)
    restored_finished: bool = False      # restore: the run had finished; the next event ends it (Done)
    resend_manifests: bool = False       # restore: finalization resumes; the next event sends the manifests again
    # -- sharded (sharding.py) --
    unpinned_members: dict[str, dict] = field(default_factory=dict)  # follower: members records read before the session
    own_final_started: bool = False      # PublishShardFinal emitted
    own_final_out: bool = False          # ... and its FinalPublished seen
    shard_finals: dict[int, dict[int, int]] = field(default_factory=dict)  # coordinator: shard -> its final versions
    # -- runtime settings (settings_rules.py) --
    settings: dict[str, Any] = field(default_factory=dict)   # `yeto run set` values in force (schemas/run_settings.py)
    settings_ids: list[str] = field(default_factory=list)    # the request ids applied, newest last (a retry is a no-op)

    def enter(self, phase: Phase, why: str) -> None:
        """Move to `phase`; raise IllegalTransition if `TRANSITIONS` does not allow it (`why`: the cause)."""
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"phase {self.phase.value} -> {phase.value} is not a legal transition ({why})")
        self.phase = phase

    def live(self) -> list[Member]:
        """The live members, by island."""
        return [self.members[i] for i in sorted(self.members) if self.members[i].live]

    def any_live(self) -> bool:
        return any(m.live for m in self.members.values())


class Output:
    """The actions one event produces, in order, and the helpers that emit the common ones."""

    def __init__(self, state: MachineState, config: SyncerConfig):
        self.state, self.config = state, config
        self.actions: list[Action] = []

    def take(self) -> list[Action]:
        out, self.actions = self.actions, []
        return out

    def emit(self, action: Action) -> None:
        self.actions.append(action)

    def tape(self, kind: str, now: float, **fields: Any) -> None:
        self.emit(Tape({"kind": kind, "t": now, **{k: v for k, v in fields.items() if v is not None}}))

    def write_member(self, m: Member) -> None:
        self.emit(WriteMember(m.island, m.record(pacing=self.config.sharded)))

    def reject(self, island: str, gen: str, code: str, message: str, now: float, *,
               fatal: bool, field: str | None = None) -> None:
        self.state.counters[f"rejected.{code}"] += 1
        self.emit(SendError(island, gen, code, message, fatal, field))
        self.tape("error", now, island=island, gen=gen, reason=f"{code}: {message}",
                  detail={"code": code, "field": field})
