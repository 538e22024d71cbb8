"""Syncer shards: the coordinator's check of another shard's `final.<K>` record (services/syncer/
shard_watch.parse_shard_final), pure. A record that passes fills the manifest's digests, so each way
a record can be wrong is refused with a message naming it. And the watch itself, against a real state KV:
a shard whose final cut is in is never reported missing."""
from __future__ import annotations

import orjson
import pytest

from yeto.services.syncer.shard_watch import ShardRecordError, parse_shard_final

D = "ab" * 32


def rec(**kw) -> bytes:
    base = {"shard": 1, "final_step": 8, "versions": {"1": 2, "3": 2}, "version_digests": {"1": D, "3": D}}
    base.update(kw)
    return orjson.dumps(base)


def test_a_good_record_gives_step_versions_and_digests():
    assert parse_shard_final(1, rec(), fragments=4, shards=2) == (8, {1: 2, 3: 2}, {1: D, 3: D})


@pytest.mark.parametrize("value, why", [
    (b"not json", "not JSON"),
    (b"[1]", "not an object"),
    (rec(shard=2), "shard 2, the key names shard 1"),
    (rec(final_step=-1), "final_step -1"),
    (rec(final_step=True), "final_step True"),
    (rec(versions={"1": 2}), "shard 1 owns ['1', '3']"),
    (rec(versions={"1": 2, "2": 2}), "shard 1 owns"),
    (rec(version_digests={"1": D}), "shard 1 owns"),
    (rec(versions={"1": -1, "3": 2}), "version -1 of fragment 1"),
    (rec(versions={"1": "2", "3": 2}), "version '2' of fragment 1"),
    (rec(version_digests={"1": D, "3": "XYZ"}), "digest 'XYZ' of fragment 3"),
    (rec(versions=[2, 2]), "not objects"),
])
def test_a_bad_record_is_refused_naming_what_is_wrong(value, why):
    with pytest.raises(ShardRecordError, match=None) as exc:
        parse_shard_final(1, value, fragments=4, shards=2)
    assert why in str(exc.value)



async def test_a_shard_whose_final_cut_is_in_is_never_missing_however_it_exits(nc, run_id):
    """The coordinator's watch (services/syncer/shard_watch.py) against a real state KV: shard 1 recorded
    its final cut and then stopped updating its status without saying it exited (killed, or slow to exit):
    it is not "missing". Shard 2, whose status went as quiet without a final cut, is (the control)."""
    import asyncio
    import time
    from collections import Counter

    from yeto.schemas.provision import RunLimits, kv as kv_handle, kv_put, provision_run
    from yeto.services.syncer.config import SyncerConfig
    from yeto.services.syncer.cut import CutPublisher
    from yeto.services.syncer.events import ShardFinal
    from yeto.services.syncer.model_store import ModelStore
    from yeto.services.syncer.shard_watch import ShardWatch
    from yeto.services.syncer.tape import TapeWriter
    from tests.scripted import tape

    js = nc.jetstream(timeout=10)
    await provision_run(js, run_id, RunLimits.small(), shard=0, shards=3, fragments=3)
    counters = Counter()
    cfg = SyncerConfig(run=run_id, islands=2, fragments=3, sync_every=3, total_steps=6, shard=0, shards=3)
    queue: asyncio.Queue = asyncio.Queue()
    # what the watch fills from a final record: the digests, in the cut publisher's final_digests
    publisher = CutPublisher(js, run_id, counters, ModelStore(js, run_id, counters, None, shard=0, shards=3), None)
    watch = ShardWatch(js=js, run_id=run_id, config=cfg, state_kv=await kv_handle(js, run_id, "state"),
                       members_kv=await kv_handle(js, run_id, "members"), queue=queue, publisher=publisher,
                       tape=TapeWriter(js, run_id, counters, "t", shard=0), counters=counters,
                       machine=None, status_every_s=0.1)
    watch.missing_after_s = 0.5   # (15 s by default)
    for k in (1, 2):
        await kv_put(js, run_id, "state", f"syncer.{k}", orjson.dumps({"phase": "running", "shard": k}))
    await kv_put(js, run_id, "state", "final.1", orjson.dumps(
        {"shard": 1, "final_step": 6, "versions": {"1": 2}, "version_digests": {"1": D}}))
    await watch.poll_once()
    got = await asyncio.wait_for(queue.get(), 5)
    assert isinstance(got, ShardFinal) and got.shard == 1 and publisher.final_digests == {1: D}
    deadline = time.monotonic() + 10
    while 2 not in watch.missing and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        watch._status_t = 0.0   # poll the status records on every pass
        await watch.poll_once()
    assert 2 in watch.missing and "no status update" in watch.missing[2], watch.missing
    assert 1 not in watch.missing, watch.missing
    await watch.tape.flush()
    reasons = [r["reason"] for r in await tape(js, run_id, "error")]
    assert any(r.startswith("shard 2 missing") for r in reasons) and not any(r.startswith("shard 1") for r in reasons)
