"""The merge weights of a round (docs/design.md §4): pure Python, so the round machine and `yeto replay`
import no torch (services/syncer/outer.py re-exports them beside the outer step that uses them)."""
from __future__ import annotations

import math
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
