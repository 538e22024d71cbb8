"""The sparse outer mode's math (learner/sparse_outer.py, services/syncer/sparse_outer.py,
schemas/sparse_update.py; docs/design.md §4.10) against an independent numpy reference
(tests/sparse_reference.py): a multi-round run of two islands on a least-squares problem agrees round by
round to f32 rounding, and an island that applies the broadcast updates to its anchor holds the syncer's
params bit for bit. Plus the aggregation by hand, the accumulator across a restart, and the update
message's round trip (over shapes) and refusals. Pure tier."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto.learner.sparse_outer import ErrorFeedback, pseudo_gradient
from yeto.schemas.errors import DecodeError, WireError
from yeto.schemas.sparse import SparseTensor, decode_push
from yeto.schemas.sparse_chunks import grid_of
from yeto.schemas.sparse_spec import SparseSpec
from yeto.schemas.sparse_update import apply_step_, decode_update, encode_update, update_nbytes
from yeto.services.syncer.sparse_outer import aggregate, clip_factors, outer_step_

from tests.sparse_reference import RefIsland, ref_aggregate, ref_outer_step

# Small tiles so a 70 x 100 weight has full tiles, a right edge (100 = 6·16 + 4), a bottom edge
# (70 = 4·16 + 6) and a corner; the bias keeps 4 of every 16 (and 2 of its last 6).
SPEC = SparseSpec(tile=16, k=8, chunk_1d=16, k_1d=4)
SHAPES = [(70, 100), (70,)]
BETA, OUTER_LR, INNER_LR, H = 0.95, 0.7, 0.05, 5


class Task:
    """Linear least squares y = W x + b, each island its own data; inner SGD in numpy f32, shared by both
    runs (the task is not under test: both sides must train on identical bits)."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.w_true = rng.standard_normal(SHAPES[0]).astype(np.float32) * 0.3
        self.b_true = rng.standard_normal(SHAPES[1]).astype(np.float32)
        self.x_val = rng.standard_normal((256, 100)).astype(np.float32)

    def batch(self, island, rnd, step):
        rng = np.random.default_rng([island, rnd, step])
        x = rng.standard_normal((32, 100)).astype(np.float32)
        return x, x @ self.w_true.T + self.b_true + np.float32(0.01) * rng.standard_normal((32, 70)).astype(np.float32)

    def train(self, w, b, island, rnd):
        w, b = w.copy(), b.copy()
        for step in range(H):
            x, y = self.batch(island, rnd, step)
            err = x @ w.T + b - y
            w -= np.float32(INNER_LR) * (err.T @ x) / np.float32(len(x))
            b -= np.float32(INNER_LR) * err.mean(axis=0)
        return w, b

    def loss(self, w, b):
        y = self.x_val @ self.w_true.T + self.b_true
        return float(((self.x_val @ w.T + b - y) ** 2).mean())


def test_two_islands_agree_with_the_reference_round_by_round_and_islands_stay_bitwise():
    task = Task()
    rng = np.random.default_rng(1)
    init = [rng.standard_normal(SHAPES[0]).astype(np.float32) * 0.1, np.zeros(SHAPES[1], np.float32)]

    ref_params = [p.copy() for p in init]
    ref_islands = [RefIsland(SHAPES, SPEC, BETA) for _ in range(2)]

    params = [torch.from_numpy(p.copy()) for p in init]      # the syncer's f32 params
    anchors = [[torch.from_numpy(p.copy()) for p in init] for _ in range(2)]  # each island's anchor
    feedback = [ErrorFeedback(SHAPES, SPEC, BETA) for _ in range(2)]
    kept = [grid_of(s, SPEC).n_kept() for s in SHAPES]

    loss0 = task.loss(*init)
    for rnd in range(8):
        # the reference round
        ref_deltas = []
        for i in range(2):
            w, b = task.train(*ref_params, i, rnd)
            ref_deltas.append([ref_params[0] - w, ref_params[1] - b])
        ref_sent = [isl.push(d) for isl, d in zip(ref_islands, ref_deltas)]
        ref_outer_step(ref_params, ref_aggregate(ref_sent), OUTER_LR)

        # ours: islands train from their anchors, push bytes; the syncer decodes, aggregates, steps
        msgs = []
        for i in range(2):
            w, b = task.train(anchors[i][0].numpy(), anchors[i][1].numpy(), i, rnd)
            deltas = [pseudo_gradient(a, torch.from_numpy(x)) for a, x in zip(anchors[i], (w, b))]
            msgs.append(feedback[i].push(deltas))
        pushes = [decode_push(m, SHAPES, SPEC) for m in msgs]
        assert [[t.indices.numel() for t in p] for p in pushes] == [kept, kept]
        steps = outer_step_(params, aggregate(pushes), OUTER_LR)
        update = encode_update(steps, SHAPES, SPEC)
        assert len(update) == update_nbytes(SHAPES, [s.indices.numel() for s in steps], SPEC)
        for i in range(2):
            for anchor, step in zip(anchors[i], decode_update(update, SHAPES, SPEC)):
                apply_step_(anchor, step)
            assert all(torch.equal(a, p) for a, p in zip(anchors[i], params)), f"island {i} round {rnd}"

        for mine, ref in zip(params, ref_params):
            np.testing.assert_allclose(mine.numpy(), ref, rtol=1e-6, atol=1e-7, err_msg=f"round {rnd}")
        for fb, isl in zip(feedback, ref_islands):
            for mine, ref in zip(fb.acc, isl.acc):
                np.testing.assert_allclose(mine.numpy(), ref, rtol=1e-5, atol=1e-6, err_msg=f"round {rnd}")
        # the two islands overlap on some coordinates and not on others: the mean is over senders
        union = torch.unique(torch.cat([p[0].indices for p in pushes])).numel()
        assert kept[0] < union < 2 * kept[0]

    assert task.loss(*[p.numpy() for p in params]) < 0.5 * loss0


def test_aggregation_by_hand():
    a = [SparseTensor(torch.tensor([0, 1]), torch.tensor([3.0, 4.0]))]     # norm 5
    b = [SparseTensor(torch.tensor([1, 2]), torch.tensor([6.0, 8.0]))]     # norm 10: clipped to 5
    c = [SparseTensor(torch.tensor([2, 5]), torch.tensor([0.6, 0.8]))]     # norm 1
    (two,) = aggregate([a, b])
    assert two.indices.tolist() == [0, 1, 2]
    torch.testing.assert_close(two.values, torch.tensor([3.0, (4.0 + 3.0) / 2, 4.0]))
    (three,) = aggregate([a, b, c])   # median 5: a untouched, b halved, c untouched
    assert three.indices.tolist() == [0, 1, 2, 5]
    torch.testing.assert_close(three.values, torch.tensor([3.0, 3.5, (4.0 + 0.6) / 2, 0.8]))
    assert clip_factors([2.0, 1.0]) == [pytest.approx(0.5), pytest.approx(1.0)]  # 1/(1 + 1e-8): f32 1.0
    assert clip_factors([1.0, 3.0, 2.0]) == [1.0, pytest.approx(2 / 3), pytest.approx(1.0)]
    p = torch.zeros(6)
    (step,) = outer_step_([p], [three], 0.5)
    torch.testing.assert_close(p, -0.5 * torch.tensor([3.0, 3.5, 2.3, 0.0, 0.0, 0.8]))
    assert step.indices.tolist() == [0, 1, 2, 5]


def test_error_feedback_keeps_what_was_not_sent():
    spec = SparseSpec(chunk_1d=8, k_1d=2)
    fb = ErrorFeedback([(8,)], spec, 0.5)
    d = torch.tensor([1.0, -8.0, 0.5, 0.0, 4.0, 0.25, -0.5, 2.0])
    (sent,) = decode_push(fb.push([d]), [(8,)], spec)
    assert sent.indices.tolist() == [1, 4]
    assert torch.equal(fb.acc[0] + sent.dense((8,)), d)   # e = Δ − sent, exactly
    before = fb.acc[0].clone()
    (sent,) = decode_push(fb.push([torch.zeros(8)]), [(8,)], spec)
    assert sent.indices.tolist() == [0, 7]   # 0.5·e: the largest left were 2.0 and 1.0
    assert torch.equal(fb.acc[0] + sent.dense((8,)), 0.5 * before)


def test_update_message_round_trip_and_refusals():
    shapes = [(70, 100), (70,), (0,)]
    g = torch.Generator().manual_seed(2)
    idx = [torch.randperm(7000, generator=g)[:500], torch.tensor([69, 0, 17]), torch.tensor([], dtype=torch.int64)]
    steps = [SparseTensor(i, torch.randn(i.numel(), generator=g)) for i in idx]
    msg = encode_update(steps, shapes, SPEC)
    assert len(msg) == update_nbytes(shapes, [500, 3, 0], SPEC)
    for mine, back in zip(steps, decode_update(msg, shapes, SPEC)):
        order = torch.argsort(back.indices)
        mo = torch.argsort(mine.indices)
        assert torch.equal(back.indices[order], mine.indices[mo]) and torch.equal(back.values[order], mine.values[mo])
    for n in range(0, len(msg), 97):
        with pytest.raises(DecodeError):
            decode_update(msg[:n], shapes, SPEC)
    counts_at = 14 + 12
    buf = bytearray(msg)
    buf[counts_at:counts_at + 2] = (300).to_bytes(2, "little")     # chunk 0 holds 256 values
    with pytest.raises(DecodeError) as e:
        decode_update(bytes(buf), shapes, SPEC)
    assert e.value.field == "tensors.0.counts.0" and e.value.value == 300
    buf = bytearray(msg)
    buf[counts_at:counts_at + 2] = (int.from_bytes(msg[counts_at:counts_at + 2], "little") + 1).to_bytes(2, "little")
    with pytest.raises(DecodeError) as e:
        decode_update(bytes(buf), shapes, SPEC)
    assert e.value.field == "tensors.0.n"
    buf = bytearray(msg)
    vals_at = len(msg) - (12 + 0) - 3 * 4
    buf[vals_at:vals_at + 4] = np.float32(np.inf).tobytes()
    with pytest.raises(DecodeError) as e:
        decode_update(bytes(buf), shapes, SPEC)
    assert e.value.field == "tensors.1.values.0"
    with pytest.raises(DecodeError) as e:
        decode_update(msg, shapes, SparseSpec(tile=8))
    assert e.value.field == "header.tile"
    with pytest.raises(WireError):
        encode_update([SparseTensor(torch.tensor([1]), torch.tensor([float("nan")]))], [(4,)], SPEC)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.one_of(st.tuples(), st.tuples(st.integers(0, 200)),
                                 st.tuples(st.integers(1, 90), st.integers(1, 90))), min_size=1, max_size=3),
       tile=st.sampled_from([64, 16, 5]), chunk_1d=st.sampled_from([64, 7]), fill=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_update_round_trip_over_shapes(shapes, tile, chunk_1d, fill, seed):
    spec = SparseSpec(tile=tile, k=1, chunk_1d=chunk_1d, k_1d=1)
    g = torch.Generator().manual_seed(seed)
    steps = []
    for s in shapes:
        n = int(np.prod(s))
        idx = torch.randperm(n, generator=g)[:int(fill * n)]
        steps.append(SparseTensor(idx, torch.randn(idx.numel(), generator=g)))
    msg = encode_update(steps, shapes, spec)
    assert len(msg) == update_nbytes(shapes, [s.indices.numel() for s in steps], spec)
    for s, shape, back in zip(steps, shapes, decode_update(msg, shapes, spec)):
        assert torch.equal(back.dense(shape), s.dense(shape))
        assert back.indices.numel() == s.indices.numel()


def test_error_feedback_state_survives_a_restart():
    g = torch.Generator().manual_seed(3)
    deltas = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(3)]
    a = ErrorFeedback(SHAPES, SPEC, BETA)
    a.push(deltas[0])
    b = ErrorFeedback(SHAPES, SPEC, BETA)
    b.load_state_dict(a.state_dict())
    assert [a.push(d) for d in deltas[1:]] == [b.push(d) for d in deltas[1:]]
    with pytest.raises(ValueError):
        ErrorFeedback([(3,)], SPEC, BETA).load_state_dict(a.state_dict())
