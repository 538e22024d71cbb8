"""bench/merge.py: a smoke run on a tiny fragment (output contract), and its byte accounting.

Not a timed assertion: throughput on 2 shared cores is too noisy to gate on.
"""
from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MERGE = ROOT / "bench" / "merge.py"
LAST_LINE = re.compile(r"^merge ratio_vs_inplace=(?P<x>[-+0-9.eE]+|nan|inf)$")
MERGE_LINE = re.compile(r"^merge \((?P<decode>view|unpack) \+ OuterStep per chunk\): (?P<mbps>\d+) MB/s read\+written "
                        r"\((?P<mib>\d+) MiB per pass, median", re.M)
PLAIN_LINE = re.compile(r"^plain in-place add \(params\.add_\(delta\) x (?P<m>\d+)\): (?P<mbps>\d+) MB/s read\+written "
                        r"\((?P<mib>\d+) MiB per pass, median", re.M)
RSS_LINE = re.compile(r"^peak RSS (?P<rss>\d+) MiB", re.M)


def _load():
    spec = importlib.util.spec_from_file_location("bench_merge", MERGE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_merge"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,decode,kernel", [("f32", "view", "sgd"), ("bf16", "view", "fused"),
                                                 ("f32", "unpack", "fused"), ("bf16", "view", "sgd")])
@pytest.mark.e2e
def test_merge_bench_smoke_prints_both_rates_rss_and_the_ratio_last(dtype, decode, kernel):
    proc = subprocess.run([sys.executable, str(MERGE), "--size-mb", "4", "--members", "3", "--chunk-kb", "64",
                           "--repeat", "1", "--push-dtype", dtype, "--decode", decode, "--kernel", kernel],
                          capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    last = LAST_LINE.match(out.strip().splitlines()[-1])
    assert last, f"last line is not `merge ratio_vs_inplace=<x>`:\n{out}"
    ratio = float(last["x"])
    assert math.isfinite(ratio) and ratio > 0
    merge, plain, rss = MERGE_LINE.search(out), PLAIN_LINE.search(out), RSS_LINE.search(out)
    assert merge and plain and rss, out
    assert merge["decode"] == decode and plain["m"] == "3" and int(rss["rss"]) > 0
    # 64 KiB chunks are under COMPILE_MIN_NUMEL: the fused kernel's eager twin runs, and says so
    assert re.search(r"^kernel " + ("sgd" if kernel == "sgd" else r"fused, eager twin \(chunks under"), out, re.M), out
    # honest bytes for 4 MiB of f32 params and 3 members: merge reads 3 deltas (push dtype) + params +
    # momentum and writes params + momentum; the plain pass reads 2 and writes 1 f32 per value per add
    per_delta = 4 if dtype == "f32" else 2
    assert int(merge["mib"]) == round(4 * (3 * per_delta + 16) / 4)
    assert int(plain["mib"]) == 3 * 4 * 3
    # the printed ratio is the quotient of the two printed (rounded) rates
    assert ratio == pytest.approx(int(merge["mbps"]) / int(plain["mbps"]), rel=0.05, abs=0.002)


def test_merge_pass_is_the_outer_step_of_the_whole_fragment():
    """The bench's chunked merge from wire bytes equals one outer_step_ over the whole tensors."""
    bench = _load()
    from yeto.schemas.dtypes import pack, unpack
    from yeto.schemas.chunks import chunk_plan
    from yeto.services.syncer.outer import outer_step_

    gen = torch.Generator().manual_seed(0)
    n = 5000
    for dtype in ("f32", "bf16"):
        p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        deltas = [torch.randn(n, generator=gen) for _ in range(3)]
        payloads = [pack(d, dtype).numpy().tobytes() for d in deltas]
        w = [0.5, 0.25, 0.25]
        p, m = p0.clone(), m0.clone()
        spans = chunk_plan(n, dtype, 1024)
        bench.merge_pass(p, m, payloads, spans, dtype, w, 0.7, 0.9, torch.empty(1024))
        rp, rm = p0.clone(), m0.clone()
        outer_step_(rp, rm, [unpack(b, dtype, n) for b in payloads], w, 0.7, 0.9)
        assert torch.equal(p, rp) and torch.equal(m, rm), dtype
        assert not torch.equal(p, p0)


def test_byte_accounting():
    bench = _load()
    cfg = bench.Config(size_mb=1, members=4, push_dtype="bf16")
    n = (1 << 20) // 4
    assert cfg.numel == n
    assert bench.merge_bytes(cfg) == n * (4 * 2 + 16)
    assert bench.plain_bytes(cfg) == 4 * n * 12
    with pytest.raises(ValueError, match="--push-dtype"):
        bench.Config(push_dtype="q4")


def test_delta_view_reads_wire_bytes_in_place_and_falls_back_to_unpack():
    """yeto.services.syncer.outer.delta_view (the merge's decode, timed above): f32/bf16 without a copy,
    equal to schemas.dtypes.unpack; q4 and misaligned buffers decoded by unpack; bad sizes refused."""
    from yeto.schemas.dtypes import pack, unpack
    from yeto.schemas.errors import WireError
    from yeto.services.syncer.outer import delta_view

    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    for dtype in ("f32", "bf16", "q4"):
        buf = pack(x, dtype).numpy().tobytes()
        v = delta_view(buf, dtype, 300)
        assert torch.equal(v.float(), unpack(buf, dtype, 300)), dtype
    f32 = pack(x, "f32").numpy().tobytes()
    v = delta_view(f32, "f32", 300)
    assert v.dtype == torch.float32 and v.untyped_storage().data_ptr() == torch.frombuffer(f32, dtype=torch.uint8).data_ptr()
    shifted = memoryview(b"\0" + f32)[1:]  # an odd address: copied, still right
    assert torch.equal(delta_view(shifted, "f32", 300), x)
    with pytest.raises(WireError):
        delta_view(f32[:-4], "f32", 300)
