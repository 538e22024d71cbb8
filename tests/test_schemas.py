"""The wire contract: every schema is valid draft 2020-12, accepts its own examples, and refuses broken
messages with an error that names the field and the value. jsonschema (a second, independent validator)
must agree with the codec (fastjsonschema) on every schema-level verdict."""
from __future__ import annotations

import json
from importlib import resources

import numpy as np
import orjson
import pytest
from jsonschema import Draft202012Validator

from yeto.schemas import codec
from yeto.schemas.errors import DecodeError, SchemaError, WireError

KINDS = codec.KINDS
# INIT chunks carry the INIT island's id and generation too (version 0 comes from one process).
ISLAND_KINDS = codec.ISLAND_KINDS


def _ref_validator(kind):
    return Draft202012Validator(codec.load_schema(kind))


def _first(kind):
    return codec.examples(kind)[0]


def _prop_schema(schema, name):
    prop = schema["properties"][name]
    if "$ref" in prop:
        prop = schema["$defs"][prop["$ref"].rsplit("/", 1)[1]]
    return prop


def _assert_refused(kind, msg, field, *, schema_level=True, show_value=True):
    """The codec refuses msg naming `field`; the value shows in the text; jsonschema agrees when schema_level."""
    with pytest.raises(SchemaError) as info:
        codec.validate(kind, msg)
    err = info.value
    assert err.field == field, str(err)
    assert kind in str(err)
    if show_value:
        assert repr(err.value) in str(err) or str(err.value) in str(err)
    # the same refusal on the wire path
    with pytest.raises(SchemaError):
        codec.decode(kind, json.dumps(msg))
    if schema_level is None:
        # A trailing newline: jsonschema runs `pattern` with Python's re.search, where `$` also matches before a
        # final "\n" (ECMA-262's `$` does not); fastjsonschema rewrites `$` to `\Z`. The codec is the strict one,
        # and this is exactly the id that must never reach a subject.
        assert _ref_validator(kind).is_valid(msg)
    elif schema_level:
        assert not _ref_validator(kind).is_valid(msg), "jsonschema accepts what the codec refuses"
    else:  # a cross-field rule JSON Schema cannot state: the reference validator accepts it
        assert _ref_validator(kind).is_valid(msg)
    return err


# ---------------------------------------------------------------------------------------------------- schema files

def test_schema_files_are_exactly_the_kinds():
    files = sorted(p.name for p in resources.files("yeto.schemas").joinpath("json").iterdir() if p.name.endswith(".json"))
    assert files == sorted(f"{k}.schema.json" for k in KINDS)
    assert set(codec.CHUNK_KINDS) <= set(KINDS) and set(codec.TYPED_KINDS) <= set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_schema_is_valid_2020_12_with_metadata(kind):
    schema = codec.load_schema(kind)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(f"/{kind}.schema.json")
    assert schema["title"] and schema["description"]
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert {"v", "run"} <= set(schema["required"])
    assert _prop_schema(schema, "v")["const"] == codec.PROTOCOL_VERSION
    assert _prop_schema(schema, "run")["pattern"] == "^[A-Za-z0-9_-]+$"
    if kind in ISLAND_KINDS:
        assert {"island", "gen"} <= set(schema["required"])
        assert _prop_schema(schema, "gen")["pattern"] == "^[0-9a-f]{16}$"
    if kind in codec.TYPED_KINDS:
        assert "type" in schema["required"] and schema["properties"]["type"]["const"] == kind
    assert schema["examples"]


@pytest.mark.parametrize("kind", KINDS)
def test_examples_are_valid_in_both_validators_and_round_trip(kind):
    ref = _ref_validator(kind)
    for example in codec.examples(kind):
        assert list(ref.iter_errors(example)) == []
        data = codec.encode(kind, example)
        assert isinstance(data, bytes)
        assert codec.decode(kind, data) == example
        assert codec.decode(kind, data.decode()) == example  # str input too
        assert codec.validate(kind, example) is example


def test_load_schema_and_examples_are_copies():
    codec.examples("pull")[0]["members"].clear()
    codec.load_schema("pull")["required"].clear()
    assert codec.examples("pull")[0]["members"]
    assert codec.load_schema("pull")["required"]


def test_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown message kind 'helo'"):
        codec.encode("helo", {})
    with pytest.raises(ValueError, match="unknown message kind"):
        codec.encode_header("pull", _first("pull"))  # not a chunk kind


# ---------------------------------------------------------------------------------------------------- broken variants

REQUIRED = [(k, f) for k in KINDS for f in codec.load_schema(k)["required"]]


@pytest.mark.parametrize("kind,field", REQUIRED, ids=[f"{k}-{f}" for k, f in REQUIRED])
def test_missing_required_field_is_named(kind, field):
    msg = _first(kind)
    del msg[field]
    err = _assert_refused(kind, msg, field, show_value=False)
    assert err.rule == "required" and "missing" in str(err)


@pytest.mark.parametrize("kind,field", REQUIRED, ids=[f"{k}-{f}" for k, f in REQUIRED])
def test_wrong_type_is_named(kind, field):
    msg = _first(kind)
    prop = _prop_schema(codec.load_schema(kind), field)
    msg[field] = ["wrong", "type"] if prop.get("type") == "object" else {"wrong": "type"}
    _assert_refused(kind, msg, field)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", ["run.1", "run 1", "", "run\n", "r*"])
def test_bad_run_id(kind, bad):
    msg = _first(kind)
    msg["run"] = bad
    err = _assert_refused(kind, msg, "run", schema_level=None if bad.endswith("\n") else True)
    assert err.rule in ("pattern", "minLength")


@pytest.mark.parametrize("kind", ISLAND_KINDS)
@pytest.mark.parametrize("field,bad", [
    ("island", "isl.0"), ("island", "isl>"), ("island", "x" * 65),
    ("gen", "9F3C2A7B1E4D6C08"), ("gen", "9f3c2a7b1e4d6c0"), ("gen", "9f3c2a7b1e4d6c08\n"), ("gen", 123),
])
def test_bad_island_or_gen(kind, field, bad):
    msg = _first(kind)
    msg[field] = bad
    lax = isinstance(bad, str) and bad.endswith("\n")
    _assert_refused(kind, msg, field, schema_level=None if lax else True)


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_field_and_other_version_are_refused(kind):
    msg = _first(kind)
    msg["colour"] = "blue"
    err = _assert_refused(kind, msg, "colour")
    assert err.rule == "additionalProperties"
    msg = _first(kind)
    msg["v"] = 2
    _assert_refused(kind, msg, "v")


NESTED = [
    ("pull", lambda m: m["members"][1].update(gen="not-hex-gen-0000"), "members.1.gen"),
    ("pull", lambda m: m["members"].clear(), "members"),
    ("pull", lambda m: m.update(step=0), "step"),
    ("pull", lambda m: m.update(attempt=0), "attempt"),
    ("hello", lambda m: m["layout"][1]["shape"].__setitem__(0, -1), "layout.1.shape.0"),
    ("hello", lambda m: m["layout"][0].update(dtype="float64"), "layout.0.dtype"),
    ("hello", lambda m: m.update(push_dtype="int8"), "push_dtype"),
    ("hello", lambda m: m.update(bulk_dtype="q4"), "bulk_dtype"),
    ("hello", lambda m: m.update(layout_fingerprint="ab" * 31), "layout_fingerprint"),
    ("hello", lambda m: m["world"].update(cp=0), "world.cp"),
    ("hello", lambda m: m["world"].pop("tp"), "world.tp"),
    ("session", lambda m: m["fragments"][1]["tensors"][0].update(numel=-1), "fragments.1.tensors.0.numel"),
    ("session", lambda m: m.update(push_dtype="auto"), "push_dtype"),
    ("session", lambda m: m.update(chunk_bytes=512), "chunk_bytes"),
    ("heartbeat", lambda m: m.update(step_time_s=-0.5), "step_time_s"),
    ("push_chunk", lambda m: m.update(dtype="f16"), "dtype"),
    ("push_chunk", lambda m: m.update(digest="5d3b0f21c8a4e9d"), "digest"),
    ("push_chunk", lambda m: m.update({"try": -1}), "try"),
    ("init_chunk", lambda m: m.update(dtype="q4"), "dtype"),
    ("bcast_chunk", lambda m: m.update(version_digest="z" * 64), "version_digest"),
    ("final_chunk", lambda m: m.update(dtype="bf16"), "dtype"),
    ("manifest", lambda m: m["versions"].update({"01": 3}), "versions.01"),
    ("manifest", lambda m: m["version_digests"].update({"1": "00"}), "version_digests.1"),
    ("manifest", lambda m: m.update(versions={}), "versions"),
    ("error", lambda m: m.update(code="Layout Mismatch"), "code"),
    ("error", lambda m: m.update(fatal="yes"), "fatal"),
    ("steplog", lambda m: m.update(bytes_out=-1), "bytes_out"),
    ("steplog", lambda m: m["versions"].update(x=1), "versions.x"),
    ("steplog", lambda m: m["extra"].update(hist=[1, 2]), "extra.hist"),
    ("event", lambda m: m.update(kind="launch"), "kind"),
    ("event", lambda m: m.pop("weights"), "weights"),  # required when kind == merge
    ("event", lambda m: m["weights"].update({"bad island": 1.0}), "weights.bad island"),
    ("event", lambda m: m["expected"][0].update(gen="0"), "expected.0.gen"),
    ("event", lambda m: m.update(kind="join", island=None, gen="9f3c2a7b1e4d6c08"), "island"),
]


@pytest.mark.parametrize("kind,mutate,field", NESTED, ids=[f"{k}-{f}" for k, _, f in NESTED])
def test_nested_and_enum_violations_name_the_path(kind, mutate, field):
    msg = _first(kind)
    mutate(msg)
    _assert_refused(kind, msg, field, show_value=field not in ("world.tp", "weights"))


def test_event_kind_rules_apply_only_to_their_kind():
    join = codec.examples("event")[2]
    assert join["kind"] == "join" and "weights" not in join
    codec.validate("event", join)
    msg = dict(join, kind="disposition")
    err = _assert_refused("event", msg, "step", show_value=False)
    assert err.rule == "required"


# ---------------------------------------------------------------------------------------------------- cross-field rules

def _push(last):
    return codec.examples("push_chunk")[1 if last else 0]


CROSS = [
    ("push_chunk", lambda m: m.update(chunk=4), "chunk"),
    ("push_chunk", lambda m: m.update(nbytes=2**21, chunk=1, offset=2**21), "nbytes"),
    ("push_chunk", lambda m: m.update(offset=5), "offset"),
    ("bcast_chunk", lambda m: m.update(chunks=1), "nbytes"),  # a single chunk must cover the whole payload
    ("final_chunk", lambda m: m.update(nbytes=1024), "nbytes"),  # last chunk ends short of total
    ("init_chunk", lambda m: m.update(offset=2**26), "nbytes"),
    ("session", lambda m: m["fragments"][1]["tensors"][1].update(numel=1048575), "fragments.1.tensors.1.numel"),
    ("session", lambda m: m["fragments"][1]["tensors"][1].update(offset=786433), "fragments.1.tensors.1.offset"),
    ("session", lambda m: m["fragments"][1].update(numel=1835521), "fragments.1.numel"),
    ("session", lambda m: m["fragments"][1].update(id=2), "fragments.1.id"),
    ("session", lambda m: m["fragments"][1]["tensors"][2].update(name="embedding.word_embeddings.weight", shape=[512]),
     "fragments.1.tensors.2.name"),
    ("session", lambda m: m.update(sync_every=101), "sync_every"),
    ("hello", lambda m: m["layout"][2].update(name=m["layout"][1]["name"]), "layout.2.name"),
    ("pull", lambda m: m["members"][1].update(island="ascend_b"), "members.1.island"),
    ("manifest", lambda m: m["versions"].update({"2": 7}), "versions.2"),
    ("manifest", lambda m: m["version_digests"].pop("0"), "versions.0"),
]


@pytest.mark.parametrize("kind,mutate,field", CROSS, ids=[f"{k}-{f}" for k, _, f in CROSS])
def test_cross_field_rules(kind, mutate, field):
    msg = _first(kind)
    mutate(msg)
    _assert_refused(kind, msg, field, schema_level=False)


def test_push_digest_on_the_last_chunk_only():
    last = _push(True)
    del last["push_digest"]
    err = _assert_refused("push_chunk", last, "push_digest", schema_level=False, show_value=False)
    assert "last chunk" in str(err)
    middle = _push(False)
    middle["push_digest"] = _push(True)["push_digest"]
    err = _assert_refused("push_chunk", middle, "push_digest", schema_level=False)
    assert err.rule == "last_chunk_only"


def test_version_digest_seals_the_last_bcast_chunk_only_and_every_final_chunk():
    # BCAST: chunks 0..n-2 may go out while the version is still being merged; the last chunk (the
    # seal) carries the version digest once the version is durable.
    first, last = codec.examples("bcast_chunk")
    assert "version_digest" not in first and last["chunk"] == last["chunks"] - 1
    assert codec.validate("bcast_chunk", first) is first
    sealless = {k: v for k, v in last.items() if k != "version_digest"}
    err = _assert_refused("bcast_chunk", sealless, "version_digest", schema_level=False, show_value=False)
    assert err.rule == "required" and "last chunk" in str(err)
    early = dict(first, version_digest=last["version_digest"])
    err = _assert_refused("bcast_chunk", early, "version_digest", schema_level=False)
    assert err.rule == "last_chunk_only" and "chunk 0 of 8" in str(err)
    # FINAL is unchanged: every chunk carries it (a schema-level requirement)
    final0 = dict(_first("final_chunk"), chunk=0, offset=0, nbytes=1048576)
    assert codec.validate("final_chunk", final0) is final0
    del final0["version_digest"]
    _assert_refused("final_chunk", final0, "version_digest", show_value=False)


# ---------------------------------------------------------------------------------------------------- plain JSON values

@pytest.mark.parametrize("kind,path,bad", [
    ("steplog", ("loss",), float("nan")),
    ("steplog", ("boundary_s",), float("inf")),
    ("steplog", ("extra", "lr"), float("-inf")),
    ("event", ("weights", "isl-0"), float("nan")),
    ("heartbeat", ("step_time_s",), float("nan")),
])
def test_non_finite_numbers_refused_on_encode(kind, path, bad):
    msg = _first(kind)
    node = msg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(SchemaError, match="finite") as info:
        codec.encode(kind, msg)
    assert info.value.field == ".".join(path)
    assert orjson.dumps(msg)  # orjson alone would have written null


def test_non_json_values_refused_with_the_field():
    msg = _first("heartbeat")
    msg["local_step"] = np.int64(5)
    with pytest.raises(SchemaError, match="numpy") as info:
        codec.encode("heartbeat", msg)
    assert info.value.field == "local_step"
    msg["local_step"] = True  # bool is not an integer in JSON Schema
    _assert_refused("heartbeat", msg, "local_step")
    msg["local_step"] = 2**53
    with pytest.raises(SchemaError, match="2\\^53") as info:
        codec.encode("heartbeat", msg)
    assert info.value.field == "local_step"
    msg = _first("manifest")
    msg["versions"] = {0: 40, "1": 40}
    with pytest.raises(SchemaError, match="key must be a string") as info:
        codec.encode("manifest", msg)
    assert info.value.field == "versions.0"


def test_tuples_are_arrays():
    msg = _first("hello")
    msg["layout"][0]["shape"] = (32000, 512)
    assert codec.decode("hello", codec.encode("hello", msg))["layout"][0]["shape"] == [32000, 512]


# ---------------------------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("data", [b"{", b"", b"{\"v\": 1,}", b"NaN", b"{\"x\": 1e400}", b"\xff\xfe", "{'v': 1}"])
@pytest.mark.parametrize("kind", ["hello", "pull", "steplog"])
def test_malformed_json_is_a_decode_error(kind, data):
    with pytest.raises(DecodeError) as info:
        codec.decode(kind, data)
    err = info.value
    assert err.field is None and err.code == "malformed"
    assert kind in str(err) and "malformed JSON" in str(err)
    assert repr(data[:10])[:8] in str(err)  # an excerpt of the input


def test_long_input_excerpt_is_short():
    data = b"{" + b"x" * 10_000
    with pytest.raises(DecodeError) as info:
        codec.decode("session", data)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("data", [b"[1, 2]", b"\"hello\"", b"42", b"null"])
def test_non_object_is_a_schema_error_at_the_root(data):
    with pytest.raises(SchemaError) as info:
        codec.decode("hello", data)
    assert info.value.field is None and "must be object" in str(info.value)
    assert repr(orjson.loads(data)) in str(info.value)


def test_unsafe_integer_on_the_wire_is_refused():
    raw = codec.encode("heartbeat", _first("heartbeat")).replace(b"\"local_step\":1234", b"\"local_step\":18446744073709551615")
    with pytest.raises(SchemaError) as info:
        codec.decode("heartbeat", raw)
    assert info.value.field == "local_step"


def test_decode_typed_dispatches_on_type():
    for kind in codec.TYPED_KINDS:
        for example in codec.examples(kind):
            assert codec.decode_typed(codec.encode(kind, example)) == (kind, example)
    # the syncer's CTL consumer takes only what islands send it
    syncer_side = ("hello", "heartbeat", "ack")
    with pytest.raises(SchemaError) as info:
        codec.decode_typed(codec.encode("pull", _first("pull")), syncer_side)
    assert info.value.field == "type" and info.value.value == "pull"
    with pytest.raises(SchemaError) as info:
        codec.decode_typed(b"{\"v\": 1}", syncer_side)
    assert info.value.field == "type"
    # a valid type with a broken body is refused by that type's schema
    bad = _first("ack")
    bad["final_step"] = 0
    with pytest.raises(SchemaError) as info:
        codec.decode_typed(orjson.dumps(bad), syncer_side)
    assert info.value.field == "final_step" and info.value.kind == "ack"
    with pytest.raises(DecodeError):
        codec.decode_typed(b"{", syncer_side)
    with pytest.raises(ValueError):
        codec.decode_typed(b"{}", ("push_chunk",))


def test_make_fills_version_and_type():
    for kind in KINDS:
        example = _first(kind)
        fields = {k: v for k, v in example.items() if k not in ("v", "type")}
        assert codec.make(kind, fields) == example
    push = _push(False)
    tries = push.pop("try")
    push.pop("v")
    assert codec.make("push_chunk", {"try": tries}, **push) == _push(False)
    with pytest.raises(SchemaError) as info:
        codec.make("ack", run="r", island="i", gen="0" * 16)
    assert info.value.field == "final_step"


# ---------------------------------------------------------------------------------------------------- headers

@pytest.mark.parametrize("kind", codec.CHUNK_KINDS)
def test_header_round_trip(kind):
    assert codec.CHUNK_HEADER == "Yeto-Chunk"
    for example in codec.examples(kind):
        text = codec.encode_header(kind, example)
        assert isinstance(text, str)
        assert "\r" not in text and "\n" not in text and ": " not in text  # compact, one header line
        assert codec.decode_header(kind, text) == example
        assert codec.decode_header(kind, text.encode()) == example
        assert len(text) < 1024  # leaves the payload its headroom under max_payload


def test_header_refuses_bad_input():
    meta = _first("bcast_chunk")
    meta["run"] = "run\r\nNats-Msg-Id: x"  # header injection attempt
    with pytest.raises(SchemaError) as info:
        codec.encode_header("bcast_chunk", meta)
    assert info.value.field == "run"
    with pytest.raises(DecodeError):
        codec.decode_header("bcast_chunk", "{\"v\":1,")
    good = codec.encode_header("init_chunk", _first("init_chunk"))
    with pytest.raises(SchemaError) as info:
        codec.decode_header("bcast_chunk", good)  # an init header is not a broadcast header
    assert info.value.field in ("version", "version_digest")


def test_errors_are_wire_errors_with_codes():
    msg = _first("pull")
    msg["fragment"] = -1
    with pytest.raises(WireError) as info:
        codec.encode("pull", msg)
    assert info.value.code == "schema" and info.value.value == -1 and info.value.rule == "minimum"
    assert "fragment" in str(info.value) and "-1" in str(info.value)
