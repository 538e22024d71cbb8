"""The round machine's outputs: one frozen dataclass per action the shell carries out, in order.

`action_to_json` / `action_from_json` turn an action into a JSON-safe dict and back (dict keys become
strings; `versions` maps come back with int keys); `action_digest` is a short digest of that form. The
shell tapes each fed event's action digests, and `yeto replay` compares a fresh machine's with them;
the golden fixtures (tests/fixtures/rounds/) hold the JSON form.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import orjson

@dataclass(frozen=True)
class Action:
    pass


@dataclass(frozen=True)
class WriteSession(Action):
    session: dict


@dataclass(frozen=True)
class WriteMember(Action):
    """Members KV: island -> {gen, layout_fingerprint, last_step, last_heartbeat, admitted_at, live}."""
    island: str
    record: dict


@dataclass(frozen=True)
class PublishPull(Action):
    """pull: {fragment, step, attempt, seq, base_version, members: [{island, gen}] sorted by island};
    the shell adds type/v/run and the msg id pull.F.step.attempt.seq."""
    pull: dict


@dataclass(frozen=True)
class SendError(Action):
    island: str
    gen: str
    code: str
    message: str
    fatal: bool
    field: str | None = None


@dataclass(frozen=True)
class MergeInput:
    """One accepted push of a merge; (island, gen, step, fragment, attempt, try_) names its chunks."""
    island: str
    gen: str
    weight: float          # normalized merge weight (the members' weights sum to 1)
    try_: int
    c_tokens: int | float  # the claim as used for the weight (after the max_token_factor cap: an exact limit
                           # that is not whole is a float)
    c_steps: int
    base_version: int
    local_step: int


@dataclass(frozen=True)
class Merge(Action):
    """Merge the accepted pushes (sorted by island), apply the outer step, commit `version` of
    `fragment` durably, update `state`, broadcast, then feed back MergeDone(step, fragment, version).

    `record` is the round's `merge` tape record, less `t` and `sync_s` (the shell adds both at the
    durable commit; the record's `sync_s` is launch to durable commit, `launched_at` being the round's
    launch time). The shell keeps it
    in the checkpoint with the commit, so the record reaches the tape exactly once even when the syncer
    dies between the commit and the tape write."""
    step: int
    fragment: int
    attempt: int
    version: int
    base_version: int
    members: tuple[MergeInput, ...]
    record: dict = field(default_factory=dict, compare=False)
    launched_at: float = 0.0
    # outer_lr / outer_momentum set at runtime (`yeto run set`), in force when this merge was decided;
    # empty = the syncer's flags (left out of the JSON form: tapes of runs without a change stay as they were)
    outer: dict = field(default_factory=dict, metadata={"omit_default": True})


@dataclass(frozen=True)
class Release(Action):
    """The payload of this push will never be merged: its chunks may be deleted from PUSH at once
    (rejected pushes, pushes discarded by a restart). The machine never releases the identity of a push
    a pending merge still needs; the shell deletes accepted pushes after `MergeDone` itself. Release may
    repeat for the same identity: deletion must be idempotent."""
    island: str
    gen: str
    step: int
    fragment: int
    attempt: int
    try_: int
    reason: str


@dataclass(frozen=True)
class Tape(Action):
    """One record for EVENTS (`events.<kind>`); the shell adds v and run."""
    event: dict


@dataclass(frozen=True)
class CommitV0(Action):
    """Commit version 0 of every fragment from the INIT data (durably), broadcast it, then feed V0Done."""
    fragments: tuple[int, ...]


@dataclass(frozen=True)
class InitStore(Action):
    """Write the held bytes of this INIT chunk into the fragment's values."""
    gen: str
    fragment: int
    chunk: int


@dataclass(frozen=True)
class InitDrop(Action):
    """Free the held bytes of this INIT chunk: they never become part of version 0."""
    gen: str
    fragment: int
    chunk: int
    reason: str


@dataclass(frozen=True)
class PublishFinal(Action):
    """Publish the f32 final cut of `versions` and mark the checkpoint final (with `record`, the
    finalization record RecordFinal describes), then feed back FinalPublished. Emitted once per run:
    the machine owns the decision, so no second publication runs beside the first."""
    final_step: int
    versions: dict
    record: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class PublishShardFinal(Action):
    """Sharded: publish this shard's fragments' f32 final cut (`versions`: its own fragments), mark its
    checkpoint final ({"shard_final": true, final_step, versions}), record the f32 version digests in
    the state KV (`final.<K>`, for the coordinator's manifest), then feed back FinalPublished. Emitted
    once, when every round of the shard's fragments up to --total-steps is committed."""
    final_step: int
    versions: dict


@dataclass(frozen=True)
class AdoptSession(Action):
    """Sharded, not the coordinator: take the session the coordinator pinned (the shell sets it in the
    cut and writes the checkpoint's session file; the state KV already holds it)."""
    session: dict


@dataclass(frozen=True)
class SendManifest(Action):
    """Send the manifest (final step, version per fragment, the f32 cut's digests) to one island
    generation. Emitted only once the final cut is out (after FinalPublished), so the shell always
    holds every fragment's digest."""
    island: str
    gen: str
    final_step: int
    versions: dict


@dataclass(frozen=True)
class RecordFinal(Action):
    """Keep the finalization record durably (checkpoint): {final_step, versions, targets {island: gen},
    acked [island], finished}. `RoundMachine.restore(final=record)` continues from it: a finished run
    ends at once, an unfinished one re-sends the manifest to the targets that have not acked."""
    record: dict


@dataclass(frozen=True)
class Rebroadcast(Action):
    """Publish the committed bytes of `version` of `fragment` to BCAST again: the bulk dtype, the same
    version and version_digest, Nats-Msg-Ids that differ per re-send (the duplicate window would drop
    the original ids). Tape a `rebroadcast` record once it is out. The fragment's params are not
    changing while this is pending (no merge of it is due), so carry it out before the next action."""
    fragment: int
    version: int
    reason: str


@dataclass(frozen=True)
class Shutdown(Action):
    island: str
    gen: str
    reason: str


@dataclass(frozen=True)
class ApplySettings(Action):
    """The answer to a Reconfigure: `ok` with the runtime settings now in force (`settings`, all of them:
    the shell keeps them in its state KV `settings` key for a successor) and what this request changed;
    or refused with `error`, `field`, `value`. The shell answers the request `id` if it still waits."""
    id: str
    ok: bool
    step: int
    changed: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    error: str | None = None
    field: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class Done(Action):
    """The syncer may exit; ok=False names the targets that never acked."""
    ok: bool
    missing: tuple[str, ...]


ACTION_TYPES: dict[str, type[Action]] = {cls.__name__: cls for cls in (
    WriteSession, WriteMember, PublishPull, SendError, Merge, Release, Tape, CommitV0, InitStore, InitDrop,
    PublishFinal, SendManifest, RecordFinal, Rebroadcast, Shutdown, Done, PublishShardFinal, AdoptSession,
    ApplySettings)}


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit_default") and getattr(value, f.name) == _default(f))}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no inf/nan (orjson would write null)
    return value


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def action_to_json(action: Action) -> dict:
    """{"type": <class name>, <field>: <value>, ...}, JSON-safe (every dict key a string)."""
    return {"type": type(action).__name__, **_jsonable(action)}


def action_from_json(data: Mapping[str, Any]) -> Action:
    """The action `action_to_json` gave `data` for."""
    name = data.get("type")
    cls = ACTION_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"action type {name!r} is not one of {sorted(ACTION_TYPES)}")
    kwargs = {k: v for k, v in data.items() if k != "type"}
    if cls is Merge:
        kwargs["members"] = tuple(MergeInput(**mi) for mi in kwargs.get("members", ()))
    if cls in (CommitV0,):
        kwargs["fragments"] = tuple(kwargs["fragments"])
    if cls is Done:
        kwargs["missing"] = tuple(kwargs["missing"])
    if "versions" in kwargs:
        kwargs["versions"] = {int(k): v for k, v in kwargs["versions"].items()}
    return cls(**kwargs)


def action_digest(action: Action) -> str:
    """16 hex characters of sha256 over the action's JSON form (keys sorted)."""
    return hashlib.sha256(orjson.dumps(action_to_json(action), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
