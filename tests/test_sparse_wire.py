"""docs/design.md §4.10, the sparse mode on the wire (pure parts): the island's pushes (learner/sparse_push.py)
as opaque byte chunks with `encoding` sparseloco, the syncer's check of that field, and the merge's step
(services/syncer/sparse_merge.py) against the functions of services/syncer/sparse_outer.py."""
from __future__ import annotations

import pytest
import torch

from yeto.learner.sparse_outer import ErrorFeedback
from yeto.learner.sparse_push import SparsePushes
from yeto.schemas import codec
from yeto.schemas import outer_mode as OM
from yeto.schemas.chunks import byte_plan, check_chunk, plan_nbytes
from yeto.schemas.errors import DecodeError, WireError
from yeto.schemas.layout import build_session
from yeto.schemas.messages import PushChunk, PushStream
from yeto.schemas.sparse import decode_push, push_nbytes
from yeto.services.syncer import sparse_merge as SM
from yeto.services.syncer.sparse_outer import aggregate, outer_step_

LAYOUT = [{"name": "a.w", "shape": [70, 40], "dtype": "float32"}, {"name": "a.b", "shape": [70], "dtype": "float32"},
          {"name": "c.w", "shape": [33, 9], "dtype": "float32"}]
OUTER = OM.parse_pin(OM.check_outer("sparseloco", tile=8, k=4, chunk_1d=16, k_1d=8, beta=0.9))


def session(chunk_bytes: int = 1024) -> dict:
    s = build_session(LAYOUT, 1, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=chunk_bytes,
                      init_island="a", sync_every=2, created=1.0)
    return OM.pin(s, OUTER.to_pin())


def test_byte_plan_cuts_opaque_bytes_and_check_chunk_reads_it():
    spans = byte_plan(2500, 1024)
    assert [(s.byte_offset, s.nbytes) for s in spans] == [(0, 1024), (1024, 1024), (2048, 452)]
    assert plan_nbytes(spans) == 2500 and all(s.elem_offset == s.byte_offset for s in spans)
    with pytest.raises(WireError, match="total"):
        byte_plan(0, 1024)


def test_the_island_pushes_error_feedback_messages_kept_only_when_the_push_got_through():
    s = session()
    frag = s["fragments"][0]
    sp = SparsePushes(s, OUTER)
    ref = ErrorFeedback(SM.shapes(frag), OUTER.spec, OUTER.beta)
    g = torch.Generator().manual_seed(0)
    shapes = SM.shapes(frag)
    for rnd in range(3):
        d = torch.randn(frag["numel"], generator=g)
        msg = sp.encode(0, d.clone())   # consumed: its storage becomes the new accumulators
        assert len(msg) == push_nbytes(shapes, OUTER.spec) == plan_nbytes(sp.spans(0))
        # Δ = anchor − local = −d, per tensor in layout order
        deltas = [(-d[t["offset"]: t["offset"] + t["numel"]]).view(t["shape"]) for t in frag["tensors"]]
        if rnd == 1:   # a failed push: the next try starts from the accumulators before it
            sp.settle(0, False)
            continue
        assert msg == ref.push(deltas)
        sp.settle(0, True)
        for got, want in zip(sp.accumulators(0), ref.acc):
            assert torch.equal(got, want)


def test_the_fold_over_d_is_bitwise_the_reference_fold_on_signed_zeros_and_underflow():
    """ErrorFeedback.folded writes (β·e − d) + 0.0 over d block by block; `push` folds β·e + (−d + 0.0):
    the same bits, signed zeros, values whose β·e underflows to −0, and β·e == d included."""
    from yeto.learner import sparse_outer as SO

    g = torch.Generator().manual_seed(7)
    n = 3 * SO.FOLD_BLOCK + 123   # several blocks and a short last one
    e = torch.randn(n, generator=g)
    d = torch.randn(n, generator=g)
    special = torch.tensor([-0.0, 0.0, -1e-45, 1e-45, -0.0, 0.0, 2.0, -3.0])
    e[:8], d[:8] = special, torch.tensor([0.0, -0.0, 0.0, -0.0, -0.0, 0.0, 1.9, -2.85])
    d[8:16] = e[8:16] * 0.95                     # β·e == d: an exact zero
    shapes = [(n,)]
    prev = ErrorFeedback(shapes, OUTER.spec, 0.95)
    prev.acc = [e.clone()]
    ref = ErrorFeedback(shapes, OUTER.spec, 0.95)
    ref.acc = [e.clone()]
    want_msg = ref.push([torch.neg(d).add_(0.0)])
    got = ErrorFeedback.folded(prev, OUTER.spec, 0.95, [d.clone()])
    assert torch.equal(prev.acc[0].view(torch.int32), e.view(torch.int32))   # untouched
    assert got.compress() == want_msg
    assert torch.equal(got.acc[0].view(torch.int32), ref.acc[0].view(torch.int32))


def test_compress_subtracts_what_it_sent_bit_for_bit_as_a_gather_and_a_scatter():
    """`compress` takes e − decode(m) as one index_add_ of −v: the bits of e[i] − v[i], signed zeros and
    values equal to what was sent (an exact zero) included."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 24, generator=g)
    x[0, :8] = torch.tensor([-0.0, 0.0, 5.0, -5.0, 1e-45, -1e-45, 3.0, 3.0])
    x[9:17, 8:16] = 0.25                         # all equal: the kept ones decode to exactly 0.25
    ef = ErrorFeedback([x.shape], OUTER.spec, 0.9)
    ef.acc = [x.clone()]
    msg = ef.compress()
    (sent,) = decode_push(msg, [x.shape], OUTER.spec)
    want = x.clone().view(-1)
    want[sent.indices] = want[sent.indices] - sent.values
    assert torch.equal(ef.acc[0].view(-1).view(torch.int32), want.view(torch.int32))


def test_delta_zero_is_plus_zero_as_anchor_minus_local():
    s = session()
    sp = SparsePushes(s, OUTER)
    sp.encode(0, torch.zeros(s["fragments"][0]["numel"]))
    sp.settle(0, True)
    assert all(not torch.signbit(a).any() for a in sp.accumulators(0))


def test_push_headers_say_the_encoding_and_the_schema_knows_only_sparseloco():
    spans = byte_plan(3000, 1024)
    stream = PushStream(spans, run="r", island="a", gen="ab" * 8, fragment=0, step=1, attempt=1, try_=0,
                        base_version=0, local_step=2, c_steps=2, c_tokens=4, dtype="f32", encoding="sparseloco")
    payload = bytes(range(256)) * 4
    head = PushChunk.from_header(stream.chunk(0, payload).header())
    assert head.encoding == "sparseloco"
    check_chunk(spans, head.to_wire(), payload)
    dense = PushStream(spans, run="r", island="a", gen="ab" * 8, fragment=0, step=1, attempt=1, try_=0,
                       base_version=0, local_step=2, c_steps=2, c_tokens=4, dtype="f32")
    assert PushChunk.from_header(dense.chunk(0, payload).header()).encoding is None   # a dense header as before
    bad = {**head.to_wire(), "encoding": "topk"}
    with pytest.raises(WireError, match="encoding"):
        codec.validate("push_chunk", bad)


def test_the_syncer_refuses_a_push_of_the_other_mode_naming_the_field():
    SM.check_encoding({"encoding": "sparseloco"}, OUTER)
    SM.check_encoding({}, None)
    for meta, outer in (({}, OUTER), ({"encoding": "sparseloco"}, None)):
        with pytest.raises(WireError) as err:
            SM.check_encoding(meta, outer)
        assert err.value.field == "encoding" and err.value.code == "wrong_encoding"


def test_a_message_the_decoder_refuses_names_the_field():
    s = session()
    frag = s["fragments"][0]
    msg = bytearray(SparsePushes(s, OUTER).encode(0, torch.randn(frag["numel"])))
    msg[4] = 9   # the format byte
    with pytest.raises(DecodeError):
        SM.decode(frag, OUTER, bytes(msg))


def test_the_merge_step_span_by_span_is_outer_step_on_the_tensors():
    s = session()
    frag = s["fragments"][0]
    g = torch.Generator().manual_seed(3)
    msgs = [SparsePushes(s, OUTER).encode(0, torch.randn(frag["numel"], generator=g) * (i + 1)) for i in range(3)]
    pushes = [SM.decode(frag, OUTER, m) for m in msgs]
    params = torch.randn(frag["numel"], generator=g)
    # the reference: outer_step_ on each tensor's own params
    ref = [params[t["offset"]: t["offset"] + t["numel"]].clone().view(t["shape"]) for t in frag["tensors"]]
    outer_step_(ref, aggregate([[t for t in p] for p in pushes]), 0.7)
    step = SM.FragmentStep.of(frag, pushes, 0.7)
    got = params.clone()
    for off in range(0, frag["numel"], 1000):   # spans of any cut
        step.apply(got[off: off + 1000], off)
    assert torch.equal(got, torch.cat([r.reshape(-1) for r in ref]))
    assert SM.norm(pushes[0]) > 0
    assert torch.equal(decode_push(msgs[0], SM.shapes(frag), OUTER.spec)[0].values, pushes[0][0].values)
