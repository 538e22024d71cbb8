"""Parameters on an accelerator at the island boundary (docs/design.md §6 "Device parameters").

The sync core works on host tensors (chunks, anchors, staging, the gloo island group); a model on a GPU
reaches it in two places only, both here:
* `HostStaging` (exports: a push's snapshot, INIT): device values are copied into pinned host buffers on a
  side stream, non-blocking, and waited for once (`wait`) before the host reads them. The side stream first
  waits for the compute stream (a copy sees the optimizer step; later training kernels never wait for it),
  and `record_stream` keeps the caching allocator from reusing a copied temporary before its copy ran.
* `to_device_of` (applies): a host f32 value moves to the parameter's device before a blend (a plain write
  uses `copy_`, which crosses devices by itself).
CPU tensors pass through untouched (the island snapshots them itself where it must), and a device without
CUDA streams (an NPU build whose stream API differs) falls back to a plain blocking copy.
"""
from __future__ import annotations

import torch


def to_device_of(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` on `like`'s device (itself when it already is there)."""
    return value if value.device == like.device else value.to(like.device)


class HostStaging:
    """Device-to-host copies of one pass (see the module doc): `host(t)` returns the host tensor that will
    hold t's values, `wait()` returns once every copy issued since the last wait has landed."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}
        self._pending: list = []
        self.copies = 0  # device tensors staged (tests, the bench)

    def _stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        self.copies += 1
        if t.device.type != "cuda":
            return t.to("cpu")
        side = self._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            out.copy_(t, non_blocking=True)
        t.record_stream(side)
        self._pending.append(side)
        return out

    def wait(self) -> None:
        for s in dict.fromkeys(self._pending):  # each stream once, in order
            s.synchronize()
        self._pending.clear()


__all__ = ["HostStaging", "to_device_of"]
