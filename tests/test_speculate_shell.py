"""The speculative merge's shell (services/syncer/speculate.Speculator) in process, on a real model store and push
ledger, fed chunk headers as intake records them: which chunks it sums and when, that the sums are the
merge kernel's Δ bit for bit, what it frees and holds, and when it adopts, throws away or drops them.
(The merge that finishes from them runs against a real nats-server in tests/test_syncer_speculate_kill.py.)"""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from yeto.schemas.chunks import chunk_header, chunk_plan, push_digest
from yeto.schemas.dtypes import pack
from yeto.services.syncer.actions import Merge, MergeInput
from yeto.services.syncer.intake import PushLedger
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.outer import OuterStep
from yeto.services.syncer.speculate import Speculator

pytestmark = pytest.mark.pure

N = 5000                      # 5 chunks of 4 KiB (1024 f32), the last shorter
TOKENS = {"a": 200, "b": 100}
LR, MU = 0.7, 0.9


def _setup(hold_bytes=1 << 20):
    model = ModelStore(None, "r", Counter(), None)
    model.set_session({"fragments": [{"id": 0, "numel": N}], "bulk_dtype": "f32", "push_dtype": "f32",
                     "chunk_bytes": 4096})
    ledger = PushLedger(hold_bytes=hold_bytes)
    counters = Counter()
    spec = Speculator(model, ledger, counters, lr=LR, momentum=MU, max_token_factor=4.0, equal_weights=False)
    return model, ledger, counters, spec


def _pull(attempt=1):
    return {"fragment": 0, "step": 1, "attempt": attempt, "seq": 0, "base_version": 0,
            "members": [{"island": "a", "gen": "ga"}, {"island": "b", "gen": "gb"}]}


def _chunks(island: str, delta: torch.Tensor, attempt=1, try_=0):
    spans = chunk_plan(N, "f32", 4096)
    bufs = [pack(delta[s.elem_offset: s.elem_offset + s.elem_count].contiguous(), "f32").numpy().tobytes()
            for s in spans]
    out, digests = [], []
    for s, buf in zip(spans, bufs):
        framing = chunk_header(spans, s.index, buf)
        digests.append(framing["digest"])
        meta = {"island": island, "gen": "g" + island, "fragment": 0, "step": 1, "attempt": attempt, "try": try_,
                "base_version": 0, "local_step": 1, "c_steps": 1, "c_tokens": TOKENS[island], "dtype": "f32", **framing}
        if s.index == len(spans) - 1:
            meta["push_digest"] = push_digest(digests)
        out.append((meta, buf))
    return out


def _feed(ledger, spec, chunks, seq0=0):
    for i, (meta, buf) in enumerate(chunks):
        ledger.add(meta, seq0 + i, expected_total=N * 4, chunk_ok=True, payload=buf)
        spec.on_chunk(meta)


def _merge(weights=(2 / 3, 1 / 3), attempt=1) -> Merge:
    return Merge(step=1, fragment=0, attempt=attempt, version=1, base_version=0, members=tuple(
        MergeInput(island=i, gen="g" + i, weight=w, try_=0, c_tokens=TOKENS[i], c_steps=1, base_version=0, local_step=1)
        for i, w in zip("ab", weights)))


def _deltas():
    gen = torch.Generator().manual_seed(3)
    return {i: torch.randn(N, generator=gen) * 0.01 for i in "ab"}


def test_chunks_are_summed_as_both_arrive_and_adopted_bit_for_bit():
    async def go():
        model, ledger, counters, spec = _setup()
        spec.expect(_pull())
        d = _deltas()
        ca, cb = _chunks("a", d["a"]), _chunks("b", d["b"])
        _feed(ledger, spec, ca[:3])                  # a ahead: nothing to sum yet (b has no try)
        assert not spec.specs and ledger.held_bytes == 3 * 4096
        _feed(ledger, spec, cb[:1], seq0=10)          # b's first chunk completes the forecast
        sp = spec.specs[(0, 1, 1)]
        assert sp.forecast.weights == (2 / 3, 1 / 3) and sp.taken == {0}
        _feed(ledger, spec, ca[3:], seq0=3)
        _feed(ledger, spec, cb[1:], seq0=11)
        assert sp.taken == set(range(5)) and ledger.held_bytes == 0   # summed pushes leave the ledger
        got = await spec.adopt(_merge(), lr=LR, momentum=MU)
        assert got is sp and sp.done == set(range(5)) and counters["speculate.adopted"] == 1
        want = torch.empty(N)
        OuterStep([2 / 3, 1 / 3], LR, MU).gradient([d["a"], d["b"]], want)
        assert torch.equal(sp.grad.view(torch.int32), want.view(torch.int32))
        assert spec.in_use == N * 4
        spec.release(sp)
        assert spec.in_use == 0 and sp.grad is None and not spec.specs and not spec.pulls
    asyncio.run(go())


def _only_a() -> Merge:
    return Merge(step=1, fragment=0, attempt=1, version=1, base_version=0,
                 members=(MergeInput("a", "ga", 1.0, 0, TOKENS["a"], 1, 0, 1),))


@pytest.mark.parametrize("merge,why", [(_merge(weights=(0.5, 0.5)), "weights"), (_only_a(), "members")])
def test_another_merge_throws_the_sums_away(merge, why, caplog):
    async def go():
        model, ledger, counters, spec = _setup()
        spec.expect(_pull())
        d = _deltas()
        _feed(ledger, spec, [c for pair in zip(_chunks("a", d["a"]), _chunks("b", d["b"])) for c in pair])
        assert await spec.adopt(merge, lr=LR, momentum=MU) is None
        assert counters["speculate.discarded"] == 1 and spec.in_use == 0
        assert why in caplog.text
    with caplog.at_level("INFO", logger="yeto.syncer"):
        asyncio.run(go())


def test_other_hyperparameters_throw_the_sums_away():
    async def go():
        model, ledger, counters, spec = _setup()
        spec.expect(_pull())
        d = _deltas()
        _feed(ledger, spec, [c for pair in zip(_chunks("a", d["a"]), _chunks("b", d["b"])) for c in pair])
        assert await spec.adopt(_merge(), lr=LR / 2, momentum=MU) is None
        assert counters["speculate.discarded"] == 1 and spec.in_use == 0
    asyncio.run(go())


def test_a_restarted_round_drops_the_old_attempt_and_speculates_the_new():
    async def go():
        model, ledger, counters, spec = _setup()
        spec.expect(_pull())
        d = _deltas()
        _feed(ledger, spec, [c for pair in zip(_chunks("a", d["a"])[:2], _chunks("b", d["b"])[:2]) for c in pair])
        old = spec.specs[(0, 1, 1)]
        spec.expect(_pull(attempt=2))
        await asyncio.sleep(0.2)    # the old worker's thread finishes, then its buffer is freed
        assert (0, 1, 1) not in spec.specs and old.grad is None and spec.in_use == 0
        assert counters["speculate.dropped"] == 1
        _feed(ledger, spec, [c for pair in zip(_chunks("a", d["a"], attempt=2), _chunks("b", d["b"], attempt=2))
                             for c in pair], seq0=100)
        sp = await spec.adopt(_merge(attempt=2), lr=LR, momentum=MU)
        assert sp is not None and sp.done == set(range(5))
        spec.release(sp)
    asyncio.run(go())


def test_chunks_not_held_are_left_to_the_merge_and_the_budget_bounds_the_buffer():
    async def go():
        d = _deltas()
        # room for 2 chunks of pushes. Arriving in turn, each pair is summed and freed at once: every chunk
        # is summed within that room.
        model, ledger, counters, spec = _setup(hold_bytes=2 * 4096)
        spec.expect(_pull())
        _feed(ledger, spec, [c for pair in zip(_chunks("a", d["a"]), _chunks("b", d["b"])) for c in pair])
        sp = await spec.adopt(_merge(), lr=LR, momentum=MU)
        assert sp.done == set(range(5)) and ledger.held_bytes == 0
        spec.release(sp)
        # a's whole push first: its first two chunks fill the room, b's find none; nothing can be summed
        # and the merge takes a's two from memory and reads the rest back from PUSH, as without speculation
        model, ledger, counters, spec = _setup(hold_bytes=2 * 4096)
        spec.expect(_pull())
        _feed(ledger, spec, _chunks("a", d["a"]))
        _feed(ledger, spec, _chunks("b", d["b"]), seq0=10)
        assert await spec.adopt(_merge(), lr=LR, momentum=MU) is None and ledger.held_bytes == 2 * 4096
        # a budget below the fragment's f32 size: no buffer at all, nothing taken from the ledger
        model, ledger, counters, spec = _setup()
        spec.budget = N * 4 - 1
        spec.expect(_pull())
        _feed(ledger, spec, [c for pair in zip(_chunks("a", d["a"]), _chunks("b", d["b"])) for c in pair])
        assert counters["speculate.no_room"] > 0 and ledger.held_bytes == 2 * N * 4 and spec.in_use == 0
        assert await spec.adopt(_merge(), lr=LR, momentum=MU) is None and counters["speculate.empty"] == 1
    asyncio.run(go())


def test_a_member_that_never_pushes_means_no_speculation():
    async def go():
        model, ledger, counters, spec = _setup()
        spec.expect(_pull())
        _feed(ledger, spec, _chunks("a", _deltas()["a"]))
        assert not spec.specs and ledger.held_bytes == N * 4   # a's push stays held for the merge
        assert await spec.adopt(_only_a(), lr=LR, momentum=MU) is None
    asyncio.run(go())


def test_an_invalid_push_stops_the_sums():
    async def go():
        model, ledger, counters, spec = _setup()
        spec.expect(_pull())
        d = _deltas()
        ca, cb = _chunks("a", d["a"]), _chunks("b", d["b"])
        _feed(ledger, spec, [ca[0], cb[0]])
        bad = dict(cb[1][0], total=N * 4 + 4)   # chunks/total changed within one push: the try is invalid
        _feed(ledger, spec, [ca[1], (bad, cb[1][1])], seq0=2)
        sp = spec.specs[(0, 1, 1)]
        assert sp.taken == {0}
        spec._drop((0, 1, 1), "test")
        await asyncio.sleep(0.1)
        assert spec.in_use == 0
    asyncio.run(go())
