"""The round machine's inputs on the tape, so a run can be replayed (`yeto replay`); pure, no I/O.

Owns `InputRecorder`: the shell feeds every event through `InputRecorder.add(event, actions)` right after
the machine handled it, and tapes each record the recorder hands back as an `input` record on the run's
EVENTS stream (`yeto.R.events.input`). One syncer process writes one *segment*: batch 0 at start (the
config, the versions it speaks, what it restored), then batches of the events fed and their actions'
signatures (the record formats: `InputRecorder`'s doc).
Invariants: heartbeats and Ticks (several a second) must not flood the tape: events are batched, one
record per `MAX_BATCH_AGE_S` second at most (or per `MAX_BATCH_EVENTS` events / `MAX_BATCH_BYTES` bytes,
whichever comes first), flushed at exit. A syncer killed -9 loses at most its last second of inputs: the
replay then stops where the tape does. `proc` names the process (the shell's tape key prefix); batches
are numbered so a replay sees a lost record as a gap.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import orjson

from yeto.schemas.versions import PROTOCOL_VERSION, STATE_FORMAT
from yeto.services.syncer.actions import Action, action_digest
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import Event, Tick, event_to_json

INPUT_KIND = "input"
MAX_BATCH_EVENTS = 500
MAX_BATCH_BYTES = 256 * 1024     # well under the server's max_payload, even with a large hello's layout
MAX_BATCH_AGE_S = 1.0


def action_signature(action: Action) -> str:
    return f"{type(action).__name__}:{action_digest(action)}"


def encode_event(event: Event) -> Any:
    if type(event) is Tick:
        return event.now
    return event_to_json(event)


class InputRecorder:
    """Batches fed events and their actions' signatures into `input` tape records (see the module doc).

    - batch 0, at start: `detail` = {proc, batch: 0, config: the SyncerConfig as a dict (its `software`:
      the syncer's release), protocol and state_format: the versions it speaks and writes
      (schemas/versions.py), restore: None for a fresh run, else the arguments `RoundMachine.restore` got
      on --resume (session, versions, committed_step, members, now, min_attempts, final), and with it
      resumed_state: {format, software, migrated_from} of the state it resumed}.
    - batch n >= 1: `detail` = {proc, batch: n, first: index of its first event in the segment,
      events: [...], actions: {i: [signature, ...]}} — the events in the order fed (`events.event_to_json`;
      a Tick is written as its bare `now`, the commonest event kept small), and for each event that
      produced actions, their signatures `<ActionType>:<action_digest>` in order (an event the machine
      refused with an exception gets `["raise:<ExceptionType>"]`).
    """

    def __init__(self, proc: str, *, max_events: int = MAX_BATCH_EVENTS, max_bytes: int = MAX_BATCH_BYTES):
        self.proc = proc
        self.max_events, self.max_bytes = max_events, max_bytes
        self.batch = 0
        self.fed = 0                          # events fed in this segment
        self._events: list[Any] = []
        self._actions: dict[str, list[str]] = {}
        self._bytes = 0
        self._first_at: float | None = None

    def start(self, config: SyncerConfig, restore: dict | None, now: float, *, resumed_state: dict | None = None
              ) -> dict:
        """The segment's first record: the machine's config, the versions this process speaks and writes,
        and what restore() got (None: a fresh run) with the versions of the state it came from."""
        self.batch = 1
        detail = {"proc": self.proc, "batch": 0, "config": dataclasses.asdict(config), "protocol": PROTOCOL_VERSION,
                  "state_format": STATE_FORMAT, "restore": restore}
        if resumed_state is not None:
            detail["resumed_state"] = resumed_state
        return {"kind": INPUT_KIND, "t": now, "detail": detail}

    def add(self, event: Event, actions: Sequence[Action] | None, now: float, *, error: BaseException | None = None
            ) -> dict | None:
        """Record one fed event (and what it produced); returns a record to tape when the batch is full."""
        enc = encode_event(event)
        if self._first_at is None:
            self._first_at = now
        i = len(self._events)
        self._events.append(enc)
        sigs = [f"raise:{type(error).__name__}"] if error is not None else [action_signature(a) for a in actions or ()]
        if sigs:
            self._actions[str(i)] = sigs
        self._bytes += len(orjson.dumps(enc)) + sum(len(s) + 3 for s in sigs)
        self.fed += 1
        if len(self._events) >= self.max_events or self._bytes >= self.max_bytes:
            return self.take(now)
        return None

    def due(self, now: float) -> bool:
        return self._first_at is not None and now - self._first_at >= MAX_BATCH_AGE_S

    def take(self, now: float) -> dict | None:
        """The batch so far as a record (None when empty); the next batch starts empty."""
        if not self._events:
            return None
        rec = {"kind": INPUT_KIND, "t": now,
               "detail": {"proc": self.proc, "batch": self.batch, "first": self.fed - len(self._events),
                          "events": self._events, "actions": self._actions}}
        self.batch += 1
        self._events, self._actions, self._bytes, self._first_at = [], {}, 0, None
        return rec
