"""`yeto demo`: the end-to-end CPU demo (README.md "Quick start").

Starts the embedded broker (or uses `--nats`), the syncer and two islands as separate processes (island
`a` one process, island `b` two data-parallel gloo ranks running `python -m yeto.learner.demo`: this
package never imports the learner), which train a tiny MLP with streaming DiLoCo, then finalize. Ends with
one JSON line: rounds, final_loss per island, eval_loss of the exported final cut, max_abs_diff_vs_final_cut
(each island's saved parameters against the exported final cut: must be 0.0), the boundary overhead.
`--datacenters 2`: a hub (broker in domain `hub`, the syncer, island a) and a datacenter `dc1` (a leaf
node, islands b and c reading their local mirror); the line adds `wan` (leaf-link bytes over the cut's
bytes, services/leaf.py). `--secure`: one auth directory, the leaf dialling with dc1's identity over TLS.
`--model-mib` widens the MLP; `--outer sparseloco` runs the sparse outer mode (docs/design.md §4.10). `--syncer-shards N`: N shard processes (at most `--fragments`), the final cut
exported from all their directories together.
Every process logs to WORK/<name>.log (services/run_harness.py); the demo echoes the lines worth watching.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from yeto.schemas.dtypes import PUSH_DTYPES
from yeto.services.run_harness import read_jsonl


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the CPU demo: embedded broker, syncer, two islands, a tiny model")
    p.add_argument("--nats", default=None, help="use this NATS server instead of starting the embedded one")
    p.add_argument("--run", default=None, help="run id (default: demo-<unix time>)")
    p.add_argument("--rounds", type=int, default=24, help="global rounds to commit (default %(default)s)")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=8, help="H, inner steps between two syncs of one fragment")
    p.add_argument("--push-dtype", default="f32", choices=PUSH_DTYPES)
    p.add_argument("--outer", default="diloco", choices=("diloco", "sparseloco"),
                   help="the syncer's outer mode (yeto syncer --outer, with its default --sparse-* settings)")
    p.add_argument("--workdir", default=None, help="keep logs, step logs and weights here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=170.0, help="give up after this many seconds")
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas of the run's streams and buckets, passed to the syncer; above 1 without --nats the "
                        "demo starts a local JetStream cluster of that many servers (default %(default)s)")
    p.add_argument("--secure", action="store_true",
                   help="run it through a secured broker: `yeto auth init --tls` into the work directory, the broker "
                        "serves it (`yeto broker --auth`), every process connects with its own identity and verifies "
                        "the server with the run's CA (not with --nats); with --datacenters 2 the hub and the leaf "
                        "node both, linked with the datacenter's leaf identity")
    p.add_argument("--datacenters", type=int, choices=(1, 2), default=1,
                   help="2: a hub (broker, syncer, island a) and a second datacenter, a leaf node with islands b and c "
                        "that read the cut from their local mirror; the summary adds the WAN bytes (default %(default)s)")
    p.add_argument("--syncer-shards", type=int, default=1,
                   help="run the syncer as this many shard processes (yeto syncer --shard K --shards N), at most "
                        "--fragments (default %(default)s)")
    p.add_argument("--model-mib", type=float, default=0.0,
                   help="give the islands a model of about this many MiB (default 0: the tiny MLP)")
    p.set_defaults(func=run)


async def _count_merges(url: str, run: str, ident: dict[str, str] | None = None) -> int:
    from yeto.schemas.conn import ConnectOptions, connect
    from yeto.services.run_harness import read_tape

    ident = ident or {}  # a secured demo reads the tape as its observer
    nc = await connect(ConnectOptions(url=url, creds=ident.get("YETO_NATS_CREDS"), tls_ca=ident.get("YETO_TLS_CA")))
    try:
        return len(await read_tape(nc.jetstream(), run, "merge"))
    finally:
        await nc.close()


def _syncer_line(line: str) -> bool:
    return (" -> version " in line or "final cut" in line or "ERROR" in line or "finished" in line
            or "session pinned" in line or "missing" in line)


def _island_line(line: str) -> bool:
    return line.startswith("[") or "Error" in line or "Traceback" in line or "RESULT {" in line


def _overhead(path: Path) -> dict:
    rows = read_jsonl(path)
    if len(rows) < 3:
        return {"steps": len(rows)}
    span = rows[-1]["t"] - rows[0]["t"]
    step_time = span / (len(rows) - 1)
    boundary = sum(r["boundary_s"] for r in rows) / len(rows)
    return {"steps": len(rows), "step_time_s": round(step_time, 5), "boundary_s": round(boundary, 5),
            "boundary_overhead": round(boundary / step_time, 4) if step_time > 0 else None}


class _Secure:
    """`yeto demo --secure`: the run's identities (`yeto auth init --tls`, island a the INIT island; with
    two datacenters also island c and the leaf identity of dc1) in WORK/auth and the broker config
    serving them (services.cmd_broker.AuthServe, what `yeto broker --auth` serves). `env(name)`: the
    credentials and CA of identity `name` as its process reads them."""

    ISLANDS = ("a", "b")

    def __init__(self, work: Path, run_id: str, datacenters: int = 1):
        from yeto.services.auth import init_auth
        from yeto.services.cmd_broker import AuthServe

        self.dir = work / "auth"
        islands = ["a", "b", "c"] if datacenters == 2 else list(self.ISLANDS)
        init_auth(run_id, islands, self.dir, init_island=self.ISLANDS[0], tls=True,
                  datacenters=["dc1"] if datacenters == 2 else None)
        self.served = AuthServe(self.dir)
        self.others = []   # the AuthServe of a secured hub and leaf (two datacenters)

    def keep(self, *served) -> None:
        """Clean up these AuthServes (a secured hub's and leaf's) with the demo's own."""
        self.others += served

    def cleanup(self) -> None:
        for s in [self.served, *self.others]:
            s.cleanup()

    def env(self, name: str) -> dict[str, str]:
        return {"YETO_NATS_CREDS": str(self.dir / f"{name}.creds"), "YETO_TLS_CA": str(self.dir / "tls" / "ca.pem")}

    def start_broker(self, work: Path, replicas: int):
        from yeto.services.broker import Broker, Cluster

        if replicas > 1:
            return Cluster(replicas, store_dir=work / "jetstream", log_dir=work, config=self.served.config,
                           route_host="127.0.0.1", connect_opts=self.served.probe_options("")).start()
        return Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log", config=self.served.config).start()


def _no_identity(name: str) -> dict[str, str]:
    return {}


def _shown(url: str, secure: "_Secure | None") -> str:
    """A secured server requires TLS: say so in the URL its clients get."""
    return url.replace("nats://", "tls://") if secure else url


def check_shards(shards: object, fragments: int) -> str | None:
    """Why `--syncer-shards` cannot run with `--fragments` (None when it can)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        return f"--syncer-shards must be an integer >= 1, got {shards!r}"
    if shards > fragments:
        return (f"--syncer-shards {shards} exceeds --fragments {fragments}: every shard needs a fragment of its own; "
                f"pass --fragments {shards} or more")
    return None


def syncer_names(shards: int) -> list[str]:
    """The demo's names of its syncer processes (and of their checkpoint directories under WORK)."""
    return ["syncer"] if shards == 1 else [f"syncer-s{k}" for k in range(shards)]


def run(args) -> int:
    from safetensors.torch import load_file

    from yeto.services.broker import Broker, Cluster
    from yeto.services.cmd_export import export
    from yeto.services.run_harness import Child, ChildFailed, stop_all, wait_all

    why = check_shards(args.syncer_shards, args.fragments)
    if why:
        print(f"yeto demo: {why}", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="yeto-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    run_id = args.run or f"demo-{int(time.time())}"
    broker = None
    url = args.nats
    # (island, ranks, NATS URL, datacenter domain): island b runs two gloo ranks in the one-site demo.
    islands = [("a", 1, None, None), ("b", 2, None, None)]
    leaf_node = None
    if args.datacenters == 2 and (url or args.replicas > 1):
        print("yeto demo: --datacenters 2 starts its own hub and leaf node (no --nats, --replicas 1)", file=sys.stderr)
        return 2
    secure, ident = None, _no_identity
    if args.secure and url:
        print("yeto demo: --secure starts its own secured broker; leave out --nats", file=sys.stderr)
        return 2
    if args.secure:
        secure = _Secure(work, run_id, args.datacenters)
        ident = secure.env
    if args.datacenters == 2:
        from yeto.services.leaf import start_hub_and_leaf

        # secured: the hub admits dc1's leaf identity only, the leaf serves islands b and c their own keys
        broker, leaf_node = start_hub_and_leaf(work, "dc1", auth_dir=secure.dir if secure else None)
        if secure:
            secure.keep(broker.served, leaf_node.served)
        url, leaf_url = (_shown(b.url, secure) for b in (broker, leaf_node))
        islands = [("a", 1, None, None), ("b", 1, leaf_url, "dc1"), ("c", 1, leaf_url, "dc1")]
        print(f"yeto demo: hub {url} (domain hub), datacenter dc1 leaf node {leaf_url}", flush=True)
    elif secure:
        broker = secure.start_broker(work, args.replicas)
        url = _shown(broker.url, secure)
    elif not url and args.replicas > 1:
        broker = Cluster(args.replicas, store_dir=work / "jetstream", log_dir=work).start()
        url = broker.url
    elif not url:
        broker = Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log").start()
        url = broker.url
    print(f"yeto demo: run {run_id}, NATS {url}, files in {work}"
          + (f", identities and CA in {secure.dir}" if secure else ""), flush=True)
    env = dict(os.environ, YETO_NATS=url, YETO_RUN=run_id, PYTHONUNBUFFERED="1")
    procs: dict[str, Child] = {}
    t0 = time.monotonic()
    shards = args.syncer_shards
    syncers = syncer_names(shards)
    try:
        for k, name in enumerate(syncers):
            # every shard the same run flags, its own --shard and checkpoint directory (docs/shards.md "Syncer shards")
            syncer_cmd = [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", url, "--run", run_id,
                          "--islands", str(len(islands)), "--fragments", str(args.fragments),
                          "--sync-every", str(args.sync_every),
                          "--total-steps", str(args.rounds), "--push-dtype", args.push_dtype, "--outer", args.outer,
                          "--checkpoint-dir", str(work / name), "--small-limits", "--replicas", str(args.replicas),
                          "--quorum-timeout", "30",
                          "--member-timeout", "20", "--final-timeout", "60"]
            if shards > 1:
                syncer_cmd += ["--shard", str(k), "--shards", str(shards)]
            if secure:  # only the INIT island of the auth directory may publish the initial weights
                syncer_cmd += ["--init-island", secure.ISLANDS[0]]
            # group=False: a Ctrl-C on the demo reaches its children too
            procs[name] = Child(name, syncer_cmd, work / f"{name}.log", env=dict(env, **ident("syncer")),
                                group=False).start()
            procs[name].follow(_syncer_line, f"[{name}]")
        for name, ranks, island_url, domain in islands:
            cmd = [sys.executable, "-P", "-m", "yeto.learner.demo", "--run", run_id, "--island", name, "--ranks", str(ranks),
                   "--out", str(work / f"island-{name}.safetensors"), "--model-mib", str(args.model_mib)]
            e = dict(env, YETO_ISLAND=name, YETO_DILOCO_STEP_LOG=str(work / f"steplog-{name}.jsonl"), **ident(name))
            if domain:  # an island of the datacenter: connected to its leaf node
                e.update(YETO_NATS=island_url, YETO_DOMAIN=domain)
            procs[name] = Child(name, cmd, work / f"island-{name}.log", env=e, group=False).start()
            procs[name].follow(_island_line, f"[island {name}]")
        try:
            wait_all(procs, args.timeout, lines=30)
        except ChildFailed as err:
            print(f"yeto demo: {err}", file=sys.stderr)
            return 1
        for p in procs.values():  # every process exited: its follower reads the log to its end
            p.join_followers()
        names = [i[0] for i in islands]
        results = {name: procs[name].result() for name in names}
        missing = [name for name, r in results.items() if r is None]
        if missing:
            print(f"yeto demo: no RESULT line from island(s) {', '.join(missing)}", file=sys.stderr)
            return 1
        final_path = work / "final-cut.safetensors"
        export([work / name for name in syncers], final_path, run_id)  # every shard's directory: one cut
        final = load_file(str(final_path))
        diff = 0.0
        for name in names:
            mine = load_file(str(work / f"island-{name}.safetensors"))
            if sorted(mine) != sorted(final):
                print(f"yeto demo: island {name} saved {sorted(mine)}, the final cut has {sorted(final)}", file=sys.stderr)
                return 1
            for k, v in final.items():
                diff = max(diff, float((mine[k] - v).abs().max()))
        ev = subprocess.run([sys.executable, "-P", "-m", "yeto.learner.demo", "eval", "--weights", str(final_path)],
                            capture_output=True, text=True, env=env, check=True)
        eval_loss = json.loads(ev.stdout.strip().splitlines()[-1])["eval_loss"]
        rounds = asyncio.run(_count_merges(url, run_id, ident("observer")))
        summary = {
            "run": run_id,
            "rounds": rounds,
            "final_loss": {n: round(r["final_loss"], 6) for n, r in results.items()},
            "eval_loss": round(eval_loss, 6),
            "max_abs_diff_vs_final_cut": diff,
            "steps": {n: r["steps"] for n, r in results.items()},
            "boundary": {n: _overhead(work / f"steplog-{n}.jsonl") for n in names},
            "seconds": round(time.monotonic() - t0, 1),
            "workdir": str(work),
        }
        if shards > 1:
            summary["syncer_shards"] = shards
        if secure:
            summary["secure"] = {"tls": True, "identities": sorted(i.name for i in secure.served.ids)}
        if leaf_node is not None:
            from yeto.schemas.conn import ConnectOptions
            from yeto.services.leaf import wan_figures

            obs = ident("observer")  # a secured hub: read the syncer's record as the observer
            summary["wan"] = asyncio.run(wan_figures(broker, run_id, ConnectOptions(
                url=url, creds=obs.get("YETO_NATS_CREDS"), tls_ca=obs.get("YETO_TLS_CA"))))
        print(json.dumps(summary), flush=True)
        return 0 if diff == 0.0 and rounds == args.rounds else 1
    finally:
        stop_all(procs)
        if leaf_node is not None:
            leaf_node.stop()
        if broker is not None:
            broker.stop()
        if secure:
            secure.cleanup()
