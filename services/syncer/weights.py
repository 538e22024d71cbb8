"""The merge weights of a round (docs/design.md §4): pure Python, so the round machine and `yeto replay`
import no torch (services/syncer/outer.py re-exports them beside the outer step that uses them)."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Sequence


def _tokens_of(member: Any) -> float:
    # Accept plain numbers, objects with .c_tokens (rounds.MergeInput) and mappings (decoded JSON).
    if isinstance(member, (int, float)):
        value = member
    elif hasattr(member, "c_tokens"):
        value = member.c_tokens
    else:
        value = member["c_tokens"]
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"c_tokens must be a finite number >= 0, got {value!r}")
    return value


def weights_for(members: Sequence[Any], equal_weights: bool) -> list[float]:
    """Normalized merge weights (sum 1) in the order of `members`.

    wᵢ = c_tokens of member i, or 1 for every member with `equal_weights`. If every member reports
    0 tokens (an island that counts no tokens, or pushes right after a reset) token weighting is
    meaningless and would divide by zero, so the weights fall back to equal.
    """
    n = len(members)
    if n == 0:
        raise ValueError("weights_for needs at least one member")
    tokens = [_tokens_of(m) for m in members]
    total = math.fsum(tokens)
    if equal_weights or total == 0.0:
        return [1.0 / n] * n
    return [t / total for t in tokens]


def cap_claims(answers: Sequence[tuple[str, int, int]], factor: float | None,
               equal_weights: bool) -> tuple[list[int | float], dict[str, dict]]:
    """The c_tokens each answer (island, c_tokens, c_steps) weighs with, and {island: {claimed, used,
    limit}} of the claims that were cut: a claim is capped at the larger of F x R_claim and
    F x R_tps x min(c_steps, F x R_steps), F = `factor`, R_claim the lower median (the smaller middle value
    for an even count) of the positive claims, R_tps the lower median of their tokens per step
    (c_tokens / c_steps) and R_steps the lower median of their c_steps. Computed in exact rationals (F
    as the decimal it was given, e.g. 2.5 caps a median of 3 at 7.5, not 7): a cut claim weighs with the
    exact limit, an int when it is whole, else the nearest float. Pure, so the round machine and the
    shell's speculative merge (which forecasts the Merge's weights) compute the same values.

    Why: the syncer cannot check a claim (tokens per step differ per island, and c_steps is claimed too),
    but it can refuse to let one island's word outweigh the others'. Claims of 0 take no part, so an
    island that counts no tokens changes nothing. The second term keeps an honest island's accumulated
    claim (one that skipped rounds, or trains faster, covers more steps: 1408 tokens over 11 steps beside
    256 over 4 was cut to 1024 by the first term alone), while a claim of 2^53-1 gets at most F x the
    tokens per step of the others over at most F x their steps. With lower medians one island of a round
    of two or more never moves a reference by lying."""
    from yeto.services.syncer.state import lower_median

    claims = [int(c) for _, c, _ in answers]
    positive = [(c, max(1, int(s))) for (_, _, s), c in zip(answers, claims) if c > 0]
    if factor is None or equal_weights or not positive:
        return claims, {}
    f = Fraction(repr(float(factor)))            # the shortest decimal of the float: what the flag said
    per_step = lower_median([Fraction(c, s) for c, s in positive])
    steps_ref = lower_median([s for _, s in positive])
    by_claim = f * lower_median([c for c, _ in positive])
    used: list[int | float] = []
    clamp = {}
    for (island, _, c_steps), c in zip(answers, claims):
        steps = min(Fraction(max(1, int(c_steps))), f * steps_ref)
        limit = max(by_claim, f * per_step * steps)
        if c > limit:
            u = limit.numerator if limit.denominator == 1 else float(limit)
            clamp[island] = {"claimed": c, "used": u, "limit": u}
            used.append(u)
        else:
            used.append(c)
    return used, clamp
