"""The ms-swift plugin (learner/plugins/yeto_swift_plugin.py) inside ms-swift 4.6's own machinery, on CPU.

What runs for real: ms-swift's external-plugin loader (`swift.utils.import_external_file`, hashed module
name) and its dataloader-worker replay (`patch_dataloader_external_plugins`, a spawn worker);
ms-swift's `BaseMegatronTrainer.__init__` (wrapped by the plugin), `train()` loop, `run_train_step`,
`train_step` (megatron-core forward/backward schedule + megatron's optimizer step), its callback events
and its `save_mcore_checkpoint` / `load_mcore_checkpoint`; megatron-core models, DDP and optimizers;
a real nats-server and the real `yeto syncer`. What is replaced, because it needs a GPU or an HF
checkpoint: the trainer's model/optimizer construction (`prepare_model`, `get_optimizer_and_scheduler`:
a tiny megatron-core GPT and megatron's own optimizer instead of mcore-bridge from an HF model), its
data (`_prepare_data_iterator`, `forward_step`: fixed random tokens, different on each data-parallel
rank, instead of a dataset + template; the loss is ms-swift's own `loss_func`),
CUDA / Transformer Engine / Triton (tests/megatron_cpu_shim.py, tests/stubs), and the trainer's
warm-up of CUDA kernel fusions (`warmup_jit_function`, skipped).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nats
import pytest
import torch
import torch.distributed as dist

from tests.extras import require  # noqa: E402

require("swift", "swift", "megatron.core")

import megatron_tiny as T  # noqa: E402
from tests.e2e_procs import join_ranks_and_syncer, rank_processes  # noqa: E402
from tests.scripted import ScriptedIsland, SyncerProc, wait_provisioned  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "learner" / "plugins" / "yeto_swift_plugin.py"
CANONICAL = "yeto.learner.plugins.yeto_swift_plugin"


def _loader(rank: int, world: int, init_file: str, out: str) -> None:
    T.init_world(rank, world, init_file)
    import megatron_cpu_shim

    megatron_cpu_shim.transformer_engine_stub()
    import swift.megatron.trainers.base as base
    from swift.megatron.callbacks import megatron_callbacks_map
    from swift.utils import import_external_file, patch_dataloader_external_plugins

    from yeto.learner import hybrid

    original = base.BaseMegatronTrainer.__init__
    os.environ["YETO_CROSS_NODE_GLOO"] = "1"  # hybrid groups are installed at import, before Megatron's groups
    mod = import_external_file(str(PLUGIN))
    assert mod.__name__.startswith("_swift_external_") and mod.__name__ != CANONICAL
    canonical = sys.modules[CANONICAL]
    assert canonical._STATE == {"registered": True, "hybrid": True} and hybrid.installed()
    cb = megatron_callbacks_map["yeto"]
    assert base.megatron_callbacks_map["yeto"] is cb and cb._yeto_callback
    wrapped = base.BaseMegatronTrainer.__init__
    assert wrapped._yeto_wrapped and wrapped.__wrapped__ is original
    # imported again (cached), and as a copy under another path (another hashed name): nothing more
    assert import_external_file(str(PLUGIN)) is mod
    copy = Path(out) / "copy" / "yeto_swift_plugin.py"
    copy.parent.mkdir()
    copy.write_text(PLUGIN.read_text())
    other = import_external_file(str(copy))
    assert other is not mod and base.BaseMegatronTrainer.__init__ is wrapped
    assert megatron_callbacks_map["yeto"] is cb
    # ms-swift replays the plugins in every dataloader worker: there it must not register anything
    patch_dataloader_external_plugins()
    # (the probe lives in megatron_tiny, which imports only torch: the spawn worker unpickles it)
    dl = torch.utils.data.DataLoader(T.PluginProbe(CANONICAL), num_workers=1, multiprocessing_context="spawn",
                                     collate_fn=T.first)
    got = next(iter(dl))
    assert got == {"replayed": True, "registered": False, "hybrid": False, "swift_megatron": False}, got
    hybrid.uninstall()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_plugin_loads_through_swift_loader_once_and_stays_inert_in_dataloader_workers(tmp_path):
    T.start(_loader, 1, tmp_path, str(tmp_path))


# ---- end to end: the syncer and two ms-swift Megatron islands --------------------------------------------

ROUNDS, H, P = 4, 2, 2


def _trainer_class(seed: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from swift.megatron.trainers import MegatronTrainer

    class CPUTrainer(MegatronTrainer):
        """ms-swift's Megatron trainer; only model/optimizer construction and data are replaced."""

        local_losses: dict[int, float]

        def prepare_model(self):
            cfg = T.config(layers=2, bf16=self.args.bf16)
            self.unwrapped_models = T.build(cfg, seed=seed)
            self.config, self.bridge, self.peft_models = cfg, None, []
            self.wrapped_models, self._opt = T.wrap(self.unwrapped_models, cfg,
                                                    distributed=self.args.use_distributed_optimizer, lr=self.args.lr)

        def get_optimizer_and_scheduler(self):
            lr = self.args.lr
            return self._opt, OptimizerParamScheduler(
                self._opt, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_steps=10**6,
                lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant")

        def _get_data_collator(self):
            return None

        def _prepare_data_iterator(self, train_dataset, val_dataset=None, use_origin_cyclic=False):
            return iter(int, 1), None  # endless; forward_step draws its own tokens

        def forward_step(self, data_iterator, model):
            from functools import partial

            from megatron.core import parallel_state as ps

            # each DP rank its own tokens: the step's loss is a mean over the global batch, not one rank's
            toks = T.tokens(seed * 1000 + self.state.iteration * 10 + ps.get_data_parallel_rank())
            pos = torch.arange(T.SEQ).unsqueeze(0).expand(toks.shape[0], T.SEQ)
            out = model(toks, pos, None, labels=toks)
            step = self.state.iteration + 1

            def loss_fn(o):
                # independent reference: this rank's mean per-token cross entropy (megatron-core's) for the step
                self.local_losses[step] = o.detach().float().mean().item()
                return partial(self.loss_func, labels=toks)(o)  # ms-swift's own causal-LM loss and metrics
            return out, loss_fn

    return CPUTrainer


def _swift_args(out: str, *, bf16: bool, distributed: bool):
    from argparse import Namespace
    return Namespace(
        router_replay_mode="disabled", padding_free=False, train_iters=200, new_special_tokens=None,
        task_type="causal_lm", tp_comm_overlap=False, bf16=bf16, fp16=False, seq_length=T.SEQ, micro_batch_size=2,
        global_batch_size=2, num_microbatches=1, finetune=True, mcore_model=None, mcore_adapter=None,
        check_model=False, callbacks=["default_flow"], async_save=False, use_persistent_ckpt_worker=False,
        is_multimodal=False, overlap_grad_reduce=False, align_grad_reduce=False, overlap_param_gather=False,
        align_param_gather=False, nccl_comm_warmup=False, manual_gc=False, manual_gc_steps=0, manual_gc_eval=False,
        logging_steps=1, eval_steps=None, enable_dft_loss=False, enable_channel_loss=False, eval_iters=0,
        save_steps=None, use_megatron_fsdp=False,
        use_distributed_optimizer=distributed, output_dir=out, no_save_optim=True, no_save_rng=True,
        save_safetensors=False, tuner_type="full", virtual_pipeline_model_parallel_size=None, mtp_num_layers=None,
        dsa_indexer_loss_coeff=None, metric_for_best_model=None, lr=1e-2, data_parallel_random_init=False,
        dist_ckpt_save_pre_mcore_014=False, dist_ckpt_optim_fully_reshardable=False,
        distrib_optim_fully_reshardable_mem_efficient=False, no_load_optim=True, no_load_rng=True,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, save_total_limit=None)


def _log_recorder(yeto_cb):
    from swift.megatron.callbacks.base import MegatronCallback

    class LogRecorder(MegatronCallback):
        """What ms-swift logs each step (logging_steps 1: on_log after every step), beside what the yeto
        callback passed to that step's boundary."""

        def __init__(self, trainer):
            super().__init__(trainer)
            self.rows = {}

        def on_log(self, logs):
            self.rows[self.state.iteration] = (logs.get("loss"), yeto_cb.last_loss)

    return LogRecorder


def _island(proc: int, url: str, run: str, out: str) -> None:
    name = "a" if proc < 2 else "b"
    rank, world = (proc, 2) if name == "a" else (proc - 2, 2)
    os.environ.update(YETO_RUN=run, YETO_ISLAND=name, YETO_NATS=url, YETO_LOCKSTEP="1", YETO_PROGRESS="0",
                      YETO_HEARTBEAT_S="0.5", YETO_SESSION_TIMEOUT="60", YETO_LOCKSTEP_TIMEOUT="60",
                      YETO_FINAL_TIMEOUT="60", YETO_SHUTDOWN_TIMEOUT="30", YETO_DILOCO_ALPHA="0.5",
                      YETO_DILOCO_STEP_LOG=f"{out}/steplog-{name}.jsonl", YETO_ANCHOR_DIR=f"{out}/anchors-{name}{rank}")
    Path(out, name).mkdir(exist_ok=True)
    T.init_world(rank, world, f"{out}/pg-{name}")
    import megatron_cpu_shim

    megatron_cpu_shim.transformer_engine_stub()
    import swift.megatron.arguments  # noqa: F401  (`megatron sft` has its Megatron arguments class loaded)
    from swift.utils import import_external_file

    import_external_file(str(PLUGIN))  # what `--external_plugins` does, while parsing those arguments
    # bf16 models (the layout names the dtype: both islands must agree); island a: PP 2 with
    # Float16OptimizerWithFloat16Params (its sync rank, on the first stage, has no loss of its own);
    # island b: DP 2 with the DistributedOptimizer (sharded over the two ranks; each sees its own data)
    pp, dp, bf16, distributed = (2, 1, True, False) if name == "a" else (1, 2, True, True)
    T.layout(pp=pp)
    args = _swift_args(f"{out}/{name}", bf16=bf16, distributed=distributed)
    args.pipeline_model_parallel_size = pp
    args.global_batch_size = args.micro_batch_size * args.num_microbatches * dp
    from types import SimpleNamespace

    import swift.megatron.trainers.base as base

    base.warmup_jit_function = lambda config, args: None  # warms CUDA kernel fusions: nothing to warm on CPU
    trainer = _trainer_class(seed=1 if name == "a" else 2)(args, SimpleNamespace(padding_free=False))
    callbacks = [c for c in trainer.callbacks if getattr(c, "_yeto_callback", False)]
    assert len(callbacks) == 1
    cb = callbacks[0]
    trainer.local_losses = {}
    recorder = _log_recorder(cb)(trainer)
    trainer.callbacks.append(recorder)
    trainer.train(None, None)
    from yeto.learner.adapters.megatron import MegatronAdapter, gather_full

    result = {"iteration": trainer.state.iteration, "steps": cb.steps, "local_step": cb.island.local_step,
              "finalized": cb.island.finalized, "final_dir": cb.final_dir, "values": gather_full(cb.adapter),
              "counters": {k: v for k, v in cb.island.counters.items() if isinstance(v, (int, float))},
              "logged": recorder.rows, "local_losses": trainer.local_losses}
    if name == "b":  # the final cut, from ms-swift's checkpoint, in a fresh TP 1 island (DP 2)
        from swift.megatron.utils import load_mcore_checkpoint

        T.layout(tp=1)
        fresh = T.build(T.config(layers=2), seed=5)
        load_mcore_checkpoint(T.swift_args(mcore_model=cb.final_dir), fresh)
        result["reloaded"] = gather_full(MegatronAdapter(fresh))
    torch.save(result, f"{out}/{name}{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(240)
async def test_syncer_and_two_swift_megatron_islands_complete_rounds_and_finalization(nats_url, run_id, tmp_path):
    import multiprocessing

    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", "--islands", "2", "--fragments", str(P),
                        "--sync-every", str(H), "--total-steps", str(ROUNDS), "--strict", "--init-island", "b",
                        "--chunk-bytes", "16384", "--status-every", "0.5").start()
    nc = await nats.connect(nats_url)
    try:
        await wait_provisioned(nc.jetstream(), run_id)
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "megatron.core.models.gpt",
                                                "megatron.core.optimizer", "megatron.core.distributed"])
        with rank_processes(_island, (nats_url, run_id, str(tmp_path)), 4, start_method="forkserver") as ctx:
            await join_ranks_and_syncer(ctx, syncer, 200)
        watcher = ScriptedIsland(nc, run_id, "watcher")
        session = await watcher.wait_session()
        frags = session["fragments"]
        cut = {f["id"]: (await watcher.read_cut(f["id"], final=True))[1] for f in frags}
    finally:
        syncer.stop()
        await nc.close()

    final = {t["name"]: cut[f["id"]][t["offset"]: t["offset"] + t["numel"]].view(t["shape"])
             for f in frags for t in f["tensors"]}
    load = lambda n: torch.load(tmp_path / f"{n}.pt", weights_only=False)  # noqa: E731
    results = {n: load(n) for n in ("a0", "a1", "b0", "b1")}
    for n, r in results.items():
        # the callback ran the boundary once after every optimizer step of ms-swift's loop, and the
        # run stopped at the boundary that installed the final cut: the one after the last round's
        # version, or that version's own when the manifest landed while the sync worker read it
        assert r["finalized"] and r["steps"] == r["iteration"] == r["local_step"] in (ROUNDS, ROUNDS + 1), \
            (n, r["steps"])
        assert set(r["values"]) == set(final)
        for name, v in final.items():  # every island ends with exactly the final cut (its fp32 masters)
            assert torch.equal(r["values"][name], v), (n, name)
        assert r["counters"].get("pushes", 0) >= (ROUNDS if n in ("a0", "b0") else 0)
        assert Path(r["final_dir"], "latest_checkpointed_iteration.txt").read_text() == str(r["steps"])
    for name, v in final.items():  # ms-swift's checkpoint of the final cut (the bf16 model params) loads back
        assert torch.equal(results["b0"]["reloaded"][name], v.bfloat16().float()), name
    # the training loss in the step log: every step's event (written by the sync rank, rank 0) carries
    # the loss ms-swift logged for that step — on island a computed on the last pipeline stage (a1),
    # on island b the token-weighted mean over both DP ranks' batches
    for island, last in (("a", "a1"), ("b", "b0")):
        steps = range(1, results[f"{island}0"]["steps"] + 1)   # the island stopped at ROUNDS or ROUNDS + 1 (above)
        lines = [json.loads(x) for x in (tmp_path / f"steplog-{island}.jsonl").read_text().splitlines()]
        assert [e["step"] for e in lines] == list(steps)
        logged = results[last]["logged"]
        assert sorted(logged) == list(steps)
        for e in lines:
            swift_loss = logged[e["step"]][0]
            assert isinstance(swift_loss, float) and 0 < swift_loss < 20, (island, e["step"], swift_loss)
            assert e["loss"] == pytest.approx(swift_loss, rel=1e-6, abs=0), (island, e)
        for n in (f"{island}0", f"{island}1"):  # every rank passed the same loss to its boundary
            assert [results[n]["logged"][s][1] for s in steps] == [e["loss"] for e in lines], n
    # independent of ms-swift's and the plugin's bookkeeping: the per-token cross entropy megatron-core
    # returned to each last-stage rank's loss function (equal token counts: the global mean is the mean)
    for island, ranks in (("a", ["a1"]), ("b", ["b0", "b1"])):
        lines = [json.loads(x) for x in (tmp_path / f"steplog-{island}.jsonl").read_text().splitlines()]
        for e in lines:
            ref = sum(results[n]["local_losses"][e["step"]] for n in ranks) / len(ranks)
            assert e["loss"] == pytest.approx(ref, rel=1e-5), (island, e["step"], ref)
    b0, b1 = results["b0"]["local_losses"], results["b1"]["local_losses"]
    assert all(abs(b0[s] - b1[s]) > 1e-4 for s in range(1, results["b0"]["steps"] + 1))  # the two DP ranks really saw different batches
