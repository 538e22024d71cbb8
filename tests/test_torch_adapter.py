"""TorchModuleAdapter and the fragment gather/scatter helpers, incl. a real 2-process gloo DP island."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from yeto.learner.adapters import (
    ModelAdapter,
    Piece,
    SlicedTorchAdapter,
    TorchModuleAdapter,
    fragment_names,
    gather_fragment,
    scatter_fragment,
)
from yeto.schemas.errors import ConfigError, WireError
from yeto.schemas.layout import build_session, natural_key


class Tiny(nn.Module):
    """lm_head is registered first and tied to embed: the kept name must still be embed.weight
    (first in canonical order), whatever the registration order."""

    def __init__(self, layers: int = 11):
        super().__init__()
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.embed = nn.Embedding(10, 4)
        self.lm_head.weight = self.embed.weight
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))
        self.norm = nn.LayerNorm(4)


def tiny(seed=0, layers=11):
    torch.manual_seed(seed)
    return Tiny(layers)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def session_for(adapter, fragments=3):
    return build_session(adapter.layout(), fragments, run="r", push_dtype="f32", bulk_dtype="f32",
                         chunk_bytes=1 << 20, init_island="a", sync_every=fragments)


# ---- what is synced -------------------------------------------------------------------------------

def test_tied_weight_appears_once_under_its_first_canonical_name():
    m = tiny()
    ad = TorchModuleAdapter(m)
    names = [s.name for s in ad.pieces()]
    assert "embed.weight" in names and "lm_head.weight" not in names
    assert ad.aliases["embed.weight"] == ["embed.weight", "lm_head.weight"]
    assert names == sorted(names, key=natural_key)  # layers.2 before layers.10
    assert names.index("layers.2.weight") < names.index("layers.10.weight")
    assert [e["name"] for e in ad.layout()] == names
    assert len(names) == 1 + 2 * 11 + 2


def test_distinct_parameters_over_one_storage_appear_once():
    m = tiny(layers=1)
    m.alias = nn.Parameter(m.layers[0].weight.data)  # another Parameter object, same memory
    ad = TorchModuleAdapter(m)
    names = [s.name for s in ad.pieces()]
    assert "alias" in names and "layers.0.weight" not in names
    assert ad.aliases["alias"] == ["alias", "layers.0.weight"]  # "alias" sorts first


def test_only_trainable_parameters_are_synced():
    m = tiny()
    for p in m.layers[1].parameters():
        p.requires_grad_(False)
    names = [s.name for s in TorchModuleAdapter(m).pieces()]
    assert "layers.1.weight" not in names and "layers.1.bias" not in names
    assert "layers.0.weight" in names and "layers.2.bias" in names


def test_shards_and_layout_describe_the_model():
    m = tiny(layers=2).to(torch.bfloat16)
    ad = TorchModuleAdapter(m)
    sh = {s.name: s for s in ad.pieces()}
    assert sh["embed.weight"] == Piece("embed.weight", (10, 4), "bfloat16", None, True)
    assert {"name": "layers.1.bias", "shape": [4], "dtype": "bfloat16"} in ad.layout()
    assert isinstance(ad, ModelAdapter)


def test_unsupported_parameter_dtype_is_refused():
    m = tiny(layers=1).double()
    with pytest.raises(ConfigError) as e:
        TorchModuleAdapter(m)
    assert "dtype" in e.value.field


# ---- read / write ---------------------------------------------------------------------------------

def test_bf16_model_with_fp32_master_reads_master_and_writes_both():
    m = tiny(layers=2).to(torch.bfloat16)
    master = {n: p.detach().float() + 1e-3 for n, p in m.named_parameters()}  # more precise than bf16
    assert "lm_head.weight" in master and "embed.weight" not in master  # keyed by the tied alias: still found
    ad = TorchModuleAdapter(m, master=master)
    assert torch.equal(ad.read("embed.weight"), master["lm_head.weight"])
    assert ad.read("layers.0.weight").dtype == torch.float32
    value = torch.full((4, 4), 1.0 + 2.0**-12)  # not representable in bf16
    ad.write("layers.0.weight", value)
    assert torch.equal(bits(master["layers.0.weight"]), bits(value))
    assert torch.equal(bits(m.layers[0].weight), bits(value.to(torch.bfloat16)))
    assert m.layers[0].weight.dtype == torch.bfloat16
    assert torch.equal(ad.read("layers.0.weight"), value)


def test_write_without_master_updates_the_parameter_and_its_tied_alias():
    m = tiny(layers=1)
    ad = TorchModuleAdapter(m)
    v = torch.arange(40, dtype=torch.float32).view(10, 4)
    ad.write("embed.weight", v.reshape(-1))  # flat values are reshaped
    assert torch.equal(m.embed.weight, v) and torch.equal(m.lm_head.weight, v)
    with pytest.raises(ValueError, match="write of embed.weight: expected 40 values"):
        ad.write("embed.weight", torch.zeros(3))
    with pytest.raises(ValueError, match="'lm_head.weight' is not a synced parameter"):
        ad.read("lm_head.weight")  # an alias is not a synced name


def test_master_must_match_its_parameter():
    m = tiny(layers=1)
    with pytest.raises(ConfigError) as e:
        TorchModuleAdapter(m, master={"layers.0.weight": torch.zeros(3, 3)})
    assert e.value.field == "master.layers.0.weight"
    with pytest.raises(ConfigError):
        TorchModuleAdapter(m, master={"nope": torch.zeros(1)})



def test_misuse_is_never_a_wire_error():
    """A receiver counts and drops a WireError and trains on; a caller's misuse of an adapter (a name it
    does not sync, a value of the wrong shape) or a model it cannot take is a bug to fix, so it must not
    look like garbage from the wire (docs/design.md §6 "Adapters")."""
    ad = TorchModuleAdapter(tiny(layers=1))
    sliced = SlicedTorchAdapter.build({"w": (4, 2)}, tp=2, tp_rank=1)
    misuse = [lambda: ad.read("ghost"), lambda: ad.write("embed.weight", torch.zeros(3)),
              lambda: ad.blend("embed.weight", torch.zeros(3), 0.5, (3,)),
              lambda: sliced.read("ghost"), lambda: sliced.write("w", torch.zeros(3)),
              lambda: gather_fragment(ad, {"id": 0, "numel": 1, "tensors": [
                  {"name": "ghost", "shape": [1], "offset": 0, "numel": 1}]}),
              lambda: TorchModuleAdapter(tiny(layers=1).double()),
              lambda: TorchModuleAdapter(tiny(layers=1), bucket_bytes=1)]
    for call in misuse:
        with pytest.raises(ValueError) as e:
            call()
        assert not isinstance(e.value, WireError), repr(e.value)

# ---- gather / scatter -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,with_master", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_gather_scatter_round_trip_is_bitwise(dtype, with_master):
    m = tiny().to(dtype)
    master = None
    if with_master:  # a consistent state, as after an optimizer step: param = bf16(master)
        master = {n: p.detach().float() + 1e-3 for n, p in m.named_parameters()}
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(master[n])
    ad = TorchModuleAdapter(m, master=master)
    before = {n: bits(p) for n, p in m.named_parameters()}
    before_master = {n: bits(t) for n, t in (master or {}).items()}
    sess = session_for(ad)
    flats = [gather_fragment(ad, f) for f in sess["fragments"]]
    for f, flat in zip(sess["fragments"], flats):
        assert flat.dtype == torch.float32 and flat.numel() == f["numel"]
        # layout order: each tensor at its offset
        t0 = f["tensors"][-1]
        assert torch.equal(flat[t0["offset"] : t0["offset"] + t0["numel"]], ad.read(t0["name"]).reshape(-1))
        scatter_fragment(ad, f, flat)
    assert all(torch.equal(bits(p), before[n]) for n, p in m.named_parameters())
    assert all(torch.equal(bits(master[n]), before_master[n]) for n in before_master)
    # New values in, same values out (bitwise for the fp32 view that gather reads).
    f = sess["fragments"][1]
    new = torch.randn(f["numel"], generator=torch.Generator().manual_seed(3))
    if dtype == torch.bfloat16 and not with_master:
        new = new.to(torch.bfloat16).float()  # only bf16 values survive a bf16 parameter
    scatter_fragment(ad, f, new)
    assert torch.equal(bits(gather_fragment(ad, f)), bits(new))


def test_gather_refuses_a_fragment_that_does_not_match_the_model():
    ad = TorchModuleAdapter(tiny(layers=1))
    frag = {"id": 0, "numel": 16, "tensors": [{"name": "layers.0.weight", "shape": [2, 8], "offset": 0, "numel": 16}]}
    with pytest.raises(ValueError, match="has shape \\[2, 8\\]; the model holds \\[4, 4\\]"):
        gather_fragment(ad, frag)
    frag = {"id": 0, "numel": 4, "tensors": [{"name": "ghost", "shape": [4], "offset": 0, "numel": 4}]}
    with pytest.raises(ValueError, match="'ghost' is not a synced tensor"):
        gather_fragment(ad, frag)
    good = {"id": 0, "numel": 4, "tensors": [{"name": "layers.0.bias", "shape": [4], "offset": 0, "numel": 4}]}
    with pytest.raises(ValueError, match="flat must be a 1-D tensor of 4 values"):
        scatter_fragment(ad, good, torch.zeros(5))


def test_sync_replicas_without_a_group_is_a_no_op():
    m = tiny(layers=1)
    ad = TorchModuleAdapter(m)
    before = bits(m.layers[0].weight)
    ad.sync_replicas()
    assert ad.owner and torch.equal(bits(m.layers[0].weight), before)


# ---- a data-parallel island of two gloo ranks -----------------------------------------------------

MASTERED = ("embed.weight", "layers.3.weight")


def _dp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        m = tiny(seed=0).to(torch.bfloat16)  # identical start on both ranks
        master = {n: p.detach().float() for n, p in m.named_parameters(remove_duplicate=False) if n in MASTERED}
        if rank == 1:  # replicas drift apart (as if they had diverged or rank 1 restarted)
            g = torch.Generator().manual_seed(99)
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
                for t in master.values():
                    t.copy_(torch.randn(t.shape, generator=g))
        # small buckets: the fragment travels in several broadcasts
        ad = TorchModuleAdapter(m, master=master, group=dist.group.WORLD, bucket_bytes=96)
        assert ad.owner == (rank == 0)
        sess = session_for(ad)
        frag = next(f for f in sess["fragments"] if {"layers.3.weight", "layers.3.bias"} & set(fragment_names(f)))
        if ad.owner:
            new = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(7))
            scatter_fragment(ad, frag, new)
        ad.sync_replicas(fragment_names(frag))
        torch.save({"params": {n: bits(p) for n, p in m.named_parameters()},
                    "master": {n: bits(t) for n, t in master.items()},
                    "frag": fragment_names(frag)}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_two_gloo_ranks_owner_writes_a_fragment_and_sync_replicas_makes_them_identical(tmp_path):
    mp.spawn(_dp_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    frag = set(r0["frag"])
    assert frag & set(MASTERED) and frag - set(MASTERED)  # both kinds of tensor travel
    for n, b0 in r0["params"].items():
        same = torch.equal(b0, r1["params"][n])
        assert same == (n in frag), n  # synced tensors equal bitwise; the others untouched
    for n in MASTERED:
        assert torch.equal(r0["master"][n], r1["master"][n]) == (n in frag), n
    # rank 0 holds the written values: bf16 params derived from the fp32 master
    # Rebuild rank 0's expected state independently: same model, same written values.
    m = tiny(seed=0).to(torch.bfloat16)
    ad = TorchModuleAdapter(m, master={n: p.detach().float() for n, p in m.named_parameters(remove_duplicate=False)
                                       if n in MASTERED})
    sess = session_for(ad)
    f = next(f for f in sess["fragments"] if set(fragment_names(f)) == frag)
    new = torch.randn(f["numel"], generator=torch.Generator().manual_seed(7))
    scatter_fragment(ad, f, new)
    for n, p in m.named_parameters():
        if n in frag:
            assert torch.equal(bits(p), r0["params"][n]), n
    for n in MASTERED:
        if n in frag:
            assert torch.equal(bits(ad.read(n)), r1["master"][n]), n


@pytest.mark.parametrize("model_dtype, with_master", [(torch.float32, False), (torch.bfloat16, True),
                                                      (torch.bfloat16, False)])
def test_blend_in_place_gives_the_bits_of_the_default_read_blend_write(model_dtype, with_master):
    """TorchModuleAdapter.blend works on its own f32 values in place (no piece-sized temporary); it must
    leave exactly the master and parameter bits of the default path (ModelAdapter.blend: read, blend
    into a new tensor, write), and agree with α·θ + (1 − α)·Θ in float64 to f32 rounding."""
    alpha = 0.3

    def make():
        m = tiny(3).to(model_dtype)
        master = {n: p.detach().float().clone() for n, p in m.named_parameters()} if with_master else None
        return TorchModuleAdapter(m, master=master)

    fast, slow = make(), make()
    for s in fast.pieces():
        glob = torch.randn(torch.Size(s.global_shape).numel(), generator=torch.Generator().manual_seed(7))
        before = fast.read(s.name).double().reshape(-1).clone()
        fast.blend(s.name, glob, alpha, tuple(s.global_shape))
        ModelAdapter.blend(slow, s.name, glob, alpha, tuple(s.global_shape))
        assert torch.equal(bits(fast.read(s.name)), bits(slow.read(s.name))), s.name
        assert torch.equal(bits(fast._param(s.name).detach()), bits(slow._param(s.name).detach())), s.name
        want = alpha * before + (1 - alpha) * glob.double()
        tol = 1e-6 if with_master or model_dtype == torch.float32 else 1e-2  # a bf16 parameter holds 8 bits
        assert torch.allclose(fast.read(s.name).double().reshape(-1), want, rtol=0, atol=tol), s.name
    with pytest.raises(ValueError, match="blend of embed.weight"):
        fast.blend("embed.weight", torch.zeros(3), alpha, (3,))
