"""Canonical names and TP boxes for megatron-core parameters (learner/adapters/megatron_names.py): pure."""
from __future__ import annotations

import pytest
import torch

from yeto.learner.adapters.megatron_names import (experts_module_path, global_expert_name, global_layer_name,
                                             strip_wrappers, tp_box)
from yeto.schemas.errors import ConfigError


def test_wrappers_layers_and_experts():
    assert strip_wrappers("module.module.base_model.model.decoder.layers.0.x") == "decoder.layers.0.x"
    assert strip_wrappers("embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"
    assert global_layer_name("decoder.layers.3.mlp.linear_fc1.weight", 8) == "decoder.layers.11.mlp.linear_fc1.weight"
    assert global_layer_name("language_model.decoder.layers.0.a", 2) == "language_model.decoder.layers.2.a"
    assert global_layer_name("vision_model.decoder.layers.0.a", 2) == "vision_model.decoder.layers.0.a"
    assert global_layer_name("decoder.final_layernorm.weight", 4) == "decoder.final_layernorm.weight"
    assert experts_module_path("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight") == \
        "decoder.layers.1.mlp.experts"
    assert experts_module_path("decoder.layers.1.mlp.shared_experts.linear_fc1.weight") is None
    assert experts_module_path("decoder.layers.1.mlp.router.weight") is None
    # SequentialMLP and TE grouped GEMM give the same canonical name; EP rank 1 of 2 local experts
    seq = global_expert_name("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight", 1, 2)
    grp = global_expert_name("decoder.layers.1.mlp.experts.linear_fc2.weight1", 1, 2)
    assert seq == grp == "decoder.layers.1.mlp.experts.3.linear_fc2.weight"
    assert global_expert_name("decoder.layers.0.mlp.experts.linear_fc1.lora_A.default.weight0", 2, 4) == \
        "decoder.layers.0.mlp.experts.8.linear_fc1.lora_A.default.weight"
    with pytest.raises(ConfigError):
        global_expert_name("decoder.layers.0.mlp.experts.weight1", 0, 2)  # legacy GroupedMLP
    with pytest.raises(ConfigError, match="moe_single_grouped_weight"):
        # megatron-core >= 0.19 `moe_single_grouped_weight`: all local experts in one unindexed tensor
        global_expert_name("decoder.layers.0.mlp.experts.linear_fc1.weight", 0, 2)
    with pytest.raises(ConfigError):
        global_expert_name("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight", 0, 2)


def _megatron_split(master: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> torch.Tensor:
    """How megatron-core cuts a master weight for TP (tensor_parallel.layers._initialize_affine_weight_cpu):
    chunks of size local/stride along `dim`, rank r takes chunks r, r + tp, ... and concatenates them."""
    per = master.shape[dim] // (tp * stride)
    chunks = torch.split(master, per, dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


@pytest.mark.parametrize("dim,stride,tp", [(0, 1, 2), (1, 1, 4), (0, 2, 2), (0, 2, 4), (1, 3, 2), (0, 2, 1)])
def test_box_of_each_rank_is_its_megatron_piece_of_the_canonical_tensor(dim, stride, tp):
    shape = [24, 12] if dim == 0 else [6, 24]
    master = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    pieces = []
    for r in range(tp):
        local = _megatron_split(master, dim, stride, r, tp)
        box = tp_box(tuple(local.shape), True, dim, stride, r, tp)
        canonical = master.reshape(box.global_shape)  # flat order = the TP=1 (master) order
        assert torch.equal(canonical[box.slices], local.view(box.view_shape))
        pieces.append(box)
    # the boxes tile the canonical tensor exactly once
    cover = torch.zeros(pieces[0].global_shape)
    for b in pieces:
        cover[b.slices] += 1
    assert torch.equal(cover, torch.ones_like(cover))
    # the canonical shape does not depend on the TP size
    one = tp_box(tuple(master.shape), True, dim, stride, 0, 1)
    assert one.global_shape == pieces[0].global_shape


def test_unpartitioned_and_bad_attributes():
    b = tp_box((4, 5), False, -1, 1, 1, 2)
    assert b.whole and b.global_shape == (4, 5)
    with pytest.raises(ConfigError):
        tp_box((5, 4), True, 0, 2, 0, 2)  # stride does not divide
    with pytest.raises(ConfigError):
        tp_box((4,), True, 1, 1, 0, 2)  # no such dim


def test_lora_b_base_path():
    from yeto.learner.adapters.megatron_names import lora_b_base

    assert lora_b_base("decoder.layers.0.mlp.linear_fc1.lora_B.default.weight") == \
        "decoder.layers.0.mlp.linear_fc1.base_layer"
    assert lora_b_base("decoder.layers.0.mlp.experts.linear_fc1.lora_B.default.weight3") == \
        "decoder.layers.0.mlp.experts.linear_fc1.base_layer"
    assert lora_b_base("decoder.layers.0.mlp.linear_fc1.lora_A.default.weight") is None
    assert lora_b_base("decoder.layers.0.mlp.linear_fc1.weight") is None
