#!/usr/bin/env python
"""Sparse outer mode vs dense DiLoCo, in process: bytes per round and validation loss (docs/design.md §4.10).

    python bench/sparse.py [--rounds 30] [--inner 10] [--islands 2] [--d-model 64] [--layers 2]

**The in-process version**, until the sparse mode is wired into pushes and BCAST: no broker, no syncer
process, no islands as processes. Both modes run the product's numerics, not copies: the dense mode
the DiLoCo outer step (the mean of the islands' Δ = anchor − local, Nesterov SGD, f32 pushes and f32
broadcasts); the sparse mode `learner.sparse_outer.ErrorFeedback` on each island, the syncer's
`decode_push` / `aggregate` / `outer_step_`, and the update message (`encode_update`) decoded and applied
by each island to its anchor with `apply_step_` (checked bitwise against the syncer's params every round).

The task: a small byte-level GPT trained on the Python standard library's own source files (they ship
with every Python: no download). Files are sorted by path; every 10th is validation text (never trained
on), the others are dealt to the islands in turn, so each island trains on its own text. Every island
starts from the same weights, trains `--inner` AdamW steps per round from the current version (its AdamW
state kept across rounds, as DiLoCo's inner optimizer), then the round's outer step makes the next
version, which every island takes. The same seeds, data and steps in both modes.

Bytes per round, as the broker would carry them: every island's push (dense: 4 bytes a parameter; sparse:
`push_nbytes`) plus the new version delivered to every island (dense: the f32 params; sparse: the update
message). The state KV and checkpoints (the syncer's side, exact in both modes) are not counted.

Last line: `sparse bytes_ratio=<sparse/dense> loss_ratio=<sparse/dense> rounds=<n>` (validation loss after
the last round).
"""
from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from yeto.learner.sparse_outer import ErrorFeedback, pseudo_gradient  # noqa: E402
from yeto.schemas.sparse import decode_push, push_nbytes  # noqa: E402
from yeto.schemas.sparse_chunks import grid_of  # noqa: E402
from yeto.schemas.sparse_spec import SparseSpec  # noqa: E402
from yeto.schemas.sparse_update import apply_step_, decode_update, encode_update, update_nbytes  # noqa: E402
from yeto.services.syncer.sparse_outer import aggregate, outer_step_  # noqa: E402


# ---------------------------------------------------------------- the task

def corpus(islands: int, max_bytes: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per-island training bytes, validation bytes) from the standard library's .py files."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train: list[list[bytes]] = [[] for _ in range(islands)]
    val: list[bytes] = []
    sizes = [0] * islands
    for n, p in enumerate(files):
        data = p.read_bytes()
        if n % 10 == 9:
            if sum(map(len, val)) < max_bytes // 4:
                val.append(data)
        else:
            i = (n - n // 10) % islands
            if sizes[i] < max_bytes:
                train[i].append(data)
                sizes[i] += len(data)
    as_t = [torch.frombuffer(bytearray(b"".join(t)), dtype=torch.uint8).long() for t in train]
    return as_t, torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batch(data: torch.Tensor, gen: torch.Generator, n: int, ctx: int):
    starts = torch.randint(0, data.numel() - ctx - 1, (n,), generator=gen)
    rows = torch.stack([data[s:s + ctx + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def val_loss(model: nn.Module, val: torch.Tensor, ctx: int, n: int = 64) -> float:
    x, y = batch(val, torch.Generator().manual_seed(1234), n, ctx)
    return float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)))


# ---------------------------------------------------------------- the two modes

class Island:
    def __init__(self, args, data: torch.Tensor, init: dict, seed: int):
        self.model = GPT(args.d_model, args.layers, args.heads, args.ctx)
        self.model.load_state_dict(init)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.inner_lr, weight_decay=0.0)
        self.data, self.gen, self.args = data, torch.Generator().manual_seed(seed), args

    def train(self, version: list[torch.Tensor]) -> list[torch.Tensor]:
        """Train --inner steps from `version`; the pseudo-gradients Δ = version − local."""
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), version):
                p.copy_(v)
        for _ in range(self.args.inner):
            x, y = batch(self.data, self.gen, self.args.batch, self.args.ctx)
            loss = F.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return [pseudo_gradient(v, p.detach()) for v, p in zip(version, self.model.parameters())]


def round_bytes(push: list[int], version_out: int, islands: int) -> int:
    """Bytes through the broker in a round: every push, and the new version delivered to every island."""
    return sum(push) + islands * version_out


def expected_bytes(shapes, islands: int, spec: SparseSpec) -> dict:
    """A round's bytes from the shapes alone: dense exact; sparse pushes exact, the update between the
    islands all sending the same coordinates and all different ones (per chunk at most islands × k)."""
    numel = sum(math.prod(s) for s in shapes)
    grids = [grid_of(s, spec) for s in shapes]
    most = []
    for g in grids:
        h, w = g.chunk_shapes()
        most.append(int(torch.minimum(islands * g.chunk_keep(), h * w).sum()))
    push = push_nbytes(shapes, spec)
    return {"dense": round_bytes([4 * numel] * islands, 4 * numel, islands), "push": push,
            "sparse_min": round_bytes([push] * islands, update_nbytes(shapes, [g.n_kept() for g in grids], spec), islands),
            "sparse_max": round_bytes([push] * islands, update_nbytes(shapes, most, spec), islands)}


def run(mode: str, args, data, val, init: dict, spec: SparseSpec) -> tuple[list[float], list[int], float]:
    torch.manual_seed(0)
    islands = [Island(args, d, init, seed=100 + i) for i, d in enumerate(data)]
    shapes = [tuple(p.shape) for p in islands[0].model.parameters()]
    params = [p.detach().clone() for p in islands[0].model.parameters()]   # the syncer's f32 version
    numel = sum(p.numel() for p in params)
    if mode == "dense":
        outer = [p.clone().requires_grad_(True) for p in params]
        opt = torch.optim.SGD(outer, lr=args.dense_outer_lr, momentum=0.9, nesterov=True)
    else:
        feedback = [ErrorFeedback(shapes, spec, args.beta) for _ in islands]
        anchors = [[p.clone() for p in params] for _ in islands]
    losses, sizes = [], []
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        if mode == "dense":
            deltas = [isl.train(params) for isl in islands]
            for o, *ds in zip(outer, *deltas):
                o.grad = torch.stack(ds).mean(dim=0)
            opt.step()
            params = [o.detach().clone() for o in outer]
            sizes.append(round_bytes([4 * numel] * len(islands), 4 * numel, len(islands)))
        else:
            msgs = [fb.push(isl.train(anchor)) for fb, isl, anchor in zip(feedback, islands, anchors)]
            steps = outer_step_(params, aggregate([decode_push(m, shapes, spec) for m in msgs]), args.sparse_outer_lr)
            update = encode_update(steps, shapes, spec)
            for anchor in anchors:
                for a, s in zip(anchor, decode_update(update, shapes, spec)):
                    apply_step_(a, s)
            if not all(torch.equal(a, p) for anchor in anchors for a, p in zip(anchor, params)):
                raise SystemExit("an island's anchor differs from the syncer's params")
            sizes.append(round_bytes([len(m) for m in msgs], len(update), len(islands)))
            assert all(len(m) == push_nbytes(shapes, spec) for m in msgs)
        probe = islands[0].model
        with torch.no_grad():
            for p, v in zip(probe.parameters(), params):
                p.copy_(v)
        losses.append(val_loss(probe, val, args.ctx))
    return losses, sizes, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=10, help="inner steps per round (H)")
    ap.add_argument("--islands", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--dense-outer-lr", type=float, default=0.7)
    ap.add_argument("--sparse-outer-lr", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.95)
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--corpus-bytes", type=int, default=1 << 20, help="training bytes per island")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the same bits every run, and no thread pool fighting a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = SparseSpec(tile=args.tile, k=args.k)
    data, val = corpus(args.islands, args.corpus_bytes)
    torch.manual_seed(0)
    init = GPT(args.d_model, args.layers, args.heads, args.ctx).state_dict()
    numel = sum(t.numel() for t in init.values())
    print(f"model {numel} parameters ({4 * numel / 2**20:.2f} MiB f32); {args.islands} islands, "
          f"{[d.numel() for d in data]} training bytes, {val.numel()} validation bytes; "
          f"H={args.inner}, {args.rounds} rounds; spec {spec}")
    shapes = [tuple(t.shape) for t in GPT(args.d_model, args.layers, args.heads, args.ctx).parameters()]
    exp = expected_bytes(shapes, args.islands, spec)
    print(f"expected bytes/round: dense {exp['dense']}; sparse pushes {args.islands} x {exp['push']}, with the "
          f"update between {exp['sparse_min']} and {exp['sparse_max']}")
    results = {}
    for mode in ("dense", "sparse"):
        losses, sizes, secs = run(mode, args, data, val, init, spec)
        results[mode] = (losses, sizes)
        every = max(1, args.rounds // 10)
        curve = " ".join(f"{r + 1}:{losses[r]:.4f}" for r in range(every - 1, args.rounds, every))
        print(f"{mode}: {secs:.1f} s; bytes/round {sizes[-1]} ({sizes[-1] / numel:.4f} per parameter); "
              f"val loss by round {curve}")
    d_loss, d_bytes = results["dense"][0][-1], sum(results["dense"][1])
    s_loss, s_bytes = results["sparse"][0][-1], sum(results["sparse"][1])
    density = sum(spec_density(tuple(t.shape), spec) * t.numel() for t in init.values()) / numel
    print(f"sparse push density {density:.4f}; bytes over {args.rounds} rounds: dense {d_bytes}, sparse {s_bytes}")
    print(f"sparse bytes_ratio={s_bytes / d_bytes:.4f} loss_ratio={s_loss / d_loss:.4f} rounds={args.rounds}")
    return 0


def spec_density(shape, spec) -> float:
    n = math.prod(shape)
    return grid_of(shape, spec).n_kept() / n if n else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
