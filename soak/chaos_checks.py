"""The bookkeeping and the checks of soak/chaos.py: the kills planned and fired (`Kill`), what the monitor saw
(`Watch`), the useful work of a run (for goodput), and the verdict of a finished run: nothing lost, doubled or
torn, every island holding the exported final cut; and the recovery lines it prints per kill kind.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from chaos_procs import IslandChild, log
from yeto.services.run_harness import clean_env


@dataclass
class Kill:
    kind: str
    target: str                      # island id, "syncer" or "broker"
    after_step: int                  # armed once this many rounds are committed (mid-run kinds)
    restart_delay: float
    fired_at: float | None = None
    what: str = ""
    on_target: bool = True
    restarted_at: float | None = None
    recovered_at: float | None = None
    killed_gen: str | None = None
    committed_at_kill: int = 0
    victim: object = None            # the process killed (--standby: the owner then, whoever owns now)


@dataclass
class Watch:
    """What the monitor has seen on `yeto.<run>.>` (live; messages published while the broker is down
    are not seen, which only delays a trigger)."""
    committed: int = 0
    merges: dict = field(default_factory=lambda: defaultdict(list))        # step -> merge records
    commits: dict = field(default_factory=lambda: defaultdict(set))        # (f, v) -> digests (tape)
    bcast_digests: dict = field(default_factory=lambda: defaultdict(set))  # (f, v) -> version digests of its seals
    bcast_seen: set = field(default_factory=set)                           # (f, v) with a chunk seen
    pull_members: dict = field(default_factory=dict)                        # (step, attempt) -> n members
    accepted: dict = field(default_factory=lambda: defaultdict(set))       # (step, attempt) -> islands
    gens: dict = field(default_factory=dict)                                # island -> newest gen seen
    final_seen: bool = False
    init_seen: bool = False


def useful_work(recs: list[dict], steplogs: list[list[dict]], fragments: int) -> tuple[int, float]:
    """(useful island-steps, training span in seconds) of one run, from its tape and step logs.

    A step is useful when it reached the model: per island process (island, gen), the steps from its
    first complete cut (steps before it are overwritten by that cut) to the local step of its last push
    that a committed round merged (later steps died with the process or ended under the final cut).
    Steps taken while the syncer or the broker is down count: the next push carries them (islands never
    wait for a round). The span runs from version 0's commit to the last merge, so both runs are
    measured over training only, not over process start-up."""
    accepted, merges = {}, {}
    t_v0 = t_last = None
    for r in recs:
        k = r.get("kind")
        if k == "disposition" and r.get("disposition") == "accepted":
            accepted[(r["step"], r["attempt"], r["island"], r["gen"])] = r.get("detail", {}).get("local_step")
        elif k == "merge":
            merges.setdefault(r["step"], r)
            t_last = r["t"] if t_last is None else max(t_last, r["t"])
        elif k == "session" and r.get("reason") == "version 0 committed" and t_v0 is None:
            t_v0 = r["t"]
    last: dict[tuple[str, str], int] = defaultdict(int)
    for t, m in merges.items():
        for who in m.get("responded", []):
            ls = accepted.get((t, m["attempt"], who["island"], who["gen"]))
            if ls is not None:
                last[(who["island"], who["gen"])] = max(last[(who["island"], who["gen"])], ls)
    first: dict[tuple[str, str], int] = {}
    for rows in steplogs:
        for row in rows:
            if len(row.get("versions", {})) == fragments:
                first.setdefault((row["island"], row["gen"]), row["step"] - 1)
                break
    steps = sum(max(0, ls - first.get(key, 0)) for key, ls in last.items())
    span = (t_last - t_v0) if t_v0 is not None and t_last is not None else 0.0
    return steps, span


def score_dir(work: Path, fragments: int) -> tuple[int, float]:
    """useful_work() of a finished run's directory (tape.jsonl and steplog-*.jsonl)."""
    recs = [orjson.loads(line) for line in (work / "tape.jsonl").read_bytes().splitlines() if line.strip()]
    logs = []
    for f in sorted(work.glob("steplog-*.jsonl")):
        rows = []
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        logs.append(rows)
    return useful_work(recs, logs, fragments)



def verdict(self, recs: list[dict], wall: float, left: dict, timed_out: bool) -> dict:
    """The checks of a finished run (`self`: the soak/chaos.py Chaos that ran it), from its tape `recs`, the
    export of its checkpoint, the islands' step logs and saved weights."""
    a = self.args
    P, T = a.fragments, a.rounds
    merges = defaultdict(list)
    commits = defaultdict(set)
    accepted = {}
    for r in recs:
        if r.get("kind") == "merge":
            merges[r["step"]].append(r)
        elif r.get("kind") == "commit":
            commits[(r["fragment"], r["version"])].add(r.get("detail", {}).get("version_digest"))
        elif r.get("kind") == "disposition" and r.get("disposition") == "accepted":
            accepted[(r["step"], r["attempt"], r["island"], r["gen"])] = r.get("detail", {}).get("local_step")
    # export the checkpoint: the final cut
    final_path = self.work / "final-cut.safetensors"
    ex = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "export", "--run", self.run, "--checkpoint-dir",
                         str(self.dirs[self.syncer.name]), "--out", str(final_path)], capture_output=True, text=True, env=clean_env())
    final, meta = None, {}
    if ex.returncode == 0:
        from safetensors import safe_open

        with safe_open(str(final_path), "pt") as f:
            final = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
    else:
        log(self.t0, f"export failed: {ex.stderr.strip()[-500:]}")
    versions = {int(k): v for k, v in orjson.loads(meta.get("versions", "{}")).items()}
    # lost: a round without its merge or commit record; versions short of T/P
    lost_rounds, count = [], defaultdict(int)
    for t in range(1, T + 1):
        f = (t - 1) % P
        count[f] += 1
        if not merges.get(t) or (f, count[f]) not in commits:
            lost_rounds.append(t)
    short = sum(max(0, T // P + (1 if f < T % P else 0) - versions.get(f, 0)) for f in range(P))
    # a round missing from the tape is usually also a version short in the cut: count each once
    lost = max(len(lost_rounds), short)
    # double: a round merged twice, a version with two digests (tape or BCAST)
    double_rounds = [t for t, ms in merges.items() if len(ms) > 1]
    double_versions = sorted({fv for fv, d in commits.items() if len(d) > 1}
                             | {fv for fv, d in self.watch.bcast_digests.items() if len(d) > 1})
    double = len(double_rounds) + len(double_versions)
    # islands: applies at most once per version, never a version that was not committed
    bad_apply = []
    islands_ok = {}
    for c in (c for c in self.children if isinstance(c, IslandChild)):
        rows = c.rows()
        prev: dict[str, int] = {}
        changes = applies = 0
        why = None
        for row in rows:
            applies += row.get("applies", 0)
            for fk, v in row.get("versions", {}).items():
                if fk in prev and v < prev[fk]:
                    why = f"fragment {fk} went back from version {prev[fk]} to {v} at step {row['step']}"
                if prev.get(fk) != v:
                    changes += 1
                if v > versions.get(int(fk), -1) and final is not None:
                    why = f"fragment {fk} version {v} at step {row['step']} was never committed"
                prev[fk] = v
        if c.result() is not None and rows:
            # the last boundary installed the final cut: up to one apply per fragment, no version change
            applies -= min(P, rows[-1].get("applies", 0))
        if applies > changes and why is None:
            why = f"{applies} applies for {changes} version changes (a version applied twice)"
        if why:
            bad_apply.append(f"{c.name}: {why}")
    # final_equal: every island's last process saved the exported final cut, bit for bit
    import torch
    from safetensors.torch import load_file

    final_equal = final is not None and meta.get("final") == "True"
    for island, c in self.current.items():
        ok = c.reap() == 0 and c.out.exists() and final is not None
        if ok:
            mine = load_file(str(c.out))
            ok = sorted(mine) == sorted(final) and all(torch.equal(mine[k], v) for k, v in final.items())
        islands_ok[island] = ok
        final_equal = final_equal and ok
    useful_steps, span = useful_work(recs, [c.rows() for c in self.children if isinstance(c, IslandChild)], P)
    rec_by_kind = defaultdict(list)
    for k in self.kills:
        if k.fired_at is not None:
            rec_by_kind[k.kind].append(None if k.recovered_at is None else k.recovered_at - k.fired_at)
    return {
        "run": self.run, "wall_s": wall, "committed": int(meta.get("committed_step", 0) or 0),
        "kills": sum(1 for k in self.kills if k.fired_at is not None), "planned": len(self.kills),
        "off_target": [f"{k.kind}: {k.what}" for k in self.kills if k.fired_at is not None and not k.on_target],
        "lost": lost, "lost_rounds": lost_rounds, "short_versions": short, "double": double,
        "double_rounds": double_rounds, "double_versions": double_versions, "bad_apply": bad_apply,
        "final_equal": final_equal, "islands_equal": islands_ok, "left": left, "crashes": self.crashes,
        "syncer_rcs": self.syncer_rcs, "timed_out": timed_out, "useful_steps": useful_steps,
        "train_s": span, "goodput": useful_steps / span if span > 0 else 0.0, "recovery": dict(rec_by_kind),
        "final_versions": versions, "pgids": {c.name: c.pgid for c in self.children} | {
            f"nats-server-{i}": g for i, g in enumerate(self.broker.pgids)},
    }


def fmt_recovery(rec: dict, kinds: tuple[str, ...]) -> list[str]:
    """One line per kill kind of `rec` (kind -> recovery seconds, None where never recovered), in `kinds`' order."""
    lines = []
    for kind in kinds:
        if kind not in rec:
            continue
        got = [x for x in rec[kind] if x is not None]
        miss = len(rec[kind]) - len(got)
        if got:
            lines.append(f"  {kind:22s} n={len(rec[kind])} recovery median {statistics.median(got):.1f}s "
                         f"max {max(got):.1f}s" + (f" ({miss} never recovered)" if miss else ""))
        else:
            lines.append(f"  {kind:22s} n={len(rec[kind])} never recovered")
    return lines
