"""The syncer's outer optimizer: merge weights and the f32 Nesterov outer step (pure numerics, no I/O).

Every island pushes d = local - anchor for a fragment. The outer gradient is the negated weighted mean
of those deltas, Δ = -Σ wᵢ dᵢ / Σ wᵢ, so an outer step with lr = 1, μ = 0 lands exactly on the weighted
mean of the islands' local values (Θ - Δ = anchor + mean d). The update is Nesterov momentum applied to
Δ, written with the same operations and in the same order as `torch.optim.SGD(nesterov=True)`, so the
two agree to f32 rounding:

    buf = μ·buf + Δ
    Θ   = Θ - lr·(Δ + μ·buf)

The shell calls `outer_step_` per chunk with slices of the fragment's params and momentum; every
operation is elementwise, so chunking never changes a single bit of the result.

`delta_view` decodes a push chunk's wire bytes for the merge without a copy (f32 and bf16 are read in
place; outer_step_ upcasts bf16 exactly): copying every chunk into fresh memory cost more than the
outer step itself (bench/merge.py).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch

__all__ = ["weights_for", "outer_step_", "delta_view"]

_VIEW_DTYPES = {"f32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}
_frombuffer_warned = False


def delta_view(buf: Any, wire_dtype: str, numel: int) -> torch.Tensor:
    """A push chunk's `numel` values as a read-only 1-D tensor over `buf` (bytes, memoryview, ...).

    f32 and bf16 are viewed in place, no copy (the tensor keeps `buf` alive; never write to it); q4,
    or a buffer whose address does not suit the dtype's alignment, is decoded into a new f32 tensor by
    `schemas.dtypes.unpack`. A buffer of the wrong length raises the same DecodeError as unpack.
    """
    global _frombuffer_warned
    from schemas.dtypes import unpack

    spec = _VIEW_DTYPES.get(wire_dtype)
    mv = memoryview(buf)
    if spec is None or mv.nbytes != numel * spec[1] or numel == 0:
        return unpack(buf, wire_dtype, numel)
    if not _frombuffer_warned:
        # torch warns once per process that a read-only buffer makes a writable-looking tensor; the
        # merge only reads deltas, so swallow that one warning here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mv, dtype=spec[0])
        _frombuffer_warned = True
    else:
        t = torch.frombuffer(mv, dtype=spec[0])
    if t.data_ptr() % spec[1]:
        return unpack(buf, wire_dtype, numel)
    return t


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


def outer_step_(
    params: torch.Tensor,
    momentum: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    lr: float,
    mu: float,
    *,
    out: torch.Tensor | None = None,
) -> None:
    """Apply one Nesterov outer step in place to `params` and `momentum` (both f32, same shape).

    `deltas` are the members' d = local - anchor for this slice, in sorted member order (the sum
    is accumulated in that order, so the result is deterministic); f32, or bf16/f16 which is upcast
    exactly. `weights` need not be normalized. `out` is an optional f32 scratch tensor with at least
    `params.numel()` elements, reused across calls to avoid an allocation per chunk; it holds Δ + μ·buf
    afterwards (the applied update direction).
    """
    if params.dtype != torch.float32 or momentum.dtype != torch.float32:
        raise TypeError(f"params and momentum must be float32, got {params.dtype} and {momentum.dtype}")
    if params.shape != momentum.shape:
        raise ValueError(f"momentum shape {tuple(momentum.shape)} != params shape {tuple(params.shape)}")
    if len(deltas) == 0 or len(deltas) != len(weights):
        raise ValueError(f"need one weight per delta and at least one delta, got {len(deltas)} deltas and {len(weights)} weights")
    for i, d in enumerate(deltas):
        if d.shape != params.shape:
            raise ValueError(f"delta {i} shape {tuple(d.shape)} != params shape {tuple(params.shape)}")
        if d.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"delta {i} dtype {d.dtype} is not a float type")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"outer lr must be finite and >= 0, got {lr!r}")
    if not (math.isfinite(mu) and 0 <= mu < 1):
        raise ValueError(f"outer momentum must be in [0, 1), got {mu!r}")
    total = math.fsum(float(w) for w in weights)
    if not (math.isfinite(total) and total > 0) or any(float(w) < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)!r}")

    n = params.numel()
    if out is None:
        scratch = torch.empty_like(params)
    else:
        if out.dtype != torch.float32 or out.numel() < n:
            raise ValueError(f"scratch must be float32 with >= {n} elements, got {out.dtype} with {out.numel()}")
        # the shell passes scratch[:n] already shaped like a 1-D chunk: skip three view ops per chunk
        scratch = out if out.shape == params.shape else out.reshape(-1)[:n].view(params.shape)

    # Δ = -Σ (wᵢ/Σw)·dᵢ, accumulated in member order; the coefficients are exact in double and
    # rounded once to f32 by the kernel.
    first = deltas[0]
    coef = -float(weights[0]) / total
    if first.dtype == torch.float32:
        torch.mul(first, coef, out=scratch)
    else:
        # mul with a low-precision input would round the product to that dtype; upcast first.
        scratch.copy_(first)
        scratch.mul_(coef)
    for d, w in zip(deltas[1:], weights[1:]):
        scratch.add_(d, alpha=-float(w) / total)

    # The rest mirrors torch.optim.SGD's single-tensor Nesterov path op for op.
    momentum.mul_(mu).add_(scratch)
    scratch.add_(momentum, alpha=mu)
    params.add_(scratch, alpha=-lr)
