"""docs/design.md §11: one owner per run. The lease's pure rules (LeaseBook), then its shell (RunLease)
against a real nats-server's KV: a second syncer stands by, takes over only once the owner's revision
stood still for a TTL, two standbys never both win, a paused owner finds itself fenced, and a commit
record written revision-checked refuses a deposed owner's write."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from yeto.schemas import subjects as S
from yeto.schemas.provision import RunLimits, kv as kv_handle, provision_run
from yeto.services.syncer.lease import (OWNER_TRUST, Fenced, FlagMismatch, LeaseBook, RunLease, flag_mismatches, read_key,
                                   lease_key)

FLAGS = {"islands": 2, "fragments": 2, "sync_every": 4, "total_steps": 8, "push_dtype": "f32", "bulk_dtype": "f32",
         "shards": 1, "strict": False}


# ---- the pure book ------------------------------------------------------------------------------------

def test_a_standby_takes_over_only_after_the_revision_stood_still_for_a_ttl():
    b = LeaseBook("me", ttl_s=10.0)
    b.saw(5, {"owner": "x"}, now=100.0)
    assert not b.lapsed(105.0)
    b.saw(6, {"owner": "x"}, now=106.0)       # the owner refreshed: the clock starts again
    assert not b.lapsed(115.0) and b.lapsed(116.0)
    b.saw(7, None, now=117.0)                  # released (deleted): nobody holds it
    assert b.lapsed(117.0)


def test_the_owner_trusts_its_lease_for_a_part_of_the_ttl_after_the_refresh_it_sent():
    b = LeaseBook("me", ttl_s=10.0)
    assert not b.valid(0.0)
    b.won(3, sent_at=50.0, record={"owner": "me"})
    assert b.valid(50.0 + OWNER_TRUST * 10.0 - 0.01) and not b.valid(50.0 + OWNER_TRUST * 10.0)
    # a standby that saw revision 3 no earlier than 50.0 takes over no earlier than 60.0: after the trust ends
    assert 50.0 + OWNER_TRUST * 10.0 < 60.0
    b.lost()
    assert b.role == "fenced" and not b.valid(51.0)
    assert b.refresh_due(100.0, 0.0) is False


def test_flag_mismatches_name_the_flag_and_both_values():
    assert flag_mismatches(FLAGS, FLAGS) == []
    bad = flag_mismatches({**FLAGS, "fragments": 4}, FLAGS)
    assert bad == ["--fragments: the owner runs with 2, this syncer with 4"]


def test_lease_keys_per_shard():
    assert lease_key(0, 1) == "lease" and lease_key(2, 4) == "lease.2"


# ---- the shell on a real server -----------------------------------------------------------------------

@pytest.fixture
async def state_kv(nc, run_id):
    js = nc.jetstream(timeout=10)
    await provision_run(js, run_id, RunLimits.small())
    yield await kv_handle(js, run_id, "state")


async def test_a_second_syncer_stands_by_and_takes_over_when_the_owner_stops_refreshing(state_kv):
    a = RunLease(state_kv, "lease", ttl_s=1.0, flags=FLAGS)
    b = RunLease(state_kv, "lease", ttl_s=1.0, flags=FLAGS)
    assert await a.acquire() and a.valid()
    assert not await b.acquire() and b.book.holder["owner"] == a.me
    keeper = asyncio.create_task(a.keep(lambda exc: None))
    finished = False

    async def done():
        return finished

    waiter = asyncio.create_task(b.wait_for_lapse(done))
    await asyncio.sleep(2.5)                        # two and a half TTLs of refreshes: b waits
    assert not waiter.done()
    keeper.cancel()                                 # a stops refreshing (killed, paused)
    t0 = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(waiter, 5) is True
    # a TTL after the last refresh it saw (up to a third of a TTL before a stopped)
    assert 0.5 <= asyncio.get_running_loop().time() - t0 <= 3.0
    assert b.valid() and orjson.loads((await state_kv.get("lease")).value)["owner"] == b.me
    # a wakes: its trust has lapsed, it asks the KV, and finds it fenced
    assert not a.valid()
    with pytest.raises(Fenced):
        await a.confirm()
    assert a.book.role == "fenced"


async def test_two_standbys_never_both_take_over(state_kv):
    a = RunLease(state_kv, "lease", ttl_s=1.0, flags=FLAGS)
    assert await a.acquire()
    standbys = [RunLease(state_kv, "lease", ttl_s=1.0, flags=FLAGS) for _ in range(3)]
    for s in standbys:
        assert not await s.acquire()

    async def never():
        return False

    waiters = [asyncio.create_task(s.wait_for_lapse(never)) for s in standbys]
    done, pending = await asyncio.wait(waiters, timeout=6, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(2.5)                        # the others keep waiting: the winner is not refreshing,
    winners = [s for s in standbys if s.book.role == "owner"]   # but its takeover moved the revision
    assert len(done) >= 1
    owners = {orjson.loads((await state_kv.get("lease")).value)["owner"]}
    assert len({w.me for w in winners} & owners) == 1
    for w in waiters:
        w.cancel()


async def test_a_standby_with_other_run_flags_is_refused_naming_them(state_kv):
    a = RunLease(state_kv, "lease", ttl_s=5.0, flags=FLAGS)
    assert await a.acquire()
    b = RunLease(state_kv, "lease", ttl_s=5.0, flags={**FLAGS, "islands": 3})
    with pytest.raises(FlagMismatch, match="--islands: the owner runs with 2, this syncer with 3"):
        await b.acquire()


async def test_a_released_lease_is_taken_at_once(state_kv):
    a = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert await a.acquire()
    await a.release()
    b = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert await b.acquire()                        # no 30 s wait: the key holds no lease


async def test_a_release_over_a_stale_revision_still_leaves_the_key_to_a_standby_at_once(state_kv):
    """A refresh that landed while its ack was lost (around a broker node's restart) leaves the owner's book a
    revision behind the key: the release reads the key and, still its own, deletes it at the revision read."""
    a = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert await a.acquire()
    await state_kv.put("lease", orjson.dumps(a.record()))   # our record again, a revision the book never saw
    await a.release()
    assert (await read_key(state_kv, "lease"))[1] is None
    b = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert await b.acquire()                        # no 30 s wait


async def test_a_standby_whose_question_goes_unanswered_still_takes_a_released_lease_at_once(state_kv):
    """A request whose reply is lost (a broker node restarting) held a standby for the client's 30 s JetStream
    timeout although the key was free (soak/rolling.py: 22 s gaps at a hand-over): each look is bounded now."""
    a = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert await a.acquire()
    b = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert not await b.acquire()

    async def unanswered() -> bool:
        await asyncio.sleep(60)
        return True

    waiting = asyncio.create_task(b.wait_for_lapse(unanswered))
    await asyncio.sleep(0.3)
    await a.release()
    t0 = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(waiting, 10) is True
    assert asyncio.get_running_loop().time() - t0 < 5.0 and b.book.role == "owner"


async def test_a_release_leaves_a_key_another_owner_holds(state_kv):
    a = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    assert await a.acquire()
    other = RunLease(state_kv, "lease", ttl_s=30.0, flags=FLAGS)
    await state_kv.put("lease", orjson.dumps(other.record()))   # taken over meanwhile
    await a.release()
    assert orjson.loads((await state_kv.get("lease")).value)["owner"] == other.me


async def test_the_commit_record_refuses_a_deposed_owners_write(nc, run_id, state_kv, tmp_path):
    from yeto.services.syncer.checkpoint import CheckpointDir
    from yeto.services.syncer.model_store import ModelStore
    from collections import Counter

    js = nc.jetstream(timeout=10)
    old, new = (ModelStore(js, run_id, Counter(), CheckpointDir(tmp_path / name)) for name in ("old", "new"))
    old.fence(0)
    await old.put_commit_record(b'{"committed_step": 1}')
    await old.put_commit_record(b'{"committed_step": 2}')
    # the new owner takes the run over: its first write is over the revision it found
    new.fence((await state_kv.get(S.kv_key(run_id, "state", "commit").rsplit(".", 1)[-1])).revision)
    await new.put_commit_record(b'{"committed_step": 2}')
    with pytest.raises(Fenced, match="moved on from revision"):
        await old.put_commit_record(b'{"committed_step": 3}')
    assert orjson.loads((await state_kv.get("commit")).value) == {"committed_step": 2}
