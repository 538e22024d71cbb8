"""docs/design.md §5.2: in lockstep mode a real run — nats-server, `yeto syncer --strict`, island `a` (one
process) and island `b` (two data-parallel gloo ranks), both `python -m yeto.learner.demo` with
YETO_LOCKSTEP=1 — ends on the same parameters as an in-process streaming-DiLoCo reference with the same
seeds, data order, inner optimizer (AdamW), outer optimizer (Nesterov SGD), α and round schedule, and
no broker (tests/diloco_reference.py, written from the design, docs/design.md, without the learner's or the syncer's
sync code).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from yeto.schemas.layout import build_fragments
from yeto.schemas.provision import remove_run
from yeto.services.cmd_export import export
from tests import diloco_reference as ref
from tests.e2e_procs import kv_json, lockstep_islands, tails, wait_exit
from tests.scripted import SyncerProc, tape

H, P, ROUNDS = 4, 2, 10          # 2 inner steps per round, 20 inner steps in all
ALPHA, OUTER_LR, OUTER_MU = 0.5, 0.7, 0.9
BATCH, INNER_LR = 64, 1e-2

# Tolerance. The two runs do the same float32 operations in the same order except one: the reference
# forms the outer gradient Δ = −Σ wᵢdᵢ/Σw in float64 and rounds once, the syncer accumulates it in
# float32 — an ulp of Δ (~1e-7 relative) per round. That difference then rides through later AdamW
# steps, which do not amplify it much over 20 steps of this small MLP (|θ| ≲ 1). Measured: the
# largest difference is about 1e-7. atol 1e-5 leaves two orders of magnitude of margin and is still
# four orders below one inner step's change (lr 1e-2): a wrong α, weight, schedule, anchor or
# momentum moves the weights by ≳1e-3 and fails.
ATOL, RTOL = 1e-5, 1e-5


@pytest.mark.timeout(150)
async def test_lockstep_run_equals_the_in_process_diloco_reference(nc, nats_url, run_id, tmp_path):
    js = nc.jetstream()
    syncer = SyncerProc(
        nats_url, run_id, tmp_path / "syncer",
        "--islands", "2", "--fragments", str(P), "--sync-every", str(H), "--total-steps", str(ROUNDS),
        "--strict", "--init-island", "a", "--push-dtype", "f32", "--bulk-dtype", "f32",
        "--outer-lr", str(OUTER_LR), "--outer-momentum", str(OUTER_MU),
        "--member-timeout", "30", "--quorum-timeout", "60", "--final-timeout", "60",
        # 1 KiB chunks (~10 per push) and room for ~10 KiB of pushes in memory: each merge takes some
        # chunks as kept at intake and reads the rest back from PUSH, and both must give the reference
        "--chunk-bytes", "1024", "--push-memory-mib", str(10 / 1024),
        log=tmp_path / "syncer.log").start()
    islands = lockstep_islands(nats_url, run_id, tmp_path, alpha=ALPHA, batch=BATCH, lr=INNER_LR)
    procs = {"syncer": syncer, **islands}
    try:
        rcs = await wait_exit(procs, 120)
        assert rcs == {"syncer": 0, "a": 0, "b": 0}, tails(procs)
        session = await kv_json(js, run_id, "session")
        commit = await kv_json(js, run_id, "commit")
        merges = [r for r in await tape(js, run_id, "merge") if r.get("step")]
        held = sum(r["detail"]["push_chunks_held"] for r in merges)
        read = sum(r["detail"]["push_chunks_read"] for r in merges)
        # every chunk of every merge was stepped by one kernel or the other, and the record says which
        stepped = [r["detail"]["outer_compiled_chunks"] + r["detail"]["outer_eager_chunks"] for r in merges]
        chunks = [r["detail"]["push_chunks_held"] + r["detail"]["push_chunks_read"] for r in merges]
    finally:
        for p in procs.values():
            p.stop()
        await remove_run(js, run_id)

    # The session splits the model as docs/design.md §3.7 says (schemas.layout is the contract).
    model = ref.demo.build_model()
    layout = [{"name": n, "shape": list(p.shape), "dtype": "float32"} for n, p in model.named_parameters()]
    want_frags = [[t["name"] for t in f["tensors"]] for f in build_fragments(layout, P)]
    got_frags = [[t["name"] for t in f["tensors"]] for f in sorted(session["fragments"], key=lambda f: f["id"])]
    assert got_frags == want_frags
    assert session["init_island"] == "a" and session["sync_every"] == H

    expected = ref.run(ref.Spec(
        islands=(ref.IslandSpec("a", 1, BATCH, INNER_LR), ref.IslandSpec("b", 2, BATCH, INNER_LR)),
        init_island="a", fragments=tuple(tuple(names) for names in got_frags), sync_every=H, rounds=ROUNDS,
        alpha=ALPHA, outer_lr=OUTER_LR, outer_momentum=OUTER_MU))

    assert commit["committed_step"] == ROUNDS
    assert len(merges) == ROUNDS and held > 0 and read > 0, (held, read)
    assert [2 * k for k in stepped] == chunks, (stepped, chunks)   # two members' chunks per stepped chunk
    assert {int(k): v for k, v in commit["versions"].items()} == expected.versions == {0: ROUNDS // P, 1: ROUNDS // P}

    # The final cut (exported from the syncer's checkpoint) equals the reference's global model.
    export(tmp_path / "syncer", tmp_path / "final.safetensors", run_id)
    final = load_file(str(tmp_path / "final.safetensors"))
    assert sorted(final) == sorted(expected.final)
    worst = {n: float((final[n] - expected.final[n]).abs().max()) for n in final}
    for n in final:
        assert torch.allclose(final[n], expected.final[n], atol=ATOL, rtol=RTOL), (n, worst)
    # Sanity of the comparison itself: training moved the model far beyond the tolerance.
    theta0 = dict(ref.demo.build_model(seed=ref.demo.model_seed("a")).named_parameters())
    assert max(float((final[n] - theta0[n].detach()).abs().max()) for n in final) > 1e3 * ATOL

    # Every island ended on the final cut, bit for bit.
    for name, isl in islands.items():
        saved = load_file(str(isl.out))
        assert all(torch.equal(saved[n], final[n]) for n in final), name
        res = isl.result()
        assert res is not None and res["steps"] >= ROUNDS * H // P, isl.output()[-2000:]

    # Each island's training trajectory matches too: the loss its step log reports for every step
    # up to the last round (later steps depend on when the manifest lands, and are not compared).
    steps = ROUNDS * H // P
    for name, isl in islands.items():
        rows = isl.steplog_rows()
        assert [r["step"] for r in rows[:steps]] == list(range(1, steps + 1))
        got = torch.tensor([r["loss"] for r in rows[:steps]], dtype=torch.float64)
        want = torch.tensor(expected.losses[name], dtype=torch.float64)
        assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), (name, json.dumps({"got": got.tolist(), "want": want.tolist()}))
        # the version column follows the round schedule: fragment (t-1) mod P bumps at step t·H/P
        for r in rows[:steps]:
            t = r["step"] // (H // P)
            assert r["versions"] == {str(f): len([u for u in range(1, t + 1) if (u - 1) % P == f]) for f in range(P)}, r
