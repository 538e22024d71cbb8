"""Canonical names and TP boxes for megatron-core parameters: pure functions, no torch.distributed.

Invariant: a canonical name and a box's global shape are the same on every island whatever its
TP/PP/EP/VPP sizes (docs/design.md §6), so islands with different parallel layouts share one session:
* wrapper prefixes are dropped (`module.` of DDP / Float16Module, `base_model.model.` of peft,
  `_orig_mod.` of torch.compile);
* `decoder.layers.<local>.` becomes `decoder.layers.<offset + local>.`, the offset being megatron-core's
  for the chunk (`get_transformer_layer_offset(config, vp_stage, pp_rank)`, virtual stages included);
* an expert parameter (under `<...>.mlp.experts`) gets its global expert index, `<...>.mlp.experts.<E>.`
  for both expert layouts megatron-core has (`global_expert_name`);
* a TP box comes from megatron-core's own attributes (`tensor_model_parallel`, `partition_dim`,
  `partition_stride`) and the TP size; a dimension cut with a stride is presented as two (`tp_box`).
A layout these rules cannot name the same everywhere (all local experts in one tensor) is a ConfigError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from yeto.schemas.errors import ConfigError

WRAPPER_PREFIXES = ("module.", "base_model.model.", "_orig_mod.")

_LAYER = re.compile(r"^((?:language_model\.)?decoder\.layers\.)(\d+)(\..*)$")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)(?:\.|$)")
_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(.*?)(weight|bias)(\d+)$")


_LORA_B = re.compile(r"^(.*)\.lora_B\.[^.]+\.(weight|bias)(\d*)$")


def lora_b_base(name: str) -> str | None:
    """For a LoRA B factor (`<layer>.lora_B.<adapter>.weight[<j>]`, peft / mcore-bridge naming), the
    path of the base layer whose output rows it produces (`<layer>.base_layer`); else None. Its rows
    are laid out like the base layer's: a gated fc1's B is [gate_r; up_r] on TP rank r too, while
    mcore-bridge builds it as a plain column-parallel linear (partition stride 1)."""
    m = _LORA_B.match(name)
    return f"{m.group(1)}.base_layer" if m else None


def strip_wrappers(name: str) -> str:
    """Drop every leading wrapper prefix (they may nest: module.module.base_model.model.…)."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name = name[len(p):]
                changed = True
    return name


def experts_module_path(name: str) -> str | None:
    """The path of the `<...>.mlp.experts` module a (wrapper-free) parameter name lies under, or None."""
    m = _EXPERTS.match(name)
    return m.group(1) if m else None


def global_layer_name(name: str, offset: int) -> str:
    """`decoder.layers.<i>.…` -> `decoder.layers.<offset + i>.…`; other names unchanged."""
    m = _LAYER.match(name)
    if not m:
        return name
    return f"{m.group(1)}{offset + int(m.group(2))}{m.group(3)}"


def local_layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(2)) if m else None


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """Local expert index -> global (`ep_rank × num_local_experts + local`) in canonical form
    `<...>.mlp.experts.<E>.<rest>`, for both expert layouts megatron-core has (SequentialMLP:
    `experts.local_experts.<j>.linear_fc1.weight`; TE grouped GEMM: `experts.linear_fc1.weight<j>`), so
    islands with different expert implementations share names. One tensor for all local experts is
    refused: the legacy GroupedMLP (`experts.weight1`) and TE grouped GEMM with megatron-core's
    `moe_single_grouped_weight` (≥ 0.19; `experts.linear_fc1.weight`, no index)."""
    for rx in (_SEQUENTIAL, _GROUPED):
        m = rx.match(name)
        if not m:
            continue
        if rx is _SEQUENTIAL:
            prefix, local, rest = m.group(1), int(m.group(2)), m.group(3)
        else:
            prefix, local = m.group(1), int(m.group(5))
            rest = f"{m.group(2)}.{m.group(3)}{m.group(4)}"
        if not 0 <= local < num_local_experts:
            raise ConfigError(f"local expert index out of range 0..{num_local_experts - 1}", field="param", value=name)
        return f"{prefix}{ep_rank * num_local_experts + local}.{rest}"
    raise ConfigError("expert parameter in an unsupported layout (use SequentialMLP or TE grouped GEMM with one "
                      "tensor per expert; the legacy GroupedMLP and megatron-core's moe_single_grouped_weight keep all "
                      "local experts in one tensor)", field="param", value=name)


@dataclass(frozen=True)
class Box:
    """Where a local piece sits in its canonical global tensor."""

    global_shape: tuple[int, ...]
    slices: tuple[slice, ...]
    view_shape: tuple[int, ...]  # the local tensor viewed in the canonical dimensions (= the box's shape)

    @property
    def whole(self) -> bool:
        return all(s.start == 0 and s.stop == n for s, n in zip(self.slices, self.global_shape))


def tp_box(local_shape: tuple[int, ...], partitioned: bool, dim: int, stride: int, tp_rank: int, tp_size: int,
           name: str = "") -> Box:
    """The canonical global shape and this rank's box for a local TP piece.

    A partition stride s > 1 means megatron-core cut the dimension into tp·s chunks and gave rank r the
    chunks r, r + tp, … (gated fc1 of SwiGLU: s = 2, [gate_r; up_r] on rank r). Concatenating the ranks'
    pieces would give a layout that depends on the TP size, so such a dimension is presented as two:
    (s, global/s) — the gate/up split first, then the TP-split rows — and rank r holds the single box
    [:, r·c:(r+1)·c], whose flat (row-major) order is the TP=1 order [gate; up] on every island. Stride-1
    tensors keep their shape (QKV included: megatron-core keeps QKV interleaved per query group and TP
    splits whole groups, so the ranks' pieces concatenated are the TP=1 tensor)."""
    local_shape = tuple(int(n) for n in local_shape)
    if not partitioned:
        return Box(local_shape, tuple(slice(0, n) for n in local_shape), local_shape)
    if not 0 <= dim < len(local_shape):
        raise ConfigError(f"partition_dim outside the {len(local_shape)}-D parameter", field=f"param.{name}.partition_dim",
                          value=dim)
    if stride < 1 or local_shape[dim] % stride:
        raise ConfigError(f"partition_stride must divide the local size {local_shape[dim]}",
                          field=f"param.{name}.partition_stride", value=stride)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp rank outside 0..{tp_size - 1}", field="tp_rank", value=tp_rank)
    if stride == 1:
        n = local_shape[dim]
        g = local_shape[:dim] + (n * tp_size,) + local_shape[dim + 1:]
        sl = tuple(slice(0, k) for k in local_shape[:dim]) + (slice(tp_rank * n, (tp_rank + 1) * n),) + \
            tuple(slice(0, k) for k in local_shape[dim + 1:])
        return Box(g, sl, local_shape)
    c = local_shape[dim] // stride
    g = local_shape[:dim] + (stride, c * tp_size) + local_shape[dim + 1:]
    view = local_shape[:dim] + (stride, c) + local_shape[dim + 1:]
    sl = tuple(slice(0, k) for k in local_shape[:dim]) + (slice(0, stride), slice(tp_rank * c, (tp_rank + 1) * c)) + \
        tuple(slice(0, k) for k in local_shape[dim + 1:])
    return Box(g, sl, view)


__all__ = ["Box", "WRAPPER_PREFIXES", "experts_module_path", "global_expert_name", "global_layer_name",
           "local_layer_index", "lora_b_base", "strip_wrappers", "tp_box"]
