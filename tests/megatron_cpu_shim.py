"""TEST-ONLY FAKE: lets megatron-core's DDP, optimizers and GPT forward run on a CPU-only torch.

megatron-core (0.16.1 and 0.19.x alike) hard-codes CUDA in a few places that do not matter for what
the tests check (stream objects, `device="cuda"` for scalars such as the unit loss scale,
`torch.cuda.current_device()` as the device of the grad/param buffers,
`param.type() == 'torch.cuda.FloatTensor'` to sort parameters into fp16/bf16/fp32 groups). `install()` makes exactly those work on the CPU:

* factory functions called with a CUDA device (`torch.tensor/zeros/empty/ones/full/arange/…`,
  `Tensor.new_empty/…`, `Tensor.to`) get the CPU instead, `Tensor.cuda()` returns the tensor itself;
* `torch.cuda.current_device()` is 0 (mapped to the CPU by the factories), streams and events are
  inert objects, `synchronize` / `empty_cache` do nothing, RNG state calls use the CPU generator;
* `Tensor.type()` (no argument) answers the CUDA type names for CPU tensors;
* megatron-core's RNG tracker forks the CPU generator; the MoE router's `te_general_gemm` (unbound
  without TE in megatron-core 0.16.1; 0.19 binds it to None itself) is None; the alltoall
  dispatcher's split sizes become numpy on the CPU as they do when moved off a GPU.

Never import this outside tests. It is installed only by the CPU worlds of tests/megatron_tiny.py and
tests/test_swift_plugin.py, in their own rank processes; the `cuda` tests' processes never install it (they
check that `torch.cuda.current_device` is torch's own), and `install()` refuses a process that has
initialized CUDA. `transformer_engine_stub()` puts the test-only stubs
`tests/stubs/transformer_engine` and `tests/stubs/triton` on the path (mcore-bridge imports both at
import time; ms-swift's Megatron trainers import mcore-bridge). Where a real triton is installed (the
CUDA torch wheel brings one: Python 3.12 with megatron-core 0.19 here) megatron-core has imported it
already and mcore-bridge gets the real one; the stub only stands in where triton is absent.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

_DONE = False
STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device) if isinstance(device, str) else device
    return torch.device("cpu") if isinstance(d, torch.device) and d.type == "cuda" else device


def _factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapper


class _Inert:
    """Stands in for torch.cuda.Stream / Event: every method is a no-op returning another inert object
    (`stream.record_event().synchronize()`)."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: _Inert()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def install() -> None:
    global _DONE
    if _DONE:
        return
    # Never on a process that uses a real GPU: the shim would turn its CUDA calls into CPU ones and a `cuda`
    # test would pass on the CPU (tests/megatron_tiny.py's CUDA world never calls this).
    if torch.cuda.is_initialized():
        raise RuntimeError("megatron_cpu_shim.install() in a process that initialized CUDA: the CPU shim "
                           "would fake the real device")
    _DONE = True
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "rand", "randn", "zeros_like",
                 "empty_like", "ones_like", "full_like"):
        wrapped = _factory(getattr(torch, name))
        setattr(torch, name, wrapped)
        # TorchScript resolves builtins by identity: tell it the wrapper is still aten::<name>.
        torch.jit._builtins._register_builtin(wrapped, f"aten::{name}")
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
        setattr(torch.Tensor, name, _factory(getattr(torch.Tensor, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    orig_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) and str(a).startswith("cuda") else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return orig_to(self, *args, **kwargs)
    torch.Tensor.to = to

    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            t = orig_type(self)
            return t.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else t
        return orig_type(self, dtype, non_blocking, **kwargs)
    torch.Tensor.type = type_

    c = torch.cuda
    c.current_device = lambda: 0
    c.device_count = lambda: 1
    c.set_device = lambda *a, **k: None
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda *a, **k: None
    c.Stream = _Inert
    c.Event = _Inert
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.current_stream = lambda *a, **k: _Inert()
    c.default_stream = lambda *a, **k: _Inert()
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    c.manual_seed = lambda seed: torch.manual_seed(seed)
    c.max_memory_reserved = lambda *a, **k: 0
    c.memory_allocated = lambda *a, **k: 0
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state
    from megatron.core.tensor_parallel import random as mrandom  # its RNG tracker forks the CUDA generator
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # megatron-core 0.16.1 reads `te_general_gemm` in the MoE router even when TE is absent (the name is
    # only bound when the TE import succeeds; 0.19 binds it to None): give it the "no TE" value.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # The alltoall dispatcher's split sizes go device -> host as numpy (what all_to_all_single takes);
    # the original only converts tensors that are on the GPU.
    from megatron.core.transformer.moe import token_dispatcher

    orig_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def transformer_engine_stub() -> None:
    """Make `import transformer_engine` find the test-only stub (tests/stubs/transformer_engine), and
    give megatron-core's TE-only class names that mcore-bridge patches at import (megatron-core sets
    them to None without TE) a placeholder class that refuses to be instantiated."""
    # megatron-core decides "TE present?" once per module at import: import the ones the tests use
    # while no transformer_engine is importable at all.
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    from megatron.core.extensions import transformer_engine as te_ext

    for name in ("TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEFusedMLP"):
        if getattr(te_ext, name, None) is None:
            setattr(te_ext, name, type(name, (_NoTE,), {}))
    # The stubs are on sys.path only while mcore-bridge imports them (then they stay in sys.modules):
    # processes spawned later (dataloader workers) inherit sys.path and must not find them.
    sys.path.insert(0, STUBS)
    try:
        import mcore_bridge.model  # noqa: F401  (imports transformer_engine and triton)
        import mcore_bridge.tuners  # noqa: F401
    finally:
        sys.path.remove(STUBS)


class _NoTE(torch.nn.Module):
    """TEST-ONLY placeholder for a Transformer Engine module: importable, never constructible."""

    def __init__(self, *a, **k):
        raise RuntimeError(f"{type(self).__name__} needs Transformer Engine (test-only placeholder)")
