"""Islands whose model trains on a GPU, through a real nats-server and the real `yeto syncer` (`cuda`; each
case runs on the CPU too, so the test itself is exercised where there is no GPU):

* two single-rank demo islands (`python -m yeto.learner.demo --device cuda`) on one GPU: every round
  exports through the host staging and applies on the device, and both islands end holding the syncer's
  final cut bit for bit;
* a megatron-core GPT (local spec, no Transformer Engine; bf16 with megatron-core's DistributedOptimizer)
  on the GPU as one island (tests/megatron_island.py): it ends holding the final cut in its fp32 masters bit
  for bit, its bf16 parameters the masters rounded. On the CPU it runs on the test-only shim; on CUDA the
  shim is never installed and the island says so.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from yeto.services.cmd_export import export
from yeto.services.run_harness import Child, clean_env
from tests.e2e_procs import ISLAND_TIMEOUTS, SYNCER_TIMEOUTS, IslandProc, assert_islands_hold_the_final_cut, wait_exit
from tests.extras import require
from tests.scripted import ROOT, SyncerProc

pytestmark = pytest.mark.e2e

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device", DEVICES)
async def test_two_single_rank_islands_on_the_device_hold_the_final_cut_bitwise(nats_url, run_id, tmp_path, device):
    rounds = 12
    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", "--islands", "2", "--fragments", "2", "--sync-every",
                        "4", "--total-steps", str(rounds), "--init-island", "a", *SYNCER_TIMEOUTS,
                        log=tmp_path / "syncer.log")
    islands = {i: IslandProc(nats_url, run_id, i, tmp_path, args=("--device", device, "--step-delay", "0.01"))
               for i in ("a", "b")}
    procs = {"syncer": syncer, **islands}
    try:
        for p in procs.values():
            p.start()
        codes = await wait_exit(procs, 200)
        assert codes == {n: 0 for n in procs}, {n: p.output()[-2000:] for n, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()
    assert_islands_hold_the_final_cut(tmp_path / "ckpt", tmp_path / "final.safetensors", run_id, islands.values())
    for isl in islands.values():
        res = isl.result()
        assert res["device"].startswith(device), res
        assert res["steps"] >= rounds * 4 // 2, res  # H = 4 over P = 2 fragments: a round every 2 steps


@pytest.mark.timeout(420)
@pytest.mark.parametrize("device", DEVICES)
async def test_a_megatron_gpt_island_on_the_device_holds_the_final_cut_in_its_masters(nats_url, run_id, tmp_path,
                                                                                      device):
    require("swift", "megatron.core")
    rounds = 8
    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", "--islands", "1", "--fragments", "4", "--sync-every",
                        "8", "--total-steps", str(rounds), "--init-island", "g", *SYNCER_TIMEOUTS,
                        log=tmp_path / "syncer.log")
    out = tmp_path / "island-g.safetensors"
    # the installed yeto, and the test helpers (megatron_tiny, the CPU shim) from tests/ alone, ahead of what the
    # caller's PYTHONPATH holds (device/check's carried wheels): never the checkout
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    island = Child("island g", [sys.executable, str(ROOT / "tests" / "megatron_island.py"), "--device", device,
                                "--work", str(tmp_path), "--out", str(out)], tmp_path / "island-g.log",
                   env=clean_env(YETO_NATS=nats_url, YETO_RUN=run_id, YETO_ISLAND="g", PYTHONPATH=path,
                                 **ISLAND_TIMEOUTS))
    procs = {"syncer": syncer, "g": island}
    try:
        for p in procs.values():
            p.start()
        codes = await wait_exit(procs, 400)
        assert codes == {n: 0 for n in procs}, {n: p.output()[-3000:] for n, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()
    res = island.result()
    assert res is not None, island.output()[-3000:]
    assert res["device"].startswith(device) and res["dtype"] == "torch.bfloat16", res
    assert res["kinds"] == ["sharded"], res  # the DistributedOptimizer's fp32 shards are what was synced
    assert res["params_are_rounded_masters"], res
    assert res["counters"]["rejected"] == 0, res
    if device == "cuda":  # the real device: the CPU shim stayed out of the process
        assert res["shim"] is False and res["real_current_device"] is True, res
    export(tmp_path / "ckpt", tmp_path / "final.safetensors", run_id)
    final, saved = load_file(str(tmp_path / "final.safetensors")), load_file(str(out))
    assert sorted(saved) == sorted(final)
    for n, v in final.items():
        assert torch.equal(saved[n].view(torch.int32), v.view(torch.int32)), n
