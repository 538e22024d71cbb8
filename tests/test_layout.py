"""Fragment layout (docs/design.md §3.7) and fingerprints."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from yeto.schemas import layout as L
from yeto.schemas.errors import ConfigError, WireError


def gpt_layout(layers=6, d=8):
    lay = [{"name": "model.embed_tokens.weight", "shape": [32, d], "dtype": "float32"},
           {"name": "lm_head.weight", "shape": [32, d], "dtype": "float32"},
           {"name": "model.norm.weight", "shape": [d], "dtype": "float32"}]
    for i in range(layers):
        lay += [{"name": f"model.layers.{i}.attn.w", "shape": [d, d], "dtype": "float32"},
                {"name": f"model.layers.{i}.mlp.w", "shape": [2 * d, d], "dtype": "float32"}]
    return lay


def test_embeddings_own_fragment_layers_strided():
    frags = L.build_fragments(gpt_layout(), 3)
    names = [[t["name"] for t in f["tensors"]] for f in frags]
    assert names[0] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert all(L.layer_index(n) % 2 == 0 for n in names[1] if L.layer_index(n) is not None)
    assert all(L.layer_index(n) % 2 == 1 for n in names[2] if L.layer_index(n) is not None)
    # the norm (no layer index) went to the lighter body fragment; every tensor exactly once
    flat = sorted(n for f in names for n in f)
    assert flat == sorted(e["name"] for e in gpt_layout())
    for f in frags:
        off = 0
        for t in f["tensors"]:
            assert t["offset"] == off and t["numel"] == L.numel(t["shape"])
            off += t["numel"]
        assert f["numel"] == off


def test_deterministic_under_input_order():
    lay = gpt_layout()
    shuffled = lay[:]
    random.Random(1).shuffle(shuffled)
    assert L.build_fragments(lay, 4) == L.build_fragments(shuffled, 4)
    assert L.layout_fingerprint(lay) == L.layout_fingerprint(shuffled)


def test_fingerprint_changes_with_shape_dtype_or_name():
    base = L.layout_fingerprint(gpt_layout())
    lay = gpt_layout()
    lay[3]["shape"] = [9, 8]
    assert L.layout_fingerprint(lay) != base
    lay = gpt_layout()
    lay[3]["dtype"] = "bfloat16"
    assert L.layout_fingerprint(lay) != base
    lay = gpt_layout()
    lay[3]["name"] += "x"
    assert L.layout_fingerprint(lay) != base


def test_session_fingerprint_covers_dtypes_and_chunks():
    s1 = L.build_session(gpt_layout(), 3, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=1 << 20, init_island="a", sync_every=6)
    s2 = L.build_session(gpt_layout(), 3, run="r", push_dtype="bf16", bulk_dtype="f32", chunk_bytes=1 << 20, init_island="a", sync_every=6)
    s3 = L.build_session(gpt_layout(), 3, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=1 << 19, init_island="a", sync_every=6)
    assert s1["layout_fingerprint"] == s2["layout_fingerprint"]
    assert len({s1["session_fingerprint"], s2["session_fingerprint"], s3["session_fingerprint"]}) == 3


def test_too_many_fragments_and_bad_layouts_refused():
    with pytest.raises(WireError) as ei:
        L.build_fragments(gpt_layout(layers=1), 10)
    assert ei.value.field == "fragments"
    with pytest.raises(WireError) as ei:
        L.canonical_layout([{"name": "a", "shape": [2]}, {"name": "a", "shape": [2]}])
    assert ei.value.field == "layout.1.name"
    with pytest.raises(WireError) as ei:
        L.canonical_layout([{"name": "a", "shape": [-1]}])
    assert ei.value.field == "layout.0.shape"
    with pytest.raises(ConfigError) as ei:  # the syncer's --push-dtype, not wire input
        L.build_session(gpt_layout(), 2, run="r", push_dtype="f8", bulk_dtype="f32", chunk_bytes=4096, init_island="a", sync_every=2)
    assert ei.value.field == "push_dtype" and "f8" in str(ei.value)
    with pytest.raises(ConfigError) as ei:  # the syncer's --fragments
        L.build_fragments(gpt_layout(), 0)
    assert ei.value.field == "fragments"


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 12), p=st.integers(1, 6))
def test_every_tensor_in_exactly_one_nonempty_fragment(layers, p):
    lay = gpt_layout(layers=layers)
    try:
        frags = L.build_fragments(lay, p)
    except WireError as exc:
        assert exc.field == "fragments"
        return
    names = [t["name"] for f in frags for t in f["tensors"]]
    assert sorted(names) == sorted(e["name"] for e in lay)
    assert all(f["tensors"] for f in frags) and len(frags) == p
