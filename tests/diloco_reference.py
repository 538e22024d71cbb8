"""An in-process streaming-DiLoCo reference for the lockstep end-to-end test: no broker, no syncer, no
learner sync code.

It re-derives what a lockstep run of `python -m yeto.learner.demo` islands against `yeto syncer --strict`
must compute, from docs/design.md §3.7, §3.9, §4 and §5 alone. It imports only the *task* from
learner.demo (model, seeds, data, held-out loss) — never learner.island / fragments / pulls /
client nor services.syncer (no SyncState, no outer_step_, no round machine):

* Version 0 is the INIT island's initial weights; the first version an island receives overwrites its
  own weights (no blend), and becomes its *anchor* of every fragment. Every island takes it before
  its first step (lockstep waits for the whole cut).
* Inner steps: each island trains with its own AdamW on its own data stream; a data-parallel island
  averages its ranks' gradients (sum over the ranks, then / world, as the demo's all-reduce does).
* Round t (1-based) targets fragment (t − 1) mod P and is due at local step t·H/P. In lockstep every
  island pushes d = local − anchor (of that fragment) at that step with c_tokens = the tokens it
  trained since that fragment's anchor was installed.
* Merge: outer gradient Δ = −Σ wᵢ dᵢ / Σ wᵢ, wᵢ = c_tokens (or 1 with equal weights; all-zero →
  equal), in sorted island order. Outer optimizer: Nesterov SGD on Δ with the syncer's --outer-lr and
  --outer-momentum, one momentum buffer per fragment starting at zero — here torch.optim.SGD
  (nesterov=True) itself, not the syncer's kernel.
* The new version Θ is blended into every island at that same boundary (lockstep waits for it, and
  nothing trains in between): θ = α·θ_local + (1 − α)·Θ; Θ becomes the anchor; the fragment's token
  counter resets.

Numerics: training is float32 like the islands (same ops, one thread). Δ is formed in float64 and
rounded once to float32, so it can differ from the syncer's float32 accumulation by an ulp — the
reason the test compares within float32 rounding rather than bit for bit.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from yeto.learner import demo


@dataclass(frozen=True)
class IslandSpec:
    name: str
    ranks: int = 1
    batch: int = 64
    lr: float = 1e-2


@dataclass(frozen=True)
class Spec:
    islands: tuple[IslandSpec, ...]
    init_island: str
    fragments: tuple[tuple[str, ...], ...]  # fragment id -> names of its tensors
    sync_every: int                         # H
    rounds: int                             # global rounds committed before the final cut
    alpha: float = 0.5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    equal_weights: bool = False


@dataclass
class Result:
    final: dict[str, torch.Tensor]                 # the global model Θ after the last round (the final cut)
    versions: dict[int, int]                       # fragment -> version after the last round
    losses: dict[str, list[float]]                 # island -> loss per local step 1..rounds·H/P, as its step log reports it
    local: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # island -> its weights after the last blend


@contextlib.contextmanager
def _one_thread():
    # The islands run torch with one thread; keep the reference's float reductions in the same order.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Island:
    def __init__(self, spec: IslandSpec, theta0: dict[str, torch.Tensor], fragments: int):
        self.spec = spec
        self.model = demo.build_model(seed=demo.model_seed(spec.name))
        self.params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(theta0[n])  # version 0 overwrites the island's own initial weights
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, weight_decay=0.0)
        self.data = [demo.island_data(spec.name, r) for r in range(spec.ranks)]
        self.anchor = {n: t.clone() for n, t in theta0.items()}
        self.tokens = [0] * fragments  # tokens trained since each fragment's anchor was installed
        self.losses: list[float] = []

    def step(self) -> None:
        names = list(self.params)
        grads, losses = [], []
        for gen, shift in self.data:
            x, y = demo.batch(gen, self.spec.batch, shift)
            loss = nn.functional.mse_loss(self.model(x), y)
            grads.append(torch.autograd.grad(loss, [self.params[n] for n in names]))
            losses.append(float(loss.detach()))
        world = self.spec.ranks
        for i, n in enumerate(names):
            g = grads[0][i].clone()
            for other in grads[1:]:
                g += other[i]
            if world > 1:
                g /= world
            self.params[n].grad = g
        self.opt.step()
        if world > 1:  # the demo all-reduces the float32 loss and divides in Python
            total = torch.zeros(1)
            for v in losses:
                total += torch.tensor([v])
            self.losses.append(float(total) / world)
        else:
            self.losses.append(losses[0])
        for f in range(len(self.tokens)):
            self.tokens[f] += self.spec.batch * world


def run(spec: Spec) -> Result:
    P, H = len(spec.fragments), spec.sync_every
    if H % P:
        raise ValueError(f"H={H} must be a multiple of P={P}")
    per_round = H // P
    with _one_thread():
        init = demo.build_model(seed=demo.model_seed(spec.init_island))
        theta0 = {n: p.detach().clone() for n, p in init.named_parameters()}
        covered = sorted(n for names in spec.fragments for n in names)
        if covered != sorted(theta0):
            raise ValueError(f"fragments cover {covered}, the model has {sorted(theta0)}")
        glob = {n: nn.Parameter(t.clone()) for n, t in theta0.items()}
        outer = [torch.optim.SGD([glob[n] for n in names], lr=spec.outer_lr, momentum=spec.outer_momentum,
                                 nesterov=True) for names in spec.fragments]
        versions = {f: 0 for f in range(P)}
        islands = sorted((_Island(s, theta0, P) for s in spec.islands), key=lambda i: i.spec.name)
        for s in range(1, spec.rounds * per_round + 1):
            for isl in islands:
                isl.step()
            if s % per_round:
                continue
            t = s // per_round
            f = (t - 1) % P
            names = spec.fragments[f]
            tokens = [isl.tokens[f] for isl in islands]
            if spec.equal_weights or sum(tokens) == 0:
                weights = [1.0] * len(islands)
            else:
                weights = [float(c) for c in tokens]
            total = sum(weights)
            for n in names:
                mean = torch.zeros_like(theta0[n], dtype=torch.float64)
                for isl, w in zip(islands, weights):
                    mean += (w / total) * (isl.params[n].detach().double() - isl.anchor[n].double())
                glob[n].grad = (-mean).float()
            outer[f].step()
            versions[f] += 1
            with torch.no_grad():
                for isl in islands:
                    for n in names:
                        new = glob[n].detach().clone()
                        isl.params[n].mul_(spec.alpha).add_(new, alpha=1.0 - spec.alpha)
                        isl.anchor[n] = new
                    isl.tokens[f] = 0
        return Result(
            final={n: p.detach().clone() for n, p in glob.items()},
            versions=versions,
            losses={isl.spec.name: list(isl.losses) for isl in islands},
            local={isl.spec.name: {n: p.detach().clone() for n, p in isl.params.items()} for isl in islands},
        )


__all__ = ["IslandSpec", "Spec", "Result", "run"]
