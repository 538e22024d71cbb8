"""Model adapter for megatron-core models (TP / PP with virtual stages / EP / DP, fp32 masters): the base.py
contract over Megatron's own parameters and optimizer (docs/design.md §6, docs/megatron.md).

    adapter = MegatronAdapter(model_chunks, optimizer)   # collective over the whole world

`model_chunks`: the model (or its list of virtual-pipeline chunks), wrapped (DDP, Float16Module, peft) or
not; `optimizer`: megatron-core's optimizer from `get_megatron_optimizer` (a ChainedOptimizer is
unwrapped), or None when the parameters themselves are the truth. `MegatronAdapter`'s doc has what is
synced, the boxes and owners, and where the fp32 master lives.
Invariants: names are canonical (megatron_names.py) and boxes TP-independent, so islands of any
TP/PP/EP/VPP share one session; writes set the master, then the model parameter from it, so they never
disagree; a model or optimizer the adapter cannot take is a ConfigError at construction. `layout_all`,
`gather_full` and `scatter_full` are collective helpers over the world (tests, checkpoints).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from yeto.schemas.errors import ConfigError
from yeto.schemas.layout import canonical_layout, natural_key

from .base import ModelAdapter, Piece, dtype_name
from .megatron_names import (Box, experts_module_path, global_expert_name, global_layer_name, local_layer_index,
                             lora_b_base, strip_wrappers, tp_box)

log = logging.getLogger("yeto.megatron")

_LOW = (torch.bfloat16, torch.float16)
_PIECE_HAS_EXPERT = "expert" in getattr(Piece, "__dataclass_fields__", {})
EMBEDDING = "embedding.word_embeddings.weight"


# ---- process groups -------------------------------------------------------------------------------

def _size(g) -> int:
    return 1 if g is None else dist.get_world_size(g)


def _rank(g) -> int:
    return 0 if g is None else dist.get_rank(g)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Follow `.module` through megatron's wrappers (DDP, Float16Module, FSDP adapters): every wrapper
    megatron-core has stores the wrapped model there; the model itself (a MegatronModule) has none."""
    m = chunk
    for _ in range(8):
        inner = getattr(m, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        m = inner
    return m


def _pg(inner: torch.nn.Module):
    pg = getattr(inner, "pg_collection", None)
    if pg is not None:
        return pg
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _group(pg, name: str):
    g = getattr(pg, name, None)
    if g is not None:
        return g
    from megatron.core import parallel_state as ps

    getters = {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
               "ep": ps.get_expert_model_parallel_group, "expt_tp": ps.get_expert_tensor_parallel_group,
               "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
               "expt_dp": ps.get_expert_data_parallel_group}
    return getters[name]()


# ---- entries --------------------------------------------------------------------------------------

@dataclass
class _Target:
    """One local parameter behind a canonical name, with its fp32 master."""

    param: torch.nn.Parameter
    kind: str = "plain"  # plain (the param is fp32 and its own master), full (Float16 copy), sharded (DistOpt)
    master: torch.Tensor | None = None
    start: int = 0  # sharded: this rank's owned range of the flattened local tensor
    end: int = 0
    group: Any = None  # sharded: the optimizer's data-parallel group
    ranges: list[tuple[int, int]] = field(default_factory=list)  # sharded: every group rank's range

    def full_master(self, master: torch.Tensor) -> None:
        """A Float16Module's fp32 copy in the optimizer is this parameter's master."""
        self.kind, self.master = "full", master

    def sharded_master(self, master: torch.Tensor | None, start: int, end: int, group: Any) -> None:
        """The distributed optimizer holds this rank's range [start, end) of the master (None: no range here)."""
        self.kind, self.master, self.start, self.end, self.group = "sharded", master, start, end, group

    def set_ranges(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = ranges


@dataclass
class _Entry:
    name: str
    box: Box
    dtype: str
    owner: bool
    expert: int | None  # global expert index of an expert tensor
    replica_group: Any
    targets: list[_Target]
    alias_only: bool = False  # only the tied replica (last stage's output layer) is on this rank

    def join(self, owner: bool, alias: bool) -> None:
        """Another local parameter maps to this name: the rank owns the box if any of them does."""
        self.owner = self.owner or owner
        self.alias_only = self.alias_only and alias

    def add(self, param: torch.nn.Parameter, alias: bool) -> None:
        self.targets.append(_Target(param))
        if alias:  # the replica must never be the read source while a primary exists on this rank
            self.targets.sort(key=lambda t: t.param is param)


def _base_stride(base, dim: int, stride: int) -> int:
    """A LoRA B factor's rows follow its base layer's row layout: take the base weight's partition
    stride when it splits the same dimension (gated fc1: 2)."""
    if base is None:
        return stride
    for pname, bp in base.named_parameters(recurse=False):
        if pname.startswith("weight") and getattr(bp, "tensor_model_parallel", False) and \
                int(getattr(bp, "partition_dim", -1)) == dim:
            return max(stride, int(getattr(bp, "partition_stride", 1)))
    return stride


def _leaf_optimizers(opt) -> list:
    if opt is None:
        return []
    chained = getattr(opt, "chained_optimizers", None)
    if chained is not None:
        return [leaf for o in chained for leaf in _leaf_optimizers(o)]
    return [opt]


class MegatronAdapter(ModelAdapter):
    """The base.py contract over a megatron-core model and its optimizer.

    What is synced: the trainable parameters (`requires_grad`; in a LoRA run the adapters), each once, under
    canonical names (megatron_names: wrappers stripped, global layer index, global expert index). Tied
    embedding and output layer (`share_embeddings_and_output_weights`): with PP > 1 the last stage's own
    copy of the word embedding (`output_layer.weight`) is listed under the embedding's name as a non-owner
    replica of the same box, written with the same values and never read for a push.

    Boxes and owners: a TP-partitioned parameter's box comes from its `partition_dim` / `partition_stride`
    and the TP group of its kind (the model's `pg_collection.tp`; `expt_tp` for experts); a partition stride
    s > 1 (gated fc1) is presented as (s, rows), so the box is one box and the flat order the TP=1 one; QKV
    needs nothing (interleaved per query group, TP splits whole groups). The padded vocabulary *is* pinned by
    the layout fingerprint: islands whose padded vocab differs have other shapes and are refused at hello.
    The owner of a box is the replica with data-parallel(-with-context) rank 0 (expert-data-parallel rank 0
    for experts) and, for a tensor TP does not split, TP rank 0.

    fp32 master, found through the optimizer by attributes (no type names):
    * DistributedOptimizer: each rank owns a contiguous range of each parameter's flattened local tensor
      (`main_param`, from `_get_model_param_range_map`, exchanged once at construction). `read` all-gathers
      the owned ranges over the optimizer's data-parallel group and places them (bitwise; nothing summed), so
      every rank of that group calls `read` for the same names in the same order (the island does); `write`
      sets the rank's owned range and the whole model parameter (no collective).
    * Float16OptimizerWithFloat16Params: the full fp32 copy of the TP slice (`fp32_from_float16_groups`).
    * fp32 parameters (FP32Optimizer, or fp32 groups of the others) are their own master.
    Writes set the master, then the model parameter from it (rounded as the optimizer's own main→model copy
    does). `sync_replicas(names)` is for callers that write on one replica only: it broadcasts each box the
    replica group's rank 0 wrote over that group (the island writes every holder itself and never calls it).
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None):
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks:
            raise ConfigError("no model chunks", field="model", value=[])
        self._entries: dict[str, _Entry] = {}
        by_param: dict[int, tuple[str, int]] = {}  # id(param) -> (canonical name, target index)
        for inner in (_unwrap(c) for c in chunks):
            self._add_chunk(inner, by_param)
        self._bind_optimizer(optimizer, by_param)
        self._pending: dict[str, torch.Tensor] = {}
        self._names = sorted(self._entries, key=natural_key)

    # ---- construction -----------------------------------------------------------------------------

    def _add_chunk(self, inner: torch.nn.Module, by_param: dict) -> None:
        pg = _pg(inner)
        tp, etp, pp = _group(pg, "tp"), _group(pg, "expt_tp"), _group(pg, "pp")
        dp_cp, edp, ep = _group(pg, "dp_cp"), _group(pg, "expt_dp"), _group(pg, "ep")
        config = getattr(inner, "config", None)
        vp_stage = getattr(inner, "vp_stage", None)
        offset = 0
        if config is not None and getattr(config, "num_layers", None):
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

            offset = get_transformer_layer_offset(config, vp_stage, _rank(pp))
        modules = {strip_wrappers(n): m for n, m in inner.named_modules()}
        tied = bool(getattr(inner, "share_embeddings_and_output_weights", False)) and \
            not getattr(inner, "pre_process", True)
        for raw, p in inner.named_parameters():
            if not p.requires_grad:
                continue
            local = strip_wrappers(raw)
            name = global_layer_name(local, offset)
            li = local_layer_index(local)
            if li is not None:
                layer = modules.get(local.split(".layers.")[0] + f".layers.{li}")
                number = getattr(layer, "layer_number", None)
                if isinstance(number, int) and number != offset + li + 1:
                    raise ConfigError(f"megatron-core numbers this layer {number} but the pipeline offset gives "
                                      f"{offset + li + 1}", field="param", value=raw)
            exp_path = experts_module_path(local)
            expert = exp_path is not None
            expert_id = None
            if expert:
                mod = modules.get(exp_path)
                nle = getattr(mod, "num_local_experts", None)
                if not isinstance(nle, int):
                    raise ConfigError("experts module without num_local_experts", field="param", value=raw)
                ep_group = getattr(mod, "ep_group", None) or ep
                name = global_expert_name(name, _rank(ep_group), nle)
                expert_id = int(name[len(exp_path) + 1:].split(".", 1)[0])
            alias = False
            if tied and local == "output_layer.weight":
                name, alias = EMBEDDING, True
            g_tp = etp if expert else tp
            partitioned = bool(getattr(p, "tensor_model_parallel", False))
            dim, stride = int(getattr(p, "partition_dim", -1)), int(getattr(p, "partition_stride", 1))
            base_path = lora_b_base(local)
            if base_path is not None and partitioned:
                stride = _base_stride(modules.get(base_path), dim, stride)
            box = tp_box(tuple(p.shape), partitioned, dim, stride, _rank(g_tp), _size(g_tp), name)
            rep = edp if expert else dp_cp
            owner = not alias and _rank(rep) == 0 and (partitioned or _rank(g_tp) == 0)
            dt = dtype_name(p.dtype, name)
            e = self._entries.get(name)
            if e is None:
                e = self._entries[name] = _Entry(name, box, dt, owner, expert_id, rep, [], alias)
            elif e.box != box or e.dtype != dt:
                raise ConfigError(f"two parameters map to {name} with different boxes or dtypes", field="param",
                                  value=raw)
            else:
                e.join(owner, alias)
            by_param[id(p)] = (name, len(e.targets))
            e.add(p, alias)

    def _bind_optimizer(self, optimizer, by_param: dict) -> None:
        targets = {id(t.param): t for e in self._entries.values() for t in e.targets}
        for opt in _leaf_optimizers(optimizer):
            if hasattr(opt, "shard_fp32_from_float16_groups"):
                self._bind_distributed(opt, targets, by_param)
            elif hasattr(opt, "fp32_from_float16_groups"):
                for params, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    for p, m in zip(params, masters):
                        t = targets.get(id(p))
                        if t is not None:
                            self._check_master(p, m, t)
                            t.full_master(m)
            # any other optimizer (FP32Optimizer): parameters are their own masters
        for e in self._entries.values():
            for t in e.targets:
                if t.kind == "plain" and t.param.dtype in _LOW:
                    if optimizer is None:
                        continue  # no optimizer: the low-precision parameter is the truth
                    raise ConfigError("low-precision parameter without an fp32 master in the optimizer (unsupported "
                                      "optimizer?)", field="param", value=e.name)

    @staticmethod
    def _check_master(p, m, t) -> None:
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32:
            raise ConfigError("optimizer master must be float32", field="master",
                              value=str(getattr(m, "dtype", type(m).__name__)))
        if t.kind != "plain":
            raise ConfigError("parameter has two optimizer masters", field="master", value=str(tuple(p.shape)))

    def _bind_distributed(self, opt, targets: dict, by_param: dict) -> None:
        group = opt.data_parallel_group
        owned: dict[int, tuple[torch.Tensor, int, int]] = {}
        for params, shards in list(zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)) + \
                list(zip(opt.model_fp32_groups, opt.shard_fp32_groups)):
            for p, m in zip(params, shards):
                if m is None:
                    raise ConfigError("distributed optimizer without fp32 main params (precision-aware optimizer) is "
                                      "not supported", field="optimizer", value="use_precision_aware_optimizer")
                r = opt._get_model_param_range_map(p)["param"]
                if m.dtype != torch.float32 or m.numel() != r.end - r.start:
                    raise ConfigError("main_param (the distributed optimizer's shard) does not match its range",
                                      field="master", value=(str(m.dtype), m.numel(), r.start, r.end))
                owned[id(p)] = (m, r.start, r.end)
        members = [p for buf in opt.buffers for p in buf.param_index_map]
        mine = {}
        for p in members:
            key = by_param.get(id(p))
            if key is None:
                continue  # not synced (frozen parameters are not in DDP buffers; nothing else should be here)
            m, s, e = owned.get(id(p), (None, 0, 0))
            mine[key] = (s, e)
            t = targets[id(p)]
            t.sharded_master(m, s, e, group)
        everyone: list = [None] * _size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for p in members:
            key = by_param.get(id(p))
            if key is None:
                continue
            t = targets[id(p)]
            t.set_ranges([r.get(key, (0, 0)) for r in everyone])
            spans = sorted((s, e) for s, e in t.ranges if e > s)
            pos = 0
            for s, e in spans:
                if s != pos:
                    break
                pos = e
            if pos != p.numel():
                raise ConfigError(f"distributed optimizer ranges do not tile the parameter ({p.numel()} elements)",
                                  field="master", value=key[0])

    # ---- ModelAdapter ---------------------------------------------------------------------------

    def pieces(self) -> list[Piece]:
        out = []
        for n in self._names:
            e = self._entries[n]
            extra = {"expert": e.expert} if _PIECE_HAS_EXPERT else {}
            out.append(Piece(n, e.box.global_shape, e.dtype, None if e.box.whole else e.box.slices, e.owner, **extra))
        return out

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            raise ValueError(f"{name!r} is not a synced parameter on this rank")
        return e

    def read(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        t = e.targets[0]
        if t.kind == "full":
            return t.master.detach().view(e.box.view_shape)
        if t.kind == "plain":
            p = t.param.detach()
            return (p if p.dtype == torch.float32 else p.float()).view(e.box.view_shape)
        return self._gather_sharded(t).view(e.box.view_shape)

    @staticmethod
    def _gather_sharded(t: _Target) -> torch.Tensor:
        n = max(e - s for s, e in t.ranges)
        dev = t.param.device
        mine = torch.zeros(n, dtype=torch.float32, device=dev)
        if t.end > t.start:
            mine[: t.end - t.start].copy_(t.master.detach().reshape(-1))
        buf = torch.empty(n * len(t.ranges), dtype=torch.float32, device=dev)
        dist.all_gather_into_tensor(buf, mine, group=t.group)
        out = torch.empty(t.param.numel(), dtype=torch.float32, device=dev)
        for r, (s, e) in enumerate(t.ranges):
            if e > s:
                out[s:e].copy_(buf[r * n : r * n + (e - s)])
        return out

    def write(self, name: str, value: torch.Tensor) -> None:
        e = self._entry(name)
        if tuple(value.shape) != e.box.view_shape and value.numel() != e.targets[0].param.numel():
            raise ValueError(f"write of {name}: expected the box shape {list(e.box.view_shape)}, got "
                             f"{tuple(value.shape)}")
        with torch.no_grad():
            for t in e.targets:
                p = t.param
                v = value.detach().reshape(p.shape)
                if v.device != p.device:
                    v = v.to(p.device)
                if t.kind == "full":
                    t.master.copy_(v)
                    p.copy_(t.master)
                elif t.kind == "sharded":
                    if t.end > t.start:
                        t.master.copy_(v.reshape(-1)[t.start : t.end])
                    p.copy_(v)  # fp32 parameter: the owned master range is a view of it, set here too
                else:
                    p.copy_(v)
        if not e.alias_only and _size(e.replica_group) > 1 and _rank(e.replica_group) == 0:
            # sync_replicas' source keeps what it wrote (a distributed optimizer holds only a shard of it)
            self._pending[name] = value.detach().reshape(e.box.view_shape).to(torch.float32, copy=True)

    def sync_replicas(self, names: Iterable[str] | None = None) -> None:
        """Collective over each tensor's data-parallel replica group (the older single-writer Island
        protocol): the box that the group's rank 0 last wrote reaches every replica (master and
        parameter). Every rank calls it with the same names; names it does not list are skipped."""
        names = self._names if names is None else [n for n in names if n in self._entries]
        for n in names:
            e = self._entries[n]
            if e.alias_only or _size(e.replica_group) == 1:
                self._pending.pop(n, None)
                continue  # the tied copy has no writer in its group: it gets its values from write()
            dev = e.targets[0].param.device
            source = _rank(e.replica_group) == 0
            if source:
                v = self._pending.pop(n, None)
                if v is None:
                    if e.targets[0].kind == "sharded":
                        raise ValueError(f"sync_replicas of {n!r}, which its source rank did not write")
                    v = self.read(n).clone()
                v = v.to(dev)
            else:
                v = torch.empty(e.box.view_shape, dtype=torch.float32, device=dev)
            dist.broadcast(v, src=dist.get_global_rank(e.replica_group, 0), group=e.replica_group)
            if not source:
                self.write(n, v)

    # ---- introspection ------------------------------------------------------------------------------

    def masters(self, name: str) -> list[tuple[torch.nn.Parameter, str, torch.Tensor | None, int, int]]:
        """(param, kind, master, start, end) for each local parameter behind `name` (tests, debugging)."""
        return [(t.param, t.kind, t.master, t.start, t.end) for t in self._entry(name).targets]


# ---- world-wide helpers (collective over `group`, default the whole world) ----------------------------

def layout_all(adapter: ModelAdapter, group=None) -> list[dict]:
    """The island's layout: every rank's pieces united (what the sync rank announces at hello).
    Raises when two ranks disagree on a tensor's global shape or dtype."""
    mine = [(s.name, tuple(s.global_shape), s.dtype) for s in adapter.pieces()]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    seen: dict[str, tuple] = {}
    for rank_list in everyone:
        for name, shape, dt in rank_list:
            if seen.setdefault(name, (shape, dt)) != (shape, dt):
                raise ConfigError(f"ranks disagree on {name}: {seen[name]} vs {(shape, dt)}", field="layout", value=name)
    return canonical_layout({"name": n, "shape": list(s), "dtype": d} for n, (s, d) in seen.items())


def gather_full(adapter: ModelAdapter, group=None) -> dict[str, torch.Tensor]:
    """Every synced tensor whole, in fp32 on the CPU, on every rank (small models: tests, checks).
    Every rank reads each of its pieces (so the adapter's own collectives run), owners contribute."""
    pieces = []
    for s in adapter.pieces():
        v = adapter.read(s.name)
        if s.owner:
            pieces.append((s.name, tuple(s.global_shape), s.local_slices, v.detach().float().cpu().clone()))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, pieces, group=group)
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for rank_pieces in everyone:
        for name, shape, slices, v in rank_pieces:
            t = out.setdefault(name, torch.full(shape, float("nan")))
            t[slices if slices is not None else tuple(slice(None) for _ in shape)] = v.view(
                t[slices].shape if slices is not None else shape)
            filled[name] = filled.get(name, 0) + v.numel()
    for name, t in out.items():
        if filled[name] != t.numel():
            raise ConfigError(f"owners cover {filled[name]} of {t.numel()} elements", field="owner", value=name)
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


def scatter_full(adapter: ModelAdapter, values: Mapping[str, torch.Tensor]) -> None:
    """Write whole canonical tensors (every rank passes the same `values`): each rank writes its box
    of every tensor it lists (collective only where the adapter's write is)."""
    for s in adapter.pieces():
        v = values[s.name]
        if list(v.shape) != list(s.global_shape):
            raise ValueError(f"values[{s.name!r}]: expected shape {list(s.global_shape)}, got {tuple(v.shape)}")
        adapter.write(s.name, v[s.local_slices] if s.local_slices is not None else v)


__all__ = ["EMBEDDING", "MegatronAdapter", "gather_full", "layout_all", "scatter_full"]
