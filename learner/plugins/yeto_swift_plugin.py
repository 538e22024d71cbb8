"""ms-swift plugin: streaming DiLoCo for `megatron sft` / `megatron pt` (docs/design.md §6, docs/megatron.md).

    megatron sft ... --external_plugins /path/to/learner/plugins/yeto_swift_plugin.py

(the yeto-nats package must be installed in the training environment; docs/megatron.md has the launch
lines, every YETO_* variable and what the callback does at each training event).
Owns the `YetoCallback` (on every rank: the island's start before step 1, a boundary after every optimizer
step with the step's tokens and loss, the final cut written when training ends) and the import-time hook
that installs it (`register`). May touch: ms-swift's trainer (its `train_step`, wrapped to keep the
step's metrics) and Megatron's groups; nothing at import in a dataloader worker.
Invariants: importing the file twice (another module name, a worker replay) changes nothing; every rank
passes the same loss to the boundary (`step_loss`); learner/plugins holds nothing that could shadow
another module's name (ms-swift puts the plugin's folder on sys.path).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations only: torch is imported where it is used, not when the plugin file loads
    import torch

log = logging.getLogger("yeto.swift")

CALLBACK_NAME = "yeto"
ENV_TOKENS = "YETO_TOKENS_PER_STEP"
ENV_FINAL_DIR = "YETO_FINAL_CUT_DIR"
IDLE_SLEEP_S = 0.2  # between idle boundaries after the last training step

_STATE = {"registered": False, "hybrid": False}


def _in_dataloader_worker() -> bool:
    try:
        from torch.utils.data import get_worker_info
    except Exception:  # torch missing: nothing to do anyway
        return True
    return get_worker_info() is not None


def register() -> dict:
    """Idempotent: install hybrid groups (if asked) and hook ms-swift's Megatron trainers. Returns what
    is in place ({"registered", "hybrid"}).

    ms-swift 4.6 imports plugins under a hashed module name (`_swift_external_<sha256>`) while parsing its
    arguments (before it initializes torch.distributed and Megatron's groups), and again in every
    dataloader worker: in a worker nothing happens; `YETO_CROSS_NODE_GLOO=1` installs the hybrid groups
    (learner.hybrid) now, before Megatron makes its groups; once ms-swift's Megatron side is loaded,
    `YetoCallback` is registered as the Megatron callback `yeto` (`--callbacks yeto` works) and
    `BaseMegatronTrainer.__init__` is wrapped to add it to every Megatron trainer that lacks it. The work
    lives in the module `learner.plugins.yeto_swift_plugin`, once per process."""
    if _in_dataloader_worker():
        return dict(_STATE)
    if not _STATE["hybrid"]:
        from yeto.learner import hybrid

        _STATE["hybrid"] = hybrid.install_from_env()
    if not _STATE["registered"] and "swift.megatron" in sys.modules:
        _hook_trainer()
        _STATE["registered"] = True
    return dict(_STATE)


def _hook_trainer() -> None:
    from swift.megatron.callbacks import mapping
    from swift.megatron.trainers.base import BaseMegatronTrainer

    callback_cls = make_callback_class()
    mapping.megatron_callbacks_map[CALLBACK_NAME] = callback_cls
    import swift.megatron.callbacks as callbacks_pkg

    callbacks_pkg.megatron_callbacks_map[CALLBACK_NAME] = callback_cls
    import swift.megatron.trainers.base as base_mod

    base_mod.megatron_callbacks_map[CALLBACK_NAME] = callback_cls  # the name the trainer module bound
    init = BaseMegatronTrainer.__init__
    if getattr(init, "_yeto_wrapped", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not any(getattr(c, "_yeto_callback", False) for c in self.callbacks):
            self.callbacks.append(callback_cls(self))

    __init__._yeto_wrapped = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    __init__.__doc__ = init.__doc__
    BaseMegatronTrainer.__init__ = __init__
    log.info("yeto: streaming DiLoCo callback installed in ms-swift's Megatron trainers")


_CALLBACK_CLS = None


def make_callback_class():
    """The MegatronCallback subclass (built on first use: ms-swift is imported only then). On every rank:

    * `on_train_begin`: `MegatronAdapter(trainer.wrapped_models, trainer.optimizer)` and `Island(...).start()`
      (hello, session, INIT on the INIT island, the initial cut);
    * `on_step_end` (after every optimizer step, skipped steps included): `island.boundary(tokens, loss)`,
      tokens = global_batch_size × seq_length (`YETO_TOKENS_PER_STEP` overrides), loss = `step_loss`;
      when the boundary says stop (final cut installed and acknowledged, or a shutdown) training stops;
    * `on_train_end`: until the run is finalized, idle boundaries (tokens 0) until the final cut arrives
      or `YETO_FINAL_TIMEOUT` passes; then `write_final_cut`."""
    global _CALLBACK_CLS
    if _CALLBACK_CLS is not None:
        return _CALLBACK_CLS
    from swift.megatron.callbacks.base import MegatronCallback

    class YetoCallback(MegatronCallback):
        _yeto_callback = True

        def __init__(self, trainer):
            super().__init__(trainer)
            self.island = None
            self.adapter = None
            self.steps = 0
            self.stopped = False
            self.final_dir: str | None = None
            self.last_loss: float | None = None  # what the last training boundary got (every rank)
            self._metrics = None  # the current step's per-microbatch metrics (last pipeline stage)
            inner = trainer.train_step

            def train_step(*args, **kwargs):
                out = inner(*args, **kwargs)
                self._metrics = out[0]
                return out

            trainer.train_step = train_step  # run_train_step calls self.train_step: the instance's

        # -- events ------------------------------------------------------------------------------

        def on_train_begin(self):
            from yeto.learner.adapters.megatron import MegatronAdapter
            from yeto.learner.config import IslandConfig
            from yeto.learner.island import Island

            t = self.trainer
            self.adapter = MegatronAdapter(t.wrapped_models, t.optimizer)
            cfg = IslandConfig.from_env(world=_world_info())
            self.island = Island(self.adapter, cfg, group=_world_group()).start()
            log.info("yeto: island %s started (%d synced tensors on this rank)", cfg.island,
                     len(self.adapter.pieces()))

        def on_step_end(self):
            if self.island is None or self.stopped:
                return
            self.steps += 1
            metrics, self._metrics = self._metrics, None
            self.last_loss = step_loss(self.trainer, metrics)  # collective: every rank, before the boundary
            if not self.island.boundary(tokens=_tokens_per_step(self.args), loss=self.last_loss):
                self._stop()

        def on_train_end(self):
            if self.island is None:
                return
            try:
                if not self.stopped:
                    deadline = time.monotonic() + self.island.config.final_timeout_s
                    while time.monotonic() < deadline and self.island.boundary(tokens=0):
                        time.sleep(IDLE_SLEEP_S)
                if self.island.finalized:
                    self.final_dir = write_final_cut(self.trainer)
                else:
                    log.warning("yeto: training ended without the run's final cut: no final checkpoint written")
            finally:
                self.island.close()

        def _stop(self):
            # Training ends after this step: run_train_step sees iteration >= train_iters, and so does
            # the trainer's own loop.
            self.stopped = True
            self.trainer.args.train_iters = self.trainer.state.iteration
            log.warning("yeto: the island stops training at iteration %d (%s)", self.trainer.state.iteration,
                        "final cut installed" if self.island.finalized else "shutdown")

    _CALLBACK_CLS = YetoCallback
    return YetoCallback


# ---- helpers ------------------------------------------------------------------------------------------

def _world_group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def _world_info() -> dict | None:
    """The island's parallel layout for hello (informational)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    from yeto.learner.hybrid import ranks_per_node

    world = dist.get_world_size()
    return {"ranks": world, "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "nodes": max(1, -(-world // ranks_per_node(world_size=world)))}


def _tokens_per_step(args) -> int:
    text = os.environ.get(ENV_TOKENS, "").strip()
    if text:
        return int(text)
    return int(getattr(args, "global_batch_size", 0) or 0) * int(getattr(args, "seq_length", 0) or 0)


def loss_parts(metrics) -> "torch.Tensor | None":
    """[sum, count] (float32) of one step's `loss` metric on this rank, from the per-microbatch dicts
    megatron-core's forward_backward_func returns, accumulated as ms-swift 4.6's
    `BaseMegatronTrainer._aggregated_metrics` does: [sum, count] entries are summed (a zero count is no
    loss), scalar entries become [sum of them, how many]. None when there is no loss (pure)."""
    import torch

    vals = [m["loss"] for m in (metrics or ()) if isinstance(m, dict) and m.get("loss") is not None]
    if not vals:
        return None
    val = torch.stack([v.detach() for v in vals], dim=0)
    if val[0].numel() == 2:
        val = val.sum(dim=0)
        if val[1] == 0:
            return None
    elif val[0].numel() == 1:
        val = val.new_tensor([val.sum(), val.shape[0]])
    else:
        raise ValueError(f"loss metric of shape {tuple(val[0].shape)}: expected a scalar or [sum, count]")
    return val.float()


def _reduces_loss_over_dp(trainer) -> bool:
    """Whether ms-swift sums the logged `loss` over the data(+context)-parallel group: its
    `MegatronTrainer._log_callback` does, for task_type causal_lm (the loss function keeps local
    [sum, tokens]); other trainers reduce inside their loss functions."""
    try:
        from swift.megatron.trainers import MegatronTrainer
    except ImportError:
        return False
    return isinstance(trainer, MegatronTrainer) and getattr(trainer.args, "task_type", None) == "causal_lm"


def step_loss(trainer, metrics) -> float | None:
    """The step's training loss, the same on every rank (collective: every rank of the island calls it):
    the number ms-swift logs for this step with a one-step logging window.

    ms-swift 4.6 calls `on_step_end()` with no arguments and before it folds the step's metrics into its
    log (`run_train_step`: `train_step`, `on_step_end`, then `_aggregated_metrics`), and keeps them
    nowhere else, so the callback wraps the trainer's `train_step` to keep the per-microbatch metric
    dicts megatron-core's forward_backward_func returned (`metrics`: filled on the last pipeline stage
    only). `loss_parts` accumulates their `loss` entries as `_aggregated_metrics` does; where ms-swift's
    `MegatronTrainer._log_callback` would (`megatron sft/pt`, task_type causal_lm) the last stage sums them
    over the data+context-parallel group (the token-weighted mean over the global batch); then the last
    stage broadcasts [sum, count] over the pipeline group (the sync rank, rank 0, is on the first stage).
    None when the step had no loss. Cost per step: one 2-float all-reduce (DP × CP > 1) and one 2-float
    broadcast (PP > 1)."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    parts = loss_parts(metrics) if last else None
    if not dist.is_initialized():
        return _mean(parts)
    from swift.utils import get_current_device

    device = get_current_device()  # the device backend's (NCCL / HCCL) tensors must live there
    v = torch.zeros(2, dtype=torch.float32, device=device) if parts is None else parts.to(device)
    if last and _reduces_loss_over_dp(trainer):
        # every last-stage rank joins, with zeros when it has no loss (as ms-swift does)
        dist.all_reduce(v, op=dist.ReduceOp.SUM, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(v, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return _mean(v)


def _mean(v) -> float | None:
    # ms-swift's own arithmetic: v[0] / v[1] in float32, then .item(); no tokens: no loss
    if v is None or not float(v[1]) > 0:
        return None
    return (v[0] / v[1]).item()


def write_final_cut(trainer) -> str | None:
    """Write the installed final cut with ms-swift's own saver (collective: every rank calls it): a
    Megatron (torch_dist) checkpoint in `YETO_FINAL_CUT_DIR` (default `<output_dir>/yeto-final-cut`),
    loadable with `--mcore_model` (`--mcore_adapter` for LoRA), plus HF-layout safetensors through
    mcore-bridge when `--save_safetensors` is on and the model has a bridge. Returns the directory, or
    None when YETO_FINAL_CUT_DIR=none."""
    args = trainer.args
    out = os.environ.get(ENV_FINAL_DIR, "").strip() or os.path.join(args.output_dir, "yeto-final-cut")
    if out.lower() == "none":
        return None
    from swift.megatron.utils import save_mcore_checkpoint

    lora = getattr(args, "tuner_type", "full") == "lora"
    keep = args.no_save_optim
    args.no_save_optim = True  # the final cut is weights only
    try:
        save_mcore_checkpoint(args, trainer.wrapped_models, iteration=trainer.state.iteration, output_dir=out,
                              peft_format=lora)
    finally:
        args.no_save_optim = keep
    bridge = getattr(trainer, "bridge", None)
    if getattr(args, "save_safetensors", False) and bridge is not None:
        template = getattr(trainer, "template", None)
        bridge.save_weights(trainer.unwrapped_models, out, peft_format=lora, args=args,
                            processor=getattr(template, "processor", None))
    log.warning("yeto: final cut written to %s (Megatron torch_dist%s)", out,
                " + HF safetensors" if getattr(args, "save_safetensors", False) and bridge is not None else "")
    return out


# ---- at import --------------------------------------------------------------------------------------------

if __name__ != "yeto.learner.plugins.yeto_swift_plugin":
    # Imported by ms-swift from its path (hashed module name): do the work in the one canonical module.
    from yeto.learner.plugins import yeto_swift_plugin as _canonical

    _canonical.register()
else:
    register()
