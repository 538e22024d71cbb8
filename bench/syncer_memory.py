#!/usr/bin/env python
"""Syncer memory benchmark: one syncer vs N syncer shards on the same run shape (docs/design.md §10).

    python bench/syncer_memory.py [--size-mib 1024] [--rounds 8] [--shards 4] [--chunk-mib 1] [--keep]
                                  [--syncer-env K=V ...]

One invocation runs the same workload twice against one embedded nats-server (or `--nats`), one after
the other (never both at once, so neither shares the CPU or the page cache with the other):

  1 shard    the real `yeto syncer` (no shard flags), one checkpoint directory
  N shards   N real `yeto syncer --shard K --shards N` processes, one checkpoint directory each

The workload: a model of `--size-mib` MiB of f32 parameters (16 equal tensors, P = 4 fragments of
size/4 each), `--strict`, H = P (every island step answers one round), f32 push and bulk, and two
scripted islands in this process (services/scripted_island.py: they speak only the wire protocol,
no torch model, so a 1 GiB run fits beside the syncers on a small machine): island i0 sends INIT, both
answer every round's pull with a delta (the same seeded values for both), and both ack the manifest.
The syncers do everything a real run asks of them: INIT, version 0, every merge with the outer step,
durable commits, broadcasts, the f32 final cut and the manifest.

Memory: each syncer process's RSS growth = peak RSS (VmHWM, read every 0.1 s while it runs, and the
`rss_bytes` of its last status record in the state KV where the syncer writes one, whichever is
larger) minus its baseline: VmRSS once the session is pinned and every shard holds it, before the
first INIT byte (imports, connections and the session, but no fragment yet). Peak RSS of every
process is printed (the bench process holds the scripted islands).

Merge time per round, per configuration, from the `merge` records of the run's EVENTS tape (each
round's detail, measured inside the syncer that merged it): the median merge loop (`merge_s`: fetch
pushes, outer step, pack + hash of the new version) and the median commit path (merge loop +
checkpoint files + state KV commit record + broadcast), the push chunks the merges took from memory
(kept at intake, `--push-memory-mib`) and read back from PUSH, and the wall time of the rounds (first pull to
the manifest at both islands) per round: with shards the rounds of different fragments merge in
different processes, and overlap.

The syncers get no YETO_* variable from the bench's environment; `--syncer-env K=V` (repeatable) gives
them one, e.g. `--syncer-env YETO_PUSH_MEMORY_MIB=1024` or `--syncer-env YETO_MEM_TRACE=1` (its lines,
RSS at each phase, land in the syncer logs: add `--keep`).

Last line: `syncer shard_rss_ratio=<x>`: the largest shard's growth over the single syncer's (ideal
1/N = 0.25 for 4 shards; the goal is <= 0.35).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path


# processes and peak RSS as every bench runs and reads them; phase_peaks is this bench's too (its tests use it)
from yeto.services.run_harness import Child, RssWatch, clean_env, phase_peaks, vm_rss  # noqa: E402, F401

MiB = 1 << 20
P = 4
TENSORS = 16      # 4 per fragment: schemas.layout assigns equal tensors round-robin, so fragments are equal
COLS = 1024
ISLANDS = ("i0", "i1")


# --------------------------------------------------------------------------- pure logic (no I/O)


def layout_for(size_mib: float) -> list[dict]:
    """16 equal f32 tensors of about `size_mib` MiB in all (at least one row each)."""
    rows = max(1, round(size_mib * MiB / 4 / TENSORS / COLS))
    return [{"name": f"layers.{i}.w", "shape": [rows, COLS], "dtype": "float32"} for i in range(TENSORS)]


def env_pair(text: str) -> tuple[str, str]:
    """`--syncer-env K=V` -> (K, V)."""
    key, sep, value = text.partition("=")
    if not sep or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key, value


def growth(peak: int, baseline: int) -> int:
    return max(0, peak - baseline)


def shard_ratio(shard_growths: dict[str, int], single_growth: int) -> float:
    """The largest shard's growth over the single syncer's; ValueError when the single syncer did not
    grow (nothing was measured: the ratio would mean nothing)."""
    if single_growth <= 0:
        raise ValueError(f"the single syncer's RSS growth is {single_growth} bytes: nothing to compare with")
    if not shard_growths:
        raise ValueError("no shard growth measured")
    return max(shard_growths.values()) / single_growth


def merge_figures(merges: list[dict]) -> dict:
    """Medians over the rounds' merge records: the merge loop and the commit path (seconds)."""
    if not merges:
        raise ValueError("no merge record on the tape")
    loop = [float(m["detail"]["merge_s"]) for m in merges]
    path = [float(m["detail"]["merge_s"]) + sum(float(m["detail"].get(k, 0.0)) for k in
                                                 ("checkpoint_s", "commit_kv_s", "broadcast_s")) for m in merges]
    return {"merge_loop": statistics.median(loop), "commit_path": statistics.median(path), "rounds": len(merges),
            # push chunks the merges took from memory (kept at intake) and read back from PUSH
            "held": sum(int(m["detail"].get("push_chunks_held", 0)) for m in merges),
            "read": sum(int(m["detail"].get("push_chunks_read", 0)) for m in merges)}


# --------------------------------------------------------------------------- one configuration


async def _status_records(js, run: str, n: int) -> dict[int, dict]:
    import orjson
    from nats.js.errors import KeyNotFoundError

    from yeto.schemas import shards as SH
    from yeto.schemas import subjects as S

    kv = await js.key_value(S.kv_bucket(run, "state"))
    out = {}
    for k in range(n):
        try:
            e = await kv.get(SH.state_key("syncer", k, n))
        except KeyNotFoundError:
            continue
        if e is not None and e.value:
            out[k] = orjson.loads(e.value)
    return out


async def run_config(args, url: str, n: int, work: Path, watch: RssWatch) -> dict:
    """One run with `n` syncer processes; returns their names, baselines, peaks, merge figures."""
    import nats
    import torch

    from yeto.schemas.provision import remove_run
    from yeto.services.run_harness import tape_of, wait_provisioned
    from yeto.services.scripted_island import ScriptedIsland

    run = f"bench_shmem{n}_{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    env = clean_env()
    env.update(dict(args.syncer_env))   # --syncer-env: the one way to give the syncers YETO_* variables
    names = ["syncer"] if n == 1 else [f"shard {k}" for k in range(n)]
    procs: dict[str, Child] = {}
    isls: list[ScriptedIsland] = []
    layout = layout_for(args.size_mib)
    try:
        for k, name in enumerate(names):
            flags = [] if n == 1 else ["--shard", str(k), "--shards", str(n)]
            procs[name] = Child(
                name, [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run, "--islands", "2",
                 "--fragments", str(P), "--sync-every", str(P), "--total-steps", str(args.rounds), "--strict",
                 "--init-island", ISLANDS[0], "--push-dtype", "f32", "--bulk-dtype", "f32",
                 "--chunk-bytes", str(int(args.chunk_mib * MiB)), "--checkpoint-dir", str(work / f"syncer-s{k}"),
                 "--quorum-timeout", "900", "--member-timeout", "900", "--final-timeout", "300",
                 "--status-every", "1", *flags],
                work / f"syncer-s{k}.log", env=env).start()
            watch.add(f"{name} ({n} shard{'s' if n > 1 else ''})", procs[name].pid)

        def check_alive():
            for name, p in procs.items():
                if p.poll() is not None:
                    raise SystemExit(f"syncer memory bench: {p.failure(f'exited with {p.returncode}', 40)}")

        for name in ISLANDS:
            isls.append(ScriptedIsland(await nats.connect(url, max_reconnect_attempts=-1), run, name, layout))
        await wait_provisioned(isls[0].js, run, timeout=120)
        for isl in isls:
            await isl.connect_consumer()
        for isl in isls:
            await isl.hello()
            await asyncio.sleep(0.05)  # the first hello pins the session and names the INIT island
        for isl in isls:
            await isl.wait_session(timeout=120)
        # Followers read the session from the state KV every 0.5 s: give every shard time to hold it,
        # then the baseline (no fragment bytes anywhere yet: INIT has not started).
        await asyncio.sleep(2.0)
        check_alive()
        baseline = {name: vm_rss(p.pid) or 0 for name, p in procs.items()}

        marks = [("INIT + v0", time.time())]
        t0 = time.monotonic()
        gen = torch.Generator().manual_seed(0)
        frags = {f["id"]: f["numel"] for f in isls[0].session["fragments"]}
        for fid, numel in sorted(frags.items()):  # one fragment's values at a time in this process
            values = torch.randn(numel, generator=gen) * 0.02
            await isls[0].send_init({fid: values})
            del values
        t_init = time.monotonic() - t0
        delta = torch.randn(max(frags.values()), generator=gen) * 1e-3
        t_rounds = time.monotonic()
        for t in range(1, args.rounds + 1):
            pulls = await asyncio.gather(*(isl.expect_pull(t, timeout=args.timeout) for isl in isls))
            if t == 1:  # a pull goes out only once version 0 is committed
                marks.append(("rounds", time.time()))
            await asyncio.gather(*(isl.push(pull, delta[: frags[pull["fragment"]]], c_tokens=100, local_step=t)
                                   for isl, pull in zip(isls, pulls)))
        # the last round's commit and the final cut: what is left is taped by the syncers as `final`
        marks.append(("last round + final cut", time.time()))
        mans = await asyncio.gather(*(isl.expect(lambda k, m: k == "manifest", timeout=args.timeout) for isl in isls))
        t_rounds = time.monotonic() - t_rounds
        for isl, (_, man) in zip(isls, mans):
            await isl.ack(man["final_step"])
        deadline = time.monotonic() + args.timeout
        for name, p in procs.items():
            rc = await asyncio.to_thread(p.wait, max(1.0, deadline - time.monotonic()))
            if rc != 0:
                check_alive()
        watch.poll()
        merges = await tape_of(isls[0].js, run, "merge")
        status = await _status_records(isls[0].js, run, n)
        await remove_run(isls[0].js, run)
    except BaseException:
        # whatever went wrong (a pull that never came, a syncer that did not exit): what each syncer
        # logged last says why
        for k, name in enumerate(names):
            path = work / f"syncer-s{k}.log"
            if path.exists():
                tail = "\n".join(path.read_text(errors="replace").splitlines()[-15:])
                print(f"--- {name} ({n} shards), log tail ---\n{tail}", file=sys.stderr, flush=True)
        raise
    finally:
        for p in procs.values():
            p.kill()
            p.close_log()
        for isl in isls:
            await isl.nc.close()
    peaks, by_phase = {}, {}
    for k, name in enumerate(names):
        by_phase[name] = {ph: growth(v, baseline[name]) for ph, v in
                          watch.phase_peaks(f"{name} ({n} shard{'s' if n > 1 else ''})", marks).items()}
        peaks[name] = max(watch.peak.get(f"{name} ({n} shard{'s' if n > 1 else ''})", 0),
                          int(status.get(k, {}).get("rss_bytes") or 0))
    return {"n": n, "names": names, "baseline": baseline, "peak": peaks,
            "growth": {name: growth(peaks[name], baseline[name]) for name in names}, "by_phase": by_phase,
            "merge": merge_figures(merges), "init_s": t_init, "rounds_s": t_rounds,
            "fragment_mib": max(frags.values()) * 4 / MiB}


def fmt_config(r: dict, rounds: int) -> str:
    label = "1 shard" if r["n"] == 1 else f"{r['n']} shards"
    mem = ", ".join(f"{name} peak {r['peak'][name] / MiB:.0f} MiB (baseline {r['baseline'][name] / MiB:.0f}, "
                    f"growth {r['growth'][name] / MiB:.0f})" for name in r["names"])
    m = r["merge"]
    phases = "; ".join(f"{name} " + ", ".join(f"{ph} {v / MiB:.0f}" for ph, v in r["by_phase"][name].items())
                       for name in r["names"])
    return (f"[{label}] {mem}\n"
            f"[{label}] RSS growth by phase (MiB, VmRSS sampled every 0.1 s): {phases}\n"
            f"[{label}] merge per round: median merge loop {m['merge_loop']:.3f} s, median commit path "
            f"{m['commit_path']:.3f} s ({m['rounds']} merge records; push chunks {m['held']} kept in memory, "
            f"{m['read']} read back); rounds wall {r['rounds_s']:.1f} s = "
            f"{r['rounds_s'] / rounds:.2f} s per round; INIT {r['init_s']:.1f} s")


async def _main(args, url: str, work: Path, watch: RssWatch) -> list[dict]:
    out = []
    for n in (1, args.shards):
        r = await run_config(args, url, n, work / f"shards{n}", watch)
        print(fmt_config(r, args.rounds), flush=True)
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=1024, help="model size in MiB of f32 parameters (default 1024)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of the run (default 8: two per fragment)")
    p.add_argument("--shards", type=int, default=4, help="shards of the sharded configuration (2..4; default 4)")
    p.add_argument("--chunk-mib", type=float, default=1, help="the syncers' --chunk-bytes in MiB (default 1)")
    p.add_argument("--nats", default=None, help="use this server instead of the embedded one")
    p.add_argument("--timeout", type=float, default=900, help="seconds one configuration's run may take")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    p.add_argument("--syncer-env", action="append", type=env_pair, default=[], metavar="K=V",
                   help="an environment variable for every syncer this bench starts (repeatable; the bench "
                        "strips YETO_* from its own environment for them, so this is how to set e.g. "
                        "YETO_PUSH_MEMORY_MIB=1024 or YETO_MEM_TRACE=1, whose lines land in the syncer logs: --keep)")
    args = p.parse_args(argv)
    if args.size_mib <= 0 or args.rounds < 1 or not 2 <= args.shards <= P or args.chunk_mib <= 0:
        p.error(f"--size-mib and --chunk-mib must be > 0, --rounds >= 1, --shards in 2..{P}")

    work = Path(tempfile.mkdtemp(prefix="yeto-syncer-memory-"))
    broker = None
    url = args.nats
    try:
        with RssWatch() as watch:
            watch.add("bench (scripted islands)", os.getpid())
            if url is None:
                from yeto.services.broker import Broker

                broker = Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log").start()
                url = broker.url
                watch.add("nats-server", broker.proc.pid)
            lay = layout_for(args.size_mib)
            model_mib = sum(t["shape"][0] * t["shape"][1] for t in lay) * 4 / MiB
            print(f"syncer memory bench: model {model_mib:g} MiB f32 ({TENSORS} tensors, P={P} fragments), 2 scripted "
                  f"islands, --strict, {args.rounds} rounds, chunks {args.chunk_mib:g} MiB; 1 shard, then "
                  f"{args.shards} shards; load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", flush=True)
            t0 = time.monotonic()
            single, sharded = asyncio.run(_main(args, url, work, watch))
            wall = time.monotonic() - t0
        print("peak RSS " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in watch.peak.items())
              + f"; wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f}", flush=True)
        m1, mn = single["merge"], sharded["merge"]
        print(f"merge time per round: 1 shard {m1['merge_loop']:.3f} s (commit path {m1['commit_path']:.3f} s, "
              f"{single['rounds_s'] / args.rounds:.2f} s per round wall), {args.shards} shards {mn['merge_loop']:.3f} s "
              f"(commit path {mn['commit_path']:.3f} s, {sharded['rounds_s'] / args.rounds:.2f} s per round wall)",
              flush=True)
        ratio = shard_ratio(sharded["growth"], single["growth"]["syncer"])
        worst = max(sharded["growth"], key=sharded["growth"].get)
        print(f"RSS growth: 1 syncer {single['growth']['syncer'] / MiB:.0f} MiB; largest shard ({worst}) "
              f"{sharded['growth'][worst] / MiB:.0f} MiB of {args.shards}; ideal ratio {1 / args.shards:.2f}, goal <= 0.35",
              flush=True)
        print(f"syncer shard_rss_ratio={ratio:.3f}" if math.isfinite(ratio) else f"syncer shard_rss_ratio={ratio}",
              flush=True)
    finally:
        if broker is not None:
            broker.stop()
        if args.keep:
            print(f"(work directory kept: {work})", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
