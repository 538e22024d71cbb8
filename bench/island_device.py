#!/usr/bin/env python
"""Device benchmark: the island boundary's export and apply of a model resident on the accelerator, against
the device<->host copy bandwidth measured in the same run; and the boundary's share of a real training step.

    python bench/island_device.py [--device cuda|cpu] [--size-mib 1024] [--fragments 4] [--repeat 3]
                                  [--train-mib 256] [--train-steps 96] [--sync-every 32] [--no-train]

Part 1, in this process, the island's own code path (learner/island_ranks.py `RankOps` over a one-rank
island, TorchModuleAdapter): a model of `--size-mib` MiB of **bf16** parameters in 8 tensors on the device
with an **fp32 master** there (what a mixed-precision optimizer keeps), split in `--fragments` fragments.
  export  every fragment's push snapshot (`RankOps.snapshot`: the master read through the host staging of
          learner/device.py — pinned buffers, non-blocking copies on a side stream — and d = local − anchor
          on the host, per chunk): what a push's boundary does;
  apply   every fragment's commit of a staged version in blend mode (θ = α·θ + (1 − α)·Θ on the device, the
          bf16 parameter re-derived from the master): what an installing boundary does. The staging of
          the version's chunks (the sync worker's part, off the training thread) is not timed.
The limit: the same f32 bytes copied device -> pinned host memory and back (`copy_(non_blocking=True)`,
synchronized), tensor by tensor; with `--device cpu` a memcpy between two host tensors. ratio = the copies'
seconds over export + apply seconds (medians of `--repeat`); 1 would be the boundary at copy speed.

Part 2 (`--no-train` leaves it out): boundary_share as bench/goodput.py measures it, inside a real training
step on the device: a broker (embedded), the real `yeto syncer` and one island process training an MLP of
`--train-mib` MiB (fp32 parameters, bf16 autocast on CUDA; forward, backward, AdamW, the loss read on the
host as a training loop logs it) and calling `Island.boundary()` after every step. boundary_share = the
seconds inside boundary() over the window's seconds (after 1/4 of the steps, before the last H/P).

Prints the peak RSS of this process and of the island (VmHWM) and the device's peak memory; the last line:

  device export_apply_ratio=<x> export_s=<s> apply_s=<s> reads_s=<s> d2h_gbps=<g> h2d_gbps=<g> boundary_share=<s> ...

reads_s: the export's adapter reads and host staging alone (no anchor subtraction, no chunk copies), so the
line says whether an export is bound by the device copies or by the host math after them.

`--device cpu` (small defaults: 64 MiB, train 8 MiB for 48 steps) lets CI run it where there is no GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

# the installed yeto (as every bench: the product as users get it)
from yeto.learner.rank_ops import CommitOp, SnapshotOp, StageOp
from yeto.services.run_harness import Child, ChildFailed, RssWatch, clean_env, peak_rss_self, stop_all, wait_all

MiB, GB = 1 << 20, 1e9
LAYERS = 8
CHUNK_BYTES = 4 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return "cpu"


# ------------------------------------------------------------------------------ part 1: export and apply

def build(size_mib: float, device: torch.device):
    """LAYERS bf16 tensors of about `size_mib` MiB in all on `device`, each with an fp32 master there."""
    per = max(1, int(size_mib * MiB / 2 / LAYERS))
    cols = 4096 if per >= 4096 * 16 else 64
    rows = max(1, per // cols)
    module = torch.nn.Module()
    master = {}
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(LAYERS):
        m = torch.randn(rows, cols, generator=g, device=device)
        module.register_parameter(f"w{i}", torch.nn.Parameter(m.to(torch.bfloat16)))
        master[f"w{i}"] = m
    return module, master


def island_ops(module, master, fragments: int):
    from yeto.learner.adapters.torch_module import TorchModuleAdapter
    from yeto.learner.anchors import AnchorStore
    from yeto.learner.island_ranks import RankOps
    from yeto.learner.layout_map import IslandLayout, describe
    from yeto.learner.piece_io import Comm
    from yeto.schemas.layout import build_session

    ad = TorchModuleAdapter(module, master=master)
    session = build_session(ad.layout(), fragments, run="bench", push_dtype="f32", bulk_dtype="f32",
                            chunk_bytes=CHUNK_BYTES, init_island="a", sync_every=32)
    comm = Comm(None)
    return RankOps(ad, comm, IslandLayout(comm.all_gather(describe(ad.pieces()))), session, AnchorStore(), 0.5), session


def stage(ops, fid: int, version: int, seed: int) -> None:
    """A version of fragment `fid` staged chunk by chunk, as the sync worker stages a fetched one (untimed).
    One random chunk per version, repeated: its values do not matter to the timing, drawing 2 GiB of them
    per version on the host would."""
    spans = ops.spans(fid, "f32")
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(max(s.elem_count for s in spans), generator=g) * 0.01
    for k, s in enumerate(spans):
        payload = base[: s.elem_count].numpy().tobytes()
        ops.stage(StageOp(fid=fid, version=version, dtype="f32", chunks=(k,), begin=k == 0), {k: payload})


def read_pass(ops, fids) -> None:
    """Every fragment's tensors read through the adapter and staged to the host (`PieceReads`, the export's
    device part), without the host math that follows: where an export's time goes."""
    from yeto.learner.piece_io import PieceReads

    for fid in fids:
        fm = ops.maps[fid]
        reads = PieceReads(ops.adapter, fm, ops.rank)
        reads.advance(0, fm.numel)
        reads.close()


def export_apply(args, device: torch.device, out=print) -> dict:
    module, master = build(args.size_mib, device)
    ops, session = island_ops(module, master, args.fragments)
    fids = [f["id"] for f in session["fragments"]]
    numel = sum(m.numel() for m in master.values())
    out(f"model: {numel * 2 / MiB:.0f} MiB bf16 in {LAYERS} tensors + its fp32 master ({numel * 4 / MiB:.0f} MiB) on "
        f"{device} ({device_name(device)}), {args.fragments} fragments, chunks {CHUNK_BYTES // MiB} MiB, torch "
        f"{torch.__version__}, repeat {args.repeat}")
    for fid in fids:  # v0 overwrites: the anchors a push is taken against
        stage(ops, fid, 0, seed=fid)
        ops.commit(CommitOp(fid=fid, version=0, digest="", mode="first"))
    sync(device)
    # the limit: the same f32 bytes device -> pinned host and back, tensor by tensor
    pin = device.type == "cuda"
    host = {n: torch.empty(m.shape, dtype=torch.float32, pin_memory=pin) for n, m in master.items()}
    t_exp, t_app, t_d2h, t_h2d, t_read = [], [], [], [], []
    for r in range(args.repeat + 1):  # the first round warms the allocators and page faults, untimed
        with torch.no_grad():
            for m in master.values():  # the training step moved the values: pushes carry a real delta
                m.add_(1e-3)
        sync(device)
        t0 = time.perf_counter()
        for fid in fids:
            snap = ops.snapshot(SnapshotOp(fid=fid, dtype="f32", purpose="push"))
        t1 = time.perf_counter()
        assert snap and snap[0][1].device.type == "cpu" and bool(torch.isfinite(snap[0][1]).all())
        del snap
        for fid in fids:
            stage(ops, fid, 1 + r, seed=100 * r + fid)
        t2 = time.perf_counter()
        for fid in fids:
            ops.commit(CommitOp(fid=fid, version=1 + r, digest="", mode="blend"))
        sync(device)
        t3 = time.perf_counter()
        for n, m in master.items():
            host[n].copy_(m, non_blocking=pin)
        sync(device)
        t4 = time.perf_counter()
        for n, m in master.items():
            m.copy_(host[n], non_blocking=pin)
        sync(device)
        t5 = time.perf_counter()
        read_pass(ops, fids)
        t6 = time.perf_counter()
        if r:
            t_exp.append(t1 - t0)
            t_app.append(t3 - t2)
            t_d2h.append(t4 - t3)
            t_h2d.append(t5 - t4)
            t_read.append(t6 - t5)
    for n, p in module.named_parameters():  # the apply kept every bf16 parameter its master rounded
        if not torch.equal(p.detach(), master[n].to(torch.bfloat16)):
            raise RuntimeError(f"{n}: the bf16 parameter is not its master rounded after the applies")
    nbytes = numel * 4
    med = statistics.median
    e, a, d2h, h2d, rd = med(t_exp), med(t_app), med(t_d2h), med(t_h2d), med(t_read)
    runs = lambda ts: "/".join(f"{t:.3f}" for t in ts)  # noqa: E731
    out(f"export (push snapshot of every fragment): median {e:.3f} s, {nbytes / e / GB:.2f} GB/s of f32 "
        f"(runs {runs(t_exp)}); of which the reads and their host staging alone {rd:.3f} s")
    out(f"apply (commit, blend, of every fragment): median {a:.3f} s, {nbytes / a / GB:.2f} GB/s of f32 "
        f"(runs {runs(t_app)})")
    kind = "pinned host memory" if pin else "memcpy"
    out(f"copy via {kind}: device->host {nbytes / d2h / GB:.2f} GB/s ({d2h:.6f} s), host->device "
        f"{nbytes / h2d / GB:.2f} GB/s ({h2d:.6f} s)")
    return {"ratio": (d2h + h2d) / (e + a), "export_s": e, "apply_s": a, "reads_s": rd,
            "d2h_gbps": nbytes / d2h / GB, "h2d_gbps": nbytes / h2d / GB}


# ------------------------------------------------------------------------------ part 2: a real training step

def worker(args) -> int:
    """One island training on the device with the boundary after every step; writes its timings to --out."""
    from torch import nn

    from yeto.learner.adapters.torch_module import TorchModuleAdapter
    from yeto.learner.config import IslandConfig
    from yeto.learner.island import Island

    device = torch.device(args.device)
    torch.manual_seed(0)
    d = max(16, int((args.train_mib * MiB / 4 / LAYERS) ** 0.5))
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(LAYERS)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    x = torch.randn(args.batch, d, device=device)
    island = Island(TorchModuleAdapter(model), IslandConfig.from_env(run=args.run, island="a")).start()
    times, boundary_s = [], []
    while True:  # until the final cut: the syncer paces the rounds, the island never waits for them
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = float(loss)  # a training loop logs its loss: the step's kernels have run
        t0 = time.monotonic()
        keep = island.boundary(tokens=args.batch, loss=lv)
        boundary_s.append(time.monotonic() - t0)
        times.append(time.monotonic())
        if not keep:
            break
    island.close()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    Path(args.out).write_text(json.dumps({"times": times, "boundary_s": boundary_s, "device_peak": peak}))
    return 0


def _goodput():
    spec = importlib.util.spec_from_file_location("bench_goodput", Path(__file__).resolve().parent / "goodput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_share(args, out=print) -> dict:
    """Broker, syncer and the training island (part 2); boundary_share as bench/goodput.py computes it."""
    from yeto.services.broker import Broker

    import contextlib

    work = Path(tempfile.mkdtemp(prefix="yeto-island-device-"))
    run = f"bench_device_{uuid.uuid4().hex[:8]}"
    rounds = max(1, args.train_steps * args.fragments // args.sync_every)
    procs: dict[str, Child] = {}
    own = Broker(store_dir=work / "broker") if args.nats is None else contextlib.nullcontext()
    with own as broker, RssWatch(every_s=0.5) as watch:
        url = args.nats or broker.url
        env = clean_env(YETO_PROGRESS="0", YETO_NATS=url)
        try:
            procs["syncer"] = Child("syncer", [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url,
                                               "--run", run, "--islands", "1", "--fragments", str(args.fragments),
                                               "--sync-every", str(args.sync_every), "--total-steps", str(rounds),
                                               "--init-island", "a", "--checkpoint-dir", str(work / "ckpt")],
                                    work / "syncer.log", env=env).start()
            procs["island"] = Child("island", [sys.executable, str(Path(__file__).resolve()), "worker", "--run", run,
                                               "--device", args.device, "--train-mib", str(args.train_mib),
                                               "--train-steps", str(args.train_steps), "--batch", str(args.batch),
                                               "--out", str(work / "island.json")],
                                    work / "island.log", env=env).start()
            watch.add_children(procs.values())
            wait_all(procs, args.timeout, watch=watch, lines=40)
        except ChildFailed as err:
            raise SystemExit(f"island device bench: {err} (logs in {work})")
        finally:
            stop_all(procs, grace=0)
    r = json.loads((work / "island.json").read_text())
    gp = _goodput()
    warmup, tail = len(r["times"]) // 4, args.sync_every // args.fragments
    share = gp.boundary_share(r["times"], r["boundary_s"], warmup, tail)
    steps_s = gp.rate(r["times"], warmup, tail)
    out(f"training step on {args.device}: {args.train_mib:g} MiB MLP, batch {args.batch}, {len(r['times'])} steps, "
        f"{steps_s:.2f} steps/s, {rounds} rounds (P={args.fragments}, H={args.sync_every}); boundary() median "
        f"{statistics.median(r['boundary_s']):.4f} s, max {max(r['boundary_s']):.4f} s; island peak RSS "
        f"{watch.peak.get('island', 0) / MiB:.0f} MiB, device peak {r['device_peak'] / MiB:.0f} MiB")
    return {"boundary_share": share, "steps_per_s": steps_s}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default where one answers) or cpu")
    ap.add_argument("--size-mib", type=float, default=None, help="bf16 model size (default 1024 on cuda, 64 on cpu)")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train-mib", type=float, default=None, help="part 2's MLP (default 256 on cuda, 8 on cpu)")
    ap.add_argument("--train-steps", type=int, default=None, help="part 2's steps (default 96 on cuda, 48 on cpu)")
    ap.add_argument("--sync-every", type=int, default=None, help="H of part 2 (default 32 on cuda, 8 on cpu)")
    ap.add_argument("--batch", type=int, default=None, help="part 2's batch rows (default 8192 on cuda, 64 on cpu)")
    ap.add_argument("--no-train", action="store_true", help="leave part 2 out")
    ap.add_argument("--nats", default=None, help="part 2's broker (default: the embedded one, started here)")
    ap.add_argument("--timeout", type=float, default=600.0)
    if argv and argv[0] == "worker":
        ap.add_argument("cmd")
        ap.add_argument("--run", required=True)
        ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    for name, on_gpu, on_cpu in (("size_mib", 1024.0, 64.0), ("train_mib", 256.0, 8.0), ("train_steps", 96, 48),
                                 ("sync_every", 32, 8), ("batch", 8192, 64)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    if getattr(args, "cmd", None) == "worker":
        return worker(args)
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    if args.fragments > LAYERS or args.fragments < 1:
        ap.error(f"--fragments must be 1..{LAYERS} (a fragment holds whole tensors)")
    device = torch.device(args.device)
    torch.set_num_threads(min(16, torch.get_num_threads()))
    res = export_apply(args, device)
    if gpu:
        torch.cuda.empty_cache()
    share = {"boundary_share": float("nan")} if args.no_train else train_share(args)
    dev_peak = torch.cuda.max_memory_allocated(device) / MiB if gpu else 0.0
    print(f"peak RSS {peak_rss_self() / MiB:.0f} MiB (this process); device peak {dev_peak:.0f} MiB")
    print(f"device export_apply_ratio={res['ratio']:.4f} export_s={res['export_s']:.6f} apply_s={res['apply_s']:.6f} "
          f"reads_s={res['reads_s']:.4f} d2h_gbps={res['d2h_gbps']:.2f} h2d_gbps={res['h2d_gbps']:.2f} boundary_share={share['boundary_share']:.4f} "
          f"size_mib={args.size_mib:g} device={args.device} name={device_name(device)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
