"""The model adapter interface: how the sync core sees a model's parameters (docs/design.md §5, §6).

An adapter lists the synced tensors as named *shards* with their global shapes, reads this rank's
fp32 master piece of one, and writes values back into the master and the model parameter together
(so they never drift apart). It is deliberately small: the plain-torch adapter implements it for an
`nn.Module`; a megatron-core adapter will implement it over TP/PP/EP-sharded parameters and the
distributed optimizer's fp32 shards, with `local_slices` saying which part of the global tensor this
rank holds.

Contract for sharded adapters (multi-rank islands: TP/PP/EP, distributed optimizers):
* `shards()` lists, on each rank, the tensors this rank holds a piece of; `local_slices` is the box
  (one slice per dimension, step 1) of the global tensor it holds; `owner` marks the one rank whose
  piece is read for pushes/INIT (every element of every synced tensor has exactly one owner across
  the island; replicas of the same box are not owners). Fused tensors whose global layout would depend
  on the TP size must be presented as TP-independent canonical tensors (or pinned).
* `read(name)` returns this rank's fp32 piece (shape = the box's shape); `write(name, value)` takes a
  value of that shape and sets master and model param. Every rank that lists a tensor calls `read`
  (for a push or INIT) and `write` (for an applied version that overwrites) or `blend` (for one that
  blends in: by default `read`, then `write`) on it, and all ranks do so in the same order (fragment by fragment, canonical order within
  a fragment), so an adapter may run a collective inside them over a group whose ranks all hold that
  tensor (e.g. the distributed optimizer's all-gather of owned main_param ranges over its
  data-parallel group).

How the island uses it (learner/island.py, learner/piece_io.py): at start every rank's shards are
gathered once over the island group (`layout_map.describe`: name, global shape, box, owner, and the
partition dim / offset / expert derived from them) and checked — the owners must tile every tensor
exactly once, else a WireError names the tensor and the ranks. An applied version reaches every
holder (owner or replica) as its own slices, point to point from the sync rank, and each holder
`write`s its piece: the island does not call `sync_replicas`. Exports gather the owners' pieces to
the sync rank chunk by chunk. The island group must carry CPU tensors (gloo, or hybrid groups).
`Shard.expert` (optional, informational) is the global expert index of an expert tensor.

`gather_fragment` / `scatter_fragment` move one session fragment between the model and a flat f32
tensor in the fragment's layout order (the session record's `tensors` [{name, shape, offset, numel}]).
They handle adapters whose shards are whole on this rank (a single process, tests); the island itself
moves fragments chunk by chunk through `learner.piece_io`, for whole and sharded pieces alike.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from yeto.schemas.errors import WireError
from yeto.schemas.layout import canonical_layout

from ..fragments import blend

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: torch.dtype, name: str = "") -> str:
    """The layout's name for a parameter dtype (float32, bfloat16, float16); others are refused."""
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise WireError(f"parameter dtype must be one of {sorted(TORCH_DTYPES.values())}",
                        field=f"param.{name}.dtype" if name else "dtype", value=str(dtype)) from None


@dataclass(frozen=True)
class Shard:
    """One synced tensor as this rank sees it.

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
    def shards(self) -> list[Shard]:
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
        owns its f32 values may do it in place (`fragments.blend_`: the same torch ops, so the same
        bits), sparing a piece-sized allocation and its page faults per version installed."""
        local = self.read(name).detach().reshape(-1)
        if glob.numel() != local.numel():
            raise WireError(f"expected {local.numel()} values for the piece", field=f"value.{name}",
                            value=tuple(glob.shape))
        self.write(name, blend(local, glob, alpha).view(shape))

    def sync_replicas(self, names: Iterable[str]) -> None:
        """Collective over the replica group: make every replica's `names` equal to the owner's.
        A single-replica adapter has nothing to do. (The island no longer needs it: every holder
        receives and writes its own values; kept for adapters' and callers' own use.)"""

    def layout(self) -> list[dict]:
        """[{name, shape, dtype}] in canonical order: what the hello message announces."""
        return canonical_layout({"name": s.name, "shape": list(s.global_shape), "dtype": s.dtype}
                                for s in self.shards())


# ---- fragments ------------------------------------------------------------------------------------

def fragment_names(frag: Mapping) -> list[str]:
    return [t["name"] for t in frag["tensors"]]


def _whole_shards(adapter: ModelAdapter, frag: Mapping) -> Iterable[tuple[dict, Shard]]:
    by_name = {s.name: s for s in adapter.shards()}
    for t in frag["tensors"]:
        s = by_name.get(t["name"])
        if s is None:
            raise WireError("fragment tensor is not a synced tensor of this model", field="tensors.name",
                            value=t["name"])
        if list(s.global_shape) != list(t["shape"]):
            raise WireError(f"model holds shape {list(s.global_shape)}", field=f"tensors.{t['name']}.shape",
                            value=t["shape"])
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
        raise WireError(f"out must be a 1-D float32 tensor of {n} values", field="out", value=tuple(out.shape))
    for t, _ in _whole_shards(adapter, frag):
        out[t["offset"] : t["offset"] + t["numel"]].copy_(adapter.read(t["name"]).reshape(-1))
    return out


def scatter_fragment(adapter: ModelAdapter, frag: Mapping, flat: torch.Tensor) -> None:
    """Write a flat fp32 fragment (layout order) back through the adapter, tensor by tensor."""
    n = frag.get("numel", _numel(frag))
    if flat.dim() != 1 or flat.numel() != n:
        raise WireError(f"expected a 1-D tensor of {n} values", field="flat", value=tuple(flat.shape))
    for t, s in _whole_shards(adapter, frag):
        adapter.write(t["name"], flat[t["offset"] : t["offset"] + t["numel"]].view(s.global_shape))
