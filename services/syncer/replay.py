"""Replay a run's recorded inputs into a fresh round machine and compare its actions (pure, no I/O).

`segments(records)` groups the tape's `input` records (services/syncer/recording.py) by syncer process;
`replay(segment)` builds the machine the way that process did (`RoundMachine(config)`, or
`RoundMachine.restore(...)` with the recorded restore inputs), feeds every recorded event in order and
compares each event's action signatures with the recorded ones. The machine has no clock and no
randomness, so a faithful tape replays identically; the first difference names the event, the action
index and both sides. `yeto replay` (services/cmd_replay.py) is the command line around it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from yeto.services.syncer.actions import action_to_json
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import Event, Tick, event_from_json, event_to_json
from yeto.services.syncer.recording import INPUT_KIND, action_signature
from yeto.services.syncer.rounds import RoundMachine


class TapeError(ValueError):
    """The tape's input records cannot be replayed (no start record, a malformed record)."""


@dataclass
class Segment:
    """The inputs one syncer process recorded: its start record and its event batches, in order."""
    proc: str
    start: dict | None = None
    batches: dict[int, dict] = field(default_factory=dict)

    @property
    def resumed(self) -> bool:
        return bool(self.start and self.start.get("restore"))

    def add(self, detail: Mapping[str, Any]) -> None:
        """One `input` record's detail: batch 0 is the start record, the others event batches."""
        if detail["batch"] == 0:
            self.start = dict(detail)
        else:
            self.batches[detail["batch"]] = dict(detail)


@dataclass
class Difference:
    event_index: int          # in the segment, 0-based
    event: dict
    action_index: int         # among all actions of the segment, 0-based
    expected: str | None      # recorded signature (None: the machine now emits an action that was not recorded)
    got: str | None           # signature now (None: a recorded action is no longer emitted)
    got_action: dict | None   # the action now, in its JSON form

    def describe(self) -> str:
        got = f"{self.got} {self.got_action}" if self.got_action is not None else str(self.got)
        return (f"first differing action #{self.action_index} at event #{self.event_index} {self.event}: "
                f"expected {self.expected}, got {got}")


@dataclass
class Result:
    proc: str
    events: int = 0
    actions: int = 0
    difference: Difference | None = None
    gap: str | None = None    # why the replay stopped before the tape's end (a lost record)

    @property
    def identical(self) -> bool:
        return self.difference is None


def segments(records: Iterable[Mapping[str, Any]]) -> list[Segment]:
    """The `input` records of a tape, grouped by process, in the order their processes started."""
    out: dict[str, Segment] = {}
    for rec in records:
        if rec.get("kind") != INPUT_KIND:
            continue
        d = rec.get("detail")
        if not isinstance(d, Mapping) or not isinstance(d.get("proc"), str) or not isinstance(d.get("batch"), int):
            raise TapeError(f"input record without detail.proc / detail.batch: {dict(rec)!r:.300}")
        out.setdefault(d["proc"], Segment(d["proc"])).add(d)
    return list(out.values())


def _machine(start: Mapping[str, Any]) -> RoundMachine:
    config = SyncerConfig(**start["config"])
    r = start.get("restore")
    if not r:
        return RoundMachine(config)
    return RoundMachine.restore(config, r["session"], r["versions"], int(r["committed_step"]), r["members"],
                                now=float(r["now"]), min_attempts={int(k): int(v) for k, v in (r.get("min_attempts") or {}).items()},
                                final=r.get("final"))


def _decode(enc: Any) -> Event:
    if isinstance(enc, (int, float)) and not isinstance(enc, bool):
        return Tick(now=float(enc))
    if isinstance(enc, Mapping):
        return event_from_json(enc)
    raise TapeError(f"recorded event is neither a Tick's time nor an event object: {enc!r:.200}")


def replay(seg: Segment) -> Result:
    """Feed a segment's events to a fresh machine; stop at the first differing action."""
    res = Result(seg.proc)
    if seg.start is None:
        res.gap = "no start record (batch 0) for this process: its config is unknown"
        return res
    machine = _machine(seg.start)
    index = 0
    for n in range(1, max(seg.batches, default=0) + 1):
        batch = seg.batches.get(n)
        if batch is None or batch.get("first") != index:
            res.gap = f"batch {n} of the tape is missing (lost record): replayed up to event #{index}"
            return res
        recorded_actions = batch.get("actions") or {}
        for i, enc in enumerate(batch.get("events") or ()):
            event = _decode(enc)
            want = list(recorded_actions.get(str(i), ()))
            try:
                actions = machine.handle(event)
                got = [action_signature(a) for a in actions]
            except Exception as exc:  # noqa: BLE001 - the recorded run may have raised too: compare
                actions, got = [], [f"raise:{type(exc).__name__}"]
            for k in range(max(len(want), len(got))):
                w = want[k] if k < len(want) else None
                g = got[k] if k < len(got) else None
                if w != g:
                    res.difference = Difference(index, event_to_json(event), res.actions + k, w, g,
                                                action_to_json(actions[k]) if k < len(actions) else None)
                    res.events = index + 1
                    return res
            res.actions += len(got)
            index += 1
            res.events = index
    return res
