"""The model adapter interface: how the sync core sees a model's parameters (docs/design.md §6 "Adapters").

Owns the contract every adapter keeps, and the single-process helpers over it. An adapter lists its
rank's *pieces* (`pieces()`: one `Piece` per synced tensor this rank holds part or all of: global shape,
dtype, box, owner), reads a piece's fp32 master (`read`) and writes master and model parameter together
(`write`, `blend`), so they never drift apart. Invariants: every element of every synced tensor has exactly
one owner across the island; every rank calls `read` / `write` / `blend` on its pieces in the same order
(fragment by fragment, canonical order within one), so an adapter may run collectives inside them; names
are canonical (independent of TP/PP/EP sizes). A caller's misuse (a name not synced here, a wrong shape)
raises ValueError, a model the adapter cannot take raises ConfigError — never WireError, which is for
what came over the wire.

`gather_fragment` / `scatter_fragment` move one session fragment between the model and a flat f32 tensor
in the fragment's layout order, for adapters whose pieces are whole tensors (one process, tests); the
island itself moves fragments chunk by chunk through `learner.piece_io`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from yeto.schemas.errors import ConfigError
from yeto.schemas.layout import canonical_layout

from ..blend import blend

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: torch.dtype, name: str = "") -> str:
    """The layout's name for a parameter dtype (float32, bfloat16, float16); others are refused."""
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"parameter dtype must be one of {sorted(TORCH_DTYPES.values())}",
                          field=f"param.{name}.dtype" if name else "dtype", value=str(dtype)) from None


@dataclass(frozen=True)
class Piece:
    """This rank's piece of one synced tensor (docs/design.md §16 "piece").

    `global_shape`: the whole tensor's shape (what the layout and the session record list).
    `dtype`: the model parameter's dtype name (the master copy is always fp32).
    `local_slices`: the part of the global tensor this rank holds (one slice per dimension), or
    None when it holds all of it.
    `owner`: this rank's piece is the one read for pushes and INIT (one owner per element across the
    island; rank 0 of a data-parallel group for replicated pieces). Applied values are written on
    every holder, owner or not.
    `expert`: the global expert index of an expert-parallel tensor (informational), else None.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    local_slices: tuple[slice, ...] | None = None
    owner: bool = True
    expert: int | None = None


class ModelAdapter(ABC):
    @abstractmethod
    def pieces(self) -> list[Piece]:
        """The synced tensors (trainable only, each tied/shared tensor once), canonical order."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """This rank's fp32 master piece of `name` (may alias live memory: do not modify)."""

    @abstractmethod
    def write(self, name: str, value: torch.Tensor) -> None:
        """Set this rank's piece of `name` (master and model parameter) to `value`."""

    def blend(self, name: str, glob: torch.Tensor, alpha: float, shape: tuple[int, ...]) -> None:
        """Set this rank's piece of `name` (box `shape`) to θ = α·θ_local + (1 − α)·Θ, `glob` being
        the flat f32 Θ. This default computes it in a new tensor and writes that; an adapter that
        owns its f32 values may do it in place (`blend.blend_`: the same torch ops, so the same
        bits), sparing a piece-sized allocation and its page faults per version installed."""
        local = self.read(name).detach().reshape(-1)
        if glob.numel() != local.numel():
            raise ValueError(f"blend of {name}: expected {local.numel()} values for the piece, got shape "
                             f"{tuple(glob.shape)}")
        self.write(name, blend(local, glob, alpha).view(shape))

    def sync_replicas(self, names: Iterable[str]) -> None:
        """Collective over the replica group: make every replica's `names` equal to the owner's.
        A single-replica adapter has nothing to do. (The island no longer needs it: every holder
        receives and writes its own values; kept for adapters' and callers' own use.)"""

    def layout(self) -> list[dict]:
        """[{name, shape, dtype}] in canonical order: what the hello message announces."""
        return canonical_layout({"name": s.name, "shape": list(s.global_shape), "dtype": s.dtype}
                                for s in self.pieces())


# ---- fragments ------------------------------------------------------------------------------------

def fragment_names(frag: Mapping) -> list[str]:
    return [t["name"] for t in frag["tensors"]]


def _whole_pieces(adapter: ModelAdapter, frag: Mapping) -> Iterable[tuple[dict, Piece]]:
    by_name = {s.name: s for s in adapter.pieces()}
    for t in frag["tensors"]:
        s = by_name.get(t["name"])
        if s is None:
            raise ValueError(f"fragment tensor {t['name']!r} is not a synced tensor of this model")
        if list(s.global_shape) != list(t["shape"]):
            raise ValueError(f"fragment tensor {t['name']!r} has shape {t['shape']}; the model holds "
                             f"{list(s.global_shape)}")
        if s.local_slices is not None:
            raise NotImplementedError(f"{t['name']} is sharded on this rank: gather it with the adapter's collective")
        yield t, s


def _numel(frag: Mapping) -> int:
    return max((t["offset"] + t["numel"] for t in frag["tensors"]), default=0)


def gather_fragment(adapter: ModelAdapter, frag: Mapping, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fragment's values as one flat fp32 CPU tensor in layout order (a copy, read through the
    adapter: the fp32 master where there is one)."""
    n = frag.get("numel", _numel(frag))
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.dim() != 1 or out.numel() != n:
        raise ValueError(f"out must be a 1-D float32 tensor of {n} values, not {out.dtype} {tuple(out.shape)}")
    for t, _ in _whole_pieces(adapter, frag):
        out[t["offset"] : t["offset"] + t["numel"]].copy_(adapter.read(t["name"]).reshape(-1))
    return out


def scatter_fragment(adapter: ModelAdapter, frag: Mapping, flat: torch.Tensor) -> None:
    """Write a flat fp32 fragment (layout order) back through the adapter, tensor by tensor."""
    n = frag.get("numel", _numel(frag))
    if flat.dim() != 1 or flat.numel() != n:
        raise ValueError(f"flat must be a 1-D tensor of {n} values, not shape {tuple(flat.shape)}")
    for t, s in _whole_pieces(adapter, frag):
        adapter.write(t["name"], flat[t["offset"] : t["offset"] + t["numel"]].view(s.global_shape))
