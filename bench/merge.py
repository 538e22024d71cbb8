#!/usr/bin/env python
"""Merge benchmark: the syncer's outer step over one fragment vs a plain in-place torch add.

    python bench/merge.py [--size-mb 256] [--members 4] [--push-dtype f32|bf16] [--chunk-kb 1024] [--repeat 3]
                          [--kernel fused|sgd]

The merge pass is the syncer's code path (services/syncer/merge.py `Merger.merge`): for every chunk of
the fragment's chunk plan (`schemas.chunks.chunk_plan`, push dtype), decode each member's push chunk
from its wire bytes (`services.syncer.outer.delta_view`, as after a direct get: f32/bf16 read in
place, q4 decoded) and apply the merge's `services.syncer.outer.OuterStep` (prepared once per pass, as
the syncer prepares one per merge) to that slice of params and momentum, with one scratch buffer.
`--decode unpack` times the older path that copied every chunk (`schemas.dtypes.unpack`).
`--kernel fused` (default) times the syncer's default kernel, the one-pass loop torch.compile'd for the
chunk length (YETO_OUTER_COMPILE=async in the syncer, which merges on the bitwise-equal eager twin
until the compile is done; here sync: compiled before timing, the syncer's steady state);
`--kernel sgd` the eager SGD-form kernel (YETO_OUTER_COMPILE=0). See services/syncer/outer.py.
The push payloads are held as `bytes`, one buffer per member over the whole fragment, so every
chunk comes from memory, not from a cache-sized pool.

The baseline, in the same process on tensors of the same size: `params.add_(delta)` once per member
over the whole f32 tensors — the memory-bound floor of "touch every delta once".

Bytes are counted honestly, per pass:
  merge: reads M deltas (push dtype bytes) + params + momentum (f32), writes params + momentum (f32)
  plain: each of the M adds reads params + delta and writes params (3 x 4 bytes per value)
Each figure is the median of --repeat runs (merge and plain alternate). MB here means MiB. The last
line is `merge ratio_vs_inplace=<x>` (merge MB/s over plain MB/s; must reach 0.7 on a quiet machine,
goal 0.9).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass


import torch  # noqa: E402

from yeto.schemas.dtypes import pack, unpack  # noqa: E402
from yeto.schemas.chunks import chunk_plan  # noqa: E402
from yeto.services.run_harness import peak_rss_self  # noqa: E402  (peak RSS as every bench reads it)
from yeto.services.syncer.outer import OuterStep, delta_dtype, delta_view, weights_for  # noqa: E402

MiB = 1 << 20
PUSH_BYTES = {"f32": 4, "bf16": 2}
DECODERS = {"view": delta_view, "unpack": unpack}
KERNELS = {"fused": "sync", "sgd": "0"}  # -> YETO_OUTER_COMPILE


# --------------------------------------------------------------------------- pure logic (no I/O)


@dataclass(frozen=True)
class Config:
    size_mb: float = 256
    members: int = 4
    push_dtype: str = "f32"
    chunk_kb: int = 1024
    repeat: int = 5
    decode: str = "view"  # view: delta_view (the syncer's path); unpack: a copy per chunk
    kernel: str = "fused"  # fused: the syncer's default, the compiled one-pass loop; sgd: the eager SGD form
    lr: float = 0.7
    mu: float = 0.9
    seed: int = 0

    def __post_init__(self):
        if not self.size_mb > 0:
            raise ValueError(f"--size-mb must be > 0, got {self.size_mb}")
        if self.members < 1:
            raise ValueError(f"--members must be >= 1, got {self.members}")
        if self.push_dtype not in PUSH_BYTES:
            raise ValueError(f"--push-dtype must be one of {sorted(PUSH_BYTES)}, got {self.push_dtype!r}")
        if self.decode not in DECODERS:
            raise ValueError(f"--decode must be one of {sorted(DECODERS)}, got {self.decode!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"--kernel must be one of {sorted(KERNELS)}, got {self.kernel!r}")
        if self.chunk_kb < 1 or self.repeat < 1:
            raise ValueError("--chunk-kb and --repeat must be >= 1")

    @property
    def numel(self) -> int:
        """f32 values of a fragment of size_mb MiB (params alone)."""
        return max(1, int(self.size_mb * MiB) // 4)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_kb * 1024


def merge_bytes(cfg: Config) -> int:
    """Bytes one merge pass reads and writes: M deltas in the push dtype, params + momentum read and written."""
    n = cfg.numel
    return n * (cfg.members * PUSH_BYTES[cfg.push_dtype] + 2 * 4 + 2 * 4)


def plain_bytes(cfg: Config) -> int:
    """Bytes one plain pass reads and writes: M adds, each reads params + delta and writes params (f32)."""
    return cfg.members * cfg.numel * 3 * 4


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds if seconds > 0 else float("inf")


# --------------------------------------------------------------------------- the passes


def merge_pass(params, momentum, payloads: list[bytes], spans, dtype: str, weights, lr: float, mu: float,
               scratch: torch.Tensor, decode=delta_view) -> None:
    """The syncer's merge of one fragment: one OuterStep, then per chunk decode every member's bytes and step."""
    views = [memoryview(p) for p in payloads]
    outer = OuterStep(weights, lr, mu, delta_dtypes=[delta_dtype(dtype)] * len(payloads), chunk_numel=spans[0].elem_count)
    for s in spans:
        deltas = [decode(v[s.byte_offset: s.byte_offset + s.nbytes], dtype, s.elem_count) for v in views]
        sl = slice(s.elem_offset, s.elem_offset + s.elem_count)
        outer(params[sl], momentum[sl], deltas, out=scratch[: s.elem_count])


def plain_pass(params: torch.Tensor, deltas: list[torch.Tensor]) -> None:
    for d in deltas:
        params.add_(d)


def kernel_used(cfg: Config, spans) -> str:
    """Which kernel the timed passes ran: fused (compiled) only where it compiled and the chunks are large enough."""
    if cfg.kernel == "sgd":
        return "sgd (eager, SGD form)"
    from yeto.services.syncer import outer

    key = ((str(delta_dtype(cfg.push_dtype)),) * cfg.members, spans[0].elem_count)
    if spans[0].elem_count < outer.COMPILE_MIN_NUMEL:
        return "fused, eager twin (chunks under COMPILE_MIN_NUMEL)"
    if outer._COMPILED._ready.get(key) is None:
        return "fused, eager twin (torch.compile unavailable or refused)"
    return "fused (compiled)"


def peak_rss_mib() -> float:
    return peak_rss_self() / MiB


def run(cfg: Config, out=print) -> float:
    n = cfg.numel
    dtype = cfg.push_dtype
    spans = chunk_plan(n, dtype, cfg.chunk_bytes)
    gen = torch.Generator().manual_seed(cfg.seed)
    out(f"merge bench: fragment {n * 4 / MiB:.1f} MiB ({n} f32 values), {cfg.members} members, push {dtype}, "
        f"chunk {cfg.chunk_kb} KiB ({len(spans)} chunks), torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, {os.cpu_count()} CPUs, repeat {cfg.repeat}, decode {cfg.decode}")
    params = torch.randn(n, generator=gen)
    momentum = torch.randn(n, generator=gen) * 0.01
    # the members' pushes as wire bytes (what a direct get hands the syncer)
    payloads = [pack(torch.randn(n, generator=gen) * 0.01, dtype).numpy().tobytes() for _ in range(cfg.members)]
    weights = weights_for([1000 + 10 * i for i in range(cfg.members)], equal_weights=False)
    scratch = torch.empty(max(s.elem_count for s in spans), dtype=torch.float32)
    # the plain pass: same number of values, f32, whole tensors
    plain_params = torch.randn(n, generator=gen)
    if dtype == "f32":
        with warnings.catch_warnings():  # bytes are read-only; the plain pass only reads the deltas
            warnings.simplefilter("ignore")
            plain_deltas = [torch.frombuffer(p, dtype=torch.float32) for p in payloads]
    else:
        plain_deltas = [unpack(p, dtype, n) for p in payloads]
    rss_setup = peak_rss_mib()

    # one untimed pass of each: first-touch page faults and allocator warm-up (and with --kernel fused
    # the compile) are not the steady state
    decode = DECODERS[cfg.decode]
    os.environ["YETO_OUTER_COMPILE"] = KERNELS[cfg.kernel]
    t0 = time.perf_counter()
    merge_pass(params, momentum, payloads, spans, dtype, weights, cfg.lr, cfg.mu, scratch, decode)
    first = time.perf_counter() - t0
    plain_pass(plain_params, plain_deltas)
    ran = kernel_used(cfg, spans)
    out(f"kernel {ran} (first, untimed pass {first:.2f} s)")
    t_merge, t_plain = [], []
    for _ in range(cfg.repeat):
        t0 = time.perf_counter()
        merge_pass(params, momentum, payloads, spans, dtype, weights, cfg.lr, cfg.mu, scratch, decode)
        t_merge.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain_pass(plain_params, plain_deltas)
        t_plain.append(time.perf_counter() - t0)
    if not (bool(torch.isfinite(params).all()) and bool(torch.isfinite(plain_params).all())):
        raise RuntimeError("non-finite values after the passes: the bench inputs are broken")
    mb, pb = merge_bytes(cfg), plain_bytes(cfg)
    m_rate, p_rate = mbps(mb, statistics.median(t_merge)), mbps(pb, statistics.median(t_plain))
    runs = lambda ts: "/".join(f"{t:.3f}" for t in ts)  # noqa: E731
    out(f"merge ({cfg.decode} + OuterStep per chunk): {m_rate:.0f} MB/s read+written "
        f"({mb / MiB:.0f} MiB per pass, median {statistics.median(t_merge):.3f} s, runs {runs(t_merge)} s)")
    out(f"plain in-place add (params.add_(delta) x {cfg.members}): {p_rate:.0f} MB/s read+written "
        f"({pb / MiB:.0f} MiB per pass, median {statistics.median(t_plain):.3f} s, runs {runs(t_plain)} s)")
    out(f"peak RSS {peak_rss_mib():.0f} MiB (after setup {rss_setup:.0f} MiB; inputs "
        f"{(2 * n * 4 + sum(len(p) for p in payloads) + n * 4) / MiB:.0f} MiB)")
    ratio = m_rate / p_rate
    out(f"merge ratio_vs_inplace={ratio:.4f}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    ap.add_argument("--size-mb", type=float, default=d.size_mb, help="fragment size in MiB of f32 params (default %(default)s)")
    ap.add_argument("--members", type=int, default=d.members, help="pushes merged (default %(default)s)")
    ap.add_argument("--push-dtype", choices=sorted(PUSH_BYTES), default=d.push_dtype)
    ap.add_argument("--chunk-kb", type=int, default=d.chunk_kb, help="chunk size in KiB (default %(default)s, the syncer's default)")
    ap.add_argument("--repeat", type=int, default=d.repeat, help="timed runs of each, the median is reported")
    ap.add_argument("--decode", choices=sorted(DECODERS), default=d.decode,
                    help="view: the syncer's zero-copy decode (default); unpack: a copy per chunk")
    ap.add_argument("--kernel", choices=sorted(KERNELS), default=d.kernel,
                    help="fused: the syncer's default, the compiled one-pass loop; sgd: the eager SGD-form kernel")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = Config(size_mb=args.size_mb, members=args.members, push_dtype=args.push_dtype, chunk_kb=args.chunk_kb,
                     repeat=args.repeat, decode=args.decode, kernel=args.kernel)
    except ValueError as exc:
        print(f"bench/merge.py: {exc}", file=sys.stderr)
        return 2
    run(cfg, out=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
