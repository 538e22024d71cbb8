"""`yeto replay`: re-feed a run's recorded round-machine inputs to a fresh machine and check its actions.

The syncer records every event it feeds its round machine, and a digest of each action that came out,
on the run's tape (`input` records on `yeto.R.events.input`, see services/syncer/recording.py).
`yeto replay --run R` reads them from the broker; `--tape FILE` reads a JSON-lines export instead (one
tape record per line; `yeto replay --run R --export FILE` writes one: every record of the run's EVENTS
stream, so it also serves a post-mortem). Each syncer process (a resumed syncer starts a new one) is
replayed from its own start. Prints "replayed N events, M actions, identical" and exits 0, or prints the
first differing action (event and action index, expected and got) and exits 1; 2 for a tape it cannot
read. A crash or a strange round can so be replayed on a laptop, in a debugger if need be.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

from yeto.schemas.conn import add_connect_args


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a run's recorded syncer inputs and check the actions are identical")
    add_connect_args(p, run_required=False)
    p.add_argument("--tape", default=None, metavar="FILE",
                   help="read the tape from this JSON-lines file instead of the broker")
    p.add_argument("--export", default=None, metavar="FILE",
                   help="with --run: also write every record of the run's tape to FILE as JSON lines")
    p.set_defaults(func=run)


async def read_tape(args) -> list[dict]:
    """Every record of the run's EVENTS stream, in stream order."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import DeliverPolicy

    from yeto.schemas import subjects as S
    from yeto.schemas.conn import ConnectOptions, connect

    nc = await connect(ConnectOptions.from_args(args, name=f"yeto-replay-{args.run}"))
    try:
        js = nc.jetstream()
        info = await js.stream_info(S.stream(args.run, "EVENTS"))
        out: list[dict] = []
        if not info.state.messages:
            return out
        sub = await js.subscribe(S.events_all(args.run), stream=S.stream(args.run, "EVENTS"), ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=10)
                except (NatsTimeout, asyncio.TimeoutError):
                    break  # records deleted under us: what was read is the tape
                out.append(orjson.loads(msg.data))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return out
    finally:
        await nc.close()


def read_file(path: str) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON record: {exc}") from None
    return out


def run(args) -> int:
    from yeto.services.syncer.replay import TapeError, replay, segments

    if (args.tape is None) == (args.run is None):
        print("yeto replay: give --run R (read the broker) or --tape FILE (a JSON-lines export), not both",
              file=sys.stderr)
        return 2
    if args.export and args.tape:
        print("yeto replay: --export needs --run (it writes what it reads from the broker)", file=sys.stderr)
        return 2
    try:
        records = read_file(args.tape) if args.tape else asyncio.run(read_tape(args))
    except (OSError, ValueError) as exc:
        print(f"yeto replay: {exc}", file=sys.stderr)
        return 2
    if args.export:
        with open(args.export, "wb") as f:
            for rec in records:
                f.write(orjson.dumps(rec) + b"\n")
        print(f"wrote {len(records)} tape records to {args.export}")
    try:
        segs = segments(records)
    except TapeError as exc:
        print(f"yeto replay: {exc}", file=sys.stderr)
        return 2
    if not segs:
        print("yeto replay: the tape holds no input records (a syncer older than the recording?)", file=sys.stderr)
        return 2
    events = actions = 0
    for seg in segs:
        res = replay(seg)
        events, actions = events + res.events, actions + res.actions
        how = "resumed" if seg.resumed else "fresh"
        if res.gap:
            print(f"syncer process {seg.proc} ({how}): {res.gap}", file=sys.stderr)
        if not res.identical:
            print(f"syncer process {seg.proc} ({how}): {res.difference.describe()}")
            return 1
        print(f"syncer process {seg.proc} ({how}): {res.events} events, {res.actions} actions, identical")
    print(f"replayed {events} events, {actions} actions, identical")
    return 0
