"""The blend an island applies when it installs a version over weights it trained (docs/design.md §5.5):
θ = α·θ_local + (1 − α)·Θ, in f32, on the parameter's device. Owns the math only (no state, no I/O);
the adapters and the ranks call it. `blend` and `blend_` run the same two torch ops, so a new tensor and
an in-place update give the same bits.
"""
from __future__ import annotations

import torch

from .device import to_device_of


def blend(local: torch.Tensor, glob: torch.Tensor, alpha: float) -> torch.Tensor:
    """θ = α·θ_local + (1 − α)·Θ as a new float32 tensor (neither input is modified: `local` may alias
    the live model). It runs on `local`'s device: a host Θ is moved there first."""
    return local.to(torch.float32).mul(alpha).add_(to_device_of(glob, local), alpha=1.0 - alpha)


def blend_(local: torch.Tensor, glob: torch.Tensor, alpha: float) -> torch.Tensor:
    """`blend` written into `local` (float32, any shape; `glob` flat): the same two ops, the same bits."""
    return local.mul_(alpha).add_(to_device_of(glob, local).view(local.shape), alpha=1.0 - alpha)


__all__ = ["blend", "blend_"]
