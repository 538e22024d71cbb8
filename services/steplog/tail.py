"""`yeto steplog tail`: a live terminal table of a run's islands and rounds (rich), or raw JSON lines.

`render(agg, now)` is pure (Aggregator in, rich renderable out); `tail(...)` is the shell that
subscribes and refreshes it.
"""
from __future__ import annotations

import asyncio
import io
import sys
import time
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .aggregate import Aggregator, IslandState, RoundState
from .consume import Feed, SourceOptions, subscribe

DASH = "-"


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return DASH
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover (loop always returns)


def secs(x: float | None) -> str:
    if x is None:
        return DASH
    if x < 1:
        return f"{x * 1000:.0f} ms" if x >= 0.0005 or x == 0 else f"{x * 1e6:.0f} µs"
    if x < 120:
        return f"{x:.2f} s"
    if x < 7200:
        return f"{x / 60:.1f} min"
    if x < 2 * 86400:
        return f"{x / 3600:.1f} h"
    return f"{x / 86400:.1f} d"


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else DASH


def fmt_versions(v: dict[int, int]) -> str:
    return " ".join(f"{f}:{ver}" for f, ver in sorted(v.items())) or DASH


def fmt_lag(st: IslandState, syncer: dict[int, int]) -> Text:
    lag = st.lag(syncer)
    missing = st.missing(syncer)
    if not lag and not missing:
        return Text(DASH)
    worst = max(lag.values()) if lag else 0
    parts = [f"{f}:{n}" for f, n in lag.items() if n]
    text = str(worst) if not parts else f"{worst} ({' '.join(parts)})"
    if missing:
        text += f" no {','.join(map(str, missing))}"
    style = "green" if worst == 0 and not missing else ("yellow" if worst <= 1 else "red")
    return Text(text, style=style)


def fmt_dispositions(c) -> str:
    if not c:
        return DASH
    order = {d: i for i, d in enumerate(("accepted", "duplicate", "unexpected_member", "future_base", "stale_base",
                                        "out_of_round", "invalid", "quarantined"))}
    return " ".join(f"{d} {n}" for d, n in sorted(c.items(), key=lambda kv: order.get(kv[0], 99)))


def _columns(t: Table, cols) -> None:
    for name, just, wrap in cols:
        # wrapping columns get a floor so a narrow terminal folds them instead of hiding them
        t.add_column(name, justify=just, no_wrap=not wrap, min_width=8 if wrap else None)


def island_table(agg: Aggregator, now: float) -> Table:
    """Per island: where it is and how long its sync boundary takes."""
    t = Table(title="islands", title_justify="left", pad_edge=False)
    _columns(t, [("island", "left", False), ("step", "right", False), ("age", "right", False),
                 ("boundary", "right", False), ("export", "right", False), ("apply", "right", False),
                 ("exp/app", "right", False), ("mean bnd", "right", False), ("versions", "left", True),
                 ("lag", "left", True), ("pulls", "right", False), ("loss", "right", False)])
    for name, st in sorted(agg.islands.items()):
        label = name + (" (left)" if st.live is False else "")
        if st.events == 0:
            t.add_row(label, *([DASH] * 11))
            continue
        t.add_row(
            label, str(st.step), secs(max(0.0, now - st.t)),
            secs(st.boundary_s), secs(st.export_s), secs(st.apply_s),
            f"{pct(st.export_s, st.boundary_s)}/{pct(st.apply_s, st.boundary_s)}",
            secs(st.boundary_sum_s / st.events),
            fmt_versions(st.versions), fmt_lag(st, agg.syncer_versions), str(st.pending_pulls),
            DASH if st.loss is None else f"{st.loss:.4g}",
        )
    return t


def traffic_table(agg: Aggregator) -> Table:
    """Per island: what it sent and received (this step, and Σ since the viewer started) and how the
    syncer disposed of its pushes."""
    t = Table(title="island traffic", title_justify="left", pad_edge=False)
    _columns(t, [("island", "left", False), ("gen", "left", False), ("push/apply", "right", False),
                 ("out", "right", False), ("in", "right", False), ("scat/gath", "right", False),
                 ("rej", "right", False), ("dispositions", "left", True), ("drop", "right", False)])
    for name, st in sorted(agg.islands.items()):
        label = name + (" (left)" if st.live is False else "")
        gen = (st.gen or DASH) + (f" ×{st.gens}" if st.gens > 1 else "")
        if st.events == 0:
            t.add_row(label, gen, *([DASH] * 5), fmt_dispositions(st.dispositions), DASH)
            continue
        tot, last = st.totals, st.last
        t.add_row(
            label, gen, f"{tot['pushes']}/{tot['applies']}",
            f"{human_bytes(last['bytes_out'])} Σ{human_bytes(tot['bytes_out'])}",
            f"{human_bytes(last['bytes_in'])} Σ{human_bytes(tot['bytes_in'])}",
            f"{human_bytes(tot['scatter_bytes'])}/{human_bytes(tot['gather_bytes'])}",
            str(tot["rejected"]), fmt_dispositions(st.dispositions), str(st.dropped),
        )
    return t


def round_table(agg: Aggregator, limit: int = 12) -> Table:
    t = Table(title=f"rounds (last {limit})", title_justify="left", pad_edge=False)
    for name in ("step", "frag", "attempt", "status", "resp/exp (K)", "quorum", "grace", "sync", "restarts",
                 "timeouts", "dispositions", "version", "reason"):
        wrap = name in ("dispositions", "reason")
        t.add_column(name, justify="right" if name in ("step", "frag", "attempt", "restarts", "timeouts") else "left",
                     no_wrap=not wrap, min_width=12 if name == "dispositions" else None)
    for step in sorted(agg.rounds)[-limit:]:
        r: RoundState = agg.rounds[step]
        status_style = {"open": "yellow", "merged": "cyan", "committed": "green"}[r.status]
        resp = (f"{DASH if r.responded is None else r.responded}/{DASH if r.expected is None else r.expected}"
                f" ({DASH if r.quorum is None else r.quorum})")
        ver = DASH if r.version is None else (f"{r.base_version}→{r.version}" if r.base_version is not None else str(r.version))
        t.add_row(str(r.step), DASH if r.fragment is None else str(r.fragment), str(r.attempt),
                  Text(r.status, style=status_style), resp, secs(r.quorum_s), secs(r.grace_s), secs(r.sync_s),
                  str(r.restarts), str(r.quorum_timeouts), fmt_dispositions(r.dispositions), ver, r.reason or "")
    return t


def shard_table(agg: Aggregator, now: float) -> Table | None:
    """Per syncer process (shard): whether it reports, what it does, its last commit and its memory.
    None before any status or commit record was read (the run's state KV is empty or unreadable)."""
    rows = agg.shard_rows(now)
    if not rows:
        return None
    n = rows[0].shards
    t = Table(title="syncer" + (f" shards ({n})" if n > 1 else ""), title_justify="left", pad_edge=False)
    _columns(t, [("shard", "right", False), ("state", "left", True), ("phase", "left", False),
                 ("committed", "right", False), ("in flight", "left", True), ("versions", "left", True),
                 ("rss", "right", False), ("age", "right", False)])
    for r in rows:
        style = {"ok": "green", "exited": "cyan"}.get(r.state, "bold red")
        state = r.state.upper() if r.state == "missing" else r.state
        if r.reason and r.state == "missing":
            state += f" ({r.reason})"
        t.add_row(str(r.shard), Text(state, style=style), r.phase or DASH,
                  DASH if r.committed_step is None else str(r.committed_step),
                  " ".join(map(str, r.rounds_in_flight)) or DASH, fmt_versions(r.versions),
                  human_bytes(r.rss_bytes), secs(r.age_s))
    return t


def header(agg: Aggregator, now: float | None = None) -> Text:
    s = agg.summary()
    text = Text()
    text.append(f"run {agg.run}", style="bold")
    text.append(f"  islands {s['islands']}  step-log events {s['steplog_events']}  syncer records {s['syncer_events']}")
    text.append(f"\nsyncer versions {fmt_versions(agg.syncer_versions)}  committed step "
                f"{DASH if s['committed_step'] is None else s['committed_step']}  merges {s['merges']}  "
                f"restarts {s['restarts']}  quorum timeouts {s['quorum_timeouts']}  errors {s['errors']}")
    if s["final_step"] is not None:
        text.append(f"  final at step {s['final_step']}", style="bold green")
    if agg.settings or agg.settings_refused:
        now_set = ", ".join(f"{k}={'off' if v is None else v}" for k, v in sorted(agg.settings.items())) or "none"
        text.append(f"\nruntime settings (yeto run set) {now_set}"
                    + (f" from step {agg.settings_step}" if agg.settings else "")
                    + (f"  refused {agg.settings_refused}" if agg.settings_refused else ""), style="bold")
    text.append(f"\ndispositions {fmt_dispositions(agg.dispositions)}")
    text.append(f"  malformed {s['malformed']}", style="red" if s["malformed"] else "")
    if agg.last_malformed:
        text.append(f" (last: {agg.last_malformed})", style="red")
    missing = agg.shards.missing(time.time() if now is None else now)
    if missing:
        text.append(f"\nsyncer shard{'s' if len(missing) > 1 else ''} missing: {', '.join(map(str, missing))}",
                    style="bold red")
    if agg.shards.malformed:
        text.append(f"  malformed state records {agg.shards.malformed} (last: {agg.shards.last_malformed})", style="red")
    if agg.island_filter:
        text.append(f"\nisland filter {agg.island_filter} ({agg.filtered} other events skipped)")
    return text


def recent_table(agg: Aggregator, limit: int = 5) -> Table | None:
    if not agg.recent:
        return None
    t = Table(title="recent syncer records", title_justify="left", pad_edge=False, show_header=False)
    for _ in range(4):
        t.add_column()
    for m in list(agg.recent)[-limit:]:
        who = m.get("island", "")
        where = f"step {m['step']}" if "step" in m else ""
        t.add_row(time.strftime("%H:%M:%S", time.localtime(m["t"])), m["kind"], who or where, m.get("reason", ""))
    return t


def render(agg: Aggregator, now: float | None = None, *, rounds: int = 12, recent: int = 5) -> Group:
    """The whole screen (pure: `now` only feeds the "age" column)."""
    now = time.time() if now is None else now
    parts = [header(agg, now), island_table(agg, now), traffic_table(agg), round_table(agg, rounds)]
    st = shard_table(agg, now)
    if st is not None:
        parts.insert(1, st)
    rt = recent_table(agg, recent)
    if rt is not None:
        parts.append(rt)
    return Group(*parts)


def render_text(agg: Aggregator, now: float | None = None, width: int = 240) -> str:
    console = Console(record=True, width=width, force_terminal=False, color_system=None, file=io.StringIO())
    console.print(render(agg, now))
    return console.export_text()


async def tail(nc, opts: SourceOptions, *, console: Console | None = None, json_out: IO | None = None,
               count: int | None = None, timeout_s: float | None = None, refresh_hz: float = 4.0,
               agg: Aggregator | None = None, stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> Aggregator:
    """Follow the run until `count` accepted events, `timeout_s`, or `stop`; returns the Aggregator.

    With `json_out`, each accepted event is written there as one raw JSON line (the bytes as
    published) instead of the table; malformed ones are skipped (and counted).
    """
    agg = agg or Aggregator(opts.run, island=opts.island)
    feed = Feed(agg)
    stop = stop or asyncio.Event()
    accepted = 0

    def on_rec(rec, subject, data):
        nonlocal accepted
        if rec is None:
            return
        accepted += 1
        if json_out is not None:
            try:
                json_out.write(bytes(data).decode("utf-8") + "\n")
                json_out.flush()
            except BrokenPipeError:  # `... --json | head`: the reader is gone, so are we
                stop.set()
                return
        if count is not None and accepted >= count:
            stop.set()

    feed.listen(on_rec)
    say = (lambda line: print(line, file=sys.stderr)) if json_out is not None else (console or Console(stderr=True)).print
    subs = await subscribe(nc, opts, feed, say=say)
    if ready is not None:
        ready.set()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    async def wait_tick(period: float) -> bool:
        left = period if deadline is None else max(0.0, min(period, deadline - time.monotonic()))
        try:
            await asyncio.wait_for(stop.wait(), left)
        except asyncio.TimeoutError:
            pass
        return stop.is_set() or (deadline is not None and time.monotonic() >= deadline)

    try:
        if json_out is not None:
            while not await wait_tick(0.5):
                pass
        else:
            console = console or Console()
            with Live(render(agg), console=console, refresh_per_second=refresh_hz, auto_refresh=False) as live:
                while True:
                    done = await wait_tick(1.0 / refresh_hz)
                    live.update(render(agg), refresh=True)
                    if done:
                        break
    finally:
        for s in subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass
    return agg
