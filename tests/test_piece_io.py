"""Per-rank scatter and gather (learner/piece_io.py, learner/island_ranks.py) on real gloo ranks.

Four processes hold a small model cut like Megatron would cut it (TP=2×DP=2, TP=2×PP=2; boxes along
rows, along columns, 1-D splits, replicated tensors, tensors on one pipeline stage only), built with
the plain-torch sharded adapter. They run the island's ops directly (no broker): stage + commit of
v0 (overwrite) and v1 (blend, staged in two batches), push exports in f32 and q4 (error feedback
over two pushes), INIT exports in bf16. The reference is computed here on whole tensors with plain
torch (`blend`, `pack`, `q4_with_feedback` on the full fragment): what a full broadcast to a single
process gives. Every rank's pieces must equal the reference's slices bit for bit, and the bytes
rank 0 moved must be the sum of the other ranks' own slices (about DP copies), not world copies.
"""
from __future__ import annotations

import math
import os
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yeto.learner.adapters.sliced_torch import SlicedTorchAdapter
from yeto.learner.anchors import AnchorStore
from yeto.learner.blend import blend
from yeto.learner.island_ranks import RankOps
from yeto.learner.rank_ops import CommitOp, ExportOp, ResidualOp, StageOp
from yeto.learner.layout_map import IslandLayout, describe
from yeto.learner.piece_io import Comm
from yeto.schemas.dtypes import pack, q4_with_feedback, unpack
from yeto.schemas.layout import build_session
from yeto.schemas.chunks import chunk_plan

SHAPES = {"embed.weight": (30, 20), "layers.0.w": (24, 20), "layers.0.b": (24,), "layers.1.w": (20, 24),
          "layers.1.b": (20,), "final_norm.weight": (20,)}
TP_DIMS = {"embed.weight": 0, "layers.0.w": 0, "layers.0.b": 0, "layers.1.w": 1}  # rows, 1-D, columns
CHUNK_BYTES = 264  # 66 f32 values (chunks end mid-row), 2 q4 blocks
ALPHA = 0.375
XSIZE = {"f32": 4, "bf16": 2}


def tp_dim(name, shape, tp):
    return TP_DIMS.get(name)


def full(name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()) % 7919)
    return torch.randn(SHAPES[name], generator=g)


def the_session(bulk: str) -> dict:
    layout = [{"name": n, "shape": list(s), "dtype": "float32"} for n, s in SHAPES.items()]
    return build_session(layout, 2, run="r", push_dtype="f32", bulk_dtype=bulk, chunk_bytes=CHUNK_BYTES,
                         init_island="a", sync_every=2)


def flat(frag: dict, seed: int) -> torch.Tensor:
    return torch.cat([full(t["name"], seed).reshape(-1) for t in frag["tensors"]])


def coords(case: str, rank: int) -> dict:
    if case == "single":
        return {}
    if case == "tp2dp2":  # Megatron order: TP fastest, then DP
        return {"tp": 2, "tp_rank": rank % 2, "dp_rank": rank // 2}
    if case == "tp2pp2":
        return {"tp": 2, "tp_rank": rank % 2, "pp": 2, "pp_rank": rank // 2}
    raise ValueError(case)


def _worker(rank: int, world: int, init_file: str, out_dir: str, case: str, bulk: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _steps(rank, world, out_dir, case, bulk)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _steps(rank, world, out_dir, case, bulk, device: str = "cpu") -> None:
    """`device`: where the adapter's pieces live (a single process on a GPU in the `cuda` test); the island's
    chunks, staging and anchors stay on the host."""
    comm = Comm(dist.group.WORLD if world > 1 else None)
    ad = SlicedTorchAdapter.build(SHAPES, values=lambda n, s: full(n, 0).to(device), tp_dim=tp_dim,
                                  **coords(case, rank))
    layout = IslandLayout(comm.all_gather(describe(ad.pieces())))
    session = the_session(bulk)
    ops = RankOps(ad, comm, layout, session, AnchorStore(), ALPHA)
    frags = session["fragments"]
    assert {t.device.type for t in ad.tensors().values()} == {device}
    snap = lambda: {n: t.cpu().clone() for n, t in ad.tensors().items()}  # noqa: E731
    out = {"boxes": {n: ad.box(n) for n in ad.tensors()}, "owner": {s.name: s.owner for s in ad.pieces()}}

    def stage(fid, version, seed, batches):
        spans = chunk_plan(frags[fid]["numel"], bulk, CHUNK_BYTES)
        values = flat(frags[fid], seed)
        for b, idx in enumerate(batches):
            payloads = None
            if rank == 0:  # what rank 0 fetched from BCAST: the packed bytes of those chunks
                payloads = {k: pack(values[spans[k].elem_offset: spans[k].elem_offset + spans[k].elem_count],
                                    bulk).numpy().tobytes() for k in idx}
            ops.run(StageOp(fid, version, bulk, tuple(idx), b == 0), payloads)

    for f in frags:  # v0 of every fragment: overwrite
        n = len(chunk_plan(f["numel"], bulk, CHUNK_BYTES))
        stage(f["id"], 0, 1, [list(range(n))])
        ops.run(CommitOp(f["id"], 0, "d", "first"))
    out["v0"] = snap()
    with torch.no_grad():  # local training, the same on every replica
        for n, t in ad.tensors().items():
            box = ad.box(n)
            t.add_(0.25 * (full(n, 2)[box] if box else full(n, 2)).to(device))
    n1 = len(chunk_plan(frags[1]["numel"], bulk, CHUNK_BYTES))
    stage(1, 1, 3, [list(range(n1 // 2)), list(range(n1 // 2, n1))])  # two boundaries' worth of chunks
    ops.run(CommitOp(1, 1, "d", "blend"))
    out["v1"] = snap()
    out["anchor1"] = {p.name: ops.store.anchor(1, p.name, 0, p.numel).clone() for p in ops.maps[1].pieces(rank)
                      if p.owner}
    out["scatter_bytes"] = comm.bytes["scatter"]
    out["pushes"] = []
    for i, dtype in enumerate(["f32", "q4", "q4"]):
        with torch.no_grad():
            for n, t in ad.tensors().items():
                box = ad.box(n)
                t.add_(0.01 * (full(n, 4 + i)[box] if box else full(n, 4 + i)).to(device))
        before = comm.bytes["gather"]
        packed = [p.numpy().tobytes() for _, p in ops.run(ExportOp(1, dtype, "push"))]
        if dtype == "q4":
            ops.run(ResidualOp(1, True))
        out["pushes"].append((dtype, b"".join(packed), comm.bytes["gather"] - before))
    out["inits"] = [b"".join(p.numpy().tobytes() for _, p in ops.run(ExportOp(f["id"], "bf16", "init"))) for f in frags]
    out["final"] = snap()
    out["devices"] = sorted({t.device.type for t in ad.tensors().values()})
    out["held"] = {f["id"]: {p.name: p.numel for p in ops.maps[f["id"]].pieces(rank)} for f in frags}
    torch.save(out, os.path.join(out_dir, f"{case}-rank{rank}.pt"))


def reference(bulk: str, device: str = "cpu") -> dict:
    """Whole tensors, plain torch: what a single process given the full broadcasts would hold. The blend runs
    on `device`, where the island's runs (the same two torch ops, so the same bits on the same device)."""
    session = the_session(bulk)
    frags = session["fragments"]
    rnd = lambda x: unpack(pack(x, bulk), bulk, x.numel())  # noqa: E731  the bulk dtype's rounding
    model = {f["id"]: rnd(flat(f, 1)) for f in frags}  # v0 overwrites
    ref = {"v0": {k: v.clone() for k, v in model.items()}}
    for f in frags:
        model[f["id"]] += 0.25 * flat(f, 2)
    v1 = rnd(flat(frags[1], 3))
    model[1] = blend(model[1].to(device), v1, ALPHA).cpu()
    ref["v1"] = {k: v.clone() for k, v in model.items()}
    ref["anchor1"] = v1
    ref["pushes"] = []
    r = None
    for i, dtype in enumerate(["f32", "q4", "q4"]):
        for f in frags:
            model[f["id"]] += 0.01 * flat(f, 4 + i)
        d = model[1] - v1
        if dtype == "q4":
            p, r = q4_with_feedback(d, r)
        else:
            p = pack(d, dtype)
        ref["pushes"].append((dtype, p.numpy().tobytes()))
    ref["residual"] = r
    ref["inits"] = [pack(model[f["id"]], "bf16").numpy().tobytes() for f in frags]
    ref["final"] = model
    return ref


def _load(path):
    return torch.load(path, weights_only=False)  # this test's own files (they hold slices)


def check(case: str, bulk: str, world: int, out_dir, device: str = "cpu") -> None:
    session = the_session(bulk)
    frags = session["fragments"]
    ref = reference(bulk, device)
    ranks = [_load(os.path.join(out_dir, f"{case}-rank{r}.pt")) for r in range(world)]

    def piece(flat_frags, name, box):
        fid, t = next((f["id"], t) for f in frags for t in f["tensors"] if t["name"] == name)
        whole = flat_frags[fid][t["offset"]: t["offset"] + t["numel"]].view(t["shape"])
        return whole[box] if box else whole

    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731
    for r, got in enumerate(ranks):
        for stage in ("v0", "v1", "final"):
            for name, t in got[stage].items():
                want = piece(ref[stage], name, got["boxes"][name])
                assert torch.equal(bits(t), bits(want)), (case, r, stage, name)
        for name, a in got["anchor1"].items():  # owners keep the raw Θ of v1 as their anchor
            want = piece({1: ref["anchor1"]}, name, got["boxes"][name])
            assert torch.equal(bits(a), bits(want.reshape(-1))), (case, r, name)
    r0 = ranks[0]
    for (dtype, payload, _), (_, want) in zip(r0["pushes"], ref["pushes"]):
        assert payload == want, (case, dtype)  # the gathered push is the full fragment's, bit for bit
    assert r0["inits"] == ref["inits"], case
    for got in ranks[1:]:
        assert got["pushes"] == [(d, b"", 0) for d, _, _ in r0["pushes"]] and got["inits"] == [b"", b""]

    # bytes: rank 0 sends each rank its own slices (v0 of both fragments, v1 of fragment 1) ...
    held = lambda r, fid: sum(ranks[r]["held"][fid].values())  # noqa: E731
    owned = lambda r, fid: sum(n for name, n in ranks[r]["held"][fid].items() if ranks[r]["owner"][name])  # noqa: E731
    want_scatter = sum((held(r, 0) + 2 * held(r, 1)) * XSIZE[bulk] for r in range(1, world))
    assert r0["scatter_bytes"] == want_scatter, (case, r0["scatter_bytes"], want_scatter)
    model = sum(f["numel"] for f in frags)
    if world > 1:
        shipped = want_scatter / XSIZE[bulk] / (model + frags[1]["numel"])  # model copies sent per version
        assert shipped < world - 1  # never a copy to every rank
    # ... and receives only the owners' slices, plus (q4) sends the owners their new residuals
    for dtype, _, moved in r0["pushes"]:
        per = sum(owned(r, 1) for r in range(1, world)) * 4
        assert moved == (2 * per if dtype == "q4" else per), (case, dtype, moved)


def _spawn(case: str, bulk: str, tmp_path) -> None:
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "yeto.learner.island_ranks"])
    mp.start_processes(_worker, args=(4, str(tmp_path / "init"), str(tmp_path), case, bulk), nprocs=4, join=True,
                       start_method="forkserver")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_single_process_is_the_degenerate_case(tmp_path, device):
    """On a GPU too (`cuda`): pieces on the device, v0 written, v1 blended in place there, pushes and INIT
    exported through the host staging (learner/device.py), all bit for bit as the host reference."""
    _steps(0, 1, str(tmp_path), "single", "f32", device)
    check("single", "f32", 1, tmp_path, device)
    got = _load(tmp_path / "single-rank0.pt")
    assert got["scatter_bytes"] == 0 and all(moved == 0 for _, _, moved in got["pushes"])
    assert got["devices"] == [device]


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_tp2_dp2_scatter_and_gather_equal_a_full_broadcast(tmp_path):
    _spawn("tp2dp2", "bf16", tmp_path)
    check("tp2dp2", "bf16", 4, tmp_path)
    r = [_load(tmp_path / f"tp2dp2-rank{i}.pt") for i in range(4)]
    # DP replicas hold the same boxes and end bit-identical; only DP rank 0 owns
    for a, b in ((0, 2), (1, 3)):
        assert r[a]["boxes"] == r[b]["boxes"]
        assert all(torch.equal(r[a]["final"][n], r[b]["final"][n]) for n in r[a]["final"])
        assert any(r[a]["owner"].values()) and not any(r[b]["owner"].values())
    assert r[0]["boxes"]["layers.1.w"] == (slice(None), slice(0, 12))  # a column split
    assert r[1]["boxes"]["layers.0.b"] == (slice(12, 24),)


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_tp2_pp2_scatter_and_gather_equal_a_full_broadcast(tmp_path):
    _spawn("tp2pp2", "f32", tmp_path)
    check("tp2pp2", "f32", 4, tmp_path)
    r = [_load(tmp_path / f"tp2pp2-rank{i}.pt") for i in range(4)]
    assert set(r[0]["final"]) == {"embed.weight", "layers.0.w", "layers.0.b"}  # stage 0
    assert set(r[2]["final"]) == {"layers.1.w", "layers.1.b", "final_norm.weight"}  # stage 1
    assert r[2]["held"][0] == {}  # the embedding's fragment has nothing on stage 1
    assert math.prod(SHAPES["final_norm.weight"]) == r[2]["held"][1]["final_norm.weight"]
