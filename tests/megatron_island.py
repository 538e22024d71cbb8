"""A megatron-core GPT training as one island (test helper, run as a script by tests/test_cuda_island.py).

    python tests/megatron_island.py --device cuda|cpu --work DIR --out FILE   (YETO_NATS, YETO_RUN, YETO_ISLAND)

megatron-core's own GPTModel (local spec, no Transformer Engine), bf16 with megatron-core's DistributedOptimizer
(fp32 masters), one rank, trained with megatron-core's forward-backward schedule; the island's boundary runs
after every optimizer step until the final cut. Then it saves every synced tensor as the adapter reads it
(the fp32 masters, canonical names) to FILE and prints one `RESULT {json}` line: steps, counters, the device
the parameters live on, and whether every bf16 parameter is its master rounded (they must never disagree).

`--device cpu` runs on the test-only CPU shim (tests/megatron_cpu_shim.py), so the script itself is checked
where there is no GPU; `--device cuda` never installs it, and says so in RESULT (`shim`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps-max", type=int, default=400)
    a = p.parse_args()

    import megatron_tiny as T

    T.init_world(0, 1, os.path.join(a.work, "megatron-init"), device=a.device)
    import megatron_cpu_shim

    from yeto.learner.adapters.megatron import MegatronAdapter, gather_full
    from yeto.learner.config import IslandConfig
    from yeto.learner.island import Island

    T.layout()
    cfg = T.config(bf16=True)
    chunks = T.to_device(T.build(cfg, seed=3), a.device)
    wrapped, opt = T.wrap(chunks, cfg, distributed=True)
    adapter = MegatronAdapter(wrapped, opt)
    island = Island(adapter, IslandConfig.from_env(run=os.environ["YETO_RUN"], island=os.environ["YETO_ISLAND"]))
    island.start()
    step = 0
    while True:
        loss = T.train_step(wrapped, opt, T.tokens(step))
        step += 1
        if not island.boundary(tokens=2 * T.SEQ, loss=loss) or step >= a.steps_max:
            break
    island.close()

    values = gather_full(adapter)
    consistent = True
    for s in adapter.pieces():
        box = values[s.name][s.local_slices] if s.local_slices is not None else values[s.name]
        for param, _, _, _, _ in adapter.masters(s.name):
            consistent &= torch.equal(param.detach().cpu().reshape(box.shape), box.bfloat16())
    from safetensors.torch import save_file

    save_file({n: v.contiguous() for n, v in values.items()}, a.out)
    param = next(wrapped[0].parameters())
    result = {"steps": step, "device": str(param.device), "dtype": str(param.dtype),
              "kinds": sorted({adapter.masters(s.name)[0][1] for s in adapter.pieces()}),
              "params_are_rounded_masters": bool(consistent), "shim": megatron_cpu_shim._DONE,
              "real_current_device": torch.cuda.current_device.__module__ == "torch.cuda",
              "counters": {k: v for k, v in island.counters.items() if isinstance(v, (int, float))}}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
