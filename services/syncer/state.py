"""What the round machine's state is made of: its phase, members (with the progress and step-time estimates
pacing uses), rounds in flight with their slots and answers, and the finalization in progress. Plain data
with the small rules that belong to one piece of it (a member's EMA step time, a round's pull); the state
as a whole is services/syncer/machine_state.MachineState, and the machine (services/syncer/rounds.py and
its rule parts) owns the decisions.

- **EMA step time**: from heartbeats: their `step_time_s` when given (> 0), else derived from two
  heartbeats (Δtime / Δlocal_step). Pushes update progress only (their arrival lags their local step
  by the transfer time, which would bias a derived step time).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from yeto.services.syncer.actions import Merge
from yeto.services.syncer.config import EMA_ALPHA


class Phase(enum.StrEnum):
    """The machine's lifecycle; the value is what the status record shows (`phase`)."""
    PINNING = "pinning"
    INIT = "init"
    COMMITTING_V0 = "committing_v0"
    RUNNING = "running"
    FINALIZING = "finalizing"
    DONE = "done"


@dataclass
class Member:
    island: str
    gen: str
    layout_fingerprint: str
    admitted_at: float
    last_heartbeat: float
    live: bool = True
    reported_step: int = 0            # highest local step heard of (heartbeat or push)
    reported_at: float = 0.0          # when that progress was last confirmed
    ema_step_s: float | None = None
    ref_step: int = 0                 # pacing reference: global step ...
    ref_local: float = 0.0            # ... and the member's local step at that point
    retired_gens: set[str] = field(default_factory=set)
    left: bool = False                # its generation said it leaves: no heartbeat of it revives it
    _hb_step: int | None = None
    _hb_at: float | None = None

    def est_local(self, now: float) -> float:
        if self.ema_step_s:
            return self.reported_step + max(0.0, now - self.reported_at) / self.ema_step_s
        return float(self.reported_step)

    def observe_heartbeat(self, local_step: int, step_time_s: float | None, now: float) -> None:
        sample = None
        if step_time_s is not None and math.isfinite(step_time_s) and step_time_s > 0:
            sample = float(step_time_s)
        elif self._hb_step is not None and local_step > self._hb_step and now > self._hb_at:
            sample = (now - self._hb_at) / (local_step - self._hb_step)
        if sample is not None:
            self.ema_step_s = sample if self.ema_step_s is None else EMA_ALPHA * sample + (1 - EMA_ALPHA) * self.ema_step_s
        self._hb_step, self._hb_at = local_step, now
        # a heartbeat is current: the island is at local_step *now* (even if it did not move)
        if local_step >= self.reported_step:
            self.reported_step, self.reported_at = local_step, now

    def observe_push(self, local_step: int, now: float) -> None:
        # a push's local step is older than its arrival: only ever raise progress, never confirm it
        if local_step > self.reported_step:
            self.reported_step, self.reported_at = local_step, now

    def record(self, *, pacing: bool = False) -> dict:
        """The members KV record; `pacing` (sharded runs) adds the estimates the other shards pace by."""
        rec = {
            "gen": self.gen,
            "layout_fingerprint": self.layout_fingerprint,
            "last_step": self.reported_step,
            "last_heartbeat": self.last_heartbeat,
            "admitted_at": self.admitted_at,
            "live": self.live,
        }
        if pacing:
            rec.update(reported_at=self.reported_at, ema_step_s=self.ema_step_s, ref_step=self.ref_step,
                       ref_local=self.ref_local)
        return rec


@dataclass
class _Answer:
    gen: str
    try_: int
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    norm: float | None = None


@dataclass
class _Slot:
    gen: str
    answer: _Answer | None = None
    refused: str | None = None     # its push of this attempt was refused: it will not answer this attempt
    quarantined: set[tuple[str, int]] = field(default_factory=set)   # (gen, try) quarantined this attempt


@dataclass
class Round:
    step: int
    fragment: int
    attempt: int
    base_version: int
    launched_at: float
    deadline: float
    quorum: int
    slots: dict[str, _Slot]
    seq: int = 0
    quorum_at: float | None = None
    grace_s: float | None = None
    complete_at: float | None = None
    merge: Merge | None = None
    merge_at: float | None = None     # when the Merge action went out
    hopeless_at: float | None = None  # when quorum became out of reach for this attempt
    norms: dict[str, float] = field(default_factory=dict)  # island -> norm of its push accepted this attempt
    push_dtype: str | None = None     # `yeto run set push_dtype` at its launch; None = the session's

    @property
    def accepting(self) -> bool:
        return self.complete_at is None

    @property
    def answered(self) -> int:
        return sum(1 for s in self.slots.values() if s.answer is not None)

    def members(self) -> list[dict]:
        return [{"island": i, "gen": self.slots[i].gen} for i in sorted(self.slots)]

    def responded(self) -> list[dict]:
        return [{"island": i, "gen": s.answer.gen} for i, s in sorted(self.slots.items()) if s.answer]

    def pull(self) -> dict:
        pull = {
            "fragment": self.fragment, "step": self.step, "attempt": self.attempt, "seq": self.seq,
            "base_version": self.base_version, "members": self.members(),
        }
        if self.push_dtype is not None:
            pull["push_dtype"] = self.push_dtype
        return pull


@dataclass
class _Final:
    final_step: int
    started_at: float
    targets: dict[str, str]           # island -> gen that must install the cut and ack
    versions: dict[int, int] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    cut_out: bool = False             # FinalPublished seen: manifests may go out

    def record(self, *, finished: bool = False) -> dict:
        return {"final_step": self.final_step, "versions": {str(k): v for k, v in sorted(self.versions.items())},
                "targets": dict(sorted(self.targets.items())), "acked": sorted(self.acked), "finished": finished}


def lower_median(values: Sequence[float]) -> float:
    """The middle value; for an even count the smaller of the two middle ones, so that one high value
    (a liar in a round of two) never raises it."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def default_builder() -> Callable[..., dict]:
    from yeto.schemas.layout import build_session  # lazily: the machine is testable without it
    return build_session
