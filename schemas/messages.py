"""Typed wire messages: one frozen dataclass per JSON Schema kind, and the stream codecs of the chunk streams.

Owns: the Python shape of every message and chunk header (`schemas/json/<kind>.schema.json` stays the
source of truth; tests/test_messages.py fails when a class and its schema disagree on a field, on which
fields are required, or on a type). Validation is the codec's (schemas/codec.py): `from_wire` and the
decoders validate what arrives, `encode`/`header` validate what leaves, so a refusal reads the same
as before. `v` and a typed kind's `type` are the class's, never a field: no caller writes its own
protocol number. An optional field is None when absent and left out on the wire.
Stream codecs: `PushStream` frames a push's chunks and seals the last; `cut_chunk` builds a BCAST or
FINAL chunk header; `read_chunk` decodes a fetched chunk's header and checks it names this run.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from yeto.schemas import codec
from yeto.schemas.chunks import chunk_header, push_digest
from yeto.schemas.errors import WireError

M = TypeVar("M", bound="Message")


def _wire_name(f: dataclasses.Field) -> str:
    # `try` is a Python keyword: the field is `try_`, the wire key `try`
    return f.metadata.get("wire", f.name)


def _try(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"wire": "try"})


@dataclass(frozen=True)
class Message:
    """A message of kind `KIND`: `to_wire`/`from_wire` convert to and from the schema's dict."""

    KIND: ClassVar[str] = ""

    def to_wire(self) -> dict:
        """The message as the schema's dict (not validated: `encode`/`header` validate)."""
        msg: dict[str, Any] = {}
        if self.KIND in codec.TYPED_KINDS:
            msg["type"] = self.KIND
        msg["v"] = codec.PROTOCOL_VERSION
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue   # optional and absent
            msg[_wire_name(f)] = list(value) if isinstance(value, tuple) else value
        return msg

    @classmethod
    def from_wire(cls: type[M], msg: Any) -> M:
        """A parsed message, validated against the schema (SchemaError/VersionError as `codec.validate`)."""
        return cls.from_valid(codec.validate(cls.KIND, msg))

    @classmethod
    def from_valid(cls: type[M], msg: Mapping) -> M:
        """A message `codec.validate` already passed."""
        kw = {}
        for f in dataclasses.fields(cls):
            value = msg.get(_wire_name(f))
            kw[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**kw)

    def encode(self) -> bytes:
        """Validated compact JSON (the NATS payload of a control message)."""
        return codec.encode(self.KIND, self.to_wire())

    @classmethod
    def decode(cls: type[M], data: bytes | bytearray | memoryview | str) -> M:
        """Parse and validate one message of this kind (DecodeError, SchemaError as `codec.decode`)."""
        return cls.from_valid(codec.decode(cls.KIND, data))


@dataclass(frozen=True)
class Chunk(Message):
    """A chunk header: the framing every chunk kind shares (schemas/chunks.py `chunk_header`)."""

    def header(self) -> str:
        """The validated `Yeto-Chunk` header text."""
        return codec.encode_header(self.KIND, self.to_wire())

    @classmethod
    def from_header(cls: type[M], text: str | bytes | None) -> M:
        """A `Yeto-Chunk` header text -> the validated header (a missing header decodes as "")."""
        return cls.from_valid(codec.decode_header(cls.KIND, "" if text is None else text))


# ---------------------------------------------------------------------------------------------------- control

@dataclass(frozen=True)
class Hello(Message):
    KIND: ClassVar[str] = "hello"
    run: str
    island: str
    gen: str
    layout: tuple
    layout_fingerprint: str
    push_dtype: str
    bulk_dtype: str
    world: dict
    host: str
    software: str | None = None


@dataclass(frozen=True)
class Session(Message):
    KIND: ClassVar[str] = "session"
    run: str
    fragments: tuple
    layout_fingerprint: str
    session_fingerprint: str
    push_dtype: str
    bulk_dtype: str
    chunk_bytes: int
    init_island: str
    sync_every: int
    created: float
    software: str | None = None
    outer: dict | None = None     # the sparse mode's pinned settings (schemas/outer_mode.py); None = dense


@dataclass(frozen=True)
class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    run: str
    island: str
    gen: str
    local_step: int
    step_time_s: float | None
    leaving: bool | None = None


@dataclass(frozen=True)
class Pull(Message):
    KIND: ClassVar[str] = "pull"
    run: str
    fragment: int
    step: int
    attempt: int
    seq: int
    base_version: int
    members: tuple
    push_dtype: str | None = None   # set by `yeto run set push_dtype`; absent: the session's


@dataclass(frozen=True)
class Manifest(Message):
    KIND: ClassVar[str] = "manifest"
    run: str
    final_step: int
    versions: dict
    version_digests: dict
    gen: str | None = None


@dataclass(frozen=True)
class Ack(Message):
    KIND: ClassVar[str] = "ack"
    run: str
    island: str
    gen: str
    final_step: int


@dataclass(frozen=True)
class Error(Message):
    KIND: ClassVar[str] = "error"
    run: str
    code: str
    message: str
    fatal: bool
    field: str | None = None
    gen: str | None = None


@dataclass(frozen=True)
class Shutdown(Message):
    KIND: ClassVar[str] = "shutdown"
    run: str
    reason: str
    gen: str | None = None


@dataclass(frozen=True)
class StepLog(Message):
    KIND: ClassVar[str] = "steplog"
    run: str
    island: str
    gen: str
    step: int
    t: float
    boundary_s: float
    export_s: float
    apply_s: float
    pushes: int
    applies: int
    bytes_out: int
    bytes_in: int
    scatter_bytes: int
    gather_bytes: int
    versions: dict
    pending_pulls: int
    rejected: int
    loss: float | None = None
    dropped: int | None = None
    extra: dict | None = None


@dataclass(frozen=True)
class Event(Message):
    KIND: ClassVar[str] = "event"
    run: str
    kind: str
    t: float
    step: int | None = None
    fragment: int | None = None
    attempt: int | None = None
    try_: int | None = _try(None)
    base_version: int | None = None
    version: int | None = None
    expected: tuple | None = None
    responded: tuple | None = None
    quorum: int | None = None
    staleness: dict | None = None
    weights: dict | None = None
    quorum_s: float | None = None
    grace_s: float | None = None
    sync_s: float | None = None
    reason: str | None = None
    island: str | None = None
    gen: str | None = None
    disposition: str | None = None
    detail: dict | None = None


@dataclass(frozen=True)
class Settings(Message):
    """`yeto run set`: the settings to change (schemas/run_settings.py names and checks them)."""

    KIND: ClassVar[str] = "settings"
    run: str
    id: str
    set: dict
    by: str | None = None


@dataclass(frozen=True)
class SettingsResult(Message):
    """One syncer shard's answer to a `settings` request."""

    KIND: ClassVar[str] = "settings_result"
    run: str
    id: str
    ok: bool
    shard: int
    shards: int
    step: int | None = None
    changed: dict | None = None
    settings: dict | None = None
    error: str | None = None
    field: str | None = None
    value: str | None = None


# ---------------------------------------------------------------------------------------------------- chunks

@dataclass(frozen=True)
class PushChunk(Chunk):
    """One chunk of a push: the try it belongs to, then its framing; the last chunk carries `push_digest`."""

    KIND: ClassVar[str] = "push_chunk"
    run: str
    island: str
    gen: str
    fragment: int
    step: int
    attempt: int
    try_: int = _try()
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    dtype: str
    chunk: int
    chunks: int
    offset: int
    nbytes: int
    total: int
    digest: str
    push_digest: str | None = None
    encoding: str | None = None   # "sparseloco": the payload is a sparse push message (schemas/outer_mode.py)

    def check_subject(self, run: str, island: str | None, fragment: str) -> None:
        """The header names the run, island and fragment of the subject it arrived on (push.<island>.<fragment>)."""
        if self.run != run or self.island != island or fragment != str(self.fragment):
            raise WireError("island/fragment in the header does not match the subject", field="island",
                            value=self.island, code="subject_mismatch")


@dataclass(frozen=True)
class InitChunk(Chunk):
    KIND: ClassVar[str] = "init_chunk"
    run: str
    island: str
    gen: str
    fragment: int
    dtype: str
    chunk: int
    chunks: int
    offset: int
    nbytes: int
    total: int
    digest: str


@dataclass(frozen=True)
class BcastChunk(Chunk):
    """One chunk of a broadcast version; the last chunk carries `version_digest` (the seal)."""

    KIND: ClassVar[str] = "bcast_chunk"
    run: str
    fragment: int
    version: int
    dtype: str
    chunk: int
    chunks: int
    offset: int
    nbytes: int
    total: int
    digest: str
    version_digest: str | None = None
    encoding: str | None = None       # "sparse-update": the payload is an update message (schemas/sparse_bcast.py)
    base_version: int | None = None   # with encoding: the version it applies to (version - 1)


@dataclass(frozen=True)
class FinalChunk(Chunk):
    """One chunk of the final cut: every chunk carries the version digest and the final step."""

    KIND: ClassVar[str] = "final_chunk"
    run: str
    fragment: int
    version: int
    dtype: str
    chunk: int
    chunks: int
    offset: int
    nbytes: int
    total: int
    digest: str
    version_digest: str
    final_step: int


MESSAGES: dict[str, type[Message]] = {c.KIND: c for c in (
    Hello, Session, Heartbeat, Pull, PushChunk, InitChunk, BcastChunk, FinalChunk, Manifest, Ack, Error, Shutdown,
    StepLog, Event, Settings, SettingsResult)}


# ---------------------------------------------------------------------------------------------------- stream codecs

class PushStream:
    """The headers of one push try's chunks, in order: each chunk's framing from its payload, and the
    push digest over the chunk digests on the last one (the seal the syncer checks the whole push by)."""

    def __init__(self, spans: Sequence, *, run: str, island: str, gen: str, fragment: int, step: int, attempt: int,
                 try_: int, base_version: int, local_step: int, c_steps: int, c_tokens: int, dtype: str,
                 encoding: str | None = None):
        self.spans = spans
        self.try_fields = dict(run=run, island=island, gen=gen, fragment=fragment, step=step, attempt=attempt,
                               try_=try_, base_version=base_version, local_step=local_step, c_steps=c_steps,
                               c_tokens=c_tokens, dtype=dtype, encoding=encoding)
        self.digests: list[str] = []

    def chunk(self, index: int, payload: Any) -> PushChunk:
        """The header of chunk `index` carrying `payload` (chunks are framed in order)."""
        framing = chunk_header(self.spans, index, payload)
        self.digests.append(framing["digest"])
        seal = push_digest(self.digests) if index == len(self.spans) - 1 else None
        return PushChunk(**self.try_fields, **framing, push_digest=seal)


def init_chunk(spans: Sequence, index: int, payload: Any, *, run: str, island: str, gen: str, fragment: int,
               dtype: str) -> InitChunk:
    """The header of one INIT chunk: island and generation name the process whose chunks make version 0."""
    return InitChunk(run=run, island=island, gen=gen, fragment=fragment, dtype=dtype,
                     **chunk_header(spans, index, payload))


def cut_chunk(spans: Sequence, index: int, payload: Any, *, run: str, fragment: int, version: int, dtype: str,
              version_digest: str | None, final_step: int | None = None,
              base_version: int | None = None) -> BcastChunk | FinalChunk:
    """The header of one BCAST chunk, or with `final_step` one FINAL chunk. BCAST seals the version with its
    digest on the last chunk only, so the other chunks can go out before the whole version is merged and
    durable (cut-through); FINAL carries it on every chunk. `base_version`: a chunk of a sparse update
    message from that version (schemas/sparse_bcast.py), `encoding` sparse-update."""
    framing = chunk_header(spans, index, payload)
    if final_step is not None:
        return FinalChunk(run=run, fragment=fragment, version=version, dtype=dtype, **framing,
                          version_digest=version_digest, final_step=final_step)
    seal = version_digest if index == len(spans) - 1 else None
    update = {} if base_version is None else {"encoding": "sparse-update", "base_version": base_version}
    return BcastChunk(run=run, fragment=fragment, version=version, dtype=dtype, **framing, version_digest=seal,
                      **update)


def read_chunk(cls: type[M], headers: Mapping | None, run: str) -> M:
    """A fetched chunk message's header: present, valid for `cls`, and naming `run`; else WireError."""
    hdr = (headers or {}).get(codec.CHUNK_HEADER)
    if hdr is None:
        raise WireError("chunk message without its header", field=codec.CHUNK_HEADER, value=None)
    meta = cls.from_header(hdr)
    if meta.run != run:
        raise WireError("chunk names another run", field="run", value=meta.run)
    return meta


__all__ = ["Ack", "BcastChunk", "Chunk", "Error", "Event", "FinalChunk", "Heartbeat", "Hello", "InitChunk", "MESSAGES",
           "Manifest", "Message", "Pull", "PushChunk", "PushStream", "Session", "Settings", "SettingsResult", "Shutdown",
           "StepLog", "cut_chunk",
           "init_chunk", "read_chunk"]
