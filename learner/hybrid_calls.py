"""The torch.distributed calls as wrapped for hybrid groups (docs/design.md §6): host copies, work handles, fallbacks.

Called with a group that learner/hybrid.py recorded as hybrid (gloo across nodes), a collective or P2P
call copies device tensors to fresh host tensors, runs on gloo and copies the results back into the
caller's tensors; an async call returns a handle whose `wait()` (or `get_future()`) copies back. Any
other group goes straight to torch. `new_group` is wrapped to record each group's backend choice
(learner/hybrid_backend.py). The wrappers are built here; `learner.hybrid.install()` puts them in place.
"""
from __future__ import annotations

import inspect
import logging
import threading
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

from yeto.learner.hybrid_backend import Choice, choose_backend, device_backend, ranks_per_node

log = logging.getLogger("yeto.hybrid")


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------

class _State:
    def __init__(self) -> None:
        self.installed = False
        self.force_host_copy = False  # test-only fake, see module doc
        self.saved: list[tuple[Any, str, Any]] = []  # (module, attribute, original)
        self.orig: dict[str, Callable] = {}  # c10d name -> original function
        self.hybrid: dict[int, Any] = {}  # id(group) -> group (strong ref keeps the id unique)
        self.choices: list[Choice] = []
        self.stats: Counter = Counter()
        self.lock = threading.Lock()


_S = _State()
_tls = threading.local()  # depth > 0 while a wrapper runs torch's function: nested wrappers pass through

# Families whose gloo support came late; False once gloo answered "does not support" (same torch on
# every rank, so every rank flips at the same call). Tests set them False to run the fallbacks.
_NATIVE = {"reduce_scatter": True, "reduce_scatter_tensor": True, "all_gather_into_tensor": True}

# c10d function -> {tensor parameter: role}; "in" is only read, "out" only written, "inout" both.
_TENSOR_OPS: dict[str, dict[str, str]] = {
    "send": {"tensor": "in"},
    "isend": {"tensor": "in"},
    "recv": {"tensor": "out"},
    "irecv": {"tensor": "out"},
    "broadcast": {"tensor": "inout"},
    "all_reduce": {"tensor": "inout"},
    "reduce": {"tensor": "inout"},
    "all_gather": {"tensor_list": "out", "tensor": "in"},
    "all_gather_into_tensor": {"output_tensor": "out", "input_tensor": "in"},
    "all_gather_single": {"output_tensor": "out", "input_tensor": "in"},
    "_all_gather_base": {"output_tensor": "out", "input_tensor": "in"},
    "reduce_scatter": {"output": "out", "input_list": "in"},
    "reduce_scatter_tensor": {"output": "out", "input": "in"},
    "reduce_scatter_single": {"output": "out", "input": "in"},
    "_reduce_scatter_base": {"output": "out", "input": "in"},
    "gather": {"tensor": "in", "gather_list": "out"},
    "scatter": {"tensor": "out", "scatter_list": "in"},
    "all_to_all_single": {"output": "out", "input": "in"},
    "all_to_all": {"output_tensor_list": "out", "input_tensor_list": "in"},
    "barrier": {},
}
_FAMILY = {
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
}
# Object collectives with a `device` argument: on a hybrid group the serialized bytes stay on the host.
# (The others already pick the CPU for a gloo group; their inner tensor calls go through our wrappers.)
_DEVICE_ARG_OPS = ("broadcast_object_list", "send_object_list", "recv_object_list")


def is_hybrid(group: Any) -> bool:
    return group is not None and _S.hybrid.get(id(group)) is group


def hybrid_groups() -> list[Any]:
    return list(_S.hybrid.values())


def choices() -> list[Choice]:
    """Every new_group decision this rank made since install(), in call order."""
    return list(_S.choices)


def stats() -> dict[str, int]:
    """Calls per function that ran through host copies (for tests and diagnostics)."""
    return dict(_S.stats)


def installed() -> bool:
    return _S.installed


# ----------------------------------------------------------------------------------------------
# Host copies and work handles
# ----------------------------------------------------------------------------------------------

def _needs_host_copy(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" or _S.force_host_copy


def _to_host(t: torch.Tensor, role: str) -> torch.Tensor:
    # Always a fresh contiguous host tensor (gloo wants dense memory; "out" needs no read of t).
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if role != "out":
        h.copy_(t.detach())
    return h


class _HostCopyWork:
    """Wraps the gloo work of a host-copied async call: the results reach the caller's tensors on
    wait() (or when get_future()'s future completes), once."""

    def __init__(self, work: Any, finish: Callable[[], None], outputs: list[torch.Tensor],
                 keep: list[Any] | None = None):
        self._work = work
        self._keep = keep
        self._finish = finish
        self._outputs = outputs
        self._done = False
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                self._finish()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._complete()
        return result

    def is_completed(self) -> bool:
        # True only once the results are back in the caller's tensors, so pollers never read stale ones.
        if not self._done and self._work.is_completed():
            self._complete()
        return self._done

    def get_future(self) -> Any:
        def done(fut: Any) -> list[torch.Tensor]:
            fut.wait()  # re-raises the collective's error
            self._complete()
            return self._outputs
        return self._work.get_future().then(done)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# ----------------------------------------------------------------------------------------------
# Fallbacks for collectives an older gloo lacks (hybrid groups only, on fresh host tensors)
# ----------------------------------------------------------------------------------------------

def _reduce_op(a: dict) -> Any:
    return a.get("op", dist.ReduceOp.SUM)


def _fallback_reduce_scatter(a: dict, group: Any) -> tuple[Any, Callable | None]:
    output, inputs = a["output"], a["input_list"]
    flat = torch.cat([t.reshape(-1) for t in inputs])
    r, k = group.rank(), output.numel()
    work = _S.orig["all_reduce"](flat, op=_reduce_op(a), group=group, async_op=a.get("async_op", False))
    return work, lambda: output.copy_(flat[r * k:(r + 1) * k].view(output.shape))


def _fallback_reduce_scatter_tensor(a: dict, group: Any) -> tuple[Any, Callable | None]:
    output, inp = a["output"], a["input"]
    flat = inp.reshape(-1)  # a fresh host copy (fallbacks always copy): reducing it in place is fine
    r, k = group.rank(), output.numel()
    work = _S.orig["all_reduce"](flat, op=_reduce_op(a), group=group, async_op=a.get("async_op", False))
    return work, lambda: output.copy_(flat[r * k:(r + 1) * k].view(output.shape))


def _fallback_all_gather_into_tensor(a: dict, group: Any) -> tuple[Any, Callable | None]:
    output, inp = a["output_tensor"], a["input_tensor"]
    chunks = list(output.view(-1).split(inp.numel()))  # views of the fresh host output
    work = _S.orig["all_gather"](chunks, inp.reshape(-1), group=group, async_op=a.get("async_op", False))
    return work, None


_FALLBACKS = {
    "reduce_scatter": _fallback_reduce_scatter,
    "reduce_scatter_tensor": _fallback_reduce_scatter_tensor,
    "all_gather_into_tensor": _fallback_all_gather_into_tensor,
}


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------

def _call_orig(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _tls.depth -= 1


def _run_hybrid(name: str, orig: Callable, ba: inspect.BoundArguments, group: Any,
                roles: dict[str, str]) -> Any:
    a = ba.arguments
    family = _FAMILY.get(name)
    fallback = _FALLBACKS[family] if family and not _NATIVE[family] else None
    avg = "op" in a and a["op"] == dist.ReduceOp.AVG
    copy_all = fallback is not None or avg  # these edit host buffers, never the caller's

    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (caller's tensor, host tensor) to copy back
    made = 0  # host copies made (inputs included)
    for param, role in roles.items():
        value = a.get(param)
        if isinstance(value, torch.Tensor):
            values, single = [value], True
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            values, single = list(value), False
        else:
            continue
        hosts = []
        for t in values:
            if copy_all or _needs_host_copy(t):
                h = _to_host(t, role)
                made += 1
                if role != "in":
                    copies.append((t, h))
                hosts.append(h)
            else:
                hosts.append(t)
        a[param] = hosts[0] if single else hosts
    if name == "barrier":
        a.pop("device_ids", None)  # device ids mean nothing to gloo
    divisor = None
    if avg:
        a["op"] = dist.ReduceOp.SUM
        divisor = group.size()

    if fallback is not None:
        result, slice_back = _call_orig(fallback, a, group)
    else:
        result, slice_back = _call_orig(orig, *ba.args, **ba.kwargs), None

    if not made and slice_back is None:
        return result
    with _S.lock:
        _S.stats[name] += 1

    def finish() -> None:
        if slice_back is not None:
            slice_back()
        with torch.no_grad():
            for t, h in copies:
                if divisor is not None:
                    if h.is_floating_point() or h.is_complex():
                        h.div_(divisor)
                    else:
                        h.copy_(torch.div(h, divisor, rounding_mode="trunc"))
                t.copy_(h)

    if result is not None and hasattr(result, "wait"):
        # The handle also holds the host tensors (in a.values()) until the caller drops it: an isend's
        # host copy must outlive the send.
        return _HostCopyWork(result, finish, [t for t, _ in copies], keep=list(a.values()))
    finish()
    return result


def _wrap_tensor_op(name: str, orig: Callable) -> Callable:
    sig = inspect.signature(orig)
    roles = {p: r for p, r in _TENSOR_OPS[name].items() if p in sig.parameters}
    family = _FAMILY.get(name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _S.hybrid or getattr(_tls, "depth", 0):
            return orig(*args, **kwargs)
        ba = sig.bind(*args, **kwargs)
        group = ba.arguments.get("group")
        if not is_hybrid(group):
            return orig(*args, **kwargs)
        try:
            return _run_hybrid(name, orig, ba, group, roles)
        except RuntimeError as exc:
            if not (family and _NATIVE[family] and "does not support" in str(exc)):
                raise
            # gloo of this torch lacks it: the same on every rank, so all ranks switch together.
            _NATIVE[family] = False
            log.warning("gloo here does not support %s: hybrid groups use the all_reduce/all_gather "
                        "fallback from now on (%s)", name, exc)
            return _run_hybrid(name, orig, sig.bind(*args, **kwargs), group, roles)

    wrapper.__name__ = name
    wrapper.__qualname__ = name
    wrapper.__doc__ = orig.__doc__
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_device_arg_op(name: str, orig: Callable) -> Callable:
    sig = inspect.signature(orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _S.hybrid or getattr(_tls, "depth", 0):
            return orig(*args, **kwargs)
        ba = sig.bind(*args, **kwargs)
        if is_hybrid(ba.arguments.get("group")) and ba.arguments.get("device") is not None:
            ba.arguments["device"] = None  # gloo group: torch keeps the bytes on the CPU
            return orig(*ba.args, **ba.kwargs)
        return orig(*args, **kwargs)

    wrapper.__name__ = name
    wrapper.__qualname__ = name
    wrapper.__doc__ = orig.__doc__
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _current_p2p(op: Callable) -> Callable:
    """The installed isend/irecv for either the original or our wrapper (P2POps made before install
    hold the original; torch compares `op is isend` against the module's current function)."""
    import torch.distributed.distributed_c10d as c10d
    for name in ("isend", "irecv"):
        if op is _S.orig.get(name) or op is getattr(c10d, name):
            return getattr(c10d, name)
    return op


def _wrap_check_op(orig: Callable) -> Callable:
    def _check_op(op: Any) -> None:
        orig(_current_p2p(op))
    return _check_op


def _wrap_batch(orig: Callable) -> Callable:
    import torch.distributed.distributed_c10d as c10d

    def batch_isend_irecv(p2p_op_list: list) -> list:
        ops = list(p2p_op_list) if isinstance(p2p_op_list, (list, tuple)) else p2p_op_list
        group = ops[0].group if isinstance(ops, list) and ops else None
        if not is_hybrid(group) or getattr(_tls, "depth", 0):
            normalized = []
            for p in ops:
                if isinstance(p, c10d.P2POp) and _current_p2p(p.op) is not p.op:
                    q = object.__new__(c10d.P2POp)
                    q.__dict__.update(p.__dict__)
                    q.op = _current_p2p(p.op)
                    p = q
                normalized.append(p)
            return orig(normalized)
        c10d._check_p2p_op_list(ops)  # same checks torch makes (one group for all ops)
        # gloo never coalesces: torch itself would issue the ops one by one, as we do here through the
        # isend/irecv wrappers, which copy to the host and return handles that copy back on wait().
        works = []
        for p in ops:
            send = _current_p2p(p.op) is c10d.isend
            fn = c10d.isend if send else c10d.irecv
            work = fn(p.tensor, p.peer, p.group, p.tag)
            if work:
                works.append(work)
        return works

    batch_isend_irecv.__doc__ = orig.__doc__
    batch_isend_irecv.__wrapped__ = orig  # type: ignore[attr-defined]
    return batch_isend_irecv


def _fmt_ranks(ranks: tuple[int, ...]) -> str:
    return str(list(ranks)) if len(ranks) <= 16 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"


def _wrap_new_group(orig: Callable) -> Callable:
    import torch.distributed.distributed_c10d as c10d
    sig = inspect.signature(orig)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        ba = sig.bind(*args, **kwargs)
        world = dist.get_world_size()
        ranks = ba.arguments.get("ranks")
        if ranks is not None:
            ranks = ba.arguments["ranks"] = list(ranks)  # an iterator would be used up by our look
        rank_set = tuple(range(world)) if ranks is None else tuple(ranks)
        per_node = ranks_per_node(world_size=world)
        choice = choose_backend(rank_set, ba.arguments.get("backend"), device_backend(), per_node)
        if choice.hybrid:
            ba.arguments["backend"] = "gloo"
            # Options and bound device of the device backend (NCCL/HCCL options) mean nothing to gloo.
            for param in ("pg_options", "device_id"):
                if ba.arguments.get(param) is not None:
                    ba.arguments[param] = None
        group = orig(*ba.args, **ba.kwargs)
        member = isinstance(group, c10d.ProcessGroup) and group is not c10d.GroupMember.NON_GROUP_MEMBER
        with _S.lock:
            _S.choices.append(choice)
            if choice.hybrid and member:
                _S.hybrid[id(group)] = group
        level = logging.INFO if choice.ranks and dist.get_rank() == choice.ranks[0] else logging.DEBUG
        log.log(level, "group %s -> %s (%s; %d ranks per node)", _fmt_ranks(choice.ranks),
                choice.backend or f"default ({device_backend()})", choice.reason, per_node)
        return group

    new_group.__doc__ = orig.__doc__
    new_group.__wrapped__ = orig  # type: ignore[attr-defined]
    return new_group


def _wrap_destroy(orig: Callable) -> Callable:
    def destroy_process_group(group: Any = None) -> Any:
        result = orig(group)
        with _S.lock:
            if group is None or group is dist.GroupMember.WORLD:
                _S.hybrid.clear()
            else:
                _S.hybrid.pop(id(group), None)
        return result

    destroy_process_group.__doc__ = orig.__doc__
    destroy_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
    return destroy_process_group
