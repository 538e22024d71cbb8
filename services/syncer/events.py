"""The round machine's inputs: one frozen dataclass per event the shell feeds to `RoundMachine.handle`.

Every event carries `now` (wall-clock seconds, the only time the machine knows). `event_to_json` /
`event_from_json` turn an event into a JSON-safe dict and back, exactly (floats round-trip through
JSON's shortest representation; a non-finite float travels as the string "inf", "-inf" or "nan"):
the shell records every event it feeds on the tape in this form, and `yeto replay` feeds them again.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

@dataclass(frozen=True)
class Event:
    pass


@dataclass(frozen=True)
class Hello(Event):
    island: str
    gen: str
    layout: Sequence[Mapping[str, Any]]
    layout_fingerprint: str
    push_dtype: str
    bulk_dtype: str
    now: float
    # The island's release as its hello states it (schemas/versions.py); taped with its join. Not stated:
    # None, left out of the event's JSON (tapes and fixtures recorded before it read the same).
    software: str | None = field(default=None, metadata={"omit_default": True})


@dataclass(frozen=True)
class InitComplete(Event):
    """The INIT island's chunks of `fragment` are all in (the shell checked them)."""
    island: str
    gen: str
    fragment: int
    now: float


@dataclass(frozen=True)
class InitChunk(Event):
    """One INIT chunk whose framing the shell checked (run, known fragment, dtype, chunk plan, size,
    digest, finite values). The shell keeps its bytes until the machine answers with InitStore (write
    them into the fragment) or InitDrop (free them): every InitChunk gets exactly one of the two, at
    once or — for a chunk held until its generation's hello — later."""
    island: str
    gen: str
    fragment: int
    chunk: int
    chunks: int
    now: float


@dataclass(frozen=True)
class PushComplete(Event):
    """Every chunk of one push try is in; the shell checked chunk digests, push digest and sizes and
    reports the outcome in `valid` / `reason`. `norm` (the try's L2 norm, None when not measured) and
    `non_finite` (how many NaN/Inf values it holds) are the figures the machine's quarantine rules
    judge: the shell sums them chunk by chunk as the chunks arrive."""
    island: str
    gen: str
    fragment: int
    step: int
    attempt: int
    try_: int
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    valid: bool
    reason: str | None
    now: float
    norm: float | None = None
    non_finite: int = 0


@dataclass(frozen=True)
class Heartbeat(Event):
    island: str
    gen: str
    local_step: int
    step_time_s: float | None
    now: float
    # the island's last heartbeat: it stops before the run ends (taped only when set: older tapes stay as they were)
    leaving: bool = field(default=False, metadata={"omit_default": True})


@dataclass(frozen=True)
class MergeDone(Event):
    """The shell finished the merge, the outer step, the durable checkpoint, the state KV and the
    broadcast of `version` of `fragment` for round `step`; `merge_to_broadcast_s` is how long that took
    as the shell measured it (merge start to broadcast done). Adaptive grace subtracts the larger of it
    and the time from the Merge action to this event (the whole sync as the machine saw it)."""
    step: int
    fragment: int
    version: int
    merge_to_broadcast_s: float
    now: float


@dataclass(frozen=True)
class V0Done(Event):
    """Version 0 of every fragment is durable and broadcast (answer to CommitV0)."""
    now: float


@dataclass(frozen=True)
class Tick(Event):
    now: float


@dataclass(frozen=True)
class FinalAck(Event):
    island: str
    gen: str
    final_step: int
    now: float


@dataclass(frozen=True)
class FinalPublished(Event):
    """The f32 final cut (answer to PublishFinal) is in FINAL and the checkpoint says final."""
    now: float


@dataclass(frozen=True)
class SessionSeen(Event):
    """Sharded, not the coordinator: the session record the coordinator pinned, as read from the
    state KV (`session`)."""
    session: Mapping[str, Any]
    now: float


@dataclass(frozen=True)
class MemberSeen(Event):
    """Sharded, not the coordinator: a members-KV record the coordinator wrote (admission, a new
    generation, liveness, the pacing estimates), read because it changed."""
    island: str
    record: Mapping[str, Any]
    now: float


@dataclass(frozen=True)
class ShardFinal(Event):
    """Sharded, the coordinator: shard `shard` published its fragments' f32 final cut (state KV
    `final.<K>`): `versions` {fragment: version}."""
    shard: int
    final_step: int
    versions: Mapping[Any, int]
    now: float


@dataclass(frozen=True)
class Reconfigure(Event):
    """`yeto run set` (schemas/run_settings.py): `settings` as the request carried them, unchecked (the
    machine checks and answers with ApplySettings); `id` the request's, applied once. The shell also feeds
    one at start with the settings its state KV kept (id "kept"), so a new owner continues with them."""
    id: str
    settings: Mapping[str, Any]
    by: str
    now: float


EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in (
    Hello, InitComplete, InitChunk, PushComplete, Heartbeat, MergeDone, V0Done, Tick, FinalAck, FinalPublished,
    SessionSeen, MemberSeen, ShardFinal, Reconfigure)}


def _float_out(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'inf', '-inf', 'nan': JSON has no such numbers (orjson would write null)
    return value


def event_to_json(event: Event) -> dict:
    """{"type": <class name>, <field>: <value>, ...}, JSON-safe."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if f.metadata.get("omit_default") and value == f.default:
            continue
        if f.name == "layout":
            value = [dict(t) for t in value]
        elif f.name in ("session", "record", "settings"):
            value = dict(value)
        elif f.name == "versions":
            value = {str(k): v for k, v in value.items()}
        out[f.name] = _float_out(value)
    return out


def event_from_json(data: Mapping[str, Any]) -> Event:
    """The event `event_to_json` gave `data` for; ValueError naming the field for anything else."""
    name = data.get("type")
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"event type {name!r} is not one of {sorted(EVENT_TYPES)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is not dataclasses.MISSING:
                continue
            raise ValueError(f"{name} event lacks field {f.name!r}")
        value = data[f.name]
        if isinstance(value, str) and "float" in str(f.type):
            value = float(value)
        kwargs[f.name] = value
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)} - {"type"}
    if unknown:
        raise ValueError(f"{name} event has unknown fields {sorted(unknown)}")
    return cls(**kwargs)
