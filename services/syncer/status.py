"""The syncer's status record for operators (the state KV key `syncer`, `syncer.<K>` when sharded): where
the process stands and every counter, written every `--status-every` and at exit by the shell
(services/syncer/service.py); a coordinator reads its shards' records (services/syncer/shard_watch.py)."""
from __future__ import annotations

import os
import resource
import time
from collections import Counter
from typing import Mapping

from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.rounds import RoundMachine


def peak_rss_bytes() -> int:
    """This process's peak resident set size (bytes): what its fragments' params and momentum cost."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # Linux reports KiB


def status_record(m: RoundMachine, mc: SyncerConfig, counters: Counter, *, started_at: float,
                  missing: Mapping[int, str] | None, final: bool = False) -> dict:
    """The record (JSON): `missing` is the coordinator's shards missing (shard_watch.py; None without one)."""
    return {
        "pid": os.getpid(),
        "started_at": started_at,
        "updated_at": time.time(),
        "exited": final,
        "phase": m.phase.value,
        "committed_step": m.committed_step,
        "total_steps": mc.total_steps,
        "versions": {str(k): v for k, v in m.versions.items()},
        "live": sorted(i for i, mem in m.members.items() if mem.live),
        "rounds_in_flight": [{"step": r.step, "fragment": r.fragment, "attempt": r.attempt,
                              "answered": r.answered, "expected": len(r.slots)}
                             for _, r in sorted(m.rounds.items())],
        "counters": dict(sorted(counters.items())),
        "rounds": dict(sorted(m.counters.items())),
        # per shard (schemas/shards.py); with one shard: shard 0 of 1, every fragment
        "shard": mc.shard,
        "shards": mc.shards,
        "fragments": list(mc.own_fragments),
        "rss_bytes": peak_rss_bytes(),
        **({"shards_missing": sorted(missing)} if missing is not None and mc.coordinator else {}),
    }
