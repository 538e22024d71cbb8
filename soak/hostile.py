"""soak/hostile.py — a real run under a flood of malformed and hostile messages (docs/design.md §14).

    .venv/bin/python soak/hostile.py                      # 1000 hostile messages, seed 0, embedded broker
    .venv/bin/python soak/hostile.py --quick              # ~250 messages, a shorter run (the suite's test)
    .venv/bin/python soak/hostile.py --count 5000 --seed 7 --nats nats://host:4222
    .venv/bin/python soak/hostile.py --poison all         # a compromised island (docs/design.md §9), default syncer flags

`--poison KIND[,KIND...]|all` runs no flood: it starts a clean 2-island run and, side by side on the same broker,
one run per KIND whose island a is compromised by learner/demo.py's test-only fault injector (YETO_DEMO_POISON:
plus50, nan, norm5x, tokens), the syncer on its default flags, and prints per kind
`poison kind=K clean=X poisoned=Y ratio=Y/X quarantined=.. clamped=.. ...` (X, Y: the final cut's held-out eval
loss), the clean run's `max_norm_ratio` (how near an honest push came to --push-norm-factor) and last
`poison ok=<true|false> ...`.

Starts the embedded broker (unless --nats), the real syncer and two real islands (`python -m yeto.learner.demo`,
a and b), and once version 0 is committed sends --count malformed or hostile messages on every subject a client can
reach, towards the syncer (CTL hello/heartbeat/ack, PUSH, INIT), the islands (CTL pull and to-island, BCAST, FINAL)
and on STEPLOG, while the run goes on. soak/hostile_messages.py builds them with the `schemas` package and a seeded
mutator: bad JSON, schema violations, forged island ids, generations and runs, truncated / oversize / overlapping
chunks, bad digests, NaN/Inf values, wrong dtypes and totals, unknown fragments, stale and future steps and
attempts, duplicate Nats-Msg-Ids, INIT from the wrong island, forged pulls, manifests, errors, shutdowns, cuts.

Every message has a category. Deterministic categories say how many rejections they must cause: one record on the
syncer's tape (EVENTS: an `error` record, or a push disposition other than `accepted`, for a complete push try), or
one rejection per island that reads it (the islands' logs: "rejected CTL message on ..." / "rejected bcast_chunk
notice on ..."). Those are attributed to their category by the forged generation (its first 4 hex digits are the
category number) or the subject's island token (`h<NN>...`), and compared. Other categories (payload forgeries on
real broadcast chunk subjects, which the islands meet only if they read that chunk before the syncer overwrites it;
FINAL garbage; step-log garbage nobody consumes here; duplicates JetStream drops) are reported as observed.

Checked at the end: the run finishes (syncer and islands exit 0), every island's parameters equal the exported
final cut bitwise, the syncer's peak RSS during the flood, the longest gap between two commits (no stall longer than
one quorum timeout), and crashes = processes that exited non-zero or never finished, plus handler errors (an
exception the syncer's intake caught instead of a rejection). Last line:

    hostile sent=<n> rejected=<r> crashes=<c> final_equal=<true|false>

where `rejected` counts the observed rejections of the deterministic categories; `must=<m>` on the line before
is what they must add up to.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# hostile_messages lies beside this script: its folder on the path also under `python -P`
sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson  # noqa: E402
import torch  # noqa: E402

from yeto.schemas import codec, subjects as S  # noqa: E402
from yeto.services.run_harness import Child, clean_env, read_tape, stop_all, vm_rss  # noqa: E402
from yeto.services.run_harness import kv_json as state_record  # noqa: E402

# the messages of the attack: soak/hostile_messages.py, beside this script (its directory is on sys.path)
from hostile_messages import CATS, ISLANDS, Hostile  # noqa: E402

ISLAND_ENV = {"YETO_SESSION_TIMEOUT": "90", "YETO_FINAL_TIMEOUT": "90", "YETO_SHUTDOWN_TIMEOUT": "30",
              "YETO_INIT_V0_TIMEOUT": "90", "YETO_PUSH_TIMEOUT": "30", "YETO_PROGRESS": "0"}
# what pull_inconsistent makes the pull book refuse (other pull refusals belong to observed categories)
RX_CTL = re.compile(r"rejected CTL message on |rejected pull \d+/\d+: (fragment must be below|round \d+ targets fragment)")
# notice garbage goes to chunk subjects 50..99 (past every real chunk); payload forgeries to real ones
RX_NOTICE = re.compile(r"rejected bcast_chunk notice on \S+\.bcast\.\d+\.(\d+)")
RX_CUT = re.compile(r"rejected (bcast_chunk|final_chunk) \d+/\d+|rejected bcast notice")


# ---- processes ----------------------------------------------------------------------------------------

def _rss_kib(pid: int) -> int | None:
    rss = vm_rss(pid)
    return None if rss is None else rss // 1024


class Procs:
    """The run's processes (services/run_harness.py Children): the syncer and the islands, logging to
    WORK/<name>.log."""

    def __init__(self, url: str, run: str, work: Path, args, island_env: dict[str, dict] | None = None):
        self.url, self.run, self.work, self.args = url, run, work, args
        self.island_env = island_env or {}   # island -> extra environment (--poison: the fault injector)
        self.procs: dict[str, Child] = {}

    def start(self) -> None:
        a = self.args
        env = clean_env(YETO_NATS=self.url, YETO_RUN=self.run)
        syncer = [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", self.url, "--run", self.run,
                  "--islands", "2", "--fragments", "2", "--sync-every", "8", "--total-steps", str(a.rounds),
                  "--chunk-bytes", str(a.chunk_bytes), "--checkpoint-dir", str(self.work / "syncer"), "--small-limits",
                  "--quorum-timeout", str(a.quorum_timeout), "--member-timeout", "20", "--final-timeout", "90",
                  "--status-every", "0.5"]
        self._spawn("syncer", syncer, env)
        for isl in ISLANDS:
            cmd = [sys.executable, "-P", "-m", "yeto.learner.demo", "--run", self.run, "--island", isl,
                   "--step-delay", str(a.step_delay), "--out", str(self.work / f"island-{isl}.safetensors")]
            self._spawn(isl, cmd, dict(env, YETO_ISLAND=isl, **ISLAND_ENV,
                                       YETO_DILOCO_STEP_LOG=str(self.work / f"steplog-{isl}.jsonl"),
                                       **self.island_env.get(isl, {})))

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        self.procs[name] = Child(name, cmd, self.work / f"{name}.log", env=env).start()

    def log(self, name: str) -> str:
        p = self.procs.get(name)
        return p.output() if p else ""

    def stop(self) -> None:
        stop_all(self.procs)


# ---- the attack --------------------------------------------------------------------------------------

async def kv_json(js, run: str, key: str) -> dict | None:
    """A state KV record; None also before the run's bucket exists or while the broker does not answer."""
    try:
        return await state_record(js, run, key)
    except Exception:
        return None


tape = read_tape  # every record of the run's EVENTS tape


def attribute(rec: dict, real_gens: set[str]) -> str | None:
    """The category a tape rejection record belongs to (None: not caused by a hostile message)."""
    gen = rec.get("gen")
    if gen in real_gens:
        return None
    if isinstance(gen, str) and len(gen) == 16:
        n = int(gen[:4], 16)
        if 1 <= n <= len(CATS):
            return CATS[n - 1].name
    isl = rec.get("island") or ""
    m = re.match(r"^h(\d\d)x", isl)
    if m and 1 <= int(m.group(1)) <= len(CATS):
        return CATS[int(m.group(1)) - 1].name
    if gen is None and not isl and str(rec.get("reason", "")).startswith("INIT chunk"):
        return "init_malformed"
    return None


def is_rejection(rec: dict) -> bool:
    return rec.get("kind") == "error" or (rec.get("kind") == "disposition" and rec.get("disposition") != "accepted")


async def attack(url: str, run: str, procs: Procs, args, report: dict) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream(timeout=20)
    try:
        t0 = time.monotonic()
        while True:   # version 0 committed and both islands admitted
            commit = await kv_json(js, run, "commit")
            st = await kv_json(js, run, "syncer")
            if commit is not None and st is not None and st.get("phase") == "running" and set(st.get("live", [])) >= set(ISLANDS):
                break
            if time.monotonic() - t0 > args.timeout / 2:
                raise RuntimeError("the run never got to version 0")
            if any(p.poll() is not None for p in procs.procs.values()):
                raise RuntimeError("a process exited before version 0")
            await asyncio.sleep(0.2)
        session = codec.decode("session", (await (await js.key_value(S.kv_bucket(run, "state"))).get("session")).value)
        members = await js.key_value(S.kv_bucket(run, "members"))
        gens = {i: orjson.loads((await members.get(i)).value)["gen"] for i in ISLANDS}
        report["real_gens"] = gens
        h = Hostile(run, session, gens, args.seed)
        rnd = h.rnd
        weights = [c.weight for c in CATS]
        by_name = {c.name: c for c in CATS}
        if args.impersonate:
            weights = [c.weight or (4 if c.name in ("pull_forged_future", "to_island_real_gen") else 0) for c in CATS]
        plan = [c.name for c in rnd.choices(CATS, weights=weights, k=args.count * 2)]
        plan[0:0] = ["pull_deep_json", "ctl_deep_json"]   # every run carries the codec's regression once
        skip = set(filter(None, (args.skip or "").split(",")))
        plan = [c for c in plan if c not in skip]   # the same draws otherwise: for bisecting a failure
        pid = procs.procs["syncer"].pid
        rss = report["rss_kib"] = [_rss_kib(pid) or 0]
        sent = 0
        t_start = time.monotonic()
        batch = max(5, args.count // 40)
        journal = open(procs.work / "sent.jsonl", "ab")   # every hostile message, for post-mortems
        i = 0
        while sent < args.count:
            st = await kv_json(js, run, "syncer") or {}
            h.committed = int(st.get("committed_step", h.committed))
            h.versions_hint = {int(k): v for k, v in (st.get("versions") or {}).items()}
            for r in st.get("rounds_in_flight", []):
                h.attempts[r["step"]] = r["attempt"]
            if st.get("phase") not in (None, "running") or h.committed >= args.rounds - 3:
                report["stopped_early"] = f"run at step {h.committed}, phase {st.get('phase')}"
                break
            rss.append(_rss_kib(pid) or 0)
            for _ in range(batch):
                if sent >= args.count or i >= len(plan):
                    break
                u = h.unit(plan[i])
                i += 1
                cat = by_name[u.cat]   # a unit may fall back to another category (e.g. nothing committed yet)
                for m in u.msgs:
                    hdrs = dict(m.headers or {})
                    hdrs[S.MSG_ID] = m.msg_id or h.mid()
                    journal.write(orjson.dumps({"t": time.time(), "cat": cat.name, "subject": m.subject,
                                                "header": (m.headers or {}).get(codec.CHUNK_HEADER), "bytes": len(m.data),
                                                "data": m.data[:200].decode("utf-8", "replace") if not m.headers else None})
                                  + b"\n")
                    try:
                        ack = await js.publish(m.subject, m.data, headers=hdrs)
                        if ack.duplicate:
                            cat.deduped += 1
                    except Exception as exc:  # a publish the server refuses is a rejection too, but not ours to count
                        report.setdefault("publish_errors", []).append(f"{cat.name}: {exc!r}")
                    sent += 1
                    cat.sent += 1
                cat.units += 1
                cat.island_must += u.islands
            await asyncio.sleep(args.pace)
        # Last: an INIT chunk of a generation the syncer never saw holds its INIT intake for a while,
        # so nothing else may queue behind it.
        for _ in range(args.init_gens if "stopped_early" not in report else 0):
            u = h.unit("init_unknown_gen")
            cat = by_name[u.cat]
            for m in u.msgs:
                await js.publish(m.subject, m.data, headers=dict(m.headers or {}, **{S.MSG_ID: h.mid()}))
                sent += 1
                cat.sent += 1
            cat.units += 1
        report["send_s"] = time.monotonic() - t_start
        report["sent"] = sent
        # keep sampling the syncer's RSS until it exits
        while procs.procs["syncer"].poll() is None and time.monotonic() - t0 < args.timeout:
            rss.append(_rss_kib(pid) or rss[-1])
            await asyncio.sleep(0.5)
    finally:
        report["_nc"] = nc


async def collect(nc, run: str, report: dict) -> None:
    js = nc.jetstream(timeout=20)
    real = set(report.get("real_gens", {}).values())
    recs = await tape(js, run)
    for c in CATS:
        c.observed = 0
    collateral = []
    for rec in recs:
        if not is_rejection(rec):
            continue
        cat = attribute(rec, real)
        if cat is None:
            collateral.append(rec)
            continue
        c = next(c for c in CATS if c.name == cat)
        if rec["kind"] == c.record:
            c.observed += 1
        else:
            c.extra += 1
    report["collateral"] = collateral
    merges = sorted(r["t"] for r in recs if r.get("kind") == "merge")
    report["merges"] = len(merges)
    report["max_commit_gap_s"] = max((b - a for a, b in zip(merges, merges[1:])), default=0.0)
    report["status"] = await kv_json(js, run, "syncer") or {}


def island_rejections(procs: Procs) -> dict[str, dict[str, int]]:
    out = {}
    for isl in ISLANDS:
        text = procs.log(isl)
        notices = [int(k) for k in RX_NOTICE.findall(text)]
        out[isl] = {"ctl": len(RX_CTL.findall(text)), "notice": sum(1 for k in notices if k >= 50),
                    "cut": len(RX_CUT.findall(text)) + sum(1 for k in notices if k < 50)}
    return out


def final_equal(work: Path, run: str) -> tuple[bool, str]:
    from safetensors.torch import load_file

    from yeto.services.cmd_export import export

    path = work / "final-cut.safetensors"
    try:
        export(work / "syncer", path, run)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the bench must print its last line
        return False, f"export failed: {exc!r}"
    final = load_file(str(path))
    for isl in ISLANDS:
        p = work / f"island-{isl}.safetensors"
        if not p.exists():
            return False, f"island {isl} saved no parameters"
        mine = load_file(str(p))
        if sorted(mine) != sorted(final):
            return False, f"island {isl} has other tensors than the final cut"
        for k, v in final.items():
            if not torch.equal(mine[k], v):
                return False, f"island {isl} differs from the final cut at {k}"
    return True, "every island equals the final cut bitwise"


# ---- --poison: a compromised island against the syncer's default defences ---------------------------

POISON_KINDS = ("plus50", "nan", "norm5x", "tokens")   # learner/demo.py's fault injector (YETO_DEMO_POISON)


def final_eval_loss(work: Path, run: str) -> float:
    """The held-out loss (learner.demo.eval_loss) of the run's final cut, exported from the syncer's checkpoint."""
    from safetensors.torch import load_file

    from yeto.learner import demo
    from yeto.services.cmd_export import export

    path = work / "final-cut.safetensors"
    export(work / "syncer", path, run)
    weights = load_file(str(path))
    model = demo.build_model(hidden=weights["0.weight"].shape[0])
    model.load_state_dict(weights)
    return demo.eval_loss(model)


def norm_headroom(merges: list[dict]) -> float:
    """The largest ratio, over a run's merged pushes, of a push's norm to the reference norm the syncer's
    default norm bound judged it against (services/syncer/pushes.py, replayed from the merge records'
    `detail.norms`): how close an honest run came to --push-norm-factor."""
    from yeto.services.syncer.config import NORM_HISTORY, NORM_MIN_ISLANDS
    from yeto.services.syncer.state import lower_median

    hist: dict[int, dict[str, list[float]]] = {}
    worst = 0.0
    for m in sorted(merges, key=lambda r: r.get("step", 0)):
        norms = (m.get("detail") or {}).get("norms") or {}
        h = hist.setdefault(m["fragment"], {})
        values = []
        for isl in sorted(e["island"] for e in m.get("expected", [])):
            own = [v for v in h.get(isl, []) if v > 0] + ([norms[isl]] if norms.get(isl, 0) > 0 else [])
            if own:
                values.append(lower_median(own))
        if len(values) >= NORM_MIN_ISLANDS:
            ref = lower_median(values)
            worst = max([worst] + [n / ref for n in norms.values()])
        for isl, n in norms.items():
            h.setdefault(isl, []).append(n)
            del h[isl][:-NORM_HISTORY]
    return worst


def poison_runs(url: str, work: Path, a) -> dict[str, dict]:
    """One clean run and one run per poison kind, side by side on one broker: the real syncer with its
    default defence flags (none given) and islands a and b (`python -m yeto.learner.demo`); island a of a
    poisoned run carries YETO_DEMO_POISON=<kind>. Returns {kind or "clean": {eval_loss, exit_codes, rounds}}."""
    import nats

    kinds = ["clean", *a.poison]
    stamp = int(time.time())
    runs = {k: (f"poison-{k}-{a.seed}-{stamp}", work / k) for k in kinds}
    procs = {}
    for k, (run, wd) in runs.items():
        wd.mkdir(parents=True, exist_ok=True)
        procs[k] = Procs(url, run, wd, a, {"a": {"YETO_DEMO_POISON": k}} if k != "clean" else None)
    out: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        for pr in procs.values():
            pr.start()
        for k, pr in procs.items():
            rcs = {}
            for name, proc in pr.procs.items():
                try:
                    rcs[name] = proc.wait(max(1.0, t0 + a.timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rcs[name] = None
            out[k] = {"exit_codes": rcs}

        async def status():
            nc = await nats.connect(url)
            try:
                js = nc.jetstream(timeout=20)
                for k, (run, _) in runs.items():
                    st = await kv_json(js, run, "syncer") or {}
                    out[k]["rounds"] = st.get("rounds", {})
                    out[k]["committed_step"] = st.get("committed_step")
                    out[k]["headroom"] = norm_headroom([r for r in await tape(js, run) if r.get("kind") == "merge"])
            finally:
                await nc.close()
        asyncio.run(status())
        for k, (run, wd) in runs.items():
            try:
                out[k]["eval_loss"] = final_eval_loss(wd, run)
            except Exception as exc:  # noqa: BLE001 - reported: the bench must print its lines
                out[k]["eval_loss"] = float("nan")
                out[k]["error"] = repr(exc)
    finally:
        for pr in procs.values():
            pr.stop()
    out["_wall_s"] = {"s": time.monotonic() - t0}
    return out


def poison_main(a, url: str, work: Path) -> int:
    print(f"hostile --poison: {','.join(a.poison)} against a clean run, {a.rounds} rounds, NATS {url}, files in {work}",
          flush=True)
    res = poison_runs(url, work, a)
    wall = res.pop("_wall_s")["s"]
    clean = res["clean"]
    ok = all(rc == 0 for rc in clean["exit_codes"].values()) and clean.get("committed_step") == a.rounds
    # an honest run is never touched by the defences: nothing quarantined, no claim cut
    honest = clean.get("rounds", {}).get("disposition.quarantined", 0) + clean.get("rounds", {}).get("tokens.clamped", 0)
    ok = ok and honest == 0
    print(f"poison kind=clean eval_loss={clean['eval_loss']:.6g} quarantined={clean.get('rounds', {}).get('disposition.quarantined', 0)} "
          f"clamped={clean.get('rounds', {}).get('tokens.clamped', 0)} committed={clean.get('committed_step')} "
          f"max_norm_ratio={clean.get('headroom', 0.0):.3g} "
          f"exit_codes={clean['exit_codes']}" + (f" error={clean['error']}" if "error" in clean else ""))
    for k in a.poison:
        r = res[k]
        rounds = r.get("rounds", {})
        quarantined = {q.split(".", 1)[1]: v for q, v in rounds.items() if q.startswith("quarantine.")}
        ratio = r["eval_loss"] / clean["eval_loss"] if clean["eval_loss"] > 0 else float("inf")
        fine = all(rc == 0 for rc in r["exit_codes"].values()) and r.get("committed_step") == a.rounds
        ok = ok and fine and ratio <= a.max_ratio
        print(f"poison kind={k} clean={clean['eval_loss']:.6g} poisoned={r['eval_loss']:.6g} ratio={ratio:.4g} "
              f"quarantined={rounds.get('disposition.quarantined', 0)} clamped={rounds.get('tokens.clamped', 0)} "
              f"merges={rounds.get('merge', 0)} committed={r.get('committed_step')} rules={json.dumps(quarantined)} "
              f"exit_codes={json.dumps(r['exit_codes'])}" + (f" error={r['error']}" if "error" in r else ""), flush=True)
    print(f"poison ok={'true' if ok else 'false'} kinds={len(a.poison)} max_ratio={a.max_ratio:g} wall_s={wall:.0f}",
          flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak/hostile.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", default=None, help="use this NATS server instead of the embedded one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=None, help="hostile messages to send (default 1000; --quick 250)")
    p.add_argument("--quick", action="store_true", help="a shorter run and fewer messages (the suite's test)")
    p.add_argument("--rounds", type=int, default=None, help="global rounds of the run (default 80; --quick 30)")
    p.add_argument("--step-delay", type=float, default=None, help="islands' simulated compute per step (s)")
    p.add_argument("--chunk-bytes", type=int, default=4096, help="session chunk size: several chunks per fragment")
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--init-gens", type=int, default=2, help="INIT chunks of unknown generations to send")
    p.add_argument("--pace", type=float, default=0.05, help="pause between two batches of messages (s)")
    p.add_argument("--impersonate", action="store_true",
                   help="also forge pulls for rounds not committed yet and messages naming the islands' real "
                        "generations (syncer impersonation: only server permissions stop it; expect stalls)")
    p.add_argument("--skip", default="", help="categories (comma separated) left out of the seeded plan, the "
                   "other messages staying the same: for bisecting a failure")
    p.add_argument("--poison", default=None, metavar="KIND[,KIND...]",
                   help="instead of the flood: a clean run and, side by side, one run per KIND (plus50, nan, norm5x, "
                        "tokens, or all) whose island a is compromised (learner/demo.py's YETO_DEMO_POISON), the "
                        "syncer on its default flags; prints per kind `poison kind=K clean=X poisoned=Y ratio=R ...` "
                        "and last `poison ok=<true|false> ...` (ok: every run finished and every ratio <= --max-ratio)")
    p.add_argument("--max-ratio", type=float, default=10.0, help="--poison: the largest poisoned/clean eval loss ratio "
                   "that passes")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--workdir", default=None)
    p.add_argument("--run", default=None)
    a = p.parse_args(argv)
    import signal

    # a SIGTERM (a CI timeout) still runs the `finally` below: no syncer, island or broker left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.poison is not None:
        kinds = list(POISON_KINDS) if a.poison.strip() == "all" else [k.strip() for k in a.poison.split(",") if k.strip()]
        bad = [k for k in kinds if k not in POISON_KINDS]
        if bad or not kinds:
            p.error(f"--poison: {bad or a.poison!r} not among {', '.join(POISON_KINDS)} (or all)")
        a.poison = kinds
        a.rounds = a.rounds if a.rounds is not None else 16
    a.count = a.count if a.count is not None else (250 if a.quick else 1000)
    a.rounds = a.rounds if a.rounds is not None else (30 if a.quick else 80)
    a.step_delay = a.step_delay if a.step_delay is not None else (0.04 if a.quick else 0.05)
    a.timeout = a.timeout if a.timeout is not None else (150.0 if a.quick else 400.0)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="yeto-hostile-"))
    work.mkdir(parents=True, exist_ok=True)
    run = a.run or f"hostile-{a.seed}-{int(time.time())}"
    broker = None
    url = a.nats
    if not url:
        from yeto.services.broker import Broker

        broker = Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log").start()
        url = broker.url
    if a.poison is not None:
        try:
            return poison_main(a, url, work)
        finally:
            if broker is not None:
                broker.stop()
    print(f"hostile: run {run}, NATS {url}, seed {a.seed}, {a.count} messages, files in {work}", flush=True)
    procs = Procs(url, run, work, a)
    report: dict = {}
    crashes = 0
    t0 = time.monotonic()
    try:
        procs.start()
        try:
            asyncio.run(asyncio.wait_for(attack(url, run, procs, a, report), a.timeout))
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            report["attack_error"] = repr(exc)
        deadline = t0 + a.timeout
        rcs = {}
        for name, proc in procs.procs.items():
            try:
                rcs[name] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rcs[name] = None
        report["exit_codes"] = rcs
        crashes += sum(1 for rc in rcs.values() if rc != 0)

        async def _collect():
            import nats

            nc = await nats.connect(url)
            try:
                await collect(nc, run, report)
            finally:
                await nc.close()
        old = report.pop("_nc", None)
        if old is not None:
            try:
                asyncio.run(old.close())
            except Exception:
                pass
        asyncio.run(_collect())
        st = report.get("status", {})
        handler_errors = {k: v for k, v in st.get("counters", {}).items() if k.startswith("handler_error")}
        report["handler_errors"] = handler_errors
        crashes += sum(handler_errors.values())
        isl_rej = island_rejections(procs)
        report["island_rejections"] = isl_rej
        eq, why = final_equal(work, run) if all(rc == 0 for rc in rcs.values()) else (False, "a process failed")
        report["final_equal_why"] = why
    finally:
        procs.stop()
        if broker is not None:
            broker.stop()

    # ---- report
    sent = report.get("sent", 0)
    print(f"\n{'category':26s} {'target':8s} {'sent':>6s} {'units':>6s} {'must':>6s} {'seen':>6s} {'other':>6s}")
    must = seen = 0
    isl_rej = report.get("island_rejections", {})
    for c in CATS:
        if c.target == "syncer":
            m, o = c.must, c.observed
        elif c.target == "islands":
            m, o = c.island_must, None
        else:
            m, o = None, c.observed or None
        if c.sent == 0:
            continue
        print(f"{c.name:26s} {c.target:8s} {c.sent:6d} {c.units:6d} {'' if m is None else m:>6} {'' if o is None else o:>6}"
              f" {c.extra or '':>6}" + (f"  (JetStream dropped {c.deduped} duplicates)" if c.deduped else ""))
        if c.target == "syncer":
            must += m
            seen += o
    syncer_must, syncer_seen = must, seen
    isl_must = sum(c.island_must for c in CATS if c.target == "islands")
    isl_seen = sum(v["ctl"] + v["notice"] for v in isl_rej.values())
    must += isl_must
    seen += isl_seen
    rss = report.get("rss_kib") or [0]
    print(f"\nsyncer: tape rejections {syncer_seen} of {syncer_must} that must be; collateral (real islands' "
          f"rejections) {len(report.get('collateral', []))}; handler errors {report.get('handler_errors', {})}")
    print(f"islands: CTL + notice rejections {isl_seen} of {isl_must} that must be; cut rejections "
          f"{sum(v['cut'] for v in isl_rej.values())} (payload forgeries read before being overwritten); per island {isl_rej}")
    print(f"run: {report.get('merges', 0)} merges of {a.rounds}; longest gap between two commits "
          f"{report.get('max_commit_gap_s', 0.0):.1f} s (quorum timeout {a.quorum_timeout:.0f} s); exit codes {report.get('exit_codes')}")
    print(f"syncer RSS: {rss[0] / 1024:.1f} MiB when the flood began, peak {max(rss) / 1024:.1f} MiB, "
          f"last {rss[-1] / 1024:.1f} MiB; flood sent in {report.get('send_s', 0.0):.1f} s; whole bench {time.monotonic() - t0:.0f} s")
    for key in ("stopped_early", "attack_error", "publish_errors"):
        if report.get(key):
            print(f"{key}: {report[key] if key != 'publish_errors' else report[key][:5]}")
    for rec in report.get("collateral", [])[:5]:
        print(f"collateral: {json.dumps(rec)[:300]}")
    print(f"final: {report.get('final_equal_why')}")
    eq = report.get("final_equal_why") == "every island equals the final cut bitwise"
    print(f"hostile must={must} stall_s={report.get('max_commit_gap_s', 0.0):.1f} rss_growth_mib="
          f"{(max(rss) - rss[0]) / 1024:.1f}")
    print(f"hostile sent={sent} rejected={seen} crashes={crashes} final_equal={'true' if eq else 'false'}", flush=True)
    return 0 if crashes == 0 and eq and seen == must else 1


if __name__ == "__main__":
    sys.exit(main())
