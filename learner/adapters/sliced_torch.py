"""A plain-torch adapter whose ranks hold boxes of a model's tensors, as Megatron's TP/PP/DP would cut them,
without Megatron: the reference implementation of the base.py contract for tests and benchmarks, and the
simplest example for a new framework's adapter.

`SlicedTorchAdapter.build(shapes, tp=, tp_rank=, pp=, pp_rank=, dp_rank=, values=)`:
* PP: layer i of L lives on stage i·pp // L; a tensor without a layer index on stage 0 if embedding-like
  (`schemas.layout.is_embedding`), else on the last stage; ranks of other stages do not list it.
* TP: `tp_dim(name, shape)` names the split dimension (default 0 when it has at least `tp` rows and 2+
  dimensions; else the tensor is replicated across TP ranks); TP rank t holds rows [⌊t·n/tp⌋, ⌊(t+1)·n/tp⌋).
* DP: every replica holds the same boxes; DP rank 0 (and TP rank 0, for a tensor TP does not split) owns
  them, so owners tile every tensor exactly once.
`values(name, shape)` gives a tensor's global float32 values (default zeros); each rank keeps a copy of its
box only (one tensor's global values at a time while building).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from yeto.schemas.errors import ConfigError
from yeto.schemas.layout import is_embedding, layer_index, natural_key

from .base import ModelAdapter, Piece


def default_tp_dim(name: str, shape: Sequence[int], tp: int) -> int | None:
    return 0 if len(shape) >= 2 and shape[0] >= tp else None


def pp_stage(name: str, layers: int, pp: int) -> int:
    li = layer_index(name)
    if li is not None:
        return li * pp // max(layers, 1)
    return 0 if is_embedding(name) else pp - 1


class SlicedTorchAdapter(ModelAdapter):
    def __init__(self, pieces: Mapping[str, tuple[tuple[int, ...], tuple[slice, ...] | None, bool, torch.Tensor]]):
        """pieces: name -> (global shape, local_slices (None: whole), owner, this rank's float32 box)."""
        self._pieces = {}
        for name in sorted(pieces, key=natural_key):
            shape, slices, owner, t = pieces[name]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise ConfigError("pieces must be float32 tensors", field=f"pieces.{name}",
                                  value=getattr(t, "dtype", t))
            self._pieces[name] = (tuple(int(s) for s in shape), None if slices is None else tuple(slices), bool(owner), t)

    @classmethod
    def build(cls, shapes: Mapping[str, Sequence[int]], *, tp: int = 1, tp_rank: int = 0, pp: int = 1,
              pp_rank: int = 0, dp_rank: int = 0, values: Callable[[str, tuple], torch.Tensor] | None = None,
              tp_dim: Callable[[str, Sequence[int], int], int | None] = default_tp_dim) -> "SlicedTorchAdapter":
        layers = 1 + max((layer_index(n) for n in shapes if layer_index(n) is not None), default=0)
        pieces = {}
        for name, shape in shapes.items():
            shape = tuple(int(s) for s in shape)
            if pp_stage(name, layers, pp) != pp_rank:
                continue
            d = tp_dim(name, shape, tp) if tp > 1 else None
            if d is None:
                slices, owner = None, dp_rank == 0 and tp_rank == 0
            else:
                n = shape[d]
                lo, hi = tp_rank * n // tp, (tp_rank + 1) * n // tp
                slices = tuple(slice(lo, hi) if i == d else slice(None) for i in range(len(shape)))
                owner = dp_rank == 0
            full = values(name, shape) if values is not None else torch.zeros(shape)
            piece = full[slices] if slices is not None else full
            pieces[name] = (shape, slices, owner, piece.to(torch.float32).clone().contiguous())
            del full
        return cls(pieces)

    # ---- ModelAdapter ---------------------------------------------------------------------------

    def pieces(self) -> list[Piece]:
        return [Piece(n, shape, "float32", slices, owner) for n, (shape, slices, owner, _) in self._pieces.items()]

    def _piece(self, name: str) -> torch.Tensor:
        p = self._pieces.get(name)
        if p is None:
            raise ValueError(f"this rank holds no piece of {name!r}")
        return p[3]

    def read(self, name: str) -> torch.Tensor:
        return self._piece(name).detach()

    def write(self, name: str, value: torch.Tensor) -> None:
        t = self._piece(name)
        if value.numel() != t.numel():
            raise ValueError(f"write of {name}: expected {t.numel()} values for the box {tuple(t.shape)}, got "
                             f"shape {tuple(value.shape)}")
        with torch.no_grad():
            t.copy_(value.reshape(t.shape))

    # ---- for tests and benchmarks ---------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> this rank's box (live)."""
        return {n: p[3] for n, p in self._pieces.items()}

    def box(self, name: str) -> tuple[slice, ...] | None:
        return self._pieces[name][1]


__all__ = ["SlicedTorchAdapter", "default_tp_dim", "pp_stage"]
