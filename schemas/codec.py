"""The wire contract's codec: JSON Schema validation, encoding and decoding of control messages and chunk headers.

The schemas in `schemas/json/<kind>.schema.json` are the source of truth (draft 2020-12, restricted to keywords
that fastjsonschema's draft-07 generator also implements: no prefixItems, dependentRequired, unevaluated*).
What one JSON Schema cannot say (relations between fields: chunk < chunks, offsets that add up, a digest on the
last chunk only, unique names) is checked here in `_CHECKS`, after the schema; `validate` runs both, and every
entry point goes through `validate`.

Every refusal is a `WireError` subclass naming the field (dotted path, e.g. `members.0.gen`) and the value.
A `v` outside the accepted protocols (schemas/versions.py) is refused before the schema, as a VersionError
that names both sides' protocol and release.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

import fastjsonschema
import orjson

from yeto.schemas.errors import DecodeError, SchemaError
from yeto.schemas.versions import PROTOCOL_VERSION, check_protocol

CHUNK_HEADER = "Yeto-Chunk"  # the NATS header that carries a chunk's metadata (compact JSON)

KINDS: tuple[str, ...] = (
    "hello", "session", "heartbeat", "pull", "push_chunk", "init_chunk", "bcast_chunk", "final_chunk",
    "manifest", "ack", "error", "shutdown", "steplog", "event", "settings", "settings_result",
)
CHUNK_KINDS: tuple[str, ...] = ("push_chunk", "init_chunk", "bcast_chunk", "final_chunk")
# Kinds with a `type` const (equal to the kind) so one consumer of a shared subject can dispatch:
# the syncer's CTL consumer (hello, heartbeat, ack), an island's (pull, manifest, error, shutdown).
TYPED_KINDS: tuple[str, ...] = ("hello", "heartbeat", "pull", "ack", "manifest", "error", "shutdown", "settings",
                                 "settings_result")
# Kinds sent by an island: they carry `island` and `gen`.
ISLAND_KINDS: tuple[str, ...] = ("hello", "heartbeat", "init_chunk", "push_chunk", "ack", "steplog")

# JSON numbers past 2^53 lose bits in most JSON readers (the reason `gen` is hex): refuse them at the source.
MAX_SAFE_INT = 2**53 - 1
# No message nests deeper than a handful of levels (a session's fragments.N.tensors.M.shape.K is 5).
MAX_DEPTH = 32
_EXCERPT = 80


def _check_kind(kind: str, allowed: tuple[str, ...] = KINDS) -> None:
    # An unknown kind is a programming error, not bad input from the wire: plain ValueError.
    if kind not in allowed:
        raise ValueError(f"unknown message kind {kind!r}; expected one of {', '.join(allowed)}")


def load_schema(kind: str) -> dict:
    """The JSON Schema of `kind` (a fresh copy, read from the package data)."""
    return copy.deepcopy(_schema(kind))


@functools.cache
def _schema(kind: str) -> dict:
    _check_kind(kind)
    text = resources.files(__package__).joinpath("json", f"{kind}.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def examples(kind: str) -> list[dict]:
    """The schema's own `examples` (fresh copies: callers may mutate them)."""
    return copy.deepcopy(_schema(kind)["examples"])


def _no_remote(uri: str) -> Any:
    # Every $ref is document-local; a remote one is a schema bug and must never reach the network.
    raise SchemaError(f"remote $ref {uri!r} is not allowed in the wire schemas", field="$ref", value=uri)


@functools.cache
def _validator(kind: str) -> Callable[[Any], Any]:
    # Compiled once per kind, on first use (compiling all 14 at import would cost every CLI start).
    return fastjsonschema.compile(
        _schema(kind), handlers={"http": _no_remote, "https": _no_remote}, use_formats=False, use_default=False,
    )


# ---------------------------------------------------------------------------------------------------- errors

def _dotted(path: Iterable[Any]) -> str | None:
    parts = [str(p) for p in path]
    return ".".join(parts) if parts else None


def _join(parent: str | None, name: str) -> str:
    return name if parent is None else f"{parent}.{name}"


def _schema_error(kind: str, exc: fastjsonschema.JsonSchemaValueException) -> SchemaError:
    """fastjsonschema's error -> SchemaError with the dotted field path of the *offending* field.

    For `required` and `additionalProperties` fastjsonschema blames the enclosing object; we name the missing
    or extra key instead, because that is what a reader has to fix.
    """
    path = exc.path[1:]  # drop the leading "data"
    parent = _dotted(path)
    field, value, rule = parent, exc.value, exc.rule
    definition = exc.definition if isinstance(exc.definition, dict) else {}
    if rule == "required" and isinstance(exc.value, Mapping):
        missing = [k for k in (exc.rule_definition or ()) if k not in exc.value]
        if missing:
            field = _join(parent, missing[0])
            err = SchemaError(f"{kind}: missing required field {field!r}", field=field, value=None)
            err.kind, err.rule = kind, rule
            return err
    if rule == "additionalProperties" and isinstance(exc.value, Mapping):
        known = set(definition.get("properties", {}))
        patterns = [re.compile(p) for p in definition.get("patternProperties", {})]
        extra = [k for k in exc.value if k not in known and not any(p.search(k) for p in patterns)]
        if extra:
            key = sorted(extra)[0]
            field, value = _join(parent, key), exc.value[key]
            what = "unknown field" if not patterns else "key does not match " + "|".join(p.pattern for p in patterns)
            err = SchemaError(f"{kind}: {what} {field!r} [rule additionalProperties]", field=field, value=value)
            err.kind, err.rule = kind, rule
            return err
    # fastjsonschema's message starts with its own path name ("data.members[0].gen must match ..."): keep the rest.
    reason = exc.message
    if exc.name and reason.startswith(exc.name):
        reason = reason[len(exc.name):].strip()
    where = field if field is not None else "<message>"
    err = SchemaError(f"{kind}: {where} {reason} [rule {rule}]", field=field, value=value)
    if field is None:  # WireError shows the value only when a field is named: show the root excerpt here
        err.args = (f"{err.args[0]} (value {_excerpt(value)})",)
    err.kind, err.rule = kind, rule
    return err


def _fail(kind: str, field: str, value: Any, why: str, rule: str) -> SchemaError:
    err = SchemaError(f"{kind}: {field} {why} [rule {rule}]", field=field, value=value)
    err.kind, err.rule = kind, rule
    return err


def _excerpt(data: Any) -> str:
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data[: _EXCERPT + 1])
    text = repr(data)
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


# ---------------------------------------------------------------------------------------------------- plain JSON

def _check_plain(kind: str, obj: Any) -> None:
    """Refuse what JSON cannot carry faithfully before the schema sees it.

    orjson would write NaN/inf as null and numpy scalars only with an option; int keys would break the schema's
    pattern checks; a lone surrogate makes orjson raise its own TypeError. Each refusal names the field.
    Iterative with a depth cap: orjson parses up to 1024 levels, which a recursive walk (and repr() of the
    value in the error) would meet as RecursionError, an exception no caller expects from bad input.
    """
    stack: list[tuple[Any, tuple]] = [(obj, ())]
    while stack:
        obj, path = stack.pop()
        if obj is None or isinstance(obj, bool):
            continue
        if isinstance(obj, str):
            if not obj.isascii():
                try:
                    obj.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise _fail(kind, _dotted(path) or "<message>", obj[max(0, exc.start - 8): exc.end + 8],
                                "holds a lone surrogate, not valid UTF-8 text", "utf8") from None
            continue
        if isinstance(obj, int):
            if abs(obj) > MAX_SAFE_INT:
                raise _fail(kind, _dotted(path) or "<message>", obj, "is an integer beyond 2^53-1, which loses bits in JSON", "int_range")
            continue
        if isinstance(obj, float):
            if not math.isfinite(obj):
                raise _fail(kind, _dotted(path) or "<message>", obj,
                            "is not a finite number (JSON has no NaN/Infinity; orjson would write null)", "finite")
            continue
        if isinstance(obj, (dict, list, tuple)):
            if len(path) >= MAX_DEPTH:
                raise _fail(kind, _dotted(path) or "<message>", f"<{type(obj).__name__} of {len(obj)}>",
                            f"nests deeper than {MAX_DEPTH} levels", "depth")
            if isinstance(obj, dict):
                for key in obj:
                    if not isinstance(key, str):
                        raise _fail(kind, _dotted(path + (key,)) or "<message>", key,
                                    f"object key must be a string, got {type(key).__name__}", "key_type")
                # reversed: the first field's problem is the one reported, as in document order
                for key, value in reversed(obj.items()):
                    stack.append((value, path + (key,)))
                    stack.append((key, path + (key,)))
            else:
                stack.extend((value, path + (i,)) for i, value in reversed(list(enumerate(obj))))
            continue
        raise _fail(kind, _dotted(path) or "<message>", obj,
                    f"is a {type(obj).__module__}.{type(obj).__qualname__}, not a JSON value (convert it to int/float/str/list/dict)",
                    "json_type")


def _resolve(kind: str, node: Any) -> dict:
    while isinstance(node, dict) and "$ref" in node:
        # fastjsonschema rewrites the cached schema's refs in place to absolute ones (<$id>#/$defs/x)
        base, _, pointer = node["$ref"].partition("#")
        if base not in ("", _schema(kind).get("$id")) or not pointer.startswith("/"):
            return {}
        target: Any = _schema(kind)
        for part in pointer[1:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        node = target
    return node if isinstance(node, dict) else {}


def _check_integers(kind: str, msg: Any) -> None:
    """Refuse a float where the schema says integer.

    JSON Schema counts 3.0 as an integer and orjson parses it as a float; a float chunk index or step then
    reaches list indexing, subject tokens and `==` with ints on the consumer side, far from the codec.
    Runs after the schema, so the message's shape already matches it.
    """
    stack: list[tuple[dict, Any, tuple]] = [(_schema(kind), msg, ())]
    while stack:
        node, value, path = stack.pop()
        node = _resolve(kind, node)
        if not node:
            continue
        if isinstance(value, float):
            if node.get("type") == "integer" or (isinstance(node.get("type"), list) and "integer" in node["type"]
                                                  and "number" not in node["type"]):
                raise _fail(kind, _dotted(path) or "<message>", value, "must be an integer, not a float", "integer")
            continue
        if isinstance(value, dict):
            props = node.get("properties", {})
            pats = node.get("patternProperties", {})
            extra = node.get("additionalProperties")
            for key, sub in value.items():
                if key in props:
                    stack.append((props[key], sub, path + (key,)))
                    continue
                matched = False
                for pat, psch in pats.items():
                    if re.search(pat, key):
                        stack.append((psch, sub, path + (key,)))
                        matched = True
                if not matched and isinstance(extra, dict):
                    stack.append((extra, sub, path + (key,)))
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            stack.extend((node["items"], sub, path + (i,)) for i, sub in enumerate(value))


# ---------------------------------------------------------------------------------------------------- cross-field checks

# kind -> the field sealing the whole payload, carried by its last chunk only (see _check_chunk).
_LAST_CHUNK_ONLY = {"push_chunk": "push_digest", "bcast_chunk": "version_digest"}


def _check_chunk(kind: str, m: dict) -> None:
    chunk, chunks, offset, nbytes, total = m["chunk"], m["chunks"], m["offset"], m["nbytes"], m["total"]
    if chunk >= chunks:
        raise _fail(kind, "chunk", chunk, f"must be < chunks ({chunks})", "chunk_index")
    if offset + nbytes > total:
        raise _fail(kind, "nbytes", nbytes, f"runs past total: offset {offset} + nbytes {nbytes} > total {total}", "chunk_bounds")
    if chunk == 0 and offset != 0:
        raise _fail(kind, "offset", offset, "of chunk 0 must be 0", "chunk_bounds")
    last = chunk == chunks - 1
    if last and offset + nbytes != total:
        raise _fail(kind, "nbytes", nbytes, f"of the last chunk must end the payload: offset {offset} + nbytes {nbytes} != total {total}",
                    "chunk_bounds")
    # The digest that seals a whole payload rides on its last chunk only: a push's push_digest, and a
    # broadcast's version_digest (so chunks 0..n-2 can go out while the version is still being merged;
    # the seal follows once it is durable). FINAL chunks carry version_digest on every chunk (schema).
    seal = _LAST_CHUNK_ONLY.get(kind)
    if seal is not None:
        if last and seal not in m:
            err = SchemaError(f"{kind}: missing required field '{seal}' on the last chunk ({chunk} of {chunks})",
                              field=seal, value=None)
            err.kind, err.rule = kind, "required"
            raise err
        if not last and seal in m:
            raise _fail(kind, seal, m[seal], f"belongs on the last chunk only (this is chunk {chunk} of {chunks})",
                        "last_chunk_only")
    if kind == "bcast_chunk" and ("encoding" in m or "base_version" in m):
        # A sparse update (schemas/sparse_bcast.py): the step from base_version, which must be the version before.
        if "encoding" not in m:
            raise _fail(kind, "base_version", m["base_version"], "belongs to an update chunk only (no encoding)",
                        "update_fields")
        if "base_version" not in m:
            raise _fail(kind, "base_version", None, f"is required with encoding {m['encoding']!r}", "update_fields")
        if m["base_version"] != m["version"] - 1:
            raise _fail(kind, "base_version", m["base_version"],
                        f"must be the version before ({m['version'] - 1}): an update is one step", "update_base")


def _check_session(kind: str, m: dict) -> None:
    names: set[str] = set()
    frags = m["fragments"]
    for i, frag in enumerate(frags):
        if frag["id"] != i:
            raise _fail(kind, f"fragments.{i}.id", frag["id"], f"must equal its position {i} (ids are 0..P-1 in order)", "fragment_order")
        end = 0
        for j, t in enumerate(frag["tensors"]):
            where = f"fragments.{i}.tensors.{j}"
            if t["name"] in names:
                raise _fail(kind, f"{where}.name", t["name"], "appears twice in the session", "unique")
            names.add(t["name"])
            numel = math.prod(t["shape"])
            if t["numel"] != numel:
                raise _fail(kind, f"{where}.numel", t["numel"], f"must equal prod(shape {t['shape']}) = {numel}", "numel")
            if t["offset"] != end:
                raise _fail(kind, f"{where}.offset", t["offset"],
                            f"must be {end}: tensors are packed contiguously in order", "packed")
            end += numel
        if frag["numel"] != end:
            raise _fail(kind, f"fragments.{i}.numel", frag["numel"], f"must equal the sum of its tensors' numel ({end})", "numel")
    if m["sync_every"] % len(frags):
        raise _fail(kind, "sync_every", m["sync_every"], f"must be a multiple of the fragment count P={len(frags)}", "multiple")


def _check_hello(kind: str, m: dict) -> None:
    seen: set[str] = set()
    for j, t in enumerate(m["layout"]):
        if t["name"] in seen:
            raise _fail(kind, f"layout.{j}.name", t["name"], "appears twice in the layout", "unique")
        seen.add(t["name"])


def _check_members(kind: str, members: list, where: str) -> None:
    seen: set[str] = set()
    for j, mem in enumerate(members):
        if mem["island"] in seen:
            raise _fail(kind, f"{where}.{j}.island", mem["island"], "is listed twice", "unique")
        seen.add(mem["island"])


def _check_pull(kind: str, m: dict) -> None:
    _check_members(kind, m["members"], "members")


def _check_manifest(kind: str, m: dict) -> None:
    versions, digests = m["versions"], m["version_digests"]
    for key in sorted(set(versions) ^ set(digests), key=int):
        field = f"version_digests.{key}" if key in digests else f"versions.{key}"
        value = digests.get(key, versions.get(key))
        raise _fail(kind, field, value, "has no counterpart: versions and version_digests must name the same fragments",
                    "same_keys")


def _check_event(kind: str, m: dict) -> None:
    for where in ("expected", "responded"):
        if where in m:
            _check_members(kind, m[where], where)


_CHECKS: dict[str, Callable[[str, dict], None]] = {
    "push_chunk": _check_chunk, "init_chunk": _check_chunk, "bcast_chunk": _check_chunk, "final_chunk": _check_chunk,
    "session": _check_session, "hello": _check_hello, "pull": _check_pull, "manifest": _check_manifest,
    "event": _check_event,
}


# ---------------------------------------------------------------------------------------------------- public API

def validate(kind: str, msg: Any) -> dict:
    """Check an already-parsed message against `kind`'s schema and cross-field rules; return it unchanged."""
    _check_kind(kind)
    _check_plain(kind, msg)
    # A protocol this release does not speak: refused naming both sides' versions, not as a schema error
    check_protocol(kind, msg, from_island=kind in ISLAND_KINDS)
    try:
        _validator(kind)(msg)
    except fastjsonschema.JsonSchemaValueException as exc:
        raise _schema_error(kind, exc) from None
    _check_integers(kind, msg)
    check = _CHECKS.get(kind)
    if check is not None:
        check(kind, msg)
    return msg


def encode(kind: str, msg: dict) -> bytes:
    """Validate, then serialize to compact JSON bytes (the NATS payload of a control message)."""
    return orjson.dumps(validate(kind, msg))


def _loads(kind: str, data: bytes | bytearray | memoryview | str) -> Any:
    try:
        return orjson.loads(data)
    except (orjson.JSONDecodeError, TypeError) as exc:
        excerpt = _excerpt(data)
        err = DecodeError(f"{kind}: malformed JSON ({exc}); input {excerpt}", field=None, value=excerpt)
        err.kind = kind
        raise err from None


def decode(kind: str, data: bytes | bytearray | memoryview | str) -> dict:
    """Parse and validate one message of `kind`. DecodeError if not JSON, SchemaError if not a valid `kind`."""
    _check_kind(kind)
    return validate(kind, _loads(kind, data))


def decode_typed(data: bytes | bytearray | memoryview | str, allowed: Iterable[str] = TYPED_KINDS) -> tuple[str, dict]:
    """Parse a message from a subject that carries several kinds; dispatch on its `type`. Returns (kind, msg)."""
    allowed = tuple(allowed)
    for kind in allowed:
        _check_kind(kind, TYPED_KINDS)
    label = "|".join(allowed)
    msg = _loads(label, data)
    typ = msg.get("type") if isinstance(msg, dict) else None
    if typ not in allowed:
        err = SchemaError(f"{label}: type must be one of {', '.join(allowed)}", field="type", value=typ)
        err.kind, err.rule = label, "type"
        raise err
    return typ, validate(typ, msg)


def make(kind: str, fields: Mapping[str, Any] | None = None, /, **kw: Any) -> dict:
    """Build a message: `v` (and `type` for TYPED_KINDS) filled in, then `fields` and keywords; validated.

    `fields` exists for keys that are Python keywords (`try`): make("push_chunk", {"try": 0}, fragment=1, ...).
    """
    _check_kind(kind)
    msg: dict[str, Any] = {}
    if kind in TYPED_KINDS:
        msg["type"] = kind
    msg["v"] = PROTOCOL_VERSION
    msg.update(fields or {})
    msg.update(kw)
    return validate(kind, msg)


def encode_header(kind: str, meta: dict) -> str:
    """Chunk metadata -> the compact JSON text of the `Yeto-Chunk` NATS header."""
    _check_kind(kind, CHUNK_KINDS)
    text = orjson.dumps(validate(kind, meta)).decode()
    # orjson escapes control characters inside strings, so compact output never holds CR/LF; a NATS header
    # line with one would split the header block. Kept as a guard against a future serializer change.
    if "\r" in text or "\n" in text:
        raise _fail(kind, "<header>", text, "contains CR/LF, not allowed in a NATS header value", "header")
    return text


def decode_header(kind: str, text: str | bytes) -> dict:
    """The `Yeto-Chunk` header text of a chunk of `kind` -> validated metadata dict."""
    _check_kind(kind, CHUNK_KINDS)
    return validate(kind, _loads(kind, text))
