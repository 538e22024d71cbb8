"""Tiny real megatron-core models for the CPU tests (gloo ranks, fp32 or bf16), and their plumbing.

`device="cuda"` (the `cuda` tests): one rank per process on the real GPU, NCCL for the device tensors and gloo
for the host ones, the test-only CPU shim never installed; the models are built the same way on the host
(same seeds, same values) and moved to the GPU.

Every helper runs inside one rank of a multi-process gloo world started by `start()` (forkserver, torch
and megatron-core preloaded once). The models are megatron-core's own GPTModel with the local
(non-TE) layer spec: SwiGLU (gated fc1, partition stride 2), grouped-query attention (fused QKV),
tied embedding/output layer, optionally MoE (SequentialMLP experts, alltoall dispatcher).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

VOCAB, SEQ, HIDDEN = 64, 8, 16


def init_world(rank: int, world: int, init_file: str, device: str = "cpu") -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if device == "cuda":
        torch.cuda.set_device(0)  # one GPU: a CUDA world is one rank (NCCL refuses two ranks on one device)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        return
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def to_device(chunks: list[torch.nn.Module], device: str) -> list[torch.nn.Module]:
    """The chunks (built on the host) moved to `device` (megatron-core's `use_cpu_initialization` path)."""
    return [c.to(device) for c in chunks] if device != "cpu" else chunks


def device_of(chunks) -> torch.device:
    return next(chunks[0].parameters()).device


def layout(tp: int = 1, pp: int = 1, ep: int = 1, vpp: int | None = None, etp: int | None = None, seed: int = 1) -> None:
    """(Re)initialize megatron-core's parallel state for this layout on the running world."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed)


def config(*, layers: int = 4, moe: bool = False, bf16: bool = False, vpp: int | None = None):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    dtype = torch.bfloat16 if bf16 else torch.float32
    kw = dict(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
              use_cpu_initialization=True, gated_linear_unit=True, hidden_dropout=0.0, attention_dropout=0.0,
              bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
              virtual_pipeline_model_parallel_size=vpp,
              add_bias_linear=not moe)
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_token_dispatcher_type="alltoall",
                  expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                  expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                  moe_aux_loss_coeff=0.0)
    return TransformerConfig(**kw)


def build(cfg, *, moe: bool = False, seed: int = 0) -> list[torch.nn.Module]:
    """The model chunks of this rank (one per virtual stage), initialized from `seed`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False)
    vpp = cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp = stage if vpp else None
        chunks.append(GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp),
                               share_embeddings_and_output_weights=True, vp_stage=vp))
    return chunks


def wrap(chunks, cfg, *, distributed: bool, lr: float = 1e-2):
    """Float16Module (bf16 configs) + megatron DDP + megatron's optimizer (DistributedOptimizer or
    Float16OptimizerWithFloat16Params / FP32Optimizer), as ms-swift builds them."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    wrapped = []
    for i, c in enumerate(chunks):
        m = Float16Module(cfg, c) if cfg.bf16 else c
        wrapped.append(DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                                              grad_reduce_in_fp32=True), m,
                           disable_bucketing=i > 0))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, bf16=cfg.bf16,
                                                 use_distributed_optimizer=distributed), wrapped)
    return wrapped, opt


def tokens(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_per_token(chunks, toks: torch.Tensor) -> torch.Tensor | None:
    """Forward only (eval mode), PP = 1: megatron-core's per-token cross entropy [b, s] (full on every
    TP rank). Eval mode: megatron-core refuses MoE + TP without sequence parallelism when training, and
    the torch LayerNorm of the local spec has no sequence parallelism."""
    toks = toks.to(device_of(chunks))
    pos = torch.arange(SEQ, device=toks.device).unsqueeze(0).expand(toks.shape[0], SEQ)
    chunks[0].eval()
    with torch.no_grad():
        return chunks[0](toks, pos, None, labels=toks).float()


def train_step(wrapped, opt, toks: torch.Tensor) -> float | None:
    """One real step: megatron-core's forward-backward schedule, then the optimizer."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    toks = toks.to(device_of(wrapped))
    pos = torch.arange(SEQ, device=toks.device).unsqueeze(0).expand(toks.shape[0], SEQ)

    def fwd(_it, model):
        out = model(toks, pos, None, labels=toks)

        def loss_fn(o):
            loss = o.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_fn

    from megatron.core.distributed import finalize_model_grads

    for m in wrapped:
        m.zero_grad_buffer()
        m.config.finalize_model_grads_func = finalize_model_grads  # DP grad sync, tied-embedding grads over PP
    opt.zero_grad()
    out = get_forward_backward_func()(forward_step_func=fwd, data_iterator=[iter([None] * 4) for _ in wrapped]
                                      if len(wrapped) > 1 else iter([None] * 4), model=wrapped,
                                      num_microbatches=1 if len(wrapped) == 1 else 2, seq_length=SEQ,
                                      micro_batch_size=toks.shape[0], forward_only=False)
    ok, _, _ = opt.step()
    assert ok
    return float(out[0]["loss"]) if out else None


def start(fn, world: int, tmp_path, *args, start_method: str = "forkserver") -> None:
    """Run fn(rank, world, init_file, *args) on `world` gloo ranks (forkserver, megatron preloaded). The CUDA
    tests pass "spawn": a rank forked from a process in which an import already touched the CUDA driver
    cannot use the GPU."""
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "megatron.core.models.gpt",
                                                "megatron.core.optimizer", "megatron.core.distributed"])
    mp.start_processes(fn, args=(world, str(tmp_path / "init"), *args), nprocs=world, join=True,
                       start_method=start_method)


def swift_args(**kw):
    """The attributes ms-swift's save_mcore_checkpoint / load_mcore_checkpoint read from its arguments."""
    from argparse import Namespace
    from megatron.core import parallel_state as ps

    base = dict(output_dir=None, async_save=False, data_parallel_random_init=False, no_save_optim=True,
                no_save_rng=True, use_megatron_fsdp=False, dist_ckpt_save_pre_mcore_014=False,
                dist_ckpt_optim_fully_reshardable=False, distrib_optim_fully_reshardable_mem_efficient=False,
                no_load_optim=True, no_load_rng=True, finetune=True, tuner_type="full", mcore_model=None,
                tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                use_distributed_optimizer=False, fp16=False, bf16=False)
    base.update(kw)
    return Namespace(**base)


class PluginProbe(torch.utils.data.Dataset):
    """Reports, from inside a dataloader worker, what ms-swift's plugin replay did there."""

    def __init__(self, canonical: str):
        self.canonical = canonical

    def __len__(self):
        return 1

    def __getitem__(self, i):
        import sys

        mod = sys.modules.get(self.canonical)
        return {"replayed": any(k.startswith("_swift_external_") for k in sys.modules),
                "registered": bool(mod and mod._STATE["registered"]), "hybrid": bool(mod and mod._STATE["hybrid"]),
                "swift_megatron": "swift.megatron" in sys.modules}


def first(batch):
    return batch[0]
