"""The demo island: a tiny MLP learns a fixed random teacher function on CPU, synced through yeto-nats.

    python -m yeto.learner.demo --run R --island a [--ranks 2] [--steps-max N] [--out params.safetensors]
    python -m yeto.learner.demo eval --weights FILE    # the held-out loss of a safetensors file

Each island draws its data from its own seed (heterogeneous data of one task), held-out data from a third;
nothing is downloaded. With `--ranks 2` the island is data-parallel over two gloo processes; rank 0 alone
talks to NATS and, once the final cut is installed, saves the parameters (canonical names) to `--out` and
prints one JSON line with its mean loss over the last 10 steps.

Fault injector (tests and soak/hostile.py --poison only, never a real run): `YETO_DEMO_POISON=KIND` trains
honestly and pushes `plus50` (+50 on every value), `nan` (every value NaN), `norm5x` (5 × its true delta)
or `tokens` (claims c_tokens = 2^53-1, its delta honest); see `poison_island`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.nn as nn

D_IN, D_HID = 16, 64
TEACHER_SEED, EVAL_SEED = 1234, 99


def build_model(seed: int = 0, hidden: int = D_HID) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, hidden), nn.Tanh(),
        nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, 1),
    )


def hidden_for_mib(mib: float) -> int:
    """The hidden width whose model holds about `mib` MiB of f32 parameters (0: the default tiny
    model). Lets a demo move a few MiB per cut, so its byte counts are about the cut, not control."""
    if not mib:
        return D_HID
    want = mib * (1 << 20) / 4  # parameters: h*h + (D_IN + 3)*h + 1
    b = D_IN + 3
    return max(D_HID, int((-b + (b * b + 4 * want) ** 0.5) / 2))


_TEACHER: nn.Module | None = None


def teacher() -> nn.Module:
    global _TEACHER
    if _TEACHER is None:
        g = torch.Generator().manual_seed(TEACHER_SEED)
        t = nn.Sequential(nn.Linear(D_IN, 32), nn.Tanh(), nn.Linear(32, 1))
        with torch.no_grad():
            for p in t.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        _TEACHER = t.requires_grad_(False)
    return _TEACHER


def batch(gen: torch.Generator, n: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from a shifted normal (the shift makes the islands' data differ); targets from the teacher."""
    x = torch.randn(n, D_IN, generator=gen) + shift
    with torch.no_grad():
        y = teacher()(x) + 0.01 * torch.randn(n, 1, generator=gen)
    return x, y


def eval_loss(model: nn.Module, n: int = 4096) -> float:
    x, y = batch(torch.Generator().manual_seed(EVAL_SEED), n)
    dev = next(model.parameters()).device  # the data is made on the host: the same on every device
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x.to(dev)), y.to(dev)))


def model_seed(island: str) -> int:
    """Seed of an island's own initial weights (version 0, the INIT island's, overwrites the others)."""
    return sum(map(ord, island))


def island_data(island: str, rank: int) -> tuple[torch.Generator, float]:
    """The data stream of one rank of an island: its generator (a fixed seed, so a run's data order is
    reproducible) and its input shift (islands a and b see opposite shifts: heterogeneous data)."""
    seed = {"a": 1, "b": 2}.get(island, 3 + len(island))
    return torch.Generator().manual_seed(seed * 1000 + rank), (0.3 if seed % 2 else -0.3)


POISON_ENV = "YETO_DEMO_POISON"
POISON_KINDS = ("plus50", "nan", "norm5x", "tokens")


def poison_island(island, kind: str) -> None:
    """Test and bench fault injector (YETO_DEMO_POISON, see the module doc): alter what `island` pushes,
    after it computed it honestly, as a compromised island would. It wraps the island's push packing
    (every chunk of d = local - anchor, on the sync rank) or its push request (the c_tokens claim);
    the wrappers stay on the objects, so calling this again (after every boundary: a new session
    builds new ones) is cheap and changes nothing more."""
    import dataclasses

    from yeto.schemas.dtypes import as_bytes_view, pack, unpack

    if kind not in POISON_KINDS:
        raise ValueError(f"{POISON_ENV} must be one of {', '.join(POISON_KINDS)}, got {kind!r}")
    if kind == "tokens":
        wire = island.wire
        if wire is None or getattr(wire, "_poisoned", False):
            return
        push = wire.push
        wire.push = lambda op: push(dataclasses.replace(op, c_tokens=2 ** 53 - 1))
        wire._poisoned = True
        return
    ops = island.ops
    if ops is None or getattr(ops, "_poisoned", False):
        return
    pack_chunks = ops.pack   # every export packs through it, at the boundary or on the sync worker

    def poisoned_pack(op, values):
        for s, packed in pack_chunks(op, values):
            if op.purpose == "push":
                d = unpack(bytes(as_bytes_view(packed)), op.dtype, s.elem_count)
                d = d + 50.0 if kind == "plus50" else torch.full_like(d, float("nan")) if kind == "nan" else d * 5.0
                packed = pack(d, op.dtype)
            yield s, packed

    ops.pack = poisoned_pack
    ops._poisoned = True


def canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone().contiguous() for name, p in model.named_parameters()}


def _train(rank: int, world: int, args, result_q=None) -> None:
    import torch.distributed as dist

    from yeto.learner.adapters.torch_module import TorchModuleAdapter
    from yeto.learner.config import IslandConfig
    from yeto.learner.island import Island

    torch.set_num_threads(1)
    group = None
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{args.port}")
        group = dist.group.WORLD
    # Every island starts from its own random weights: version 0 (the INIT island's) overwrites them.
    # --device cuda: the model, its optimizer and its batches live on the GPU (one per island on one
    # machine is fine: the demo's islands are small); the island moves values through the host.
    device = torch.device(args.device)
    model = build_model(seed=model_seed(args.island), hidden=hidden_for_mib(args.model_mib)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    adapter = TorchModuleAdapter(model, group=group)
    cfg = IslandConfig.from_env(run=args.run, island=args.island)
    island = Island(adapter, cfg, group=group)
    island.start()
    poison = os.environ.get(POISON_ENV, "").strip()
    if poison:
        poison_island(island, poison)
        if rank == 0:
            print(f"[{args.island}] {POISON_ENV}={poison}: this island pushes poisoned updates (fault injector)",
                  flush=True)
    gen, shift = island_data(args.island, rank)
    losses: list[float] = []
    step = 0
    t_last = time.monotonic()
    while True:
        x, y = batch(gen, args.batch, shift)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)
        opt.step()
        step += 1
        lv = float(loss.detach())
        if world > 1:
            t = torch.tensor([lv])
            dist.all_reduce(t, group=group)
            lv = float(t) / world
        losses.append(lv)
        if args.step_delay:
            time.sleep(args.step_delay)  # stands in for a real model's compute time
        keep = island.boundary(tokens=args.batch * world, loss=lv)
        if poison:
            poison_island(island, poison)
        if rank == 0 and time.monotonic() - t_last > 2.0:
            t_last = time.monotonic()
            print(f"[{args.island}] step {step} loss {lv:.4f} versions {island.state.versions()}", flush=True)
        if not keep or (args.steps_max and step >= args.steps_max):
            break
    island.close()
    if rank == 0:
        final = {
            "island": args.island,
            "steps": step,
            "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "eval_loss": eval_loss(model),
            "device": str(next(model.parameters()).device),
            "counters": {k: v for k, v in island.counters.items() if isinstance(v, (int, float))},
        }
        if args.out:
            from safetensors.torch import save_file

            save_file(canonical_state(model), args.out)
        # One write call for the whole line: print() writes text and newline separately, and the
        # other ranks of this island share stdout, so their output could split the line otherwise.
        sys.stdout.write("RESULT " + json.dumps(final) + "\n")
        sys.stdout.flush()
    if world > 1:
        # Leave together. Without this barrier rank 1 tore its gloo group down while rank 0 still
        # waited for the syncer's shutdown, and it died in teardown with SIGABRT once in CI and once
        # in about 120 runs here under load ("terminate called without an active exception"); the cause
        # inside gloo was not pinned down. torch documents destroy_process_group as called by all
        # ranks together, which the barrier makes true.
        dist.barrier(group=group)
        dist.destroy_process_group()


def _log_with_time() -> None:
    """The island's log records (warnings and up, as before) with a timestamp: a soak's or a test's island
    log is read beside the syncer's, which has one, to find when a stall began."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _spawn_rank(rank, world, args):
    _log_with_time()            # a spawned rank starts with the interpreter's default logging
    _train(rank, world, args)
    # Leave without running the interpreter's and C++'s exit-time destructors: even after the barrier
    # and destroy_process_group above, a rank still died in them now and then with SIGABRT
    # ("terminate called without an active exception": a joinable C++ thread destroyed at exit), once
    # in soak/chaos.py --cluster 3 after its RESULT line, so the island exited 1 with its work done.
    # Everything this rank writes is flushed first; mp.spawn reads exit code 0 as success.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        p = argparse.ArgumentParser(prog="python -m yeto.learner.demo eval")
        p.add_argument("--weights", required=True)
        a = p.parse_args(argv[1:])
        from safetensors.torch import load_file

        weights = load_file(a.weights)
        model = build_model(hidden=weights["0.weight"].shape[0])  # the width the run trained
        model.load_state_dict(weights)
        print(json.dumps({"eval_loss": eval_loss(model)}))
        return 0
    p = argparse.ArgumentParser(prog="python -m yeto.learner.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=os.environ.get("YETO_RUN"), required="YETO_RUN" not in os.environ)
    p.add_argument("--island", default=os.environ.get("YETO_ISLAND"), required="YETO_ISLAND" not in os.environ)
    p.add_argument("--ranks", type=int, default=1, help="data-parallel gloo processes in this island")
    p.add_argument("--port", type=int, default=0, help="rendezvous port for --ranks > 1 (default: a free one)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--step-delay", type=float, default=0.01, help="seconds of simulated compute per step")
    p.add_argument("--steps-max", type=int, default=0, help="stop after this many steps even without a final cut (0: no limit)")
    p.add_argument("--out", default=None, help="save the island's parameters here after the final cut")
    p.add_argument("--device", default=os.environ.get("YETO_DEMO_DEVICE", "cpu"),
                   help="where the model trains: cpu (default) or cuda (YETO_DEMO_DEVICE)")
    p.add_argument("--model-mib", type=float, default=0.0, help="widen the MLP to about this many MiB of f32 "
                   "parameters (default 0: the tiny model)")
    args = p.parse_args(argv)
    _log_with_time()
    from yeto.schemas.errors import ConfigError

    from yeto.learner.errors import IslandUnhealthy

    try:
        if args.ranks > 1:
            import torch.multiprocessing as mp

            if not args.port:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    args.port = s.getsockname()[1]
            try:
                mp.spawn(_spawn_rank, args=(args.ranks, args), nprocs=args.ranks, join=True)
            except mp.ProcessRaisedException as exc:
                # a rank's expected error: its last line (the message) is the news, its traceback is not
                last = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
                if "IslandUnhealthy" in last or "ConfigError" in last:
                    print(f"yeto.learner.demo island {args.island}: {last.split(': ', 1)[-1]}", file=sys.stderr)
                    return 2 if "ConfigError" in last else 1
                raise
        else:
            _train(0, 1, args)
    except (IslandUnhealthy, ConfigError) as exc:
        if os.environ.get("YETO_LOG_LEVEL", "").upper() == "DEBUG":
            raise
        print(f"yeto.learner.demo island {args.island}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
