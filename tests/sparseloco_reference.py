"""An in-process SparseLoCo reference for the sparse lockstep end-to-end test: no broker, no syncer, no
learner sync code.

The round schedule, inner training, blend and anchors are tests/diloco_reference.py's (its `_Island`: the
demo's task, seeds, data and AdamW, one thread); only the outer step differs, taken from docs/design.md
§4.10 through tests/sparse_reference.py (numpy, plain Python, no yeto import, no torch):

* at round t of fragment f every island, per tensor of f in session order, forms Δ = anchor − local in
  f32, folds it into its error-feedback accumulator (`RefIsland`: e ← β·e + Δ; m = Q(TopK(e)); e ← e − m)
  and sends m;
* the syncer clips each island's m to the lower median norm, takes the per-coordinate mean over the
  islands that sent it (sorted island order) and steps θ ← θ − f32(lr)·mean (`ref_aggregate`,
  `ref_outer_step`); no momentum, islands weighted equally;
* the new version is blended into every island (θ = α·θ_local + (1 − α)·Θ) and becomes its anchor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tests import diloco_reference as dref
from tests.sparse_reference import RefIsland, ref_aggregate, ref_outer_step
from yeto.learner import demo


@dataclass(frozen=True)
class SparseSpec:
    """The compression (the fields of `yeto syncer --sparse-*`), duck-typed for tests/sparse_reference.py."""

    tile: int
    k: int
    chunk_1d: int
    k_1d: int
    value_bits: int


@dataclass(frozen=True)
class Spec:
    islands: tuple[dref.IslandSpec, ...]
    init_island: str
    fragments: tuple[tuple[str, ...], ...]  # fragment id -> names of its tensors, in session order
    sync_every: int
    rounds: int
    sparse: SparseSpec
    beta: float
    alpha: float = 0.5
    outer_lr: float = 0.7


def run(spec: Spec) -> dref.Result:
    P, H = len(spec.fragments), spec.sync_every
    per_round = H // P
    with dref._one_thread():
        init = demo.build_model(seed=demo.model_seed(spec.init_island))
        theta0 = {n: p.detach().clone() for n, p in init.named_parameters()}
        glob = {n: t.numpy().copy() for n, t in theta0.items()}
        versions = {f: 0 for f in range(P)}
        islands = sorted((dref._Island(s, theta0, P) for s in spec.islands), key=lambda i: i.spec.name)
        ef = {(isl.spec.name, f): RefIsland([theta0[n].shape for n in names], spec.sparse, spec.beta)
              for isl in islands for f, names in enumerate(spec.fragments)}
        for s in range(1, spec.rounds * per_round + 1):
            for isl in islands:
                isl.step()
            if s % per_round:
                continue
            t = s // per_round
            f = (t - 1) % P
            names = spec.fragments[f]
            pushes = []
            for isl in islands:
                deltas = [(isl.anchor[n] - isl.params[n].detach()).numpy() for n in names]
                pushes.append(ef[(isl.spec.name, f)].push(deltas))
            params = [glob[n] for n in names]
            ref_outer_step(params, ref_aggregate(pushes), spec.outer_lr)
            versions[f] += 1
            with torch.no_grad():
                for isl in islands:
                    for n in names:
                        new = torch.from_numpy(np.array(glob[n], dtype=np.float32, copy=True))
                        isl.params[n].mul_(spec.alpha).add_(new, alpha=1.0 - spec.alpha)
                        isl.anchor[n] = new
                    isl.tokens[f] = 0
        return dref.Result(
            final={n: torch.from_numpy(v.copy()) for n, v in glob.items()},
            versions=versions,
            losses={isl.spec.name: list(isl.losses) for isl in islands},
            local={isl.spec.name: {n: p.detach().clone() for n, p in isl.params.items()} for isl in islands},
        )


__all__ = ["SparseSpec", "Spec", "run"]
