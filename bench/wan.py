#!/usr/bin/env python
"""WAN benchmark: broadcast bytes over a datacenter's leaf link per byte of cut committed.

    python bench/wan.py [--islands 1,2,4] [--model-mib 4] [--rounds 8] [--naive]

For each island count N: a hub nats-server (JetStream domain `hub`, leafnode listener) with the real
`yeto syncer`, and one island datacenter, a leaf node (domain `dc1`) dialling the hub, with N real
`python -m yeto.learner.demo` islands connected to it (YETO_DOMAIN=dc1: they keep the run's mirror of
BCAST / FINAL in dc1 and read the cut from it). After the run:

    bytes_per_committed_byte = hub -> datacenter bytes on the leaf link (the hub's /leafz out_bytes:
                               the mirror's copy of the cut plus every control message, ack and KV read)
                               / payload bytes of every broadcast and final chunk the syncer published

A design that served each island the cut from the hub would send it once per island (>= N); the
mirror sends it once. `--naive` runs the same with the islands reading the hub's streams across the
link (YETO_DOMAIN=hub), for comparison. The last line is `wan bytes_per_committed_byte=<x>` for the
largest N (4 by default; goal <= 1.1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path


from yeto.services.leaf import start_hub_and_leaf, wan_figures  # noqa: E402
from yeto.services.run_harness import Child, ChildFailed, clean_env, stop_all, wait_all  # noqa: E402


def one_run(n: int, args, work: Path, naive: bool) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    hub, leaf = start_hub_and_leaf(work, "dc1")
    run = f"wan{n}{'n' if naive else ''}-{int(time.time())}"
    env = clean_env(YETO_RUN=run, YETO_PROGRESS="0")
    procs: dict[str, Child] = {}
    t0 = time.monotonic()
    try:
        names = [f"i{k}" for k in range(n)]
        procs["syncer"] = Child(
            "syncer", [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", hub.url, "--run", run, "--islands", str(n),
             "--fragments", "2", "--sync-every", "8", "--total-steps", str(args.rounds), "--init-island", names[0],
             "--checkpoint-dir", str(work / "syncer"), "--small-limits", "--quorum-timeout", "60",
             "--member-timeout", "60", "--final-timeout", "60"],
            work / "syncer.log", env=env).start()
        for name in names:
            e = dict(env, YETO_NATS=leaf.url, YETO_ISLAND=name, YETO_DOMAIN="hub" if naive else "dc1")
            procs[name] = Child(
                f"island {name}", [sys.executable, "-P", "-m", "yeto.learner.demo", "--run", run, "--island", name,
                                   "--model-mib", str(args.model_mib), "--step-delay", "0.02"],
                work / f"island-{name}.log", env=e).start()
        try:
            wait_all(procs, args.timeout, lines=40)
        except ChildFailed as err:
            raise SystemExit(f"wan: {err}")
        figures = asyncio.run(wan_figures(hub, run))
    finally:
        stop_all(procs, grace=0)
        leaf.stop()
        hub.stop()
    bpc = figures["hub_to_dc_bytes"] / figures["bcast_bytes"]
    return {"islands": n, "naive": naive, **figures, "bytes_per_committed_byte": round(bpc, 4),
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands", default="1,2,4", help="island counts behind the leaf node (default %(default)s)")
    p.add_argument("--model-mib", type=float, default=4.0, help="model size in MiB of f32 (default %(default)s)")
    p.add_argument("--rounds", type=int, default=8, help="rounds per run (default %(default)s)")
    p.add_argument("--naive", action="store_true", help="also run with the islands reading the hub's streams")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default %(default)s)")
    p.add_argument("--workdir", default=None, help="keep the runs' logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.islands.split(",") if x.strip()]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="yeto-wan-"))
    rows = []
    for naive in ((False, True) if args.naive else (False,)):
        for n in counts:
            r = one_run(n, args, work / f"{'naive' if naive else 'mirror'}-{n}", naive)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"{'islands':>7} {'reads':>7} {'bcast MiB':>10} {'hub->dc MiB':>12} {'per committed byte':>19}")
    for r in rows:
        print(f"{r['islands']:>7} {'hub' if r['naive'] else 'mirror':>7} {r['bcast_bytes'] / 2**20:>10.2f} "
              f"{r['hub_to_dc_bytes'] / 2**20:>12.2f} {r['bytes_per_committed_byte']:>19.4f}")
    last = [r for r in rows if not r["naive"]][-1]
    print(f"wan bytes_per_committed_byte={last['bytes_per_committed_byte']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
