"""Parameters on an accelerator (learner/device.py, docs/design.md §6 "Device parameters"): the host staging
of exports (pinned buffers, non-blocking copies on a side stream) and TorchModuleAdapter with its parameters
and fp32 master on the device (export, apply, blend in place, bf16 parameters).

Each adapter test runs on the CPU here and on a GPU under the `cuda` marker (skipped with the reason where
torch sees no CUDA device): the same checks, the expected values computed with the same torch ops on the same
device, so bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from yeto.learner.adapters import TorchModuleAdapter, gather_fragment, scatter_fragment
from yeto.learner.device import HostStaging, to_device_of
from yeto.learner.blend import blend
from yeto.schemas.layout import build_session

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def tiny(device: str, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    return m.to(device=device, dtype=dtype)


def session_for(ad, fragments=2):
    return build_session(ad.layout(), fragments, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=256,
                         init_island="a", sync_every=2)


# ---- host staging -----------------------------------------------------------------------------------

def test_host_tensors_pass_through_the_staging_and_stay_put():
    st = HostStaging()
    t = torch.arange(6.0)
    assert st.host(t) is t and st.copies == 0
    st.wait()  # nothing issued: returns at once
    g = torch.ones(3)
    assert to_device_of(g, t) is g


@pytest.mark.cuda
def test_device_values_reach_pinned_host_buffers_on_a_side_stream_after_the_queued_kernels():
    st = HostStaging()
    big = torch.randn(1 << 22, device="cuda")  # 16 MiB: the kernels below are still queued when host() returns
    want = (big * 3 + 1).cpu()
    big.mul_(3).add_(1)  # queued on the compute stream before the boundary: the copy must see it
    h = st.host(big)
    side = st._streams[big.device]
    assert side != torch.cuda.current_stream() and h.is_pinned() and h.device.type == "cpu"
    # a temporary (an fp32 view of a bf16 parameter, say) freed right after: its memory must not be reused
    # by the next kernel before the copy ran (record_stream)
    tmp_h = st.host(big.to(torch.bfloat16).float())
    scratch = torch.full((1 << 22,), -7.0, device="cuda")  # would take the freed block without record_stream
    st.wait()
    assert st.copies == 2
    assert torch.equal(h, want)
    assert torch.equal(tmp_h, want.to(torch.bfloat16).float())  # not the scratch's -7s
    del scratch
    assert torch.equal(to_device_of(h, big), big) and to_device_of(h, big).device == big.device


# ---- TorchModuleAdapter on the device ------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_fp32_params_on_the_device_export_apply_and_blend_in_place(device):
    m = tiny(device)
    ad = TorchModuleAdapter(m)
    sess = session_for(ad)
    f = sess["fragments"][0]
    before = {n: bits(p) for n, p in m.named_parameters()}
    flat = gather_fragment(ad, f)  # the host fp32 fragment, from the device values
    assert flat.device.type == "cpu"
    scatter_fragment(ad, f, flat)
    assert all(torch.equal(bits(p), before[n]) for n, p in m.named_parameters())
    new = torch.randn(f["numel"], generator=torch.Generator().manual_seed(1))
    scatter_fragment(ad, f, new)
    assert torch.equal(gather_fragment(ad, f), new)
    assert {p.device.type for p in m.parameters()} == {device}
    # blend: θ = α·θ + (1 − α)·Θ, in the parameter's own memory, on its device
    name, t = f["tensors"][0]["name"], f["tensors"][0]
    p = dict(m.named_parameters())[name]
    glob = torch.randn(t["numel"], generator=torch.Generator().manual_seed(2))
    want = blend(p.detach().clone().reshape(-1), glob.to(device), 0.375)
    ptr = p.data_ptr()
    ad.blend(name, glob, 0.375, tuple(t["shape"]))
    assert p.data_ptr() == ptr and p.device.type == device
    assert torch.equal(bits(p), bits(want.view(p.shape)))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_params_with_an_fp32_master_on_the_device(device):
    m = tiny(device, torch.bfloat16)
    master = {n: p.detach().float() + 1e-3 for n, p in m.named_parameters()}  # more bits than bf16
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(master[n])
    ad = TorchModuleAdapter(m, master=master)
    name = "0.weight"
    assert ad.read(name).dtype == torch.float32 and ad.read(name).device.type == device
    value = torch.full((24, 12), 1.0 + 2.0**-12)  # not representable in bf16: the master keeps it
    ad.write(name, value)
    assert torch.equal(bits(master[name]), bits(value))
    assert torch.equal(bits(m[0].weight), bits(value.to(torch.bfloat16)))
    glob = torch.randn(24 * 12, generator=torch.Generator().manual_seed(4))
    want = blend(master[name].clone().reshape(-1), glob.to(device), 0.5).view(24, 12)
    ad.blend(name, glob, 0.5, (24, 12))
    assert torch.equal(bits(master[name]), bits(want))
    assert torch.equal(bits(m[0].weight), bits(want.to(torch.bfloat16)))  # the param is the master rounded
    frag = session_for(ad, 1)["fragments"][0]
    t = next(t for t in frag["tensors"] if t["name"] == name)
    got = gather_fragment(ad, frag)[t["offset"]: t["offset"] + t["numel"]]
    assert torch.equal(bits(got), bits(want.reshape(-1)))  # exports read the master, on the host


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_params_without_a_master_blend_through_an_fp32_copy(device):
    m = tiny(device, torch.bfloat16)
    ad = TorchModuleAdapter(m)
    name = "2.bias"
    p = dict(m.named_parameters())[name]
    glob = torch.randn(5, generator=torch.Generator().manual_seed(5))
    want = blend(p.detach().float().reshape(-1), glob.to(device), 0.25).to(torch.bfloat16)
    ad.blend(name, glob, 0.25, (5,))
    assert p.dtype == torch.bfloat16 and p.device.type == device
    assert torch.equal(bits(p), bits(want))
