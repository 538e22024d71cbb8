"""Re-broadcast of a fragment's committed version (a rule of the round machine, services/syncer/rounds.py).

BCAST keeps one message per chunk subject, so a forged chunk, a purge or a broker that lost its last
writes can leave a committed version incomplete there for good (the islands stay on an older version,
push stale bases, and no round of that fragment commits again). Asked for by round_rules (a round past
its deadline below quorum) and pushes (a stale_base push): at most once per `quorum_timeout_s` per
fragment, only while running, and never while that fragment's merge is due or under way (its params
are changing and the next broadcast comes anyway).
"""
from __future__ import annotations

from yeto.services.syncer.actions import Rebroadcast
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.state import Phase


def rebroadcast(s: MachineState, cfg: SyncerConfig, out: Output, fragment: int, now: float, reason: str) -> None:
    if s.phase != Phase.RUNNING or fragment not in s.versions:
        return
    if any(r.fragment == fragment and not r.accepting for r in s.rounds.values()):
        s.counters["rebroadcast.merge_due"] += 1
        return
    last = s.rebroadcast_at.get(fragment)
    if last is not None and now - last < cfg.quorum_timeout_s:
        s.counters["rebroadcast.rate_limited"] += 1
        return
    s.rebroadcast_at[fragment] = now
    s.counters["rebroadcast"] += 1
    out.emit(Rebroadcast(fragment, s.versions[fragment], reason))
