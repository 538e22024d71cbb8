"""Fuzzing the wire codec (schemas/codec.py) with hypothesis.

Whatever arrives on a subject — arbitrary bytes, or a near-valid message of any kind with fields deleted,
replaced by any JSON value, or added — `decode`, `decode_typed`, `decode_header` and `validate` either return a
message that satisfies the schema or raise the codec's own `WireError`; a refusal of a JSON object names the
offending field. Anything else (RecursionError, TypeError, a float where an integer belongs getting through to
list indexing) would escape the consumers' `except WireError` and crash or silently mis-handle a message.
"""
from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from yeto.schemas import codec
from yeto.schemas.errors import DecodeError, SchemaError, WireError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from([0, 1, -1, 2**53, 3.0, 0.5, "", "0", "x" * 70, "9f3c2a7b1e4d6c08", "a.b", "*", ">"]),
)
JSON = st.recursive(LEAF, lambda ch: st.one_of(st.lists(ch, max_size=4), st.dictionaries(st.text(max_size=8), ch, max_size=4)),
                    max_leaves=12)
# what a Python caller may hand `encode`: non-JSON values included
PY = st.one_of(JSON, st.floats(), st.tuples(st.integers()), st.binary(max_size=4),
               st.dictionaries(st.integers(), st.integers(), max_size=2), st.just(object()), st.just("a\ud800"))


def _paths(obj, pre=()):
    yield pre
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, pre + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, pre + (i,))


def _parent(obj, path):
    for p in path[:-1]:
        obj = obj[p]
    return obj


@st.composite
def near_valid(draw, kind: str, values=JSON):
    """One of the schema's own examples with 1-3 mutations: a field replaced, deleted, or a key added."""
    msg = draw(st.sampled_from(codec.examples(kind)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(msg))))
        op = draw(st.sampled_from(("set", "del", "add")))
        if op == "set":
            if not path:
                return draw(values)
            _parent(msg, path)[path[-1]] = draw(values)
        elif op == "del" and path:
            del _parent(msg, path)[path[-1]]
        elif op == "add":
            target = msg
            for p in path:
                target = target[p]
            if isinstance(target, dict):
                target[draw(st.text(max_size=6))] = draw(values)
    return msg


def _check_refusal(kind: str, msg, exc: WireError) -> None:
    assert isinstance(exc, (SchemaError, DecodeError)), repr(exc)
    if isinstance(msg, dict) and isinstance(exc, SchemaError):
        # a refusal of an object names what to fix (a dotted path, or "<message>" for the root)
        assert exc.field is not None or "<message>" in str(exc), str(exc)
        assert kind in str(exc)


@pytest.mark.parametrize("kind", codec.KINDS)
def test_near_valid_messages_pass_the_schema_or_are_refused_with_a_wire_error_naming_the_field(kind):
    @FUZZ
    @given(near_valid(kind))
    def check(msg):
        try:
            out = codec.validate(kind, msg)
        except WireError as exc:
            _check_refusal(kind, msg, exc)
            return
        # accepted: it really is a valid message, and survives a round trip through bytes unchanged
        assert codec.decode(kind, codec.encode(kind, out)) == out
        _assert_integers_are_ints(kind, out)

    check()


@pytest.mark.parametrize("kind", codec.KINDS)
def test_near_valid_bytes_decode_or_raise_only_wire_errors(kind):
    @FUZZ
    @given(near_valid(kind))
    def check(msg):
        data = orjson.dumps(msg)
        for fn in _decoders(kind):
            try:
                fn(data)
            except WireError as exc:
                _check_refusal(kind, msg, exc)

    check()


@pytest.mark.parametrize("kind", codec.KINDS)
def test_encode_of_python_values_raises_only_wire_errors(kind):
    @FUZZ
    @given(near_valid(kind, PY))
    def check(msg):
        try:
            data = codec.encode(kind, msg)
        except WireError as exc:
            assert isinstance(exc, SchemaError), repr(exc)
            return
        assert codec.decode(kind, data) == orjson.loads(data)

    check()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.sampled_from(codec.KINDS))
def test_arbitrary_bytes_raise_only_wire_errors(data, kind):
    for fn in _decoders(kind):
        try:
            fn(data)
        except WireError:
            pass


def _decoders(kind):
    fns = [lambda d: codec.decode(kind, d)]
    if kind in codec.CHUNK_KINDS:
        fns.append(lambda d: codec.decode_header(kind, d.decode("utf-8", "replace")))
    if kind in codec.TYPED_KINDS:
        fns.append(lambda d: codec.decode_typed(d))
        fns.append(lambda d: codec.decode_typed(d, allowed=(kind,)))
    return fns


def _assert_integers_are_ints(kind, msg):
    """Every value the schema types as integer came out a Python int (never 3.0)."""
    stack = [(codec._schema(kind), msg)]
    while stack:
        node, value = stack.pop()
        node = codec._resolve(kind, node)
        if node.get("type") == "integer":
            assert isinstance(value, int) and not isinstance(value, bool), (kind, value)
        if isinstance(value, dict):
            for k, v in value.items():
                if k in node.get("properties", {}):
                    stack.append((node["properties"][k], v))
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            stack.extend((node["items"], v) for v in value)


# ---- regressions the fuzzer found ---------------------------------------------------------------

@pytest.mark.parametrize("depth", [100, 990, 1000, 1020])
def test_deeply_nested_json_is_refused_as_a_schema_error_not_a_recursion_error(depth):
    # orjson parses up to 1024 levels; the codec's recursive plain-JSON walk hit Python's recursion
    # limit at ~1000 (RecursionError, which the island's CTL pump does not catch: the island died).
    for data in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        for kind in ("pull", "hello", "manifest", "event"):
            with pytest.raises(WireError):
                codec.decode(kind, data)
        with pytest.raises(WireError):
            codec.decode_typed(data, allowed=("pull", "manifest", "error", "shutdown"))
    msg = codec.examples("event")[0]
    nested: list = []
    for _ in range(depth):
        nested = [nested]
    msg["detail"] = {"x": nested}
    with pytest.raises(SchemaError, match="nests deeper") as ei:
        codec.validate("event", msg)
    assert ei.value.field.startswith("detail.x.0.0")


@pytest.mark.parametrize("kind, field", [
    ("bcast_chunk", "chunk"), ("bcast_chunk", "version"), ("final_chunk", "final_step"), ("init_chunk", "chunk"),
    ("push_chunk", "step"), ("push_chunk", "try"), ("pull", "attempt"), ("pull", "fragment"), ("ack", "final_step"),
    ("heartbeat", "local_step"),
])
def test_a_float_where_the_schema_says_integer_is_refused_naming_the_field(kind, field):
    # JSON Schema counts 3.0 as an integer, so it passed the schema and reached the consumers as a float:
    # `spans[3.0]` in the syncer's INIT/PUSH intake raised TypeError (an untaped handler error).
    msg = codec.examples(kind)[0]
    msg[field] = float(msg[field])
    data = orjson.dumps(msg)
    assert b'"%s":%s' % (field.encode(), repr(msg[field]).encode()) in data   # e.g. "chunk":2.0 on the wire
    with pytest.raises(SchemaError, match="must be an integer, not a float") as ei:
        codec.decode(kind, data)
    assert ei.value.field == field
    manifest = codec.examples("manifest")[0]
    manifest["versions"]["0"] = 40.0
    with pytest.raises(SchemaError) as ei:
        codec.validate("manifest", manifest)
    assert ei.value.field == "versions.0"
    hb = codec.examples("heartbeat")[0]
    hb["step_time_s"] = 1.0          # a number field keeps taking integral floats
    assert codec.validate("heartbeat", hb)["step_time_s"] == 1.0


def test_a_lone_surrogate_is_refused_by_encode_naming_the_field():
    # orjson raised its own TypeError ("str is not valid UTF-8") from encode/encode_header.
    msg = codec.examples("error")[0]
    msg["message"] = "bad \ud800 text"
    with pytest.raises(SchemaError, match="surrogate") as ei:
        codec.encode("error", msg)
    assert ei.value.field == "message"
