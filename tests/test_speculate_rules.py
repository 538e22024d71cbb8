"""The speculative merge's pure parts: the forecast, the match against the round's Merge, which chunks are
ready, the buffer budget (services/syncer/spec_rules.py), and the split outer step it relies on: Δ summed
first (OuterStep.gradient) and finished later (OuterStep.presummed) gives one merge's bits exactly, in
every kernel mode."""
from __future__ import annotations

import pytest
import torch

from yeto.services.syncer import spec_rules as SR
from yeto.services.syncer.actions import Merge, MergeInput
from yeto.services.syncer.outer import OuterStep
from yeto.services.syncer import pushes
from yeto.services.syncer.weights import cap_claims, weights_for

pytestmark = pytest.mark.pure

PULL = {"fragment": 2, "step": 7, "attempt": 1, "seq": 0, "base_version": 3,
        "members": [{"island": "b", "gen": "g2"}, {"island": "a", "gen": "g1"}]}


def _claims(over=None):
    c = {("a", "g1"): [SR.Claim(1, 300, 3)], ("b", "g2"): [SR.Claim(1, 100, 1)]}
    c.update(over or {})
    return c


def _fc(claims=None, **kw):
    args = dict(version=4, lr=0.7, momentum=0.9, max_token_factor=4.0, equal_weights=False)
    args.update(kw)
    return SR.forecast(PULL, _claims() if claims is None else claims, **args)


def _merge(f: SR.Forecast, **over) -> Merge:
    members = tuple(MergeInput(island=i, gen=g, weight=w, try_=t, c_tokens=1, c_steps=1, base_version=f.base_version,
                               local_step=0) for (i, g, t), w in zip(f.members, f.weights))
    args = dict(step=f.step, fragment=f.fragment, attempt=f.attempt, version=f.version, base_version=f.base_version,
                members=members)
    args.update(over)
    return Merge(**args)


def test_forecast_orders_members_by_island_and_weighs_as_the_machine_does() -> None:
    f = _fc()
    assert f.members == (("a", "g1", 1), ("b", "g2", 1))
    assert f.weights == (0.75, 0.25)
    assert (f.fragment, f.step, f.attempt, f.version, f.base_version) == (2, 7, 1, 4, 3)
    assert _fc(equal_weights=True).weights == (0.5, 0.5)


def test_forecast_caps_a_claim_like_the_round_machine() -> None:
    # a claim far above the others' is cut to the machine's limit, in both
    claims = _claims({("a", "g1"): [SR.Claim(1, 10**12, 3)]})
    f = _fc(claims)
    used, clamp = cap_claims([("a", 10**12, 3), ("b", 100, 1)], 4.0, False)
    assert clamp and f.weights == tuple(weights_for(used, False))
    assert f.weights[0] < 0.99


def test_the_machine_uses_the_same_cap() -> None:
    # pushes._clamp_tokens is cap_claims plus its counter: one rule, not two copies
    from collections import Counter
    from types import SimpleNamespace

    from yeto.services.syncer.state import _Answer

    cfg = SimpleNamespace(max_token_factor=2.5, equal_weights=False)
    state = SimpleNamespace(counters=Counter())
    answers = [("a", _Answer("g", 1, 0, 0, 4, 10**9)), ("b", _Answer("g", 1, 0, 0, 1, 3)), ("c", _Answer("g", 1, 0, 0, 2, 7))]
    used, clamp = pushes._clamp_tokens(state, cfg, None, answers)
    assert (used, clamp) == cap_claims([(i, a.c_tokens, a.c_steps) for i, a in answers], 2.5, False)
    assert state.counters["tokens.clamped"] == len(clamp) == 1


@pytest.mark.parametrize("claims", [
    {("a", "g1"): [SR.Claim(1, 300, 3)]},                                          # b has no try yet
    _claims({("b", "g2"): [SR.Claim(1, 100, 1), SR.Claim(2, 100, 1)]}),          # two tries: which?
    _claims({("b", "g2"): [SR.Claim(1, 100, 1, valid=False)]}),                 # an invalid try
])
def test_no_forecast_until_every_member_has_one_valid_try(claims) -> None:
    assert _fc(claims) is None


def test_the_forecast_merge_matches() -> None:
    f = _fc()
    assert SR.mismatch(f, _merge(f), lr=0.7, momentum=0.9) is None


@pytest.mark.parametrize("change,word", [
    (dict(step=8), "step"), (dict(attempt=2), "attempt"), (dict(version=5), "version"),
    (dict(base_version=2), "base_version"), (dict(fragment=1), "fragment"),
])
def test_any_other_round_or_version_does_not_match(change, word) -> None:
    f = _fc()
    assert SR.mismatch(f, _merge(f, **change), lr=0.7, momentum=0.9).startswith(word)


def test_other_members_tries_weights_or_hyperparameters_do_not_match() -> None:
    f = _fc()
    m = _merge(f)
    fewer = _merge(f, members=m.members[:1])
    assert SR.mismatch(f, fewer, lr=0.7, momentum=0.9).startswith("members")
    other_try = _merge(f, members=(m.members[0], MergeInput("b", "g2", 0.25, 2, 1, 1, 3, 0)))
    assert SR.mismatch(f, other_try, lr=0.7, momentum=0.9).startswith("members")
    # weights equal to the last bit only: 0.75 vs the next float below it
    nudged = _merge(f, members=(MergeInput("a", "g1", 0.7499999999999999, 1, 1, 1, 3, 0), m.members[1]))
    assert SR.mismatch(f, nudged, lr=0.7, momentum=0.9).startswith("weights")
    assert SR.mismatch(f, m, lr=0.5, momentum=0.9).startswith("lr/momentum")
    assert SR.mismatch(f, m, lr=0.7, momentum=0.0).startswith("lr/momentum")


def test_ready_chunks_are_those_every_member_holds_not_yet_taken() -> None:
    have = [{0, 1, 2, 5}, {1, 2, 3, 5}]
    assert SR.ready_chunks(have, taken={2}, among=range(6)) == [1, 5]
    assert SR.ready_chunks(have, taken=set(), among=[3]) == []
    assert SR.ready_chunks([], taken=set(), among=[0]) == []


def test_budget() -> None:
    assert SR.fits(100, 0, 100) and not SR.fits(100, 1, 100) and not SR.fits(-1, 0, 100)


@pytest.mark.parametrize("mode", ["0", "async", "sync"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summed_then_finished_gives_the_merge_s_bits(mode: str, dtype, monkeypatch) -> None:
    # chunks under COMPILE_MIN_NUMEL: async/sync run the eager twin, which the compiled loop must equal
    # bitwise before it is ever used (outer._CompiledKernels.compile)
    monkeypatch.setenv("YETO_OUTER_COMPILE", mode)
    gen = torch.Generator().manual_seed(5)
    n = 4099
    for members, (lr, mu) in ((1, (0.7, 0.9)), (2, (1.0, 0.0)), (3, (0.35, 0.5)), (4, (0.7, 0.9))):
        deltas = [(torch.randn(n, generator=gen) * 0.01).to(dtype) for _ in range(members)]
        # exact opposites and signed zeros: Δ's zero must keep the sign one merge gives it
        if members >= 2:
            deltas[1][:50] = -deltas[0][:50]
            deltas[0][50:60] = -0.0
            deltas[1][50:60] = 0.0
        weights = weights_for([1.0] * members if members % 2 == 0 else list(range(1, members + 1)), False)
        params, mom = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
        mom[:30] = -0.0
        mom[30:40] = 0.0
        p1, m1, p2, m2 = params.clone(), mom.clone(), params.clone(), mom.clone()
        OuterStep(weights, lr, mu)(p1, m1, deltas)
        grad = torch.empty(n)
        OuterStep(weights, lr, mu).gradient(deltas, grad)
        OuterStep.presummed(lr, mu)(p2, m2, [grad])
        assert torch.equal(p1.view(torch.int32), p2.view(torch.int32)), (mode, members)
        assert torch.equal(m1.view(torch.int32), m2.view(torch.int32)), (mode, members)
