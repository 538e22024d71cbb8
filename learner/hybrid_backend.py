"""Which backend a process group gets in an island with hybrid groups (docs/design.md §6), and the node math.

Pure decisions plus device detection, no patching (learner/hybrid.py installs the patches that use
them): `choose_backend` is a function of the rank set, the requested backend, the device backend and
ranks-per-node only, so every rank (members and non-members, which torch requires to call `new_group`
for every group) makes the same calls in the same order. Rank r is on node r // ranks_per_node
(launchers number ranks node by node); ranks per node come from `YETO_RANKS_PER_NODE`, else the
launcher's `LOCAL_WORLD_SIZE`, else the world size (one node). `device_backend` never imports torch_npu
unless CANN is set up.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from yeto.schemas.errors import ConfigError

ENV_RANKS_PER_NODE = "YETO_RANKS_PER_NODE"

# Backends that only move device memory: a request for one of them on a cross-node group is what we
# replace with gloo. Anything else (gloo, mpi, ucc...) the caller asked for knowingly and keeps.
_DEVICE_BACKENDS = frozenset({"nccl", "hccl"})
# Set by the launcher of CANN (set_env.sh); without it importing torch_npu fails half-way and can
# leave torch unusable, so we never try.
_CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


# ----------------------------------------------------------------------------------------------
# Pure node math and backend choice
# ----------------------------------------------------------------------------------------------

def _positive_int(text: str, var: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"cannot parse {var}={text!r} as a positive integer", field="ranks_per_node",
                        value=text) from None
    if value < 1:
        raise ConfigError(f"{var} must be >= 1", field="ranks_per_node", value=text)
    return value


def ranks_per_node(env: Mapping[str, str] | None = None, world_size: int | None = None) -> int:
    """`YETO_RANKS_PER_NODE`, else `LOCAL_WORLD_SIZE` (torchrun), else the world size (one node)."""
    env = os.environ if env is None else env
    for var in (ENV_RANKS_PER_NODE, "LOCAL_WORLD_SIZE"):
        text = env.get(var)
        if text not in (None, ""):
            return _positive_int(text, var)
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            world_size = _positive_int(env.get("WORLD_SIZE", "1"), "WORLD_SIZE")
    return world_size


def node_of(rank: int, per_node: int) -> int:
    """Node index of a global rank; launchers number ranks node by node (torchrun, mpirun by slot)."""
    return rank // per_node


def spans_nodes(ranks: Iterable[int], per_node: int) -> bool:
    return len({node_of(r, per_node) for r in ranks}) > 1


class Choice(NamedTuple):
    """One `new_group` decision. `backend` is what torch's new_group receives (None: the default)."""
    ranks: tuple[int, ...]
    requested: str | None
    backend: str | None
    hybrid: bool
    reason: str


def _names_device_backend(requested: str, device_backend: str) -> bool:
    # "nccl", "hccl", or a per-device spec such as "cpu:gloo,cuda:nccl"
    names = {part.split(":")[-1].strip() for part in requested.lower().split(",")}
    return bool(names & ((_DEVICE_BACKENDS | {device_backend.lower()}) - {"gloo"}))


def choose_backend(ranks: Sequence[int], requested: str | None, device_backend: str,
                   per_node: int) -> Choice:
    """Pure: the same inputs give the same answer on every rank, so all ranks make the same calls."""
    ranks = tuple(sorted(int(r) for r in ranks))
    req = None if requested is None else str(requested)
    if not spans_nodes(ranks, per_node):
        return Choice(ranks, req, req, False, "inside one node: backend as requested")
    if req is None or req.lower() == "undefined":
        return Choice(ranks, req, "gloo", True, f"spans nodes: gloo instead of default {device_backend}")
    if _names_device_backend(req, device_backend):
        return Choice(ranks, req, "gloo", True, f"spans nodes: gloo instead of requested {req}")
    return Choice(ranks, req, req, False, f"spans nodes, but the caller asked for {req}: kept")


# ----------------------------------------------------------------------------------------------
# Device backend detection (device-agnostic; never imports torch_npu unless it can work)
# ----------------------------------------------------------------------------------------------

def _backend_of_spec(spec: str) -> str:
    """"hccl" -> hccl; "cpu:gloo,cuda:nccl" -> nccl (the device part decides)."""
    parts = [p.strip() for p in spec.lower().split(",") if p.strip()]
    for part in parts:
        device, _, backend = part.rpartition(":")
        if device and device != "cpu":
            return backend
    return parts[-1].rpartition(":")[2] if parts else "gloo"


def _npu_usable() -> bool:
    npu = getattr(torch, "npu", None)  # present once torch_npu is loaded (also by torch's autoload)
    if npu is None:
        if importlib.util.find_spec("torch_npu") is None or not any(os.environ.get(v) for v in _CANN_ENV):
            return False
        try:
            import torch_npu  # noqa: F401  (only with CANN set up; see _CANN_ENV)
        except Exception:
            return False
        npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:
        return False


def device_backend() -> str:
    """The backend the default group uses: from the default group once initialized, else detected."""
    if dist.is_available() and dist.is_initialized():
        return _backend_of_spec(str(dist.get_backend()))
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        try:
            kind = accel.current_accelerator()
        except Exception:
            kind = None
        if kind is not None:
            known = {"npu": "hccl", "cuda": "nccl", "xpu": "xccl"}
            if kind.type in known:
                return known[kind.type]
    hccl_built = getattr(dist, "is_hccl_available", None)  # torch_npu adds it once loaded
    if (hccl_built is not None and hccl_built()) or "torch_npu" in sys.modules \
            or importlib.util.find_spec("torch_npu") is not None:
        if _npu_usable():
            return "hccl"
    if torch.cuda.is_available():
        return "nccl"
    return "gloo"
