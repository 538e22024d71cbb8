"""bench/island_device.py: a smoke run with `--device cpu` at a tiny size (output contract: the export, apply
and copy lines, the training part's boundary share, the peak RSS, the ratio last), and part 1 in-process.

Not a timed assertion: rates on 2 shared cores are too noisy to gate on; the GPU figure is device/check's.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "island_device.py"
NUM = r"[-+0-9.eE]+|nan|inf"
LAST = re.compile(rf"^device export_apply_ratio=(?P<ratio>{NUM}) export_s=(?P<e>{NUM}) apply_s=(?P<a>{NUM}) "
                  rf"reads_s=(?P<reads>{NUM}) d2h_gbps=(?P<d2h>{NUM}) h2d_gbps=(?P<h2d>{NUM}) boundary_share=(?P<share>{NUM}) "
                  r"size_mib=(?P<size>\S+) device=(?P<device>\w+) name=(?P<name>\S+)$")


def _load():
    spec = importlib.util.spec_from_file_location("bench_island_device", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(150)
@pytest.mark.e2e
def test_cpu_smoke_prints_the_parts_and_the_ratio_last():
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--size-mib", "4", "--repeat", "1",
                           "--fragments", "2", "--train-mib", "1", "--train-steps", "16", "--sync-every", "4"],
                          capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    last = LAST.match(out.strip().splitlines()[-1])
    assert last, f"last line is not `device export_apply_ratio=<x> ...`:\n{out}"
    ratio, share = float(last["ratio"]), float(last["share"])
    assert math.isfinite(ratio) and ratio > 0, out
    assert math.isfinite(share) and 0 <= share < 1, out
    assert last["device"] == "cpu" and last["size"] == "4", out
    for line in (r"^export \(push snapshot of every fragment\): median .* host staging alone [0-9.]+ s$", r"^apply \(commit, blend, of every fragment\)",
                 r"^copy via memcpy: device->host ", r"^training step on cpu: .* boundary\(\) median ",
                 r"^peak RSS \d+ MiB"):
        assert re.search(line, out, re.M), (line, out)
    # the ratio is the copies' seconds over export + apply, from the printed figures
    e, a = float(last["e"]), float(last["a"])
    copies = re.search(r"\((?P<d2h>[0-9.]+) s\), host->device [0-9.]+ GB/s \((?P<h2d>[0-9.]+) s\)", out)
    assert ratio == pytest.approx((float(copies["d2h"]) + float(copies["h2d"])) / (e + a), rel=0.05, abs=0.005)


def test_export_apply_runs_the_island_ops_and_keeps_params_the_rounded_master():
    bench = _load()
    lines: list[str] = []
    args = argparse.Namespace(size_mib=1.0, fragments=2, repeat=1)
    res = bench.export_apply(args, torch.device("cpu"), out=lines.append)
    assert res["ratio"] > 0 and math.isfinite(res["ratio"]) and res["export_s"] > 0 and res["apply_s"] > 0
    assert 0 < res["reads_s"] and math.isfinite(res["reads_s"])
    assert lines[0].startswith("model: 1 MiB bf16 in 8 tensors + its fp32 master (2 MiB) on cpu"), lines
    module, master = bench.build(1.0, torch.device("cpu"))
    assert sum(p.numel() * 2 for p in module.parameters()) == pytest.approx(1 << 20, rel=0.01)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, master[n].bfloat16()) for n, p in module.named_parameters())
