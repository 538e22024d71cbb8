#!/usr/bin/env python
"""Goodput benchmark: what streaming sync costs an island's training loop.

    python bench/goodput.py [--islands 2] [--size-mib 256] [--fragments 4] [--step-s 0.25]
                            [--sync-every 32] [--steps 160] [--warmup 24] [--ranks 1]

N islands (processes) train a model of S MiB of f32 parameters in 8 square weight tensors (so P
fragments of whole tensors divide it evenly). Each step is a fixed simulated accelerator time
(`--step-s`, a sleep: the host CPU is free meanwhile, as while a GPU computes) plus the real optimizer
step (torch AdamW over every parameter, gradients fixed at the start: the bench measures the loop, not
learning). With `--ranks R` each island is a gloo group of R processes holding the whole model
(data-parallel; each step ends with a barrier of the group, as a gradient all-reduce would), whose
worker stages each version on every rank over the staging group (learner/stager.py; or, with
YETO_STAGING_GROUP=0, the installing boundary hands it to them: a collective). The same script
runs twice, in one invocation:

  sync   a real broker (embedded, or `--nats`), the real `yeto syncer` (P fragments, H = `--sync-every`,
         streaming: not lockstep) and N islands calling `Island.boundary()` after every step;
  alone  the same N processes with no Island at all.

Per island, steps/s over the steps after `--warmup` and before the last H/P (the final cut's wait is not
training); goodput = the median island's steps/s with sync over without. Staleness: each time an island
installs a new version of a fragment (its step log, YETO_DILOCO_STEP_LOG), how many versions of that
fragment the syncer had committed by then beyond the one installed (the tape's merge records); the median
over every install. Peak RSS (VmHWM) of every process. The last line:

  goodput ratio=<x> staleness=<y> sync_steps_per_s=<a> alone_steps_per_s=<b> boundary_share=<s> ...

boundary_share: per island, the seconds its training thread spent inside boundary() over the window's
seconds (median over islands): what sync costs the loop itself, free of the spread between the passes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path


# processes and peak RSS as every bench runs and reads them
from yeto.services.run_harness import (  # noqa: E402
    Child, ChildFailed, RssWatch, clean_env, free_port, read_tape, stop_all, vm_hwm, wait_all,
)

MiB = 1 << 20
LAYERS = 8


# ---------------------------------------------------------------------------------------- the island


def width_for(size_mib: float) -> int:
    """The width d of LAYERS d x d f32 tensors holding about `size_mib` MiB."""
    return max(8, int((size_mib * MiB / 4 / LAYERS) ** 0.5))


def worker(args) -> int:
    if args.ranks > 1:
        import torch.multiprocessing as mp

        mp.spawn(_rank_loop, args=(args,), nprocs=args.ranks, join=True)
        return 0
    _rank_loop(0, args)
    return 0


def _rank_loop(rank: int, args) -> None:
    """One rank of an island: with `--ranks` > 1 the island is a gloo group of that many processes, each
    holding the whole model (data-parallel; the gradients are fixed, so no all-reduce is needed for the
    replicas to stay equal) and calling boundary() together; rank 0 writes the results."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    group = None
    if args.ranks > 1 and args.sync:
        dist.init_process_group("gloo", rank=rank, world_size=args.ranks, init_method=f"tcp://127.0.0.1:{args.port}")
        group = dist.group.WORLD
    d = width_for(args.size_mib)
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(LAYERS)])
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3   # fixed: the loop's cost, not learning, is measured
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    island = None
    if args.sync:
        from yeto.learner.adapters.torch_module import TorchModuleAdapter
        from yeto.learner.config import IslandConfig
        from yeto.learner.island import Island

        island = Island(TorchModuleAdapter(model, group=group), IslandConfig.from_env(run=args.run, island=args.island),
                        group=group)
        island.start()
    times, boundary_s = [], []
    for _ in range(args.steps + (10 * args.sync_every if args.sync else 0)):
        time.sleep(args.step_s)               # the accelerator's forward and backward
        opt.step()
        if group is not None:
            # A data-parallel step ends with its gradients' all-reduce, so the ranks leave it together:
            # boundary() then times its own work, not one rank waiting for the other's step.
            dist.barrier(group=group)
        if island is not None:
            t0 = time.monotonic()
            keep = island.boundary(tokens=1)
            boundary_s.append(time.monotonic() - t0)
            times.append(time.monotonic())
            if not keep:
                break
        else:
            times.append(time.monotonic())
            if len(times) >= args.steps:
                break
    if island is not None:
        island.close()
    if args.ranks > 1:   # the RssWatch sees the launcher only: every rank reports its own peak
        Path(f"{args.out}.rss{rank}").write_text(str(vm_hwm("self") or 0))
    if rank == 0:
        Path(args.out).write_text(json.dumps({"island": args.island, "times": times, "boundary_s": boundary_s,
                                              "params": sum(p.numel() for p in model.parameters())}))
    if group is not None:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the driver


def rate(times: list[float], warmup: int, tail: int) -> float:
    """Steps per second between step `warmup` and the step `tail` steps before the end."""
    end = len(times) - 1 - tail
    if end <= warmup:
        raise SystemExit(f"goodput bench: {len(times)} steps leave no window after --warmup {warmup} (tail {tail})")
    return (end - warmup) / (times[end] - times[warmup])


def boundary_share(times: list[float], boundary_s: list[float], warmup: int, tail: int) -> float:
    """Seconds inside boundary() over the seconds of the window `rate` measures (same steps)."""
    end = len(times) - 1 - tail
    return sum(boundary_s[warmup + 1: end + 1]) / (times[end] - times[warmup])


def staleness(steplog_lines: list[str], merges: list[dict]) -> list[int]:
    """Per install of a new fragment version seen in an island's step log: versions of that fragment the
    syncer had committed by then beyond the one installed (pure)."""
    committed: dict[int, list[tuple[float, int]]] = {}
    for m in merges:
        committed.setdefault(int(m["fragment"]), []).append((float(m["t"]), int(m["version"])))
    out, last = [], {}
    for line in steplog_lines:
        ev = json.loads(line)
        for f, v in (ev.get("versions") or {}).items():
            f, v = int(f), int(v)
            if v > last.get(f, 0) and v > 0:
                newest = max((ver for t, ver in committed.get(f, []) if t <= ev["t"]), default=v)
                out.append(max(0, newest - v))
            last[f] = max(last.get(f, 0), v)
    return out


async def read_merges(url: str, run: str) -> list[dict]:
    import nats

    nc = await nats.connect(url)
    try:
        return await read_tape(nc.jetstream(), run, "merge")
    finally:
        await nc.close()


def rounds_for(args) -> int:
    """Global rounds in `--steps` island steps: one fragment's round every H/P steps."""
    return max(1, args.steps * args.fragments // args.sync_every)


def one_pass(args, url: str | None, work: Path, sync: bool, watch: RssWatch) -> tuple[dict, str | None]:
    run = f"bench_goodput_{uuid.uuid4().hex[:8]}"
    names = [f"i{k}" for k in range(args.islands)]
    env = clean_env(YETO_PROGRESS="0")
    tag = "sync" if sync else "alone"
    procs: dict[str, Child] = {}
    try:
        if sync:
            procs[f"{tag}-syncer"] = Child(
                f"{tag}-syncer", [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run, "--islands",
                 str(args.islands), "--fragments", str(args.fragments), "--sync-every", str(args.sync_every),
                 "--total-steps", str(rounds_for(args)), "--init-island", names[0],
                 "--checkpoint-dir", str(work / f"{tag}-ckpt"), "--status-every", "30"],
                work / f"{tag}-syncer.log", env=env).start()
        for name in names:
            e = dict(env)
            if sync:
                e.update(YETO_NATS=url, YETO_DILOCO_STEP_LOG=str(work / f"{tag}-steplog-{name}.jsonl"))
            procs[f"{tag}-{name}"] = Child(
                f"{tag}-{name}", [sys.executable, str(Path(__file__).resolve()), "worker", "--island", name, "--run", run,
                 "--size-mib", str(args.size_mib), "--steps", str(args.steps), "--step-s", str(args.step_s),
                 "--sync-every", str(args.sync_every), "--out", str(work / f"{tag}-{name}.json"),
                 "--ranks", str(args.ranks), "--port", str(free_port() if args.ranks > 1 else 0)]
                + (["--sync"] if sync else []),
                work / f"{tag}-{name}.log", env=e).start()
        watch.add_children(procs.values())
        try:
            wait_all(procs, args.timeout, watch=watch, lines=40)
        except ChildFailed as err:
            raise SystemExit(f"goodput bench: {err} (logs in {work})")
    finally:
        stop_all(procs, grace=0)
    results = {n: json.loads((work / f"{tag}-{n}.json").read_text()) for n in names}
    for n in names:   # --ranks > 1: each rank's own peak, in place of its launcher's
        for k in range(args.ranks if args.ranks > 1 else 0):
            watch.peak.pop(f"{tag}-{n}", None)
            watch.peak[f"{tag}-{n}-r{k}"] = int((work / f"{tag}-{n}.json.rss{k}").read_text())
    return results, run if sync else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--island", required=True)
    w.add_argument("--run", required=True)
    w.add_argument("--size-mib", type=float, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--step-s", type=float, required=True)
    w.add_argument("--sync-every", type=int, required=True)
    w.add_argument("--sync", action="store_true")
    w.add_argument("--out", required=True)
    w.add_argument("--ranks", type=int, default=1)
    w.add_argument("--port", type=int, default=0, help="the island group's rendezvous port (--ranks > 1)")
    ap.add_argument("--islands", type=int, default=2)
    ap.add_argument("--size-mib", type=float, default=256.0)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=1,
                    help="processes per island (a gloo group, data-parallel; their staging is the group's collective)")
    ap.add_argument("--step-s", type=float, default=0.25, help="simulated accelerator time per step (a sleep)")
    ap.add_argument("--sync-every", type=int, default=32, help="H")
    ap.add_argument("--steps", type=int, default=160,
                    help="training steps per island (the syncer commits steps x P / H rounds)")
    ap.add_argument("--warmup", type=int, default=24, help="steps left out at the start (initial cut, first pulls)")
    ap.add_argument("--nats", default=None, help="a broker to use (default: the embedded one)")
    ap.add_argument("--workdir", default=None, help="keep logs here (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return worker(args)
    if args.fragments > LAYERS:
        ap.error(f"--fragments {args.fragments}: the model has {LAYERS} tensors and a fragment holds whole tensors")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="yeto-goodput-"))
    work.mkdir(parents=True, exist_ok=True)
    broker = None
    url = args.nats
    if url is None:
        from yeto.services.broker import Broker

        broker = Broker(store_dir=work / "broker").start()
        url = broker.url
    try:
        with RssWatch(every_s=0.5) as watch:
            t0 = time.monotonic()
            synced, run = one_pass(args, url, work, True, watch)
            t_sync = time.monotonic() - t0
            merges = asyncio.run(read_merges(url, run))
            t0 = time.monotonic()
            alone, _ = one_pass(args, None, work, False, watch)
            t_alone = time.monotonic() - t0
    finally:
        if broker is not None:
            broker.stop()
    tail = args.sync_every // args.fragments
    sync_rates = {n: rate(r["times"], args.warmup, tail) for n, r in synced.items()}
    alone_rates = {n: rate(r["times"], args.warmup, tail) for n, r in alone.items()}
    stale: list[int] = []
    for n in synced:
        stale += staleness((work / f"sync-steplog-{n}.jsonl").read_text().splitlines(), merges)
    boundary = sorted(b for r in synced.values() for b in r["boundary_s"][args.warmup:])
    params = next(iter(synced.values()))["params"]
    print(f"model: {params * 4 / MiB:.0f} MiB f32 in {LAYERS} tensors, {args.fragments} fragments, H={args.sync_every}, "
          f"{args.islands} islands of {args.ranks} rank(s), step {args.step_s}s + AdamW")
    print(f"sync  pass {t_sync:.0f}s: steps/s per island {', '.join(f'{n} {v:.3f}' for n, v in sync_rates.items())}; "
          f"{len(merges)} merges; boundary() median {statistics.median(boundary):.3f}s, p90 "
          f"{boundary[int(0.9 * (len(boundary) - 1))]:.3f}s, max {boundary[-1]:.3f}s")
    print(f"alone pass {t_alone:.0f}s: steps/s per island {', '.join(f'{n} {v:.3f}' for n, v in alone_rates.items())}")
    print("peak RSS MiB: " + ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(watch.peak.items())))
    ratio = statistics.median(sync_rates.values()) / statistics.median(alone_rates.values())
    st = statistics.median(stale) if stale else float("nan")
    # The share of the window the training thread spent inside boundary(): what sync costs the loop itself,
    # free of the two passes' run-to-run spread on a shared machine (the ratio also carries the CPU the
    # syncer, the broker and the other island take).
    share = statistics.median(boundary_share(r["times"], r["boundary_s"], args.warmup, tail) for r in synced.values())
    print(f"goodput ratio={ratio:.3f} staleness={st:g} sync_steps_per_s={statistics.median(sync_rates.values()):.3f} "
          f"alone_steps_per_s={statistics.median(alone_rates.values()):.3f} boundary_share={share:.4f} "
          f"installs={len(stale)} merges={len(merges)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
