"""MegatronAdapter on real megatron-core modules, 4 gloo ranks on the CPU (tests/megatron_cpu_shim.py).

The truth the adapter is checked against is never the adapter itself:
* the full model is a TP=1/PP=1/EP=1 megatron-core model whose canonical values are its own
  parameters; it reaches the sharded island through megatron-core's checkpoint resharding (ms-swift's
  save_mcore_checkpoint / load_mcore_checkpoint for the GPT, megatron's dist_checkpointing for the
  MoE), so the sharded island's export must reproduce it bitwise;
* across TP/EP layouts, megatron-core's own forward: after one island's values are written into an
  island with other TP/EP sizes, both compute the same per-token loss;
* for the optimizers, megatron-core's own main→model copy and step: after a write, a step with
  lr = 0 must leave master and model parameters where the write put them.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_tiny as T
from yeto.learner.adapters.megatron import EMBEDDING, MegatronAdapter, gather_full, layout_all, scatter_full
from yeto.learner.adapters.megatron_names import strip_wrappers
from yeto.learner.blend import blend
from yeto.schemas.layout import layout_fingerprint
from tests.extras import require

pytestmark = pytest.mark.e2e

require("swift", "megatron.core")

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def _random_values(full: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(v.shape, generator=g) for n, v in full.items()}


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for n in want:
        assert got[n].shape == want[n].shape, f"{what}: {n} {tuple(got[n].shape)} vs {tuple(want[n].shape)}"
        assert torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)), f"{what}: {n} differs"


def _own_values(chunk) -> dict[str, torch.Tensor]:
    """A TP=1/PP=1 model's parameters by name (the reference), fc1 in megatron's [gate; up] order."""
    return {strip_wrappers(n): p.detach().float().clone() for n, p in chunk.named_parameters()}


def _check_reference(ref: dict, own: dict) -> None:
    # At TP=1 every canonical tensor is the parameter itself (gated fc1 only viewed as (2, F, H)).
    assert set(ref) == set(own)
    for n, v in ref.items():
        assert torch.equal(v.reshape(-1), own[n].reshape(-1)), n
    fc1 = ref.get(FC1, ref.get("decoder.layers.0.mlp.experts.0.linear_fc1.weight"))
    assert fc1 is not None and fc1.shape[0] == 2 and fc1.dim() == 3, "gated fc1 must be viewed as (2, F, H)"


# ---- GPT: TP=2, PP=2 with 2 virtual stages; checkpoints through ms-swift's own save/load ---------------

def _gpt(rank: int, world: int, init_file: str, ckpt: str) -> None:
    T.init_world(rank, world, init_file)
    import megatron_cpu_shim

    megatron_cpu_shim.transformer_engine_stub()
    from swift.megatron.utils import load_mcore_checkpoint, save_mcore_checkpoint

    T.layout()  # reference: TP=1, PP=1 (four data-parallel replicas)
    ref_chunks = T.build(T.config(), seed=7)
    ref_adapter = MegatronAdapter(ref_chunks)
    ref = gather_full(ref_adapter)
    _check_reference(ref, _own_values(ref_chunks[0]))
    ref_fp = layout_fingerprint(layout_all(ref_adapter))
    assert all(s.local_slices is None for s in ref_adapter.pieces())
    assert [s.owner for s in ref_adapter.pieces()] == [rank == 0] * len(ref)
    save_mcore_checkpoint(T.swift_args(), ref_chunks, iteration=1, output_dir=f"{ckpt}/ref")

    T.layout(tp=2, pp=2, vpp=2)
    cfg = T.config(vpp=2)
    chunks = T.build(cfg, seed=99)  # other values: only the checkpoint can make them equal
    load_mcore_checkpoint(T.swift_args(mcore_model=f"{ckpt}/ref"), chunks)
    adapter = MegatronAdapter(chunks)
    # names: global layer indices (stage 1, chunk 0 holds layer 1; stage 0, chunk 1 holds layer 2)
    names = {s.name for s in adapter.pieces()}
    stage, tp_rank = rank // 2, rank % 2  # megatron's default order tp-cp-ep-dp-pp
    want_layers = {0, 2} if stage == 0 else {1, 3}
    got_layers = {int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")}
    assert got_layers == want_layers, (rank, got_layers)
    assert EMBEDDING in names  # stage 0 has the embedding, stage 1 its tied copy (output_layer)
    emb = next(s for s in adapter.pieces() if s.name == EMBEDDING)
    assert emb.owner == (stage == 0)
    assert emb.local_slices == (slice(tp_rank * 32, (tp_rank + 1) * 32), slice(0, T.HIDDEN))
    fc1 = next(s for s in adapter.pieces() if s.name == FC1) if stage == 0 else None
    if fc1 is not None:  # gated fc1: (gate/up, rows, hidden), rank r holds rows r*16:(r+1)*16 of both
        assert fc1.global_shape == (2, 32, T.HIDDEN)
        assert fc1.local_slices == (slice(0, 2), slice(tp_rank * 16, (tp_rank + 1) * 16), slice(0, T.HIDDEN))
    assert layout_fingerprint(layout_all(adapter)) == ref_fp
    _assert_bitwise(gather_full(adapter), ref, "TP2/PP2/VPP2 export vs the TP1 model")

    # apply, then export: bitwise; the tied copy on the last stage gets the embedding's values
    values = _random_values(ref, seed=3)
    scatter_full(adapter, values)
    _assert_bitwise(gather_full(adapter), values, "apply-then-export")
    if stage == 1:
        out = dict(chunks[-1].named_parameters())["output_layer.weight"]
        assert torch.equal(out.detach(), values[EMBEDDING][emb.local_slices])

    # the final cut as ms-swift's Megatron checkpoint, loaded into a fresh TP1 island
    save_mcore_checkpoint(T.swift_args(), chunks, iteration=5, output_dir=f"{ckpt}/final")
    T.layout()
    fresh = T.build(T.config(), seed=11)
    load_mcore_checkpoint(T.swift_args(mcore_model=f"{ckpt}/final"), fresh)
    _assert_bitwise(gather_full(MegatronAdapter(fresh)), values, "final checkpoint loaded into a TP1 island")
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_gpt_tp2_pp2_vpp2_export_roundtrip_and_swift_checkpoint(tmp_path):
    T.start(_gpt, 4, tmp_path, str(tmp_path / "ckpt"))


# ---- MoE: TP=2, PP=2, EP=2 (expert TP 1); the reference through megatron's dist_checkpointing ---------

def _moe(rank: int, world: int, init_file: str, ckpt: str) -> None:
    T.init_world(rank, world, init_file)
    from megatron.core import dist_checkpointing

    T.layout()  # reference: TP=1, PP=1, EP=1
    ref_chunks = T.build(T.config(moe=True), moe=True, seed=7)
    ref = gather_full(MegatronAdapter(ref_chunks))
    own = _own_values(ref_chunks[0])
    # at EP=1 the canonical expert name only drops SequentialMLP's "local_experts."
    _check_reference(ref, {n.replace("experts.local_experts.", "experts."): v for n, v in own.items()})
    assert len([n for n in ref if ".mlp.experts." in n]) == 4 * 4 * 2  # layers x experts x (fc1, fc2)
    dist_checkpointing.save({"model0": ref_chunks[0].sharded_state_dict()}, ckpt)

    T.layout(tp=2, pp=2, ep=2, etp=1)
    chunks = T.build(T.config(moe=True), moe=True, seed=99)
    sd = dist_checkpointing.load({"model0": chunks[0].sharded_state_dict()}, ckpt)
    chunks[0].load_state_dict(sd["model0"])
    adapter = MegatronAdapter(chunks)
    stage, ep_rank = rank // 2, rank % 2
    mine = [s for s in adapter.pieces() if ".mlp.experts." in s.name]
    # this rank's experts: global indices ep_rank*2 + {0, 1}, in its stage's layers only
    got = {(int(s.name.split(".")[2]), int(s.name.split(".")[5])) for s in mine}
    assert got == {(layer, ep_rank * 2 + j) for layer in ((0, 1) if stage == 0 else (2, 3)) for j in (0, 1)}, got
    assert all(s.owner and s.local_slices is None for s in mine)  # expert TP 1, expert DP 1: whole, owned
    router = [s for s in adapter.pieces() if s.name.endswith("mlp.router.weight")]
    assert router and all(s.owner == (ep_rank == 0) for s in router)  # replicated over TP: TP rank 0 owns

    _assert_bitwise(gather_full(adapter), ref, "MoE TP2/PP2/EP2 export vs the TP1/EP1 model")
    values = _random_values(ref, seed=4)
    scatter_full(adapter, values)
    _assert_bitwise(gather_full(adapter), values, "MoE apply-then-export")
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_moe_tp2_pp2_ep2_export_matches_reference_and_roundtrips(tmp_path):
    (tmp_path / "ckpt").mkdir()
    T.start(_moe, 4, tmp_path, str(tmp_path / "ckpt"))


# ---- fp32 masters: DistributedOptimizer and Float16OptimizerWithFloat16Params (bf16 model) -----------

def _check_optimizer(distributed: bool, moe: bool, device: str = "cpu") -> None:
    """On the CPU ranks here, and on one CUDA rank in tests/test_cuda_megatron.py (params, masters and the
    optimizer on the GPU; the checks compare host copies)."""
    kind = "sharded" if distributed else "full"
    chunks = T.to_device(T.build(T.config(moe=moe, bf16=True), moe=moe, seed=5), device)
    wrapped, opt = T.wrap(chunks, chunks[0].config, distributed=distributed)
    for step in range(2):
        T.train_step(wrapped, opt, T.tokens(step))
    adapter = MegatronAdapter(wrapped, opt)
    shards = adapter.pieces()
    assert {adapter.masters(s.name)[0][1] for s in shards} == {kind}
    if moe:  # ChainedOptimizer of a dense and an expert optimizer, each over its own data-parallel group
        assert len(opt.chained_optimizers) == 2
    full = gather_full(adapter)
    # after megatron's step the bf16 params are its masters rounded; the masters carry more bits
    extra_bits = False
    for s in shards:
        box = full[s.name][s.local_slices] if s.local_slices is not None else full[s.name]
        for p, _, master, _, _ in adapter.masters(s.name):
            assert p.dtype == torch.bfloat16 and p.device.type == device
            assert master is None or master.device.type == device, s.name
            assert torch.equal(p.detach().cpu().reshape(box.shape), box.bfloat16()), s.name
            if not distributed:
                assert torch.equal(master.reshape(box.shape), adapter.read(s.name)), s.name  # read is the master
        extra_bits |= not torch.equal(box, box.bfloat16().float())
    assert extra_bits, "reads must come from the fp32 masters, not the bf16 params"

    values = {n: v + 1e-3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(i))
              for i, (n, v) in enumerate(full.items())}
    scatter_full(adapter, values)
    assert list(gather_full(adapter)) == list(values)
    _assert_bitwise(gather_full(adapter), values, f"{kind} master apply-then-export")

    def consistent(what: str) -> None:
        for s in shards:
            box = values[s.name][s.local_slices] if s.local_slices is not None else values[s.name]
            for p, _, master, start, end in adapter.masters(s.name):
                assert torch.equal(p.detach().cpu().reshape(box.shape), box.bfloat16()), f"{what}: param {s.name}"
                if distributed and end > start:
                    assert torch.equal(master.cpu(), box.reshape(-1)[start:end]), f"{what}: master shard {s.name}"
                elif not distributed:
                    assert torch.equal(master.cpu().reshape(box.shape), box), f"{what}: master {s.name}"
    consistent("after write")
    # a later version blends in: θ = α·θ + (1 − α)·Θ through the adapter (every rank, every shard, in order:
    # the DistributedOptimizer's read is a collective), on the parameters' device; the same ops there give the
    # same bits
    dev = torch.device(device)
    globs = {n: torch.randn(v.shape, generator=torch.Generator().manual_seed(50 + i))
             for i, (n, v) in enumerate(values.items())}
    for s in shards:
        g = globs[s.name][s.local_slices] if s.local_slices is not None else globs[s.name]
        adapter.blend(s.name, g.reshape(-1), 0.375, tuple(g.shape))
    values = {n: blend(v.to(dev).reshape(-1), globs[n].reshape(-1), 0.375).view(v.shape).cpu()
              for n, v in values.items()}
    consistent("after blend")
    _assert_bitwise(gather_full(adapter), values, f"{kind} master blend-then-export")
    # megatron's own step with lr = 0 copies its masters back into the params: they must be ours
    for g in opt.param_groups:
        g["lr"] = 0.0
    T.train_step(wrapped, opt, T.tokens(9))
    consistent("after an lr=0 step")
    _assert_bitwise(gather_full(adapter), values, f"{kind} export after an lr=0 step")

    # the single-writer protocol: only each data-parallel group's rank 0 writes, sync_replicas spreads it
    values = {n: v * 0.5 for n, v in values.items()}
    for s in shards:
        e = adapter._entries[s.name]
        if e.replica_group is None or dist.get_rank(e.replica_group) == 0:
            adapter.write(s.name, values[s.name][s.local_slices] if s.local_slices is not None else values[s.name])
    adapter.sync_replicas([s.name for s in shards])
    consistent("after sync_replicas")


def _optimizers(rank: int, world: int, init_file: str) -> None:
    T.init_world(rank, world, init_file)
    T.layout(tp=2)  # dense: TP 2 x DP 2
    for distributed in (True, False):
        _check_optimizer(distributed, moe=False)
    T.layout(ep=2, etp=1)  # MoE: DP 4 for dense params, EP 2 x expert DP 2 for experts
    for distributed in (True, False):
        _check_optimizer(distributed, moe=True)
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_masters_of_both_optimizers_read_write_and_survive_a_step(tmp_path):
    T.start(_optimizers, 4, tmp_path)


def _optimizers_on_the_gpu(rank: int, world: int, init_file: str) -> None:
    T.init_world(rank, world, init_file, device="cuda")
    import megatron_cpu_shim

    T.layout()  # one rank: NCCL takes one rank per device
    for distributed in (True, False):
        _check_optimizer(distributed, moe=False, device="cuda")
    # the real device all along: the CPU shim was never installed in this process
    assert not megatron_cpu_shim._DONE and torch.cuda.current_device.__module__ == "torch.cuda"
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.timeout(240)
def test_masters_on_the_gpu_read_write_blend_and_survive_a_step(tmp_path):
    """The same checks on one CUDA rank: bf16 parameters, the DistributedOptimizer's fp32 shards and the
    Float16Optimizer's fp32 copies on the GPU; reads gathered there, writes and blends in place there."""
    T.start(_optimizers_on_the_gpu, 1, tmp_path, start_method="spawn")


# ---- two islands, other TP and EP sizes: same names, values exchanged, same forward -----------------

def _exchange(rank: int, world: int, init_file: str) -> None:
    T.init_world(rank, world, init_file)
    toks = T.tokens(1, batch=4)
    T.layout(tp=2, ep=2, etp=2)  # island A: TP 2 x DP 2, EP 2 x expert TP 2
    a_chunks = T.build(T.config(moe=True), moe=True, seed=1)
    a = MegatronAdapter(a_chunks)
    a_layout, a_values = layout_all(a), gather_full(a)
    a_loss = T.loss_per_token(a_chunks, toks)
    assert any(s.local_slices is not None for s in a.pieces() if ".mlp.experts." in s.name)  # experts TP-split

    T.layout(tp=1, ep=4)  # island B: TP 1 x DP 4, EP 4
    b_chunks = T.build(T.config(moe=True), moe=True, seed=2)
    b = MegatronAdapter(b_chunks)
    assert layout_all(b) == a_layout
    assert layout_fingerprint(layout_all(b)) == layout_fingerprint(a_layout)
    assert not torch.allclose(T.loss_per_token(b_chunks, toks), a_loss)
    scatter_full(b, a_values)
    _assert_bitwise(gather_full(b), a_values, "A's values written into B")
    torch.testing.assert_close(T.loss_per_token(b_chunks, toks), a_loss, rtol=1e-5, atol=1e-5)
    _lora_b_of_gated_fc1(rank)
    dist.destroy_process_group()


class _LoraFc1(torch.nn.Module):
    """A gated fc1 with a LoRA B factor, named as peft / mcore-bridge name them, built from megatron-core's
    ColumnParallelLinear: the base has partition stride 2, the B factor (as mcore-bridge builds it) 1."""

    def __init__(self, cfg, r: int = 4):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        init = torch.nn.init.normal_
        self.base_layer = ColumnParallelLinear(T.HIDDEN, 64, config=cfg, init_method=init, bias=False, stride=2,
                                               gather_output=False)
        self.lora_B = torch.nn.ModuleDict({"default": ColumnParallelLinear(
            r, 64, config=cfg, init_method=init, bias=False, gather_output=False)})
        self.base_layer.weight.requires_grad_(False)  # a LoRA run trains the factors only


def _lora_tree(cfg):
    root = torch.nn.Module()
    root.decoder = torch.nn.Module()
    root.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.decoder.layers[0].mlp = torch.nn.Module()
    root.decoder.layers[0].mlp.linear_fc1 = _LoraFc1(cfg)
    return root


def _lora_b_of_gated_fc1(rank: int) -> None:
    """The B factor's rows are [gate_r; up_r] on TP rank r like its base layer's: its canonical tensor
    must be (2, F, r) with the TP=1 order, else values would land in the wrong rows across TP sizes."""
    name = "decoder.layers.0.mlp.linear_fc1.lora_B.default.weight"
    x = torch.randn(T.SEQ, 1, 4, generator=torch.Generator().manual_seed(0))
    T.layout(tp=2)
    tree = _lora_tree(T.config(layers=1))
    ad = MegatronAdapter(tree)
    assert [s.name for s in ad.pieces()] == [name]  # the frozen base layer is not synced
    s = ad.pieces()[0]
    tp_rank = rank % 2
    assert s.global_shape == (2, 32, 4) and s.local_slices == (slice(0, 2), slice(tp_rank * 16, tp_rank * 16 + 16),
                                                               slice(0, 4))
    values = gather_full(ad)
    local_out = tree.decoder.layers[0].mlp.linear_fc1.lora_B["default"](x)[0]
    T.layout(tp=1)
    tree1 = _lora_tree(T.config(layers=1))
    ad1 = MegatronAdapter(tree1)
    scatter_full(ad1, values)
    full_out = tree1.decoder.layers[0].mlp.linear_fc1.lora_B["default"](x)[0]
    gate, up = full_out[..., :32], full_out[..., 32:]
    rows = slice(tp_rank * 16, tp_rank * 16 + 16)
    torch.testing.assert_close(local_out, torch.cat([gate[..., rows], up[..., rows]], dim=-1))


@pytest.mark.timeout(240)
def test_islands_with_other_tp_and_ep_share_names_and_exchange_values(tmp_path):
    T.start(_exchange, 4, tmp_path)
