"""Syncer shards share the tape's subjects: a resumed shard re-tapes exactly the records of its last
commit that are missing, even when the newest record of the kind is another shard's and the server's
duplicate window has passed (services/syncer/tape.TapeWriter.retape). Against a real nats-server."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

from yeto.schemas.provision import RunLimits, provision_run, remove_run
from yeto.services.syncer.checkpoint import CheckpointState
from yeto.services.syncer.tape import TapeWriter
from tests.scripted import tape

D = "cd" * 32


def commit(fragment: int, version: int, t: float) -> dict:
    return {"kind": "commit", "t": t, "step": 2 * version, "fragment": fragment, "version": version,
            "detail": {"version_digest": D}}


async def test_a_resumed_shard_retapes_only_its_missing_records_after_the_duplicate_window(nc, run_id):
    js = nc.jetstream()
    await provision_run(js, run_id, RunLimits.small(duplicate_window_s=1.0), shard=1, shards=2, fragments=4,
                        log=lambda _: None)
    try:
        now = time.time()
        mine = [commit(1, 1, now), commit(3, 1, now)]     # shard 1's last commit: two fragments
        w1 = TapeWriter(js, run_id, Counter(), "p1s1", shard=1)
        await w1.write(dict(mine[0]), kind="commit", msg_id=TapeWriter.record_msg_id(mine[0]))  # then it died
        w0 = TapeWriter(js, run_id, Counter(), "p0s0", shard=0)
        other = commit(0, 1, now)
        await w0.write(dict(other), kind="commit", msg_id=TapeWriter.record_msg_id(other))     # newest on the subject
        await asyncio.sleep(1.5)                          # past the duplicate window: no dedup to hide a repeat
        state = CheckpointState(run=run_id, session_fingerprint="s", layout_fingerprint="l", tape=mine)
        counters = Counter()
        await TapeWriter(js, run_id, counters, "p2s1", shard=1).retape(state)
        got = sorted((r["fragment"], r["version"], r["detail"]["shard"]) for r in await tape(js, run_id, "commit"))
        assert got == [(0, 1, 0), (1, 1, 1), (3, 1, 1)]
        assert counters["tape.replayed"] == 1
    finally:
        await remove_run(js, run_id)
