#!/usr/bin/env python
"""Island memory benchmark: rank 0's RSS growth during INIT and the initial cut, against model size.

    python bench/island_memory.py [--sizes 256,512,1024] [--ranks 2] [--fragments 4] [--anchors files|memory]

For each size (MiB of float32 parameters) a fresh run: the real `yeto syncer` (one island, f32 bulk,
1 MiB chunks), and an island of `--ranks` gloo processes holding the model split TP-wise (rows of
8 MiB tensors, the plain-torch sharded adapter), built from cheap deterministic values. The island
is the INIT island: `Island.start()` gathers every fragment chunk by chunk to rank 0 and streams it
on INIT (a background thread publishes while the next chunks are gathered), the syncer commits
version 0 and broadcasts it, and the island installs it (rank 0 fetches chunks in bounded batches
and sends each rank its slices). All against the embedded nats-server (max_payload 8 MiB).

Measured on rank 0 with the kernel's accounting: RSS just after the model is built (VmRSS), then
VmHWM is reset (`/proc/self/clear_refs` ← 5) and read again after `start()` returns; growth = peak −
baseline. A sampler thread (VmRSS every 5 ms) backs the reading up where clear_refs is refused.
After the phase each rank checks that its pieces hold exactly what it started with (v0 is the INIT
island's own f32 weights, so the whole round trip must be bit-exact).

`--anchors files` (default; `YETO_ANCHOR_DIR` in a run) keeps each rank's anchors — the raw value of the version it holds, an
f32 copy of the rank's *own* share, which DiLoCo needs — in files (page cache, not process memory),
so the growth is the transient wire state only; `--anchors memory` keeps them in RAM, where they add
rank 0's share of the model (1/ranks of it) to the growth by design.

Output: one line per size, then last: `island rank0_rss_slope=<x>` = (growth at the largest size −
growth at the smallest) / (largest − smallest), in MiB per MiB of model (goal: ≤ 0.1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path


# processes and /proc readings as every bench runs and reads them
from yeto.services.run_harness import Child, vm_hwm, vm_rss  # noqa: E402

MiB = 1 << 20
TENSOR_BYTES = 8 * MiB
ISLAND = "bench"


# --------------------------------------------------------------------------- pure logic (no I/O)


def model_shapes(size_mib: float) -> dict[str, tuple[int, int]]:
    """Tensors `layers.i.w` of 8 MiB (fewer bytes for small sizes: at least 4 tensors), 256 columns,
    adding up to `size_mib` MiB of float32 (rounded down to whole rows of 2)."""
    total = int(size_mib * MiB) // 4
    per = max(512, min(TENSOR_BYTES // 4, total // 4))
    per -= per % 512
    shapes, i, left = {}, 0, total
    while left >= 512:
        n = min(per, left - left % 512)
        shapes[f"layers.{i}.w"] = (n // 256, 256)
        left -= n
        i += 1
    return shapes


def slope(sizes: list[float], growth: list[float]) -> float:
    """MiB of growth per MiB of model between the smallest and the largest size."""
    pairs = sorted(zip(sizes, growth))
    (s0, g0), (s1, g1) = pairs[0], pairs[-1]
    return (g1 - g0) / (s1 - s0) if s1 != s0 else float("nan")


def parse_sizes(text: str) -> list[float]:
    sizes = [float(x) for x in text.split(",") if x.strip()]
    if len(sizes) < 2 or any(s <= 0 for s in sizes) or len(set(sizes)) < 2:
        raise argparse.ArgumentTypeError("--sizes needs at least two different positive sizes in MiB")
    return sizes


# --------------------------------------------------------------------------- kernel accounting


def rss() -> int:
    return vm_rss("self")


def hwm() -> int:
    return vm_hwm("self")


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler:
    """VmRSS every few ms on a thread: the peak where VmHWM cannot be reset."""

    def __init__(self, every_s: float = 0.005):
        self.every_s, self.peak, self._stop = every_s, rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.every_s)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


# --------------------------------------------------------------------------- the island ranks


def _values(name: str, shape):
    import torch

    n = shape[0] * shape[1]
    seed = zlib.crc32(name.encode()) % 997
    return (torch.arange(n, dtype=torch.float32).remainder_(1009).mul_(1e-3).add_(seed)).view(shape)


def _crc(ad) -> dict[str, int]:
    return {n: zlib.crc32(memoryview(t.numpy()).cast("B")) for n, t in ad.tensors().items()}


def _rank(rank: int, world: int, cfg: dict) -> None:
    import gc
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    from yeto.learner.adapters.sliced_torch import SlicedTorchAdapter
    from yeto.learner.config import IslandConfig
    from yeto.learner.island import Island
    from yeto.schemas.conn import ConnectOptions

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO if cfg["verbose"] else logging.ERROR,
                        format="%(asctime)s rank%(process)d %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['pg']}", rank=rank, world_size=world)
    try:
        ad = SlicedTorchAdapter.build(model_shapes(cfg["size"]), tp=world, tp_rank=rank, values=_values)
        before = _crc(ad)
        icfg = IslandConfig(run=cfg["run"], island=ISLAND, nats=ConnectOptions(url=cfg["url"]), progress=False,
                            session_timeout_s=120, init_v0_timeout_s=600, push_timeout_s=600, fetch_timeout_s=120,
                            connect_timeout_s=60, heartbeat_s=2.0,
                            anchor_dir=cfg["anchor_dir"] if cfg["anchors"] == "files" else None)  # YETO_ANCHOR_DIR
        island = Island(ad, icfg, group=dist.group.WORLD)
        gc.collect()
        dist.barrier()
        base = rss()
        reset = reset_hwm()
        t0 = time.monotonic()
        with Sampler() as sampler:
            island.start()
        seconds = time.monotonic() - t0
        peak = max(hwm(), sampler.peak) if reset else sampler.peak
        exact = _crc(ad) == before
        result = {"rank": rank, "size": cfg["size"], "base": base, "peak": peak, "growth": peak - base,
                  "reset_hwm": reset, "seconds": seconds, "exact": exact, "store_bytes": island.store.nbytes(),
                  "versions": island.state.versions() if island.state else {},
                  "counters": {k: v for k, v in island.counters.items() if k in ("init_bytes", "bytes_in",
                                                                               "scatter_bytes", "gather_bytes")}}
        with open(f"{cfg['out']}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        island.close()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the driver


def _remove_run(url: str, run: str) -> None:
    import nats

    from yeto.schemas.provision import remove_run

    async def go():
        nc = await nats.connect(url)
        try:
            await remove_run(nc.jetstream(), run)
        finally:
            await nc.close()

    asyncio.run(go())


def one_size(size: float, args, url: str, work: Path) -> dict:
    import torch.multiprocessing as mp

    run = f"bench_isl_{uuid.uuid4().hex[:8]}"
    d = work / run
    d.mkdir(parents=True)
    syncer = Child("syncer", [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run,
                              "--islands", "1", "--fragments", str(args.fragments), "--sync-every",
                              str(args.fragments), "--total-steps", "1", "--init-island", ISLAND,
                              "--bulk-dtype", "f32", "--push-dtype", "f32", "--chunk-bytes", str(args.chunk_kb * 1024),
                              "--checkpoint-dir", str(d / "ckpt"), "--small-limits", "--status-every", "5"],
                   d / "syncer.log").start()
    try:
        cfg = {"size": size, "run": run, "url": url, "pg": str(d / "pg"), "out": str(d), "anchors": args.anchors,
               "anchor_dir": str(d / "anchors"), "verbose": args.verbose}
        mp.start_processes(_rank, args=(args.ranks, cfg), nprocs=args.ranks, join=True, start_method="spawn")
        results = [json.loads((d / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    except BaseException:
        sys.stderr.write(syncer.tail(40) + "\n")
        raise
    finally:
        syncer.stop(grace=20)
        try:
            _remove_run(url, run)
        except Exception as exc:  # noqa: BLE001 - cleanup only
            print(f"(could not remove run {run}: {exc!r})", file=sys.stderr)
        shutil.rmtree(d, ignore_errors=True)
    r0 = results[0]
    if not all(r["exact"] for r in results):
        raise SystemExit(f"size {size} MiB: a rank's pieces changed through INIT and v0 (must be bit-exact)")
    if len(r0["versions"]) != args.fragments:
        raise SystemExit(f"size {size} MiB: the initial cut was not installed: {r0['versions']}")
    return r0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("256,512,1024"),
                   help="model sizes in MiB of float32, comma-separated (default 256,512,1024)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks in the island (TP split)")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--chunk-kb", type=int, default=1024)
    p.add_argument("--anchors", choices=("files", "memory"), default="files",
                   help="where ranks keep their anchors (see the module doc)")
    p.add_argument("--nats", default=None, help="use this server instead of the embedded one")
    p.add_argument("--verbose", action="store_true", help="the island's INFO log on stderr")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="yeto-island-mem-"))
    broker = None
    url = args.nats
    try:
        if url is None:
            from yeto.services.broker import Broker

            broker = Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log").start()
            url = broker.url
        print(f"island memory: {args.ranks} gloo ranks (TP), {args.fragments} fragments, chunks of {args.chunk_kb} KiB, "
              f"f32 bulk, anchors in {args.anchors}; rank 0's RSS during INIT + initial cut", flush=True)
        growth, transient = [], []
        for size in args.sizes:
            r = one_size(size, args, url, work)
            g = r["growth"] / MiB
            growth.append(g)
            transient.append(g - r["store_bytes"] / MiB)
            c = r["counters"]
            print(f"size {size:g} MiB: rank0 growth {g:.1f} MiB (baseline {r['base'] / MiB:.0f} MiB, peak "
                  f"{r['peak'] / MiB:.0f} MiB{'' if r['reset_hwm'] else ', sampled'}; anchors in memory "
                  f"{r['store_bytes'] / MiB:.0f} MiB, the rest {transient[-1]:.1f} MiB); INIT "
                  f"{c.get('init_bytes', 0) / MiB:.0f} MiB out, cut {c.get('bytes_in', 0) / MiB:.0f} MiB in, "
                  f"gathered {c.get('gather_bytes', 0) / MiB:.0f} MiB, scattered "
                  f"{c.get('scatter_bytes', 0) / MiB:.0f} MiB; {r['seconds']:.1f}s", flush=True)
        if args.anchors == "memory":
            print(f"(without the anchors: slope {slope(args.sizes, transient):.4f})", flush=True)
        print(f"island rank0_rss_slope={slope(args.sizes, growth):.4f}", flush=True)
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
