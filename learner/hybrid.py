"""Hybrid process groups inside an island (docs/design.md §6): gloo across nodes, the device backend inside one.

For clusters with no working device fabric between nodes (HCCL/NCCL across hosts fails or is not
provisioned) but TCP: enabled with `YETO_CROSS_NODE_GLOO=1` (`install_from_env()`, which the ms-swift
plugin calls at import time) or `install()`. Owns the patching of `torch.distributed`: `new_group` makes
a group whose ranks span nodes a gloo group (remembered as *hybrid*), one inside a node exactly as asked;
collectives and P2P calls on a hybrid group run on host copies and copy back (in-place semantics kept).
`install`'s doc has the semantics that differ from plain gloo, and the limits.
Invariants: the backend choice is a pure function of the rank set, the requested backend and ranks per
node (`YETO_RANKS_PER_NODE`, else `LOCAL_WORLD_SIZE`), so every rank makes the same calls in the same
order; calls on any other group go straight to torch; nothing changes until a hybrid group exists.
Modules: the choice and node math in learner/hybrid_backend.py, the wrapped calls in
learner/hybrid_calls.py; this one installs and removes them, and re-exports the public names.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Mapping

import torch.distributed as dist

# The backend choice (learner/hybrid_backend.py) and the wrapped calls (learner/hybrid_calls.py) live in
# their own modules; this one puts the wrappers in place, and the public names stay importable from here.
from yeto.learner.hybrid_backend import (
    ENV_RANKS_PER_NODE, Choice, choose_backend, device_backend, node_of, ranks_per_node, spans_nodes,
)
from yeto.learner.hybrid_calls import (
    _DEVICE_ARG_OPS, _NATIVE, _S, _TENSOR_OPS, _wrap_batch, _wrap_check_op, _wrap_destroy, _wrap_device_arg_op,
    _wrap_new_group, _wrap_tensor_op, choices, hybrid_groups, installed, is_hybrid, stats,
)

__all__ = [
    "ENV_ENABLE", "ENV_FORCE_HOST_COPY", "ENV_RANKS_PER_NODE", "Choice", "choices", "choose_backend",
    "device_backend", "hybrid_groups", "install", "install_from_env", "installed", "is_hybrid", "node_of",
    "ranks_per_node", "spans_nodes", "stats", "uninstall",
]

log = logging.getLogger("yeto.hybrid")

ENV_ENABLE = "YETO_CROSS_NODE_GLOO"
ENV_FORCE_HOST_COPY = "YETO_HYBRID_FORCE_HOST_COPY"  # test-only
_TRUE = {"1", "true", "yes", "on"}


# ----------------------------------------------------------------------------------------------
# install / uninstall
# ----------------------------------------------------------------------------------------------

def _env_true(env: Mapping[str, str], var: str) -> bool:
    return env.get(var, "").strip().lower() in _TRUE


def install(force_host_copy: bool | None = None) -> None:
    """Patch torch.distributed (and distributed_c10d, whose own functions call each other through its
    module globals). Idempotent.

    Called with a hybrid group, a collective or P2P call copies device tensors to fresh host tensors, runs
    on gloo and copies the results back into the caller's tensors (`all_reduce(t)` leaves the result in
    `t`, `all_gather` fills the caller's list); async calls (`async_op=True`, isend/irecv,
    batch_isend_irecv) return a handle whose `wait()` (or `get_future()`) copies back. Rank r is on node
    r // ranks_per_node (launchers number ranks node by node); each group's choice is logged once by its
    lowest rank (logger `yeto.hybrid`) and kept on every rank in `choices()`.
    Not plain gloo semantics, on purpose, for hybrid groups only: `ReduceOp.AVG` runs as SUM then a
    division on the host (older gloo builds reject AVG); `reduce_scatter` / `reduce_scatter_tensor` /
    `all_gather_into_tensor` fall back to all_reduce + slice / all_gather into views where gloo answers
    "does not support"; `barrier(device_ids=...)` drops the ids; `pg_options` / `device_id` of the device
    backend are dropped when a group is switched to gloo; `P2POp`s built with the isend/irecv bound
    before install are accepted. Each wrapped call binds its arguments to find the group (microseconds).
    Limits: it must run before Megatron (or anything) binds names from torch.distributed (`from
    torch.distributed import all_reduce`) or creates its groups: those keep the unwrapped functions and
    their backend. Groups made without `new_group` (`split_group`, `_new_group_with_tag`, DeviceMesh
    internals) are not inspected.
    `force_host_copy` (test-only; default: `YETO_HYBRID_FORCE_HOST_COPY`) treats CPU tensors as device
    tensors, so on a CPU-only machine the host-copy path really runs."""
    if not dist.is_available():
        raise RuntimeError("hybrid groups need torch.distributed, which this torch build lacks")
    import torch.distributed.distributed_c10d as c10d

    if force_host_copy is None:
        force_host_copy = _env_true(os.environ, ENV_FORCE_HOST_COPY)
    _S.force_host_copy = bool(force_host_copy)
    if _S.installed:
        return

    wrappers: dict[str, Callable] = {}
    for name in _TENSOR_OPS:
        if hasattr(c10d, name):
            wrappers[name] = _wrap_tensor_op(name, getattr(c10d, name))
    for name in _DEVICE_ARG_OPS:
        if hasattr(c10d, name):
            wrappers[name] = _wrap_device_arg_op(name, getattr(c10d, name))
    wrappers["new_group"] = _wrap_new_group(c10d.new_group)
    wrappers["destroy_process_group"] = _wrap_destroy(c10d.destroy_process_group)
    wrappers["batch_isend_irecv"] = _wrap_batch(c10d.batch_isend_irecv)

    _S.orig = {name: getattr(c10d, name) for name in wrappers}
    _S.saved = []
    for name, wrapper in wrappers.items():
        for module in (c10d, dist):
            if hasattr(module, name):
                _S.saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
    if hasattr(c10d, "_check_op"):
        _S.saved.append((c10d, "_check_op", c10d._check_op))
        c10d._check_op = _wrap_check_op(c10d._check_op)
    _S.installed = True
    log.info("hybrid groups on: cross-node groups use gloo with host copies%s",
             " (test mode: CPU tensors are host-copied too)" if _S.force_host_copy else "")


def uninstall() -> None:
    """Restore torch.distributed and forget all groups and records (tests)."""
    for module, name, original in reversed(_S.saved):
        setattr(module, name, original)
    _S.saved = []
    _S.orig = {}
    _S.hybrid.clear()
    _S.choices.clear()
    _S.stats.clear()
    _S.force_host_copy = False
    _S.installed = False
    for family in _NATIVE:
        _NATIVE[family] = True


def install_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Install when `YETO_CROSS_NODE_GLOO` is set to a true value; returns whether it is installed.
    The ms-swift plugin calls this at import, before Megatron creates its groups."""
    env = os.environ if env is None else env
    if not _env_true(env, ENV_ENABLE):
        return False
    install(force_host_copy=_env_true(env, ENV_FORCE_HOST_COPY))
    return True
