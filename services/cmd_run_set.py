"""`yeto run set R key=value ...`: change what may change between rounds of a running run.

Sends one `settings` request (schemas/run_settings.py names the keys) on `yeto.R.ctl.set` and waits for
every syncer shard's answer; asks once more with the same id when none came in half the time (a shard
applies one id once). Exit 0 when every shard put the change in force, 1 when one refused it or none
answered, 2 for a bad key or value (nothing is sent).
"""
from __future__ import annotations

import asyncio
import getpass
import socket
import time
import uuid

from yeto.schemas import codec, subjects as S
from yeto.schemas.conn import ConnectOptions, add_connect_args, connect
from yeto.schemas.errors import WireError
from yeto.schemas.run_settings import KEYS, parse_assignments


def _fmt(values: dict) -> str:
    return ", ".join(f"{k}={'off' if v is None else v:g}" if isinstance(v, float) else f"{k}={'off' if v is None else v}"
                     for k, v in sorted(values.items()))


async def ask(opts: ConnectOptions, run: str, settings: dict, *, timeout_s: float = 10.0, request_id: str | None = None,
              by: str | None = None) -> tuple[list[dict], int | None]:
    """Send the request; every shard's answer (validated), and how many shards the run has (None: nobody answered)."""
    rid = request_id or f"set-{uuid.uuid4().hex[:12]}"
    who = by or f"{getpass.getuser()}@{socket.gethostname()}"
    msg = codec.encode("settings", codec.make("settings", run=run, id=rid, set=settings, by=who[:128]))
    nc = await connect(opts, name="yeto-run-set")
    answers: dict[int, dict] = {}
    shards: list[int] = []
    got = asyncio.Event()

    async def on_answer(m) -> None:
        try:
            _, a = codec.decode_typed(m.data, allowed=("settings_result",))
        except WireError:
            return   # not an answer of ours: ignored (the syncers' answers validate)
        if a["id"] != rid or a["run"] != run:
            return
        answers[a["shard"]] = a
        shards[:] = [a["shards"]]
        if len(answers) >= a["shards"]:
            got.set()

    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=on_answer)
        deadline = time.monotonic() + timeout_s
        await nc.publish(S.settings(run), msg, reply=inbox)
        try:
            await asyncio.wait_for(got.wait(), timeout_s / 2)
        except asyncio.TimeoutError:
            if not answers:   # lost on the way, or the owner was changing hands: the same id again
                await nc.publish(S.settings(run), msg, reply=inbox)
            try:
                await asyncio.wait_for(got.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
        await sub.unsubscribe()
    finally:
        await nc.close()
    return [answers[k] for k in sorted(answers)], (shards[0] if shards else None)


def cmd(args) -> int:
    settings = parse_assignments(args.settings)   # ConfigError: a usage error naming the word (exit 2)
    answers, shards = asyncio.run(ask(ConnectOptions.from_args(args, name="yeto-run-set"), args.run, settings,
                                      timeout_s=args.timeout, request_id=args.id))
    if shards is None:
        print(f"yeto run set: no syncer of run {args.run} answered on {S.settings(args.run)} within {args.timeout:g} s "
              f"(is its syncer running, and may this identity publish there?); nothing changed", flush=True)
        return 1
    ok = len(answers) == shards and all(a["ok"] for a in answers)
    for a in answers:
        where = f"shard {a['shard']}/{a['shards']}" if a["shards"] > 1 else "syncer"
        if a["ok"]:
            what = _fmt(a.get("changed") or {}) or "nothing new (already in force)"
            print(f"run {args.run}: {where}: {what} in force from committed step {a.get('step', 0)} (rounds launched "
                  f"from now on; outer values from the next merge); now set: {_fmt(a.get('settings') or {})}")
        else:
            detail = f" (field {a['field']}, value {a.get('value')!r})" if "field" in a else ""
            print(f"run {args.run}: {where} refused: {a.get('error')}{detail}")
    missing = sorted(set(range(shards)) - {a["shard"] for a in answers})
    if missing:
        print(f"run {args.run}: no answer from shard(s) {missing} within {args.timeout:g} s: run the same command "
              f"again (with --id {answers[0]['id']}) once they are back")
    return 0 if ok else 1


def add_parser(rsub) -> None:
    s = rsub.add_parser("set", help="change settings of a running run between rounds (outer lr, timeouts, quorum, ...)",
                        description=__doc__ + "\nKeys: " + ", ".join(KEYS) + " (off/all for none).")
    s.add_argument("run_id", metavar="R", help="run id")
    s.add_argument("settings", nargs="+", metavar="KEY=VALUE", help="e.g. outer_lr=0.5 quorum_timeout=120")
    add_connect_args(s, run=False)
    s.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for every shard's answer (default 10)")
    s.add_argument("--id", default=None, help="the request id (default: a new one); a retry with the same id is "
                   "applied once")
    s.set_defaults(func=cmd)
