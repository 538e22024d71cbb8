#!/usr/bin/env python
"""Round benchmark: one streaming-DiLoCo round of ours vs the peers' gloo all_reduce of the same tensor.

    python bench/round.py [--size-mib 256] [--islands 2] [--rounds 5] [--push-dtype f32] [--bulk-dtype f32]
                          [--outer {diloco,sparseloco}]

A fresh run on the embedded nats-server (or `--nats`): the real `yeto syncer` (`--strict`: the round
waits for every island; one fragment; H = 1, so every island step is a round) and N real islands
(`python -m yeto.learner.demo --model-mib S`, lockstep: each blocks at its boundary until it holds the
round's pull, pushes, and has installed the new version). Their model is one fragment of about S MiB
of f32 parameters. The islands train one demo step between rounds; that is not part of a round.

A round t is timed from its **start**, the later of the pull's publication and the moment the last
island reached the boundary that answers it (with H = 1 the syncer publishes pull t+1 as soon as
version t is committed, while islands still install version t and train a step: counting that as
part of round t+1 would count it twice), to the moment **every island has installed** version t.
Stages, from what the product already records (the bench itself changes nothing in the syncer or islands):

  push       start -> the first island's push complete at the syncer (its `disposition` tape record)
  members    first push complete -> last push complete (waiting for members)
  merge      last push complete -> the `merge` tape record's `t` (merge_s of it: the merge loop alone)
  checkpoint merge done -> the first broadcast chunk seen on BCAST (version digest, checkpoint files,
             state KV commit record; the digest alone = the `commit` record's `t` - the merge's `t`)
  broadcast  first broadcast chunk -> the `merge` record on the tape (taped after every broadcast
             chunk is acknowledged by JetStream)
  apply      broadcast out -> the last island's step-log event of that boundary (islands read and
             apply chunks while the broadcast runs; this is the tail after it)

Next to each row, the syncer's own timings from the `merge` record's detail (EXACT): fetch (merge loop
waiting for push bytes), outer (the outer step), pack+hash (the new version packed in the bulk dtype and
hashed for the version digest, inside the merge loop), digest (what was left of it after the loop),
checkpoint files (what the commit spends on them before the state KV record: since the merge streams
the files, fsync + rename + manifest; before, write + fsync), commit kv (state KV record), broadcast
(every chunk acknowledged). A third line per row, `checkpoint stream`: ckpt write (the merge's writes of
the new version's files into the page cache, inline in the merge loop or on a writer thread beside it)
and writer wait (of checkpoint files, the commit waiting for that thread), state KV puts (the merge
loop's puts of the new version's params and momentum into the state KV, whose acks `state in JetStream`
then waits for); "-" from a syncer that does not stream them. Then counts: push chunks the merge took from memory and read back from PUSH, and
chunks the compiled outer loop stepped and the eager kernel stepped (with `--outer-compile async` the
eager twin works until the background compile is done: on a slow compile every round may be eager).

Observed with a core NATS subscription (pull, chunk 0 of BCAST, the tape) in this process, and each
island's step-log file (YETO_DILOCO_STEP_LOG): its `t`, `boundary_s`, `export_s`, `apply_s`. All
processes share one clock. Each figure is the median over `--rounds` rounds after `--warmup`.
`--outer-compile` sets the syncer's YETO_OUTER_COMPILE (default async, the syncer's: the fused loop
compiled in the background during the warm-up round; `0`: the eager SGD-form kernel).
`--checkpoint-writer`, `--broadcast`, `--push-memory-mib` and `--speculate` are the syncer's flags of those names
(default: inline writes, cut-through broadcast, 1024 MiB of pushes kept for the merge; 0 makes the
merge read every push chunk back from PUSH, the path before). With `with-commit` or `cut-through` the new version's chunks go out before it is
durable (cut-through: as they are merged, so chunk 0 is seen before the merge loop ends), so the
checkpoint stage counts 0 and the broadcast stage is the durable commit and the seal.

The peer: N processes (torch.distributed gloo, init_method tcp://127.0.0.1) all_reduce a tensor of the
fragment's f32 size (median of `--allreduce-repeat` after one warm-up), run after the round run so the
two never share the CPU. Peak RSS (VmHWM, sampled) of every process is printed. Islands save their
final parameters; `final_equal` says they hold bitwise the same bytes (the final cut).
Bytes per round through the broker: the broker's /connz (the embedded one's monitoring port, or
`--nats-monitor`) when the warm-up's and the last round's merge records go by (the islands' reads: when the
first push of those rounds is accepted, a point where no island is reading a version); per timed round, what
the islands sent and received and what the syncer sent and received, each also in model sizes (the
fragment's f32 bytes), then `round bytes_per_model_byte=<x>` (all of it: in and out of the broker).
`--outer sparseloco` starts the syncer in the sparse outer mode (docs/design.md §4.10; the islands follow the
session's pin): the same breakdown and bytes, plus a line with the pushes' bytes per round to 4 decimals of a
model size, and the merge's up-front decode and aggregate; BCAST and the state KV carry each version between full
cuts as its update message, so the round's bytes are a small fraction of a model size.
The last line is `round ratio_vs_allreduce=<x>`: median round / median all_reduce (the headline is
f32 push and bulk, 2 islands).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


from yeto.schemas.dtypes import BULK_DTYPES, PUSH_DTYPES  # noqa: E402  (no torch import)
# processes, ports and peak RSS as every bench runs and reads them
from yeto.services.run_harness import Child, ChildFailed, RssWatch, clean_env, free_port, stop_all, vm_hwm, wait_all  # noqa: E402

MiB = 1 << 20
STAGES = ("push", "members", "merge", "checkpoint", "broadcast", "apply")
# The syncer's own stage timings, from the `merge` tape record's detail (seconds, measured in the syncer):
# (detail key, printed name). fetch + outer + the hop overheads make the merge loop; pack (and hash) of
# the new version runs inside the merge loop; digest is what remained of it after the loop.
EXACT = (("fetch_s", "fetch"), ("outer_s", "outer"), ("pack_s", "pack+hash"), ("digest_s", "digest"),
         ("checkpoint_s", "checkpoint files"), ("state_store_s", "state in JetStream"), ("commit_kv_s", "commit kv"),
         ("broadcast_s", "broadcast"))
# Recorded by a syncer that streams the checkpoint files during the merge (optional: printed as "-" when
# absent, so older syncers' records still make a breakdown).
STREAM = (("ckpt_write_s", "ckpt write"), ("ckpt_wait_s", "writer wait"), ("state_streamed_s", "state KV puts"))
# The sparse mode's up-front part of the merge (optional, as STREAM): the pushes taken as intake decoded
# them (or read and decoded again), then aggregated into the step.
SPARSE = (("sparse_decode_s", "decode"), ("sparse_aggregate_s", "aggregate"))
# Counts (optional): push chunks the merge took from memory (kept at intake) and read back from PUSH;
# chunks the compiled outer loop stepped and the eager kernel stepped (a compile not yet done leaves
# them to the eager twin).
HELD = (("push_chunks_held", "push chunks held"), ("push_chunks_read", "read back"),
        ("outer_compiled_chunks", "outer compiled"), ("outer_eager_chunks", "eager"),
        ("speculated_chunks", "speculated"), ("sparse_pushes_held", "sparse pushes decoded at intake"),
        ("sparse_pushes_decoded", "decoded again"))


# --------------------------------------------------------------------------- pure logic (no I/O)


@dataclass
class RoundObs:
    """What was seen of one round (wall-clock seconds; None where not seen)."""
    step: int
    pull: float | None = None                                    # pull received by the observer
    ready: dict[str, float] = field(default_factory=dict)        # island -> its boundary started
    accepted: dict[str, float] = field(default_factory=dict)     # island -> push complete at the syncer
    merge_t: float | None = None                                 # merge record's t (merge loop done)
    merge_s: float | None = None
    exact: dict = field(default_factory=dict)                    # the merge record's stage timings (EXACT)
    commit_t: float | None = None                                # commit record's t (version digest done)
    bcast0: float | None = None                                  # first chunk of the new version seen
    taped: float | None = None                                   # merge record seen (broadcast acked)
    installed: dict[str, float] = field(default_factory=dict)    # island -> its boundary ended, version held
    export_s: dict[str, float] = field(default_factory=dict)
    apply_s: dict[str, float] = field(default_factory=dict)


def breakdown(o: RoundObs, islands: list[str]) -> dict:
    """Stage durations of one round (see the module doc); they add up to `round` exactly.
    Raises ValueError naming what was not observed."""
    missing = [n for n in ("pull", "merge_t", "merge_s", "commit_t", "bcast0", "taped") if getattr(o, n) is None]
    for what in ("ready", "accepted", "installed"):
        lack = sorted(set(islands) - set(getattr(o, what)))
        if lack:
            missing.append(f"{what}[{','.join(lack)}]")
    missing += [f"detail.{k}" for k, _ in EXACT if o.merge_s is not None and k not in o.exact]
    if missing:
        raise ValueError(f"round {o.step}: not observed: {', '.join(missing)}")
    start = max(o.pull, max(o.ready[i] for i in islands))
    first, last = min(o.accepted[i] for i in islands), max(o.accepted[i] for i in islands)
    done = max(o.installed[i] for i in islands)
    marks = [start, first, last, o.merge_t, o.bcast0, o.taped, done]
    # One island may push before the last one reaches its boundary (the round's start): a stage whose
    # end came before the previous mark counts 0, so every stage is >= 0 and they still add up.
    for k in range(1, len(marks)):
        marks[k] = max(marks[k], marks[k - 1])
    out = {name: b - a for name, a, b in zip(STAGES, marks, marks[1:])}
    # The round ends at the last mark: an island may report its install before the observer sees
    # the broadcast's tape record, and the stages must add up.
    out["round"] = marks[-1] - start
    out["from_pull"] = marks[-1] - o.pull   # the same end as `round` (start >= pull, so never shorter)
    out["merge_loop"] = o.merge_s
    out["digest"] = o.commit_t - o.merge_t
    out["export"] = max(o.export_s.get(i, 0.0) for i in islands)
    out["island_apply"] = max(o.apply_s.get(i, 0.0) for i in islands)
    out.update((k, float(o.exact[k])) for k, _ in EXACT)
    out.update((k, float(o.exact[k])) for k, _ in STREAM + SPARSE + HELD if k in o.exact)
    return out


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0] if all(k in r for r in rows)}


def parse_steplog(lines, island: str, rounds: dict[int, RoundObs]) -> None:
    """Fill each round's ready/installed/export/apply from an island's step-log lines (H = 1: round t
    is answered at local step t, whose event is emitted once version t is installed)."""
    for line in lines:
        if not line.strip():
            continue
        ev = json.loads(line)
        o = rounds.get(ev["step"])
        if o is None or int(ev["versions"].get("0", -1)) < o.step:
            continue
        o.ready[island] = ev["t"] - ev["boundary_s"]
        o.installed[island] = ev["t"]
        o.export_s[island] = ev["export_s"]
        o.apply_s[island] = ev["apply_s"]


def note_event(rec: dict, seen_at: float, rounds: dict[int, RoundObs]) -> None:
    """Fill a round from one tape record (as published by the syncer) seen at `seen_at`."""
    o = rounds.get(rec.get("step"))
    if o is None:
        return
    kind = rec.get("kind")
    if kind == "disposition" and rec.get("disposition") == "accepted":
        o.accepted.setdefault(rec["island"], rec["t"])
    elif kind == "merge":
        o.merge_t, o.merge_s, o.taped = rec["t"], rec["detail"]["merge_s"], seen_at
        o.exact = {k: rec["detail"][k] for k, _ in EXACT + STREAM + SPARSE + HELD if k in rec["detail"]}
    elif kind == "commit" and rec.get("fragment") == 0:
        o.commit_t = rec["t"]


# --------------------------------------------------------------------------- observer (core NATS)


def conn_bytes(connz: dict) -> dict[str, tuple[int, int]]:
    """/connz of the broker -> connection name -> (bytes the client sent, bytes sent to it), summed per name."""
    out: dict[str, tuple[int, int]] = {}
    for c in connz.get("connections") or ():
        name = c.get("name") or f"cid{c.get('cid')}"
        got, sent = out.get(name, (0, 0))
        out[name] = (got + int(c.get("in_bytes", 0)), sent + int(c.get("out_bytes", 0)))
    return out


TRAFFIC = (("islands_out", "from islands (pushes, step logs)"), ("syncer_in", "to the syncer (pushes)"),
           ("syncer_out", "from the syncer (BCAST, state KV, tape)"), ("islands_in", "to islands (BCAST, pulls)"))


def traffic(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], rounds: int,
            reads: tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]] | None = None) -> dict[str, float]:
    """Bytes per round through the broker between two /connz snapshots, by who sent or received them: islands
    are the `yeto-island-*` connections, the syncer `yeto-syncer-*` (the bench's own observer is left out).
    `reads`, when given, is the pair of snapshots the islands' received bytes are counted between (taken where
    no island is reading). `total` is every byte in and out of the broker on those connections."""
    def delta(prefix: str, before: dict, after: dict) -> tuple[int, int]:
        got = sent = 0
        for name, (i, o) in after.items():
            if name.startswith(prefix):
                i0, o0 = before.get(name, (0, 0))
                got, sent = got + i - i0, sent + o - o0
        return got, sent
    isl, syn = delta("yeto-island-", before, after), delta("yeto-syncer-", before, after)
    isl_in = delta("yeto-island-", *reads)[1] if reads else isl[1]
    out = {"islands_out": isl[0], "islands_in": isl_in, "syncer_out": syn[0], "syncer_in": syn[1]}
    out = {k: v / rounds for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def fmt_traffic(t: dict[str, float], model_bytes: int) -> str:
    per = (lambda x: x / model_bytes) if model_bytes else (lambda x: math.nan)
    return ("bytes per round through the broker: " + ", ".join(f"{label} {t[k] / MiB:.1f} MiB ({per(t[k]):.2f})"
                                                               for k, label in TRAFFIC)
            + f"; total {t['total'] / MiB:.1f} MiB = {per(t['total']):.2f} model sizes (f32 fragment)\n"
            + f"round bytes_per_model_byte={per(t['total']):.2f}")


def fmt_sparse_pushes(t: dict[str, float], model_bytes: int, islands: int) -> str:
    """The push side of `traffic` in bytes and in model sizes to 4 decimals (the islands' side includes their step
    logs and heartbeats), next to what f32 pushes would move: one model size per island."""
    per = (lambda x: x / model_bytes) if model_bytes else (lambda x: math.nan)
    return (f"sparse pushes per round: from islands {t['islands_out']:.0f} B ({per(t['islands_out']):.4f}), to the "
            f"syncer {t['syncer_in']:.0f} B ({per(t['syncer_in']):.4f}) model sizes; f32 pushes: {islands} each way")


class Observer:
    """Records when pulls, chunk 0 of each broadcast version and tape records go by. Chunk 0 alone
    (one chunk per version, not the whole broadcast) keeps the observer off the server's budget."""

    def __init__(self, url: str, run: str, rounds: dict[int, RoundObs], *, monitor: str | None = None,
                 snap_steps: tuple[int, ...] = (), sparse: bool = False):
        self.url, self.run, self.rounds = url, run, rounds
        self.sparse = sparse   # versions also come as update messages, on their own subjects (schemas/sparse_bcast)
        # the broker's monitoring URL: /connz snapshots when the merge records and the first accepted pushes of
        # `snap_steps` go by
        self.monitor, self.snap_steps = monitor, snap_steps
        self.snaps: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}
        self.bcast_bytes = None
        self.errors: list[str] = []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._t = threading.Thread(target=self._main, daemon=True)

    def __enter__(self):
        self._t.start()
        if not self._ready.wait(30):
            raise SystemExit("round bench: the observer could not connect")
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._t.join(30)

    def _main(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._run())

    async def _run(self):
        import nats
        import orjson

        from yeto.schemas import codec
        from yeto.schemas import subjects as S

        self._stop = asyncio.Event()
        by_version: dict[int, float] = {}
        nc = await nats.connect(self.url)

        async def on_pull(msg):
            now = time.time()
            try:
                p = orjson.loads(msg.data)
                o = self.rounds.get(p["step"])
                if o is not None and o.pull is None:
                    o.pull = now
            except Exception as exc:  # noqa: BLE001 - a bench observer reports, never dies
                self.errors.append(f"pull: {exc!r}")

        async def on_bcast(msg):
            now = time.time()
            try:
                meta = codec.decode_header("bcast_chunk", (msg.headers or {}).get(codec.CHUNK_HEADER, b""))
                if meta.get("encoding") is None:   # a full cut: the fragment's size (an update is far smaller)
                    self.bcast_bytes = meta["total"]
                by_version.setdefault(meta["version"], now)
                o = self.rounds.get(meta["version"])  # one fragment: version t is round t's
                if o is not None and o.bcast0 is None:
                    o.bcast0 = by_version[meta["version"]]
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"bcast: {exc!r}")

        def connz() -> dict:
            import urllib.request

            with urllib.request.urlopen(f"{self.monitor}/connz?limit=4096", timeout=10) as r:
                return json.loads(r.read())

        async def on_event(msg):
            now = time.time()
            try:
                rec = orjson.loads(msg.data)
                note_event(rec, now, self.rounds)
                if self.monitor and rec.get("step") in self.snap_steps:
                    # pushes and the syncer's writes are counted between merge records (every push of the round
                    # is in, none of the next: lockstep); the islands' reads between the first accepted push of
                    # a round (both islands hold the previous version, nobody can read this one yet): at a merge
                    # record an island may already be reading the version in flight (cut-through broadcast)
                    point = {"merge": "merge", "disposition": "accept"}.get(rec.get("kind"))
                    if point == "accept" and rec.get("disposition") != "accepted":
                        point = None
                    if point and (point, rec["step"]) not in self.snaps:
                        self.snaps[(point, rec["step"])] = {}
                        self.snaps[(point, rec["step"])] = conn_bytes(await asyncio.to_thread(connz))
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"event: {exc!r}")

        await nc.subscribe(S.pull(self.run), cb=on_pull)
        await nc.subscribe(S.bcast(self.run, 0, 0), cb=on_bcast)
        if self.sparse:   # chunk 0 of every kept update slot (the bench runs the default --sparse-full-every)
            from yeto.schemas.outer_mode import DEFAULT_FULL_EVERY
            from yeto.schemas.sparse_bcast import update_subject

            for slot in range(DEFAULT_FULL_EVERY):
                await nc.subscribe(update_subject(self.run, 0, slot, 0), cb=on_bcast)
        await nc.subscribe(S.events_all(self.run), cb=on_event)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.drain()


# --------------------------------------------------------------------------- the peer: gloo all_reduce


def _allreduce_rank(rank: int, world: int, port: int, numel: int, repeat: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.full((numel,), float(rank + 1))
        times = []
        for i in range(repeat + 1):  # the first one warms gloo's buffers up
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
            x.fill_(float(rank + 1))
        want = world * (world + 1) / 2
        dist.all_reduce(x)
        ok = bool((x == want).all())
        with open(f"{out}/ar{rank}.json", "w") as f:
            json.dump({"times": times[1:], "ok": ok, "hwm": vm_hwm(os.getpid())}, f)
    finally:
        dist.destroy_process_group()


def allreduce(world: int, numel: int, repeat: int, work: Path) -> dict:
    import torch.multiprocessing as mp

    d = work / "allreduce"
    d.mkdir()
    mp.start_processes(_allreduce_rank, args=(world, free_port(), numel, repeat, str(d)), nprocs=world,
                       join=True, start_method="spawn")
    res = [json.loads((d / f"ar{r}.json").read_text()) for r in range(world)]
    if not all(r["ok"] for r in res):
        raise SystemExit("round bench: gloo all_reduce gave a wrong sum")
    # a collective ends when its slowest rank does
    per_run = [max(r["times"][i] for r in res) for i in range(repeat)]
    return {"median": statistics.median(per_run), "runs": per_run, "hwm": max(r["hwm"] or 0 for r in res)}


# --------------------------------------------------------------------------- the round run


def run_rounds(args, url: str, work: Path, rss: RssWatch, monitor: str | None = None
               ) -> tuple[dict[int, RoundObs], list[str], dict]:
    run = f"bench_round_{uuid.uuid4().hex[:8]}"
    names = [f"i{k}" for k in range(args.islands)]
    total = args.warmup + args.rounds
    rounds = {t: RoundObs(step=t) for t in range(1, total + 1)}
    env = clean_env(YETO_PROGRESS="0")
    procs: dict[str, Child] = {}
    info: dict = {"run": run}
    with Observer(url, run, rounds, monitor=monitor, snap_steps=(args.warmup, total),
                  sparse=args.outer == "sparseloco") as obs:
        try:
            procs["syncer"] = Child(
                "syncer", [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run,
                 "--islands", str(args.islands), "--fragments", "1", "--sync-every", "1", "--total-steps", str(total),
                 "--init-island", names[0], "--strict", "--push-dtype", args.push_dtype, "--bulk-dtype", args.bulk_dtype,
                 "--chunk-bytes", str(args.chunk_bytes), "--checkpoint-dir", str(work / "ckpt"),
                 "--quorum-timeout", "900", "--member-timeout", "900", "--final-timeout", "300", "--status-every", "30",
                 "--push-memory-mib", str(args.push_memory_mib), "--outer", args.outer],
                work / "syncer.log",
                env=dict(env, YETO_OUTER_COMPILE=args.outer_compile, YETO_CHECKPOINT_WRITER=args.checkpoint_writer,
                         YETO_BROADCAST=args.broadcast, YETO_SPECULATE=args.speculate,
                         YETO_STATE_STORE=args.state_store)).start()
            rss.add("syncer", procs["syncer"].pid)
            for name in names:
                e = dict(env, YETO_NATS=url, YETO_LOCKSTEP="1", YETO_DILOCO_STEP_LOG=str(work / f"steplog-{name}.jsonl"),
                         YETO_LOCKSTEP_TIMEOUT="900", YETO_PUSH_TIMEOUT="900", YETO_SESSION_TIMEOUT="300")
                if args.fetch_batch_mib:
                    e["YETO_FETCH_BATCH_BYTES"] = str(int(args.fetch_batch_mib * MiB))
                procs[name] = Child(
                    f"island {name}",
                    [sys.executable, "-P", "-m", "yeto.learner.demo", "--run", run, "--island", name, "--model-mib",
                     str(args.size_mib), "--step-delay", "0", "--out", str(work / f"final-{name}.safetensors")],
                    work / f"island-{name}.log", env=e).start()
                rss.add(f"island {name}", procs[name].pid)
            try:
                wait_all(procs, args.timeout, lines=40)
            except ChildFailed as err:
                raise SystemExit(f"round bench: {err}")
        finally:
            stop_all(procs, grace=0)
    info["observer_errors"] = obs.errors
    info["fragment_bytes"] = obs.bcast_bytes
    info["snaps"] = obs.snaps
    for name in names:
        with open(work / f"steplog-{name}.jsonl") as f:
            parse_steplog(f, name, rounds)
    return rounds, names, info


def final_equal(work: Path, names: list[str]) -> tuple[bool, dict[str, int]]:
    from safetensors.torch import load_file

    states = [load_file(str(work / f"final-{n}.safetensors")) for n in names]
    same = all(s.keys() == states[0].keys() and all(bool((s[k] == states[0][k]).all()) and s[k].dtype == states[0][k].dtype
                                                     for k in s) for s in states[1:])
    return same, {n: len(s) for n, s in zip(names, states)}


def last_versions(work: Path, names: list[str]) -> dict[str, int]:
    out = {}
    for n in names:
        last = None
        with open(work / f"steplog-{n}.jsonl") as f:
            for line in f:
                if line.strip():
                    last = json.loads(line)
        out[n] = int(last["versions"].get("0", -1)) if last else -1
    return out


def fmt_stage_row(label: str, b: dict) -> str:
    return (f"{label}: round {b['round']:.3f} s = " + " + ".join(f"{s} {b[s]:.3f}" for s in STAGES)
            + f" (from pull {b['from_pull']:.3f}; merge loop {b['merge_loop']:.3f}, digest {b['digest']:.3f}, "
              f"island export {b['export']:.3f}, island apply {b['island_apply']:.3f})\n"
            + f"{label} syncer stages: " + ", ".join(f"{name} {b[k]:.3f}" for k, name in EXACT) + "\n"
            + f"{label} checkpoint stream: "
            + ", ".join(f"{name} {b[k]:.3f}" if k in b else f"{name} -" for k, name in STREAM)
            + "; " + ", ".join(f"{name} {b[k]:.0f}" if k in b else f"{name} -" for k, name in HELD)
            + ("" if not any(k in b for k, _ in SPARSE) else f"\n{label} sparse merge up front: "
               + ", ".join(f"{name} {b[k]:.3f}" if k in b else f"{name} -" for k, name in SPARSE)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=256, help="fragment size in MiB of f32 parameters (default 256)")
    p.add_argument("--islands", type=int, choices=(2, 3, 4), default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them (default 1)")
    p.add_argument("--push-dtype", choices=PUSH_DTYPES, default="f32")
    p.add_argument("--bulk-dtype", choices=BULK_DTYPES, default="f32")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="the syncer's --chunk-bytes (default 1 MiB)")
    p.add_argument("--fetch-batch-mib", type=float, default=0, help="islands' YETO_FETCH_BATCH_BYTES in MiB "
                   "(default: the island's)")
    p.add_argument("--outer-compile", choices=("async", "sync", "0"), default="async",
                   help="the syncer's YETO_OUTER_COMPILE (default async, the syncer's: the fused loop compiled in the "
                   "background, i.e. in the warm-up round; sync: compiled before the first merge; 0: eager SGD form)")
    p.add_argument("--push-memory-mib", type=float, default=1024,
                   help="the syncer's --push-memory-mib (default %(default)s; 0: the merge reads every push chunk "
                   "back from PUSH)")
    p.add_argument("--checkpoint-writer", choices=("inline", "thread", "whole"), default="inline",
                   help="the syncer's --checkpoint-writer: write the checkpoint files in the merge loop (inline, the "
                   "default), on a writer thread beside it, or whole at the commit")
    p.add_argument("--broadcast", choices=("cut-through", "with-commit", "after-commit"), default="cut-through",
                   help="the syncer's --broadcast: each chunk as soon as it is merged (cut-through, the default), "
                   "the chunks after the merge while the version is made durable (with-commit), or all after the "
                   "commit; the first two send the seal after the durable commit")
    p.add_argument("--speculate", choices=("on", "off"), default="off",
                   help="the syncer's --speculate: sum the round's outer gradient while the pushes arrive (on) or "
                   "only in the merge (off, the syncer's default)")
    p.add_argument("--state-store", choices=("jetstream", "local"), default="jetstream",
                   help="the syncer's --state-store (default jetstream, the syncer's: the committed state also kept "
                        "in the run's ckpt KV; local: the checkpoint directory only)")
    p.add_argument("--outer", choices=("diloco", "sparseloco"), default="diloco",
                   help="the syncer's --outer (default diloco: dense pushes, Nesterov outer step; sparseloco: sparse "
                   "pushes at the syncer's default --sparse-* settings, islands following the session's pin; BCAST "
                   "stays a dense full cut, docs/design.md §4.10)")
    p.add_argument("--allreduce-repeat", type=int, default=5)
    p.add_argument("--nats", default=None, help="use this server instead of the embedded one")
    p.add_argument("--nats-monitor", default=None, help="with --nats: its monitoring URL (http://host:8222), for the "
                   "bytes per round through the broker")
    p.add_argument("--timeout", type=float, default=1800, help="seconds the whole round run may take")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, step logs, checkpoint)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.size_mib <= 0:
        p.error("--rounds must be >= 1, --warmup >= 0 and --size-mib > 0")
    if args.outer == "sparseloco" and args.speculate == "on":
        # the syncer refuses the pair (speculation sums dense pushes): say so before starting a broker
        p.error("--speculate on is for --outer diloco")

    work = Path(tempfile.mkdtemp(prefix="yeto-round-"))
    broker = None
    url = args.nats
    try:
        with RssWatch() as rss:
            if url is None:
                from yeto.services.broker import Broker

                broker = Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log").start()
                url = broker.url
                rss.add("nats-server", broker.proc.pid)
            print(f"round bench: {args.islands} islands (learner.demo, lockstep), one fragment of {args.size_mib:g} MiB "
                  f"f32, push {args.push_dtype}, bulk {args.bulk_dtype}, chunks {args.chunk_bytes / MiB:g} MiB, "
                  f"{args.warmup} warm-up + {args.rounds} timed rounds, YETO_OUTER_COMPILE={args.outer_compile}, "
                  f"--checkpoint-writer {args.checkpoint_writer}, --broadcast {args.broadcast}, "
                  f"--push-memory-mib {args.push_memory_mib:g}, --speculate {args.speculate}, --state-store {args.state_store}"
                  # named only off the default, so a dense run prints what it printed before --outer
                  + (f", --outer {args.outer}" if args.outer != "diloco" else "") + "; "
                  f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", flush=True)
            t0 = time.monotonic()
            monitor = f"http://127.0.0.1:{broker.http_port}" if broker is not None else args.nats_monitor
            rounds, names, info = run_rounds(args, url, work, rss, monitor)
            wall = time.monotonic() - t0
        if info["observer_errors"]:
            print("observer errors: " + "; ".join(info["observer_errors"][:5]), flush=True)
        rows = []
        for t in range(args.warmup + 1, args.warmup + args.rounds + 1):
            b = breakdown(rounds[t], names)
            rows.append(b)
            print(fmt_stage_row(f"round {t}", b), flush=True)
        med = medians(rows)
        print(fmt_stage_row("median", med), flush=True)
        versions = last_versions(work, names)
        same, _ = final_equal(work, names)
        print("islands final versions: " + " ".join(f"{n}={v}" for n, v in versions.items())
              + f" (rounds {args.warmup + args.rounds}); final_equal={'true' if same else 'false'}", flush=True)
        frag = info["fragment_bytes"] or 0
        numel = frag // (4 if args.bulk_dtype == "f32" else 2)
        snaps, total = info["snaps"], args.warmup + args.rounds
        # pushes: between the warm-up's and the last round's merge records (rounds warm-up+1 .. last); reads:
        # between the first accepted pushes of the warm-up's and the last round (versions warm-up .. last-1)
        keys = [("merge", args.warmup), ("merge", total), ("accept", args.warmup), ("accept", total)]
        if all(snaps.get(k) for k in keys):
            tr = traffic(snaps[keys[0]], snaps[keys[1]], args.rounds, reads=(snaps[keys[2]], snaps[keys[3]]))
            print(fmt_traffic(tr, numel * 4), flush=True)
            if args.outer == "sparseloco":
                # the line above rounds to 0.01 model sizes, which a sparse push is well under
                print(fmt_sparse_pushes(tr, numel * 4, args.islands), flush=True)
        else:
            print("bytes per round through the broker: - (no monitoring endpoint: give --nats-monitor with --nats)",
                  flush=True)
        ar = allreduce(args.islands, numel, args.allreduce_repeat, work)
        print(f"gloo all_reduce of {numel * 4 / MiB:.1f} MiB f32 between {args.islands} processes: median "
              f"{ar['median']:.4f} s (runs {'/'.join(f'{x:.4f}' for x in ar['runs'])})", flush=True)
        peaks = dict(rss.peak, **{"all_reduce rank": ar["hwm"]})
        print("peak RSS " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in peaks.items())
              + f"; round run wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f}", flush=True)
        print(f"round ratio_vs_allreduce={med['round'] / ar['median']:.2f}", flush=True)
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
