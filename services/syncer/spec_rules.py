"""The speculative merge's decisions — pure: which merge a round will most likely get, whether the
round's real Merge is that merge, which chunks can be summed now, and whether a buffer fits.

The shell (services/syncer/speculate.py; the design: docs/design.md §4.6) sums chunk k's outer gradient Δ
of the pushes of the members the round machine will most likely merge, with the weights it would give
them, as soon as every one of those chunk k's is in. `forecast`: every member the round's pull asked
(sorted by island, as the machine orders its answers), each with the one push try seen for it, weighted
as a round where every member answered (weights.cap_claims, then weights.weights_for).
Invariants: the sums are adopted (`mismatch` is None) only if every input of Δ is the same: fragment,
step, attempt, version and base version, the members (island, gen, try, in order) and their weights
(exactly equal floats), and the outer lr and momentum (which Δ does not use, but a merge whose
hyper-parameters changed under it is not the one that was forecast); else they are thrown away and the
merge reads the pushes as it always did. Δ is a buffer beside the committed params and momentum, which
it never touches, so nothing is visible before the Merge. A round merged without one of its members
(quorum, a quarantine) or with another try simply does not match.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

from yeto.services.syncer.actions import Merge
from yeto.services.syncer.weights import cap_claims, weights_for


@dataclass(frozen=True)
class Claim:
    """One push try as intake saw it: enough to forecast its place in the merge."""
    try_: int
    c_tokens: int
    c_steps: int
    valid: bool = True


@dataclass(frozen=True)
class Forecast:
    fragment: int
    step: int
    attempt: int
    version: int        # the version the merge will make (the fragment's committed version + 1)
    base_version: int
    members: tuple[tuple[str, str, int], ...]   # (island, gen, try) sorted by island
    weights: tuple[float, ...]
    lr: float
    momentum: float


def forecast(pull: Mapping, claims: Mapping[tuple[str, str], Sequence[Claim]], *, version: int, lr: float,
             momentum: float, max_token_factor: float | None, equal_weights: bool) -> Forecast | None:
    """The merge of the round `pull` asked for if every member answers with the one try seen so far
    (`claims`: (island, gen) -> its tries seen); None while a member has no try, or more than one, or an
    invalid one."""
    members = sorted((m["island"], m["gen"]) for m in pull["members"])
    if not members:
        return None
    picked = []
    for island, gen in members:
        seen = claims.get((island, gen), ())
        if len(seen) != 1 or not seen[0].valid:
            return None
        picked.append((island, gen, seen[0]))
    used, _ = cap_claims([(island, c.c_tokens, c.c_steps) for island, _, c in picked], max_token_factor,
                         equal_weights)
    weights = weights_for(used, equal_weights)
    return Forecast(fragment=int(pull["fragment"]), step=int(pull["step"]), attempt=int(pull["attempt"]),
                    version=int(version), base_version=int(pull["base_version"]),
                    members=tuple((island, gen, c.try_) for island, gen, c in picked),
                    weights=tuple(float(w) for w in weights), lr=float(lr), momentum=float(momentum))


def mismatch(f: Forecast, a: Merge, *, lr: float, momentum: float) -> str | None:
    """Why the speculative sums of forecast `f` cannot stand in for the Merge `a` (None: adopt them)."""
    for name, want, got in (("fragment", f.fragment, a.fragment), ("step", f.step, a.step),
                            ("attempt", f.attempt, a.attempt), ("version", f.version, a.version),
                            ("base_version", f.base_version, a.base_version)):
        if want != got:
            return f"{name} {got}, forecast {want}"
    members = tuple((m.island, m.gen, m.try_) for m in a.members)
    if members != f.members:
        return f"members {list(members)}, forecast {list(f.members)}"
    weights = tuple(float(m.weight) for m in a.members)
    if weights != f.weights:   # exact: the sums were rounded with these very coefficients
        return f"weights {list(weights)}, forecast {list(f.weights)}"
    if (float(lr), float(momentum)) != (f.lr, f.momentum):
        return f"lr/momentum {lr}/{momentum}, forecast {f.lr}/{f.momentum}"
    return None


def ready_chunks(have: Sequence[Collection[int]], taken: Collection[int], among: Iterable[int]) -> list[int]:
    """The chunks of `among` every member holds (`have`: per member, the chunk indices it holds) and that
    were not taken already, in order."""
    if not have:
        return []
    return sorted(k for k in set(among) if k not in taken and all(k in h for h in have))


def fits(need: int, in_use: int, budget: int) -> bool:
    """Whether a buffer of `need` bytes fits beside `in_use` bytes within `budget`."""
    return need >= 0 and in_use + need <= budget
