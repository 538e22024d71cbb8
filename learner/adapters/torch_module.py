"""Model adapter for a plain `torch.nn.Module` (single process, or a data-parallel island): the base.py contract.

* Synced tensors: the trainable parameters (`requires_grad`), canonical (natural-sort) order; a tied or
  shared parameter appears once, under its first name in that order (found by Parameter identity, and by
  identical memory for distinct Parameters over one storage): syncing both would apply every update twice.
* `master` (optional): name (any of a tied parameter's names) -> the optimizer's fp32 master copy of a
  low-precision model. Reads come from it; writes set master and parameter (rounded to its dtype), so
  they stay consistent.
* `group` (optional): the data-parallel group of the island's replicas (`dist.group.WORLD` for the default
  group; None: a single replica). Every replica holds the whole model; the group's rank 0 owns it (read for
  pushes and INIT); the island writes every replica point to point (learner/piece_io.py).
  `sync_replicas(names)` remains for callers that copy the owner's values to the replicas themselves: a
  broadcast over the group in bounded buckets of host memory (gloo-friendly).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from yeto.schemas.errors import ConfigError
from yeto.schemas.layout import natural_key

from ..blend import blend_
from .base import ModelAdapter, Piece, dtype_name

_ALIGN = 16  # byte alignment of each tensor inside a broadcast bucket (so dtype views are legal)


def _memory_key(p: torch.Tensor) -> tuple | None:
    if p.numel() == 0:
        return None  # empty tensors may share a null address without aliasing anything
    return (str(p.device), p.data_ptr(), tuple(p.shape), tuple(p.stride()), p.dtype)


class TorchModuleAdapter(ModelAdapter):
    def __init__(self, module: torch.nn.Module, master: Mapping[str, torch.Tensor] | None = None,
                 group: "dist.ProcessGroup | None" = None, *, bucket_bytes: int = 64 << 20):
        if bucket_bytes < _ALIGN:
            raise ConfigError(f"must be at least {_ALIGN}", field="bucket_bytes", value=bucket_bytes)
        self.module = module
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.aliases: dict[str, list[str]] = {}  # kept name -> every name of that tensor
        self._params: dict[str, torch.nn.Parameter] = {}
        by_id: dict[int, str] = {}
        by_mem: dict[tuple, str] = {}
        named = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
        for name, p in sorted(named, key=lambda np_: natural_key(np_[0])):
            mem = _memory_key(p)
            first = by_id.get(id(p)) or (by_mem.get(mem) if mem is not None else None)
            if first is not None:
                self.aliases[first].append(name)
                continue
            dtype_name(p.dtype, name)
            by_id[id(p)] = name
            if mem is not None:
                by_mem[mem] = name
            self._params[name] = p
            self.aliases[name] = [name]

        self._master: dict[str, torch.Tensor] = {}
        if master:
            owner_of = {alias: kept for kept, names in self.aliases.items() for alias in names}
            for key, m in master.items():
                kept = owner_of.get(key)
                if kept is None:
                    raise ConfigError("master entry names no trainable parameter", field="master", value=key)
                if kept in self._master:
                    raise ConfigError("two master entries for one (tied) parameter", field="master", value=key)
                p = self._params[kept]
                if not isinstance(m, torch.Tensor) or m.dtype != torch.float32 or tuple(m.shape) != tuple(p.shape):
                    raise ConfigError(f"master must be float32 of shape {tuple(p.shape)}", field=f"master.{key}",
                                      value=(getattr(m, "dtype", type(m).__name__), tuple(getattr(m, "shape", ()))))
                self._master[kept] = m

        if group is not None:
            self._rank = dist.get_rank(group)
            self._size = dist.get_world_size(group)
            self._src = dist.get_global_rank(group, 0)
        else:
            self._rank, self._size, self._src = 0, 1, 0
        self.owner = self._rank == 0

    # ---- ModelAdapter ---------------------------------------------------------------------------

    def pieces(self) -> list[Piece]:
        return [Piece(name, tuple(p.shape), dtype_name(p.dtype), None, self.owner) for name, p in self._params.items()]

    def _param(self, name: str) -> torch.nn.Parameter:
        p = self._params.get(name)
        if p is None:
            raise ValueError(f"{name!r} is not a synced parameter of this model")
        return p

    def read(self, name: str) -> torch.Tensor:
        p = self._param(name)
        m = self._master.get(name)
        if m is not None:
            return m.detach()
        return p.detach() if p.dtype == torch.float32 else p.detach().float()

    def write(self, name: str, value: torch.Tensor) -> None:
        p = self._param(name)
        if value.numel() != p.numel():
            raise ValueError(f"write of {name}: expected {p.numel()} values for shape {tuple(p.shape)}, got "
                             f"shape {tuple(value.shape)}")
        v = value.reshape(p.shape)
        with torch.no_grad():
            m = self._master.get(name)
            if m is not None:
                m.copy_(v)
                p.copy_(m)  # the parameter is the master rounded to the model dtype
            else:
                p.copy_(v)

    def blend(self, name: str, glob: torch.Tensor, alpha: float, shape: tuple[int, ...]) -> None:
        p = self._param(name)
        m = self._master.get(name)
        if m is None and p.dtype != torch.float32:  # read() is a copy there: the default path
            return super().blend(name, glob, alpha, shape)
        if glob.numel() != p.numel():
            raise ValueError(f"blend of {name}: expected {p.numel()} values for shape {tuple(p.shape)}, got "
                             f"shape {tuple(glob.shape)}")
        with torch.no_grad():
            if m is not None:
                blend_(m, glob, alpha)
                p.copy_(m)  # the parameter is the master rounded to the model dtype
            else:
                blend_(p, glob, alpha)

    # ---- data-parallel replicas -----------------------------------------------------------------

    def write_fragment(self, values: Mapping[str, torch.Tensor]) -> None:
        """Owner side of an update: write each named value (then every rank calls sync_replicas)."""
        for name, v in values.items():
            self.write(name, v)

    def _tensors_for(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        # The master is the source of truth where there is one: broadcasting it (and re-deriving the
        # parameter from it) leaves every replica with the same master and parameter bits.
        return [(n, self._master[n] if n in self._master else self._param(n).data) for n in names]

    def sync_replicas(self, names: Iterable[str] | None = None) -> None:
        """Collective: every rank of the group calls it with the same names (default: all synced
        tensors); afterwards each replica's tensors (master and parameter) equal the owner's bitwise."""
        names = list(self._params) if names is None else list(names)
        if self.group is None or self._size == 1:
            return
        tensors = self._tensors_for(names)
        bucket: list[tuple[str, torch.Tensor, int]] = []
        used = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            size = -(-nbytes // _ALIGN) * _ALIGN
            if bucket and used + size > self.bucket_bytes:
                self._broadcast_bucket(bucket, used)
                bucket, used = [], 0
            bucket.append((name, t, used))
            used += size
        if bucket:
            self._broadcast_bucket(bucket, used)

    def _broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor, int]], nbytes: int) -> None:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.owner:
            for _, t, off in bucket:
                n = t.numel() * t.element_size()
                buf[off : off + n].copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
        dist.broadcast(buf, src=self._src, group=self.group)
        if self.owner:
            return
        with torch.no_grad():
            for name, t, off in bucket:
                n = t.numel() * t.element_size()
                t.copy_(buf[off : off + n].view(t.dtype).view(t.shape))
                if name in self._master:
                    self._params[name].copy_(t)
