"""Islands with different parallel layouts in one session: a real nats-server, the real `yeto syncer`
(--strict), an island of one process (TP=1) and an island of two gloo ranks (TP=2: boxes along
rows, along columns, a 1-D split, a replicated tensor), both `learner.island.Island` in lockstep.

The TP=2 island is the INIT island, so version 0 is its weights gathered chunk by chunk from both
ranks. Each island's inner step pulls its boxes towards its own target (the same elementwise math on
a box as on the whole tensor). The reference replays the run on whole tensors in plain torch:
overwrite by v0, inner steps, d = local − anchor pushed at each due round with the tokens trained
since the anchor, the syncer's token-weighted Nesterov step (tests.scripted.Reference, torch SGD),
and the blend θ = α·θ_local + (1 − α)·Θ. The final cut must match it, both islands must end with
exactly the final cut (the TP=2 island as its slices), and the TP=2 island's counters must show
per-rank traffic: rank 1's own slices, not whole fragments.
"""
from __future__ import annotations

import json
import os
import warnings
import zlib

import nats
import pytest
import torch
import torch.distributed as dist

from yeto.learner.adapters.sliced_torch import SlicedTorchAdapter
from yeto.learner.blend import blend
from yeto.schemas.layout import build_fragments
from tests.e2e_procs import join_ranks_and_syncer, rank_processes
from tests.scripted import LR, MU, Reference, ScriptedIsland, SyncerProc, wait_provisioned

SHAPES = {"embed.weight": (40, 16), "layers.0.w": (36, 16), "layers.0.b": (36,), "layers.1.w": (16, 36),
          "layers.1.b": (16,)}  # 1 KiB chunks: 3 and 5 per fragment in f32, ending mid-row
TP_DIMS = {"embed.weight": 0, "layers.0.w": 0, "layers.0.b": 0, "layers.1.w": 1}  # layers.1.b: replicated
TOKENS = {"a": 8, "b": 16}
INNER_LR, ALPHA, ROUNDS, H, P = 0.2, 0.5, 4, 2, 2


def full(kind: str, island: str, name: str) -> torch.Tensor:
    seed = zlib.crc32(f"{kind}/{island}/{name}".encode())
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def tp_dim(name, shape, tp):
    return TP_DIMS.get(name)


def _island(proc: int, url: str, run: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from yeto.learner.config import IslandConfig
    from yeto.learner.island import Island
    from yeto.schemas.conn import ConnectOptions

    name = "a" if proc == 0 else "b"
    group, rank = None, 0
    if name == "b":
        rank = proc - 1
        dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=2)
        group = dist.group.WORLD
    try:
        coords = {"tp": 2, "tp_rank": rank} if name == "b" else {}
        ad = SlicedTorchAdapter.build(SHAPES, values=lambda n, s: full("init", name, n), tp_dim=tp_dim, **coords)
        cfg = IslandConfig(run=run, island=name, nats=ConnectOptions(url=url), lockstep=True, alpha=ALPHA,
                           progress=False, heartbeat_s=0.5, session_timeout_s=60, lockstep_timeout_s=60,
                           final_timeout_s=60, shutdown_timeout_s=30, connect_timeout_s=20,
                           step_log=f"{out}/steplog-{name}.jsonl" if rank == 0 else None)
        island = Island(ad, cfg, group=group).start()
        targets = {n: (full("target", name, n)[ad.box(n)] if ad.box(n) else full("target", name, n))
                   for n in ad.tensors()}
        steps = 0
        while True:
            with torch.no_grad():  # one inner step: pull the box towards this island's target
                for n, t in ad.tensors().items():
                    t.sub_(INNER_LR * (t - targets[n]))
            steps += 1
            if not island.boundary(tokens=TOKENS[name]) or steps > 50:
                break
        torch.save({"tensors": ad.tensors(), "boxes": {n: ad.box(n) for n in ad.tensors()},
                    "owner": {s.name: s.owner for s in ad.pieces()}, "finalized": island.finalized,
                    "counters": dict(island.counters), "steps": steps}, f"{out}/{name}{rank}.pt")
        island.close()
    finally:
        if group is not None:
            dist.destroy_process_group()


def reference(fragments: list[dict]) -> Reference:
    """The whole run on whole tensors (see the module doc)."""
    def flat(kind, island, frag):
        return torch.cat([full(kind, island, t["name"]).reshape(-1) for t in frag["tensors"]])

    v0 = {f["id"]: flat("init", "b", f) for f in fragments}  # the INIT island's weights, f32 bulk
    ref = Reference(v0, lr=LR, mu=MU)
    theta = {i: {f: v.clone() for f, v in v0.items()} for i in TOKENS}
    anchor = {i: {f: v.clone() for f, v in v0.items()} for i in TOKENS}
    steps = {i: {f: 0 for f in v0} for i in TOKENS}
    target = {i: {f["id"]: flat("target", i, f) for f in fragments} for i in TOKENS}
    for t in range(1, ROUNDS + 1):  # round t is due at local step t·H/P = t
        for i in TOKENS:
            for f in v0:
                theta[i][f] -= INNER_LR * (theta[i][f] - target[i][f])
                steps[i][f] += 1
        fid = (t - 1) % P
        ref.round(fid, [theta[i][fid] - anchor[i][fid] for i in sorted(TOKENS)],
                  [steps[i][fid] * TOKENS[i] for i in sorted(TOKENS)])
        new = ref.value(fid)
        for i in TOKENS:
            theta[i][fid] = blend(theta[i][fid], new, ALPHA)
            anchor[i][fid] = new
            steps[i][fid] = 0
    return ref


@pytest.mark.timeout(180)
async def test_a_tp1_and_a_tp2_island_share_one_session_and_end_with_identical_global_values(
        nats_url, run_id, tmp_path):
    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", "--islands", "2", "--fragments", str(P),
                        "--sync-every", str(H), "--total-steps", str(ROUNDS), "--strict", "--init-island", "b",
                        "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024",
                        "--status-every", "0.5").start()
    nc = await nats.connect(nats_url)
    try:
        await wait_provisioned(nc.jetstream(), run_id)
        with rank_processes(_island, (nats_url, run_id, str(tmp_path)), 3) as ctx:
            await join_ranks_and_syncer(ctx, syncer, 150)

        watcher = ScriptedIsland(nc, run_id, "watcher")
        session = await watcher.wait_session()
        frags = session["fragments"]
        # the session is the canonical layout: the same whatever the islands' TP
        assert [[t["name"] for t in f["tensors"]] for f in frags] == \
            [[t["name"] for t in f["tensors"]] for f in build_fragments(
                [{"name": n, "shape": list(s), "dtype": "float32"} for n, s in SHAPES.items()], P)]
        cut = {f["id"]: (await watcher.read_cut(f["id"], final=True))[1] for f in frags}
    finally:
        syncer.stop()
        await nc.close()

    ref = reference(frags)
    for f in frags:
        assert any(len(t["shape"]) == 2 for t in f["tensors"])
        torch.testing.assert_close(cut[f["id"]], ref.value(f["id"]), rtol=1e-5, atol=1e-6)

    load = lambda n: torch.load(tmp_path / f"{n}.pt", weights_only=False)  # noqa: E731
    a, b0, b1 = load("a0"), load("b0"), load("b1")
    where = {t["name"]: (f["id"], t) for f in frags for t in f["tensors"]}

    def global_value(name):
        fid, t = where[name]
        return cut[fid][t["offset"]: t["offset"] + t["numel"]].view(t["shape"])

    for got in (a, b0, b1):
        # Stopped at the boundary where the manifest was seen: the one after the last round's version, or
        # that version's own when the manifest landed while the sync worker read it (the syncer sends the
        # manifest right after that version's seal; TP=2's boundary hands the version to its ranks first).
        assert got["finalized"] and got["steps"] in (ROUNDS, ROUNDS + 1), got["steps"]
        for name, t in got["tensors"].items():  # exactly the final cut, as whole tensors or as slices
            want = global_value(name)
            box = got["boxes"][name]
            assert torch.equal(t, want[box] if box else want), name
    assert set(a["tensors"]) == set(SHAPES) and all(box is None for box in a["boxes"].values())
    assert b1["boxes"]["layers.1.w"] == (slice(None), slice(18, 36)) and b1["boxes"]["layers.1.b"] is None

    # per-rank traffic of the TP=2 island: rank 0 sent rank 1 its own slices of every version it
    # installed (v0, two rounds' versions and the final cut of each fragment, all f32) ...
    share = {f["id"]: sum(b1["tensors"][t["name"]].numel() for t in f["tensors"]) for f in frags}
    owned = {f["id"]: sum(b1["tensors"][t["name"]].numel() for t in f["tensors"] if b1["owner"][t["name"]])
             for f in frags}
    # Stopped at the last round's own boundary (see above): that version gave way to the final cut. The
    # worker scatters a version to the ranks as it reads it (learner/stager.py), so it was scattered
    # unless the final cut's reading stopped the worker before it began that version.
    unscattered = {0, share[(ROUNDS - 1) % P]} if b0["steps"] == ROUNDS else {0}
    c = b0["counters"]
    assert c["scatter_bytes"] in {4 * (4 * sum(share.values()) - e) for e in unscattered}
    early = 4 * sum(share.values()) - c["scatter_bytes"] // 4
    assert c["scatter_bytes"] < 4 * 4 * sum(f["numel"] for f in frags)  # less than whole fragments
    # ... and received rank 1's owned slices for INIT and for each round's push (f32)
    assert c["gather_bytes"] == 4 * (sum(owned.values()) + sum(owned[(t - 1) % P] for t in range(1, ROUNDS + 1)))
    assert a["counters"]["scatter_bytes"] == a["counters"]["gather_bytes"] == 0
    # the step log carries them per step (v0 landed before step 1, INIT too)
    lines = [json.loads(x) for x in (tmp_path / "steplog-b.jsonl").read_text().splitlines()]
    assert sum(e["scatter_bytes"] for e in lines) == 4 * (3 * sum(share.values()) - early)
    assert sum(e["gather_bytes"] for e in lines) == 4 * sum(owned[(t - 1) % P] for t in range(1, ROUNDS + 1))
    assert [e["gather_bytes"] > 0 for e in lines] == [True] * ROUNDS + [False] * (b0["steps"] - ROUNDS)
    assert os.path.exists(tmp_path / "steplog-a.jsonl")
