"""The typed messages (schemas/messages.py) against the JSON Schemas they stand for: every kind has a class, and
each class names exactly the schema's fields, requires exactly what the schema requires and types each field
as the schema does, so the two cannot drift. Every schema example survives from_wire -> to_wire; what the
codec refuses, from_wire refuses with the codec's text; the stream codecs build the headers an island and
the syncer publish (framing, the push and version seals)."""
from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from yeto.schemas import codec, messages
from yeto.schemas.chunks import chunk_header, chunk_plan, push_digest
from yeto.schemas.errors import SchemaError, WireError

# JSON Schema type -> the Python type a message field holds
PY = {"integer": int, "number": float, "string": str, "boolean": bool, "array": tuple, "object": dict, "null": type(None)}


def _resolve(schema: dict, prop: dict) -> dict:
    while "$ref" in prop:
        prop = schema["$defs"][prop["$ref"].rsplit("/", 1)[1]]
    return prop


def _schema_types(schema: dict, prop: dict) -> set[type]:
    prop = _resolve(schema, prop)
    typ = prop.get("type")
    if typ is None:   # a const or an enum without a type: the type of its values
        values = [prop["const"]] if "const" in prop else prop["enum"]
        return {type(v) for v in values}
    return {PY[t] for t in ([typ] if isinstance(typ, str) else typ)}


def _field_types(hint) -> set[type]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return {a for a in typing.get_args(hint)}
    return {hint}


def _wire(f: dataclasses.Field) -> str:
    return f.metadata.get("wire", f.name)


def test_every_kind_has_a_class():
    assert sorted(messages.MESSAGES) == sorted(codec.KINDS)
    for kind, cls in messages.MESSAGES.items():
        assert cls.KIND == kind
        assert cls.__dataclass_params__.frozen, kind


@pytest.mark.parametrize("kind", codec.KINDS)
def test_class_matches_schema(kind):
    schema = codec.load_schema(kind)
    cls = messages.MESSAGES[kind]
    hints = typing.get_type_hints(cls)
    fields = {_wire(f): f for f in dataclasses.fields(cls)}
    # `v` and a typed kind's `type` are the class's own, written by to_wire
    own = {"v"} | ({"type"} if kind in codec.TYPED_KINDS else set())
    assert set(fields) | own == set(schema["properties"]), kind
    assert not own & set(fields)
    required = {name for name, f in fields.items() if f.default is dataclasses.MISSING}
    assert required | own == set(schema["required"]), kind
    for name, f in fields.items():
        want = _schema_types(schema, schema["properties"][name])
        got = _field_types(hints[f.name])
        if name not in schema["required"]:
            assert type(None) in got, f"{kind}.{name}: optional, so None (absent) must be allowed"
            got = got - {type(None)}
            want = want - {type(None)}
        assert got == want, f"{kind}.{name}: class says {got}, schema says {want}"


@pytest.mark.parametrize("kind", codec.KINDS)
def test_examples_round_trip(kind):
    cls = messages.MESSAGES[kind]
    for ex in codec.examples(kind):
        msg = cls.from_wire(ex)
        # an optional field null on the wire reads as absent (None), the same to every reader's .get
        assert msg.to_wire() == {k: v for k, v in ex.items() if v is not None or k in codec.load_schema(kind)["required"]}
        assert cls.decode(msg.encode()) == msg


def test_from_wire_refuses_with_the_codec_text():
    bad = codec.examples("push_chunk")[0]
    bad["chunk"] = bad["chunks"]
    with pytest.raises(SchemaError) as want:
        codec.validate("push_chunk", dict(bad))
    with pytest.raises(SchemaError) as got:
        messages.PushChunk.from_wire(bad)
    assert str(got.value) == str(want.value) and got.value.field == "chunk"
    with pytest.raises(SchemaError, match="missing required field 'version_digest'"):
        messages.FinalChunk.from_header('{"v":1}'.replace("}", ',"run":"r","fragment":0,"version":1,"dtype":"f32",'
                                        '"chunk":0,"chunks":1,"offset":0,"nbytes":4,"total":4,'
                                        '"digest":"0000000000000000","final_step":3}'))


def test_push_stream_frames_and_seals():
    spans = chunk_plan(700, "f32", 1024)
    payloads = [bytes([s.index]) * s.nbytes for s in spans]
    stream = messages.PushStream(spans, run="r", island="isl-0", gen="9f3c2a7b1e4d6c08", fragment=1, step=6,
                                 attempt=1, try_=2, base_version=3, local_step=300, c_steps=4, c_tokens=64,
                                 dtype="f32")
    heads = [stream.chunk(s.index, p) for s, p in zip(spans, payloads)]
    digests = [chunk_header(spans, s.index, p)["digest"] for s, p in zip(spans, payloads)]
    assert [h.push_digest for h in heads[:-1]] == [None] * (len(spans) - 1)
    assert heads[-1].push_digest == push_digest(digests)
    for h, s, p in zip(heads, spans, payloads):
        wire = codec.decode_header("push_chunk", h.header())
        assert wire["try"] == 2 and wire["v"] == codec.PROTOCOL_VERSION
        assert {k: wire[k] for k in ("chunk", "chunks", "offset", "nbytes", "total", "digest")} == chunk_header(spans, s.index, p)
        assert messages.PushChunk.from_header(h.header()) == h
    h = heads[0]
    h.check_subject("r", "isl-0", "1")
    with pytest.raises(WireError, match="does not match the subject") as info:
        h.check_subject("r", "isl-1", "1")
    assert info.value.code == "subject_mismatch"


def test_cut_chunks_seal_as_the_stream_kind_says():
    spans = chunk_plan(700, "f32", 1024)
    vd = "ab" * 32
    bcast = [messages.cut_chunk(spans, s.index, b"\0" * s.nbytes, run="r", fragment=0, version=5, dtype="f32",
                                version_digest=vd) for s in spans]
    assert [type(h) for h in bcast] == [messages.BcastChunk] * len(spans)
    assert [h.version_digest for h in bcast] == [None] * (len(spans) - 1) + [vd]
    final = [messages.cut_chunk(spans, s.index, b"\0" * s.nbytes, run="r", fragment=0, version=5, dtype="f32",
                                version_digest=vd, final_step=9) for s in spans]
    assert all(type(h) is messages.FinalChunk and h.version_digest == vd and h.final_step == 9 for h in final)
    for h in bcast + final:
        assert type(h).from_header(h.header()) == h
    hdrs = {codec.CHUNK_HEADER: bcast[-1].header()}
    assert messages.read_chunk(messages.BcastChunk, hdrs, "r") == bcast[-1]
    with pytest.raises(WireError, match="chunk names another run"):
        messages.read_chunk(messages.BcastChunk, hdrs, "other")
    with pytest.raises(WireError, match="chunk message without its header"):
        messages.read_chunk(messages.BcastChunk, {}, "r")
