"""The syncer's outer optimizer: merge weights and the f32 Nesterov outer step (pure numerics, no I/O).

Every island pushes d = local - anchor for a fragment. The outer gradient is the negated weighted mean
of those deltas, Δ = -Σ wᵢ dᵢ / Σ wᵢ, so an outer step with lr = 1, μ = 0 lands exactly on the weighted
mean of the islands' local values (Θ - Δ = anchor + mean d). The update is Nesterov momentum applied to
Δ, as `torch.optim.SGD(nesterov=True)` does, so the two agree to f32 rounding:

    buf = μ·buf + Δ
    Θ   = Θ - lr·(Δ + μ·buf)

Owns `OuterStep` (one per merge, called per chunk with slices of the fragment's params and momentum;
`outer_step_` is the one-call form), its kernels (`YETO_OUTER_COMPILE`: `_CompiledKernels.mode`) and
`delta_view`. Invariants: every operation is elementwise, so chunking never changes a single bit; one
process keeps one kernel setting, and a resumed syncer must get the same one, or a re-merged round may
differ in the last bit.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from typing import Any, Callable, Sequence

import torch

from yeto.schemas.dtypes import unpack
from yeto.services.syncer import compile_cache


__all__ = ["weights_for", "OuterStep", "delta_dtype", "outer_step_", "delta_view", "COMPILE_MIN_NUMEL", "MODES",
           "compile_in_flight", "exit_now_if_compiling", "prewarm"]

log = logging.getLogger(__name__)

_VIEW_DTYPES = {"f32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}
_frombuffer_warned = False


def delta_view(buf: Any, wire_dtype: str, numel: int) -> torch.Tensor:
    """A push chunk's `numel` values as a read-only 1-D tensor over `buf` (bytes, memoryview, ...).

    f32 and bf16 are viewed in place, no copy (the tensor keeps `buf` alive; never write to it); q4,
    or a buffer whose address does not suit the dtype's alignment, is decoded into a new f32 tensor by
    `schemas.dtypes.unpack`. A buffer of the wrong length raises the same DecodeError as unpack.
    (outer_step_ upcasts bf16 exactly.) No copy because copying every chunk into fresh memory cost more
    than the outer step itself (bench/merge.py).
    """
    global _frombuffer_warned
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


# The merge weights are pure Python: they live apart so the round machine (pushes.py) and `yeto replay`
# never import torch.
from yeto.services.syncer.weights import _tokens_of, weights_for  # noqa: E402,F401


def delta_dtype(wire_dtype: str) -> torch.dtype:
    """The dtype `delta_view` usually returns for `wire_dtype` (q4 and misaligned buffers decode to f32;
    an OuterStep checks each chunk's real dtypes before it uses a compiled loop)."""
    spec = _VIEW_DTYPES.get(wire_dtype)
    return spec[0] if spec is not None else torch.float32


def _check_hyper(weights: Sequence[float], lr: float, mu: float) -> float:
    """Validate the merge's hyper-parameters; the weights' sum."""
    if len(weights) == 0:
        raise ValueError("need at least one delta and one weight per delta, got no weights")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"outer lr must be finite and >= 0, got {lr!r}")
    if not (math.isfinite(mu) and 0 <= mu < 1):
        raise ValueError(f"outer momentum must be in [0, 1), got {mu!r}")
    total = math.fsum(float(w) for w in weights)
    if not (math.isfinite(total) and total > 0) or any(float(w) < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)!r}")
    return total


def _check_slice(params: torch.Tensor, momentum: torch.Tensor, deltas: Sequence[torch.Tensor], n_weights: int) -> None:
    if params.dtype != torch.float32 or momentum.dtype != torch.float32:
        raise TypeError(f"params and momentum must be float32, got {params.dtype} and {momentum.dtype}")
    if params.shape != momentum.shape:
        raise ValueError(f"momentum shape {tuple(momentum.shape)} != params shape {tuple(params.shape)}")
    if len(deltas) == 0 or len(deltas) != n_weights:
        raise ValueError(f"need one weight per delta and at least one delta, got {len(deltas)} deltas and {n_weights} weights")
    for i, d in enumerate(deltas):
        if d.shape != params.shape:
            raise ValueError(f"delta {i} shape {tuple(d.shape)} != params shape {tuple(params.shape)}")
        if d.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"delta {i} dtype {d.dtype} is not a float type")


class OuterStep:
    """One merge's outer step, prepared once and then applied chunk by chunk.

    The weights, lr and μ are checked, the f32 coefficients built and the kernel chosen here, once per
    merge; a call per chunk then checks only what can differ between chunks (shapes, dtypes) and runs
    the kernel. At 1 MiB chunks a merge makes ~1000 calls per 256 MiB, and per-call overhead is what
    separates a chunked merge from one in-place pass over memory (bench/merge.py).

    `chunk_numel` is the merge's usual chunk length: with YETO_OUTER_COMPILE=async|sync the fused loop
    is compiled for exactly that length (static shapes: the cheapest call); other lengths (a
    fragment's last chunk) run the eager twin, which gives the same bits.
    """

    __slots__ = ("weights", "total", "lr", "mu", "mode", "coefs", "mu_lr", "kernel_for", "compiled_calls",
                 "eager_calls")

    def __init__(self, weights: Sequence[float], lr: float, mu: float, *, delta_dtypes: Sequence[torch.dtype] = (),
                 chunk_numel: int = 0, device: torch.device | str = "cpu"):
        self.total = _check_hyper(weights, lr, mu)
        self.weights = [float(w) for w in weights]
        self.lr, self.mu = float(lr), float(mu)
        self.mode = _COMPILED.mode()
        if self.mode != "0":
            # Δ = -Σ (wᵢ/Σw)·dᵢ: the coefficients are exact in double and rounded once to f32, here, so
            # the compiled kernel and its eager twin multiply by the same f32 values.
            self.coefs = torch.tensor([-w / self.total for w in self.weights], dtype=torch.float32, device=device)
            self.mu_lr = torch.tensor([self.mu, -self.lr], dtype=torch.float32, device=device)
        else:
            self.coefs = self.mu_lr = None
        self.kernel_for = None
        # chunks stepped by the compiled loop and by eager torch ops (the twin or the SGD form): a merge
        # record says which kernel did its work (a compile still running in the background leaves it
        # to the twin)
        self.compiled_calls = self.eager_calls = 0
        if self.mode != "0" and chunk_numel >= COMPILE_MIN_NUMEL and torch.device(device).type == "cpu" \
                and len(delta_dtypes) == len(self.weights):
            self.kernel_for = _COMPILED.prepare(tuple(str(d) for d in delta_dtypes), int(chunk_numel),
                                                wait=self.mode == "sync")

    def __call__(self, params: torch.Tensor, momentum: torch.Tensor, deltas: Sequence[torch.Tensor], *,
                 out: torch.Tensor | None = None) -> None:
        """Apply the step in place to this chunk's `params` and `momentum` slices (f32, same shape);
        `deltas` in the merge's member order; `out` an optional f32 scratch of >= params.numel()
        elements reused across calls (contents afterwards unspecified)."""
        _check_slice(params, momentum, deltas, len(self.weights))
        n = params.numel()
        if out is not None and (out.dtype != torch.float32 or out.numel() < n):
            raise ValueError(f"scratch must be float32 with >= {n} elements, got {out.dtype} with {out.numel()}")
        if self.mode == "0":
            _sgd_step_(params, momentum, deltas, self.weights, self.total, self.lr, self.mu, out)
            self.eager_calls += 1
            return
        kernel = self.kernel_for(n, deltas) if self.kernel_for is not None else None
        if kernel is not None and params.is_contiguous() and momentum.is_contiguous() and params.device.type == "cpu":
            kernel(params, momentum, self.coefs, self.mu_lr, *deltas)
            self.compiled_calls += 1
        else:
            _eager_step_(params, momentum, self.coefs, self.mu_lr, deltas, out)
            self.eager_calls += 1


    def gradient(self, deltas: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Only the outer gradient Δ = -Σ (wᵢ/Σw)·dᵢ of one chunk, into `out` (f32, the deltas' shape),
        with exactly the roundings this step's kernel gives it before it touches momentum and params:
        the speculative merge (services/syncer/speculate.py) sums a chunk's pushes as soon as they are
        in and finishes it later with `presummed`, to the same bits as one call of this step."""
        if out.dtype != torch.float32 or len(deltas) != len(self.weights) or any(d.shape != out.shape for d in deltas):
            raise ValueError("gradient: one delta per weight, each of the f32 output's shape")
        if self.mode == "0":
            _sgd_gradient_(deltas, self.weights, self.total, out)
        else:
            _twin_gradient_(deltas, self.coefs, out, _twin_buffers(out.numel(), out, out)[1])
        self.eager_calls += 1

    @classmethod
    def presummed(cls, lr: float, mu: float, *, chunk_numel: int = 0) -> "OuterStep":
        """The step finishing a chunk whose outer gradient Δ `gradient` computed: called with [Δ] as its one
        delta, its Δ·1 is exactly Δ (the kernel's first product, by +1) and the rest runs as in a merge
        of the pushes themselves. With YETO_OUTER_COMPILE=async|sync the compiled one-input loop is used
        (the coefficient is an input of the loop, not compiled in)."""
        step = cls([1.0], lr, mu, delta_dtypes=[torch.float32], chunk_numel=chunk_numel)
        step.weights = [-1.0]   # the SGD form's coefficient -w/Σw is then +1 (its total stays 1)
        if step.coefs is not None:
            step.coefs = torch.tensor([1.0], dtype=torch.float32)
        return step


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

    One call, one `OuterStep` (the shell prepares one per merge instead). Which kernel runs:
    YETO_OUTER_COMPILE (`_CompiledKernels.mode`); here `sync` compiles the loop for this slice's length, `async`
    uses only a loop already compiled for it.
    """
    _check_slice(params, momentum, deltas, len(weights))
    # async compiles nothing here: a one-off call must not start a compile per slice length it sees
    step = OuterStep(weights, lr, mu, delta_dtypes=[d.dtype for d in deltas],
                     chunk_numel=params.numel() if _COMPILED.mode() == "sync" else 0, device=params.device)
    step(params, momentum, deltas, out=out)


# --------------------------------------------------------------------------- the kernels


def _sgd_step_(params, momentum, deltas, weights, total, lr, mu, out) -> None:
    """The default kernel: torch.optim.SGD's single-tensor Nesterov path op for op."""
    n = params.numel()
    if out is None:
        scratch = torch.empty_like(params)
    else:
        # the shell passes scratch[:n] already shaped like a 1-D chunk: skip three view ops per chunk
        scratch = out if out.shape == params.shape else out.reshape(-1)[:n].view(params.shape)
    _sgd_gradient_(deltas, weights, total, scratch)
    momentum.mul_(mu).add_(scratch)
    scratch.add_(momentum, alpha=mu)
    params.add_(scratch, alpha=-lr)


def _sgd_gradient_(deltas, weights, total, scratch) -> None:
    """_sgd_step_'s first part, Δ = -Σ (wᵢ/Σw)·dᵢ into `scratch`, accumulated in member order; the
    coefficients are exact in double and rounded once to f32 by the kernel."""
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
    s, t = _twin_buffers(n, out, params)
    _twin_gradient_(deltas, coefs, s, t)
    momentum.mul_(mu_lr[0]).add_(s)           # buf = μ·buf + Δ
    torch.mul(momentum, mu_lr[0], out=t)
    s.add_(t)                                 # Δ + μ·buf
    torch.mul(s, mu_lr[1], out=t)
    params.add_(t)                            # Θ - lr·(Δ + μ·buf)


def _twin_buffers(n: int, out, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's two scratch chunks shaped like `like`: `out` (else the thread's own) and the thread's."""
    buf = getattr(_scratch, "t", None)
    if buf is None or buf.numel() < (n if out is not None else 2 * n) or buf.device != like.device:
        buf = torch.empty(n if out is not None else 2 * n, dtype=torch.float32, device=like.device)
        _scratch.t = buf
    s = (out if out is not None else buf[n:]).reshape(-1)[:n].view(like.shape)
    return s, buf[:n].view(like.shape)


def _twin_gradient_(deltas, coefs, s, t) -> None:
    """The twin's first part: Δ = Σ coefsᵢ·dᵢ into `s` in member order (`t` a scratch chunk)."""
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


COMPILE_MIN_NUMEL = 1 << 16   # 256 KiB of f32: smaller chunks gain nothing from a compiled loop
LOAD_WAIT_S = 60.0            # the longest a merge waits for a cached loop to load (seconds, measured)
MODES = ("0", "async", "sync")


class _CompiledKernels:
    """The fused loop compiled per (delta dtypes, chunk length), static shapes: ahead of time with
    AOTInductor (the cheapest call), else with torch.compile.

    A compile is checked before use: the compiled loop must give its eager twin's bits on random
    chunks (a compiler that contracts a*b+c into one rounding would not); otherwise, or where
    compiling fails (no C++ compiler, an unsupported torch), the key stays on the twin for the
    process's life, with one warning. The eager twin and the compiled loop being bitwise equal is what
    lets `async` switch from one to the other in the middle of a merge without changing a version's
    bytes, and a restarted syncer redo a merge with the same bytes whichever of them runs.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._ready: dict[tuple, Callable | None] = {}   # key -> compiled and checked, or None (twin for good)
        self._pending: dict[tuple, threading.Thread] = {}

    @staticmethod
    def mode() -> str:
        """`YETO_OUTER_COMPILE`, read when a merge prepares its `OuterStep`:

        - `async` (default): the step as one loop, compiled on CPU (AOTInductor, else `torch.compile`) in a
          background thread as soon as the syncer's session is pinned (`prewarm`, for the expected member
          count), else the first time a merge needs it (per member count, delta dtype and chunk length:
          about a minute of one core, once per process, and once per host with the compile cache,
          compile_cache.py), checked bitwise against its eager twin, and used from then on; until then,
          and wherever it is not compiled (no C++ compiler, tensors not on CPU, a chunk under
          COMPILE_MIN_NUMEL elements or of another length, e.g. a fragment's last chunk), the eager twin
          computes the same bits. The loop reads every delta, params and momentum once and writes params
          and momentum once. Every product and sum is rounded on its own (no fused multiply-add, which a
          C++ or Triton compiler may or may not choose: the check before use refuses a compile that did).
        - `sync`: the same, but the merge waits for the compile instead of starting on the twin.
        - `0`: eager torch ops, the SGD form op for op (`add_(x, alpha=a)`: a fused multiply-add on CPU;
          SGD's operations in SGD's order), ~M+4 passes over a chunk, in cache for 1 MiB chunks; differs
          from the fused loop by at most a rounding per op. The default until measured slower than the
          compiled loop (bench/merge.py, figures in bench/README.md: 0.39 of a plain in-place add against
          0.81-0.83 for the compiled loop).
        """
        m = os.environ.get("YETO_OUTER_COMPILE", "async").strip().lower() or "async"
        if m not in MODES:
            raise ValueError(f"YETO_OUTER_COMPILE must be one of {', '.join(MODES)}, got {m!r}")
        return m

    def prepare(self, dtypes: tuple[str, ...], numel: int, *, wait: bool) -> Callable:
        """Start (or with `wait`, finish) compiling the loop for `dtypes` chunks of `numel` values; a
        lookup `(n, deltas) -> compiled kernel or None` for the merge's calls."""
        key = (dtypes, numel)
        with self._lock:
            if key not in self._ready and key not in self._pending:
                th = threading.Thread(target=self._build, args=(key,), name=f"outer-compile-{len(dtypes)}x{numel}",
                                      daemon=True)
                self._pending[key] = th
                th.start()
            th = self._pending.get(key)
        if th is not None and not wait and _LOOP_SOURCE:
            # A package on disk is loaded and checked in seconds: the merge waits for that rather than
            # start on the twin, so a second start merges compiled from its first round.
            path = compile_cache.package_path(_LOOP_SOURCE, dtypes, numel)
            if path is not None and os.path.exists(path):
                th.join(timeout=LOAD_WAIT_S)
        if wait and th is not None:
            th.join()
        ready = self._ready

        want_dtypes = tuple(getattr(torch, k.split(".")[-1]) for k in dtypes)

        def kernel_for(n: int, deltas: Sequence[torch.Tensor]) -> Callable | None:
            # the compiled loop checks nothing at run time (AOTInductor): only exact fits reach it
            if n != numel:
                return None
            fn = ready.get(key)
            if fn is None or len(deltas) != len(want_dtypes):
                return None
            for d, want in zip(deltas, want_dtypes):
                if d.dtype is not want or not d.is_contiguous() or d.device.type != "cpu":
                    return None
            return fn

        return kernel_for

    def _build(self, key: tuple) -> None:
        fn = self.compile(key)
        with self._lock:
            self._ready[key] = fn
            self._pending.pop(key, None)

    @staticmethod
    def compile(key: tuple, *, here: bool = False) -> Callable | None:
        """Build the loop (AOTInductor, else torch.compile), run it once and check it against the eager
        twin on random chunks at odd offsets (where the work happens). With a compile cache
        (compile_cache.py) the package is built by a helper process unless `here` (that process),
        kept once checked, and loaded and checked the same way by every later start."""
        import time

        dtypes, numel = key
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(numel)
        # odd offsets into larger buffers, as the shell's slices are
        base = torch.randn(2 * numel + 8, generator=gen)
        dts = [(torch.randn(numel + 1, generator=gen) * 0.01).to(getattr(torch, k.split(".")[-1]))[1:]
               for k in dtypes]
        coefs = -torch.rand(len(dtypes), generator=gen)
        mu_lr = torch.tensor([0.9, -0.7])

        def differs(cand: Callable) -> str | None:
            out, twin = base.clone(), base.clone()
            cand(out[1:numel + 1], out[numel + 5:2 * numel + 5], coefs, mu_lr, *dts)
            _eager_step_(twin[1:numel + 1], twin[numel + 5:2 * numel + 5], coefs, mu_lr, dts, None)
            if torch.equal(out, twin):
                return None
            return f"differs from the eager twin by up to {(out - twin).abs().max().item():.3g}"

        cached = compile_cache.package_path(_LOOP_SOURCE, dtypes, numel) if _LOOP_SOURCE else None
        for _ in range(2):   # a damaged or foreign package is removed and built once more
            if cached is None:
                break
            if not here and not os.path.exists(cached):
                compile_cache.build_elsewhere(cached, dtypes, numel, log)   # waits; if it fails: built here below
            if not os.path.exists(cached):
                break
            try:
                fn = _load_aoti(cached)
                why = differs(fn)
            except Exception as exc:  # a damaged or foreign file
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if why is None:
                log.info("outer step: fused loop for %d members (%s) x %d values loaded from %s and checked in %.2fs",
                         len(dtypes), ",".join(dtypes), numel, cached, time.perf_counter() - t0)
                return fn
            compile_cache.discard(cached, log.warning, why)

        fn, how, errors = None, "", []
        tmp = None
        for how in ("AOTInductor", "torch.compile"):
            try:
                if how == "AOTInductor":
                    tmp = compile_cache.temp_path(cached) if cached is not None else None
                    cand = _build_aoti(numel, dtypes, tmp)
                else:
                    cand = _build_dynamo(numel, dtypes)
                why = differs(cand)
                if why is not None:
                    errors.append(f"{how}: {why}")
                    continue
                fn = cand
                break
            except Exception as exc:  # no compiler, unsupported platform: the next way, or the eager twin
                errors.append(f"{how}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if tmp is not None:
            try:
                if fn is not None and how == "AOTInductor":
                    compile_cache.keep(tmp, cached)
                else:
                    os.unlink(tmp)
            except OSError as exc:   # a read-only or full cache costs the next start a compile, nothing more
                log.warning("outer step: could not keep the compiled loop in %s: %s", cached, exc)
        if fn is None:
            log.warning("outer step: no compiled loop for %d members (%s) x %d values (%s); its eager twin is used",
                        len(dtypes), ",".join(dtypes), numel, "; ".join(errors))
            return None
        log.info("outer step: fused loop for %d members (%s) x %d values built with %s and checked in %.1fs%s",
                 len(dtypes), ",".join(dtypes), numel, how, time.perf_counter() - t0,
                 f" (kept in {cached})" if cached is not None and how == "AOTInductor" else "")
        return fn


class _Step(torch.nn.Module):
    """The loop as the module AOTInductor exports (its source is part of the compile cache's key)."""

    def forward(self, params, momentum, coefs, mu_lr, *deltas):
        _fused_step_(params, momentum, coefs, mu_lr, *deltas)
        return ()


def _loop_source() -> str:
    # What the compiled code depends on in this file; a change to either gives new cache keys.
    import inspect

    try:
        return inspect.getsource(_fused_step_) + inspect.getsource(_Step)
    except (OSError, TypeError):   # no source on disk (a frozen install): keep no packages
        return ""


def _build_aoti(numel: int, dtypes: tuple[str, ...], package_path: str | None = None) -> Callable:
    """The loop exported and compiled ahead of time (AOTInductor): the cheapest call measured (no
    dynamo frame, guards or autograd wrappers: measured ~0.1 of a plain add better than torch.compile
    at 1 MiB chunks with bench/merge.py; that comparison is in bench/README.md's git history). It checks nothing about its inputs at run time, so OuterStep calls
    it only for contiguous CPU chunks of exactly `numel` values and the compiled dtypes. The package is
    written to `package_path` when given (compile_cache.py keeps it once checked)."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1   # no pool of compile worker processes (memory, orphans on kill)
    example = (torch.zeros(numel), torch.zeros(numel), torch.zeros(len(dtypes)), torch.zeros(2),
               *[torch.zeros(numel, dtype=getattr(torch, k.split(".")[-1])) for k in dtypes])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(_Step(), example)
        path = torch._inductor.aoti_compile_and_package(program, package_path=package_path)
    return _load_aoti(path)


def _load_aoti(path: str) -> Callable:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch._inductor.aoti_load_package(path)
    run = getattr(getattr(model, "loader", None), "boxed_run", None)
    if run is None:
        return model

    def kernel(*args: torch.Tensor) -> None:
        # AOTICompiledModel.__call__ parses its call spec and flattens its inputs on every call: ~20 us
        # of a ~60 us 1 MiB chunk here. The inputs are a flat list of tensors already, so run the
        # loader on them directly (compile()'s bitwise self-check runs this very function).
        run(list(args))

    return kernel


def _build_dynamo(numel: int, dtypes: tuple[str, ...]) -> Callable:
    """torch.compile with static shapes; its own copy of the function's code, so its dynamo cache holds
    one entry and no other key's guards are evaluated for it."""
    import types

    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    code = _fused_step_.__code__.replace()
    return torch.compile(types.FunctionType(code, _fused_step_.__globals__, "_fused_step_"), dynamic=False)


_COMPILED = _CompiledKernels()
_LOOP_SOURCE = _loop_source()


def prewarm(wire_dtype: str, chunk_numel: int, members: int) -> bool:
    """Start building (or loading from compile_cache.py) the loop that a merge of `members` pushes of
    `wire_dtype` chunks of `chunk_numel` values will use, in the background, as soon as the syncer knows
    its session: the first merge then finds it ready instead of starting its compile. False where no
    compiled loop would be used (YETO_OUTER_COMPILE=0, chunks under COMPILE_MIN_NUMEL)."""
    if _COMPILED.mode() == "0" or chunk_numel < COMPILE_MIN_NUMEL or members < 1:
        return False
    _COMPILED.prepare((str(delta_dtype(wire_dtype)),) * int(members), int(chunk_numel), wait=False)
    return True


def compile_in_flight() -> bool:
    """Whether a background compile of the merge loop is still running. Such a thread is a daemon inside
    C++ (inductor, the C++ compiler): an interpreter that finalizes around it can abort the process
    ("terminate called without an active exception", SIGABRT), so a process that is done leaves with
    os._exit instead (`yeto syncer` does; reproduced by exiting 3 s after a compile started)."""
    with _COMPILED._lock:
        return any(th.is_alive() for th in _COMPILED._pending.values())


def exit_now_if_compiling(rc: int) -> None:
    """Leave with `rc` at once (buffers flushed, logging shut down) when a compile is in flight (see
    compile_in_flight); else return and let the interpreter exit as usual."""
    if not compile_in_flight():
        return
    import logging
    import sys
    import traceback

    exc = sys.exc_info()[1]
    if exc is not None and not isinstance(exc, SystemExit):
        traceback.print_exc()   # os._exit would drop the traceback the interpreter prints
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the exit
            pass
    os._exit(rc)
