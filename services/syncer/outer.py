"""The syncer's outer optimizer: merge weights and the f32 Nesterov outer step (pure numerics, no I/O).

Every island pushes d = local - anchor for a fragment. The outer gradient is the negated weighted mean
of those deltas, Δ = -Σ wᵢ dᵢ / Σ wᵢ, so an outer step with lr = 1, μ = 0 lands exactly on the weighted
mean of the islands' local values (Θ - Δ = anchor + mean d). The update is Nesterov momentum applied to
Δ, the same operations in the same order as `torch.optim.SGD(nesterov=True)`, so the two agree to f32
rounding:

    buf = μ·buf + Δ
    Θ   = Θ - lr·(Δ + μ·buf)

The shell calls `outer_step_` per chunk with slices of the fragment's params and momentum; every
operation is elementwise, so chunking never changes a single bit of the result.

**Kernels** (`YETO_OUTER_COMPILE`, read per call; one process must keep one setting, and a resumed
syncer must get the same one, or a re-merged round may differ in the last bit):
- `0` (default): eager torch ops, the SGD form op for op (`add_(x, alpha=a)`: a fused multiply-add on
  CPU), ~M+4 passes over a chunk, in cache for 1 MiB chunks.
- `sync`: the step as one loop, `torch.compile`d on CPU before its first use (seconds, once per
  process and member count / delta dtype): it reads every delta, params and momentum once and writes
  params and momentum once. Every product and sum is rounded on its own (no fused multiply-add, which
  a C++ or Triton compiler may or may not choose), so that where it is not compiled (no C++ compiler,
  tensors not on CPU, a chunk under COMPILE_MIN_NUMEL elements) an eager twin computes the same bits.
  It differs from `0` by at most a rounding per op.
Measured on the 2-core VM (bench/README.md, bench/merge.py) the compiled loop was no faster than the
default (both ~0.45 of a plain in-place add, within noise of each other), so it stays opt-in.

`delta_view` decodes a push chunk's wire bytes for the merge without a copy (f32 and bf16 are read in
place; outer_step_ upcasts bf16 exactly): copying every chunk into fresh memory cost more than the
outer step itself (bench/merge.py).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from typing import Any, Callable, Sequence

import torch


__all__ = ["weights_for", "outer_step_", "delta_view", "COMPILE_MIN_NUMEL"]

log = logging.getLogger(__name__)

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
    `params.numel()` elements that the eager path reuses across calls (its contents afterwards are
    unspecified).

    Which kernel runs: YETO_OUTER_COMPILE (module doc).
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
    if out is not None and (out.dtype != torch.float32 or out.numel() < n):
        raise ValueError(f"scratch must be float32 with >= {n} elements, got {out.dtype} with {out.numel()}")
    if _COMPILED.mode() == "0":
        _sgd_step_(params, momentum, deltas, weights, total, lr, mu, out)
        return
    # Δ = -Σ (wᵢ/Σw)·dᵢ: the coefficients are exact in double and rounded once to f32, here, so the
    # compiled kernel and its eager twin multiply by the same f32 values.
    coefs = torch.tensor([-float(w) / total for w in weights], dtype=torch.float32, device=params.device)
    mu_lr = torch.tensor([mu, -lr], dtype=torch.float32, device=params.device)
    kernel = _COMPILED.get(params, deltas)
    if kernel is not None:
        kernel(params, momentum, coefs, mu_lr, *deltas)
    else:
        _eager_step_(params, momentum, coefs, mu_lr, deltas, out)


# --------------------------------------------------------------------------- the kernels


def _sgd_step_(params, momentum, deltas, weights, total, lr, mu, out) -> None:
    """The default kernel: torch.optim.SGD's single-tensor Nesterov path op for op."""
    n = params.numel()
    if out is None:
        scratch = torch.empty_like(params)
    else:
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
    momentum.mul_(mu).add_(scratch)
    scratch.add_(momentum, alpha=mu)
    params.add_(scratch, alpha=-lr)


def _fused_step_(params, momentum, coefs, mu_lr, *deltas) -> None:
    """The step as one expression (what torch.compile fuses into one loop). coefs: f32 (-wᵢ/Σw);
    mu_lr: f32 [μ, -lr]."""
    s = deltas[0].float() * coefs[0]
    for i in range(1, len(deltas)):
        s = s + deltas[i].float() * coefs[i]
    buf = momentum * mu_lr[0] + s
    params.copy_(params + (s + buf * mu_lr[0]) * mu_lr[1])
    momentum.copy_(buf)


_scratch = threading.local()  # per thread: asyncio.to_thread may run two merges' chunks on two threads


def _eager_step_(params, momentum, coefs, mu_lr, deltas, out) -> None:
    """_fused_step_'s eager twin: in-place ops and two scratch buffers instead of temporaries, the
    same roundings in the same order, so the same bits."""
    n = params.numel()
    buf = getattr(_scratch, "t", None)
    if buf is None or buf.numel() < (n if out is not None else 2 * n) or buf.device != params.device:
        buf = torch.empty(n if out is not None else 2 * n, dtype=torch.float32, device=params.device)
        _scratch.t = buf
    s = (out if out is not None else buf[n:]).reshape(-1)[:n].view(params.shape)
    t = buf[:n].view(params.shape)

    def term(i: int, into: torch.Tensor) -> None:
        d = deltas[i]
        if d.dtype == torch.float32:
            torch.mul(d, coefs[i], out=into)
        else:  # a low-precision input would make mul compute in that dtype: upcast first (exact)
            into.copy_(d)
            into.mul_(coefs[i])

    term(0, s)
    for i in range(1, len(deltas)):
        term(i, t)
        s.add_(t)
    momentum.mul_(mu_lr[0]).add_(s)           # buf = μ·buf + Δ
    torch.mul(momentum, mu_lr[0], out=t)
    s.add_(t)                                 # Δ + μ·buf
    torch.mul(s, mu_lr[1], out=t)
    params.add_(t)                            # Θ - lr·(Δ + μ·buf)


COMPILE_MIN_NUMEL = 1 << 16   # 256 KiB of f32: smaller chunks gain nothing from a compiled loop


class _CompiledKernels:
    """torch.compile'd `_fused_step_` per (member count, delta dtypes), compiled on first use; None
    for chunks it does not serve (under COMPILE_MIN_NUMEL, not on CPU) or for good where compiling
    failed (no C++ compiler, an unsupported torch): the caller then runs the eager twin."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ready: dict[tuple, Callable | None] = {}

    @staticmethod
    def mode() -> str:
        m = os.environ.get("YETO_OUTER_COMPILE", "0").strip().lower() or "0"
        if m not in ("sync", "0"):
            raise ValueError(f"YETO_OUTER_COMPILE must be 0 or sync, got {m!r}")
        return m

    def get(self, params: torch.Tensor, deltas: Sequence[torch.Tensor]) -> Callable | None:
        if params.device.type != "cpu" or params.numel() < COMPILE_MIN_NUMEL:
            return None
        key = tuple(str(d.dtype) for d in deltas)
        with self._lock:  # one compile per key, even with merges on two threads
            if key not in self._ready:
                self._ready[key] = self.compile(key)
            return self._ready[key]

    @staticmethod
    def compile(key: tuple) -> Callable | None:
        """Compile and run once on dummy chunks (where the work happens)."""
        import time

        t0 = time.perf_counter()
        try:
            import torch._inductor.config as inductor_config

            # one kernel: no pool of compile worker processes (memory, and orphans if the syncer is killed)
            inductor_config.compile_threads = 1
            fn = torch.compile(_fused_step_, dynamic=True)
            n = COMPILE_MIN_NUMEL + 3   # odd sizes and offsets: a general kernel, no specialisation
            base = torch.zeros(2 * n + 8)
            dts = [torch.zeros(n + 1, dtype=getattr(torch, k.split(".")[-1]))[1:] for k in key]
            fn(base[1:n + 1], base[n + 5:2 * n + 5], torch.zeros(len(key)), torch.zeros(2), *dts)
        except Exception as exc:  # no compiler, unsupported platform: the eager twin gives the same bits
            log.warning("outer step: torch.compile unavailable (%s: %s); its eager twin is used",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        log.info("outer step: fused kernel for %d members (%s) compiled in %.1fs", len(key), ",".join(key),
                 time.perf_counter() - t0)
        return fn


_COMPILED = _CompiledKernels()
