"""`YETO_MEM_TRACE=1`: the syncer logs its memory at phase points (docs/design.md §10), to find what a
process carries beyond its fragments' params and momentum (8 bytes per parameter).

Each mark is one log line, `memtrace <phase>: rss <MiB> hwm <MiB> | <name> <MiB> ...`: the process's
VmRSS and VmHWM (/proc/self/status) and the big allocations the shell knows of at that point (the
fragments' params and momentum, the pushes kept from intake to the merge, the INIT bytes waiting for
the round machine), so a growth of RSS that none of them explains stands out. `YETO_MEM_TRACE=2` also
starts tracemalloc and adds the five largest Python allocation sites (bytes objects such as NATS
payloads; torch tensors are not Python allocations and do not show there). Off (unset or 0), a mark
costs one dict lookup.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("yeto.syncer")

MiB = 1 << 20


def level() -> int:
    try:
        return max(0, int(os.environ.get("YETO_MEM_TRACE", "0") or "0"))
    except ValueError:
        return 1


_LEVEL = level()


def enabled() -> bool:
    return _LEVEL > 0


def proc_status_bytes(fields: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    """Those /proc/self/status fields in bytes (empty where /proc is not there)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in fields:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def format_mark(phase: str, status: dict[str, int], sizes: dict[str, int]) -> str:
    """One mark's log line (pure)."""
    parts = [f"memtrace {phase}: rss {status.get('VmRSS', 0) / MiB:.0f} MiB hwm {status.get('VmHWM', 0) / MiB:.0f} MiB"]
    if sizes:
        parts.append(" ".join(f"{k} {v / MiB:.0f}" for k, v in sizes.items()))
    return " | ".join(parts)


def start() -> None:
    """At start-up: tracemalloc on at level 2."""
    if _LEVEL >= 2:
        import tracemalloc

        if not tracemalloc.is_tracing():
            tracemalloc.start(4)
    mark("start")


def mark(phase: str, **sizes: int) -> None:
    """Log RSS and the named sizes (bytes) at `phase`; nothing when YETO_MEM_TRACE is off."""
    if _LEVEL <= 0:
        return
    log.info("%s", format_mark(phase, proc_status_bytes(), sizes))
    if _LEVEL >= 2:
        import tracemalloc

        if tracemalloc.is_tracing():
            top = tracemalloc.take_snapshot().statistics("lineno")[:5]
            for s in top:
                log.info("memtrace %s:   %.1f MiB in %d blocks at %s", phase, s.size / MiB, s.count, s.traceback)
