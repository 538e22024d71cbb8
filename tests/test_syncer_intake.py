"""The syncer's pure push ledger (services/syncer/intake.py): tries complete, and nothing leaks."""
from __future__ import annotations

from schemas.chunks import push_digest
from services.syncer.intake import PushLedger, key_of


def chunk(i: int, *, island="a", gen="g1", fragment=0, step=1, attempt=1, try_=0, chunks=3) -> dict:
    meta = {"island": island, "gen": gen, "fragment": fragment, "step": step, "attempt": attempt, "try": try_,
            "chunks": chunks, "total": 12 * chunks, "dtype": "f32", "base_version": 0, "local_step": 1,
            "c_steps": 1, "c_tokens": 10, "chunk": i, "digest": f"d{i}"}
    if i == chunks - 1:
        meta["push_digest"] = push_digest([f"d{k}" for k in range(chunks)])
    return meta


def feed(ledger: PushLedger, metas, seq0: int = 1, *, redelivered: bool = False):
    """What the shell does per chunk: drop closed ones, add the rest. Returns completed tries."""
    done = []
    for n, meta in enumerate(metas):
        if ledger.closed(meta, redelivered=redelivered) is not None:
            continue
        t = ledger.add(meta, seq0 + n, expected_total=meta["total"], chunk_ok=True)
        if t is not None:
            done.append(t)
    return done


def test_a_try_completes_once_and_pop_round_forgets_it():
    led = PushLedger()
    (t,) = feed(led, [chunk(0), chunk(2), chunk(1)])
    assert t.invalid is None and t.ordered_seqs() == [1, 3, 2]
    assert feed(led, [chunk(1)], 10) == []                      # a resend of a chunk: the first stays
    assert sorted(led.pop_round(0, 1)) == [1, 2, 3] and led.tries == {}


def test_redelivered_chunks_after_pop_round_or_pop_try_open_no_try():
    # issue 16: chunks redelivered after pop_round / pop_try created tries that never completed and
    # were never removed
    led = PushLedger()
    feed(led, [chunk(i) for i in range(3)])
    feed(led, [chunk(i, island="b", try_=1) for i in range(3)], 10)
    assert led.pop_try(("b", "g1", 0, 1, 1, 1)) == [10, 11, 12]   # a rejected try, released
    # while its round is in flight a released try stays closed, redelivered or not
    assert feed(led, [chunk(i, island="b", try_=1) for i in range(3)], 15) == [] and len(led.tries) == 1
    assert sorted(led.pop_round(0, 1)) == [1, 2, 3]
    feed(led, [chunk(1), chunk(0, island="b", try_=1)], 20, redelivered=True)
    assert led.tries == {}


def test_late_fresh_push_to_a_committed_round_completes_and_partial_ones_are_swept():
    led = PushLedger()
    feed(led, [chunk(i) for i in range(3)])
    led.pop_round(0, 1)
    # a fresh (not redelivered) late push still completes, so the machine can tape out_of_round
    (t,) = feed(led, [chunk(i, island="c") for i in range(3)], 30)
    assert t.key == ("c", "g1", 0, 1, 1, 0)
    led.pop_try(t.key)                                          # the machine released it
    # an island that died mid-push: its partial try of a committed round goes at the next commit but one
    feed(led, [chunk(0, island="d")], 40)
    assert key_of(chunk(0, island="d")) in led.tries
    feed(led, [chunk(i, step=2, fragment=1) for i in range(3)], 50)
    led.pop_round(1, 2)                                         # opened after commit 1: survives this one
    assert key_of(chunk(0, island="d")) in led.tries and led.pop_swept() == []
    feed(led, [chunk(i, step=3) for i in range(3)], 60)
    led.pop_round(0, 3)
    assert led.tries == {} and led.pop_swept() == [40]
    assert led.released == set()                                # tombstones of committed rounds pruned


def test_resumed_ledger_starts_at_the_checkpoints_committed_step():
    led = PushLedger(committed_step=5)
    assert feed(led, [chunk(i, step=4) for i in range(3)], redelivered=True) == [] and led.tries == {}
    (t,) = feed(led, [chunk(i, step=6) for i in range(3)], redelivered=True)
    assert t.key[3] == 6


def test_every_incomplete_try_dropped_at_a_commit_is_reported_once():
    # issue 16: a try whose chunks straddle its round's commit never completed and was never taped
    led = PushLedger()
    feed(led, [chunk(i) for i in range(3)])                               # a's try completes
    feed(led, [chunk(0, island="b"), chunk(2, island="b")], 10)           # b's try: 2 of 3 chunks in
    feed(led, [chunk(0, island="c", attempt=2, chunks=4)], 20)            # another attempt, 1 of 4
    led.pop_round(0, 1)
    dropped = {d.key[0]: d for d in led.pop_dropped()}
    assert set(dropped) == {"b", "c"}, "the complete try already has its disposition"
    assert (dropped["b"].chunks_in, dropped["b"].chunks) == (2, 3) and dropped["b"].key == key_of(chunk(0, island="b"))
    assert dropped["b"].reason.startswith("push_incomplete: 2/3 chunks in when round 1 committed")
    assert dropped["c"].reason.startswith("push_incomplete: 1/4")
    assert led.pop_dropped() == []
    # b's last chunk arrives after the commit (fresh, not redelivered): it opens no second try
    assert led.closed(chunk(1, island="b")) is not None
    assert feed(led, [chunk(1, island="b")], 30) == [] and led.tries == {}
    # a try of a committed round that is swept (an island died mid-push after the commit) too
    feed(led, [chunk(0, island="d")], 40)
    for step, frag in ((2, 1), (3, 0)):
        feed(led, [chunk(i, step=step, fragment=frag) for i in range(3)], 50 + 10 * step)
        led.pop_round(frag, step)
    (d,) = led.pop_dropped()
    assert d.key == key_of(chunk(0, island="d")) and "swept" in d.reason and led.pop_swept() == [40]
    # rounds may commit several a second (bench/hostile.py --seed 5: a try's last chunk came two commits
    # after its first, opened a second try and was taped twice): a tombstone outlives many commits
    for step in range(4, 40):
        feed(led, [chunk(i, step=step, fragment=step % 2) for i in range(3)], 100 * step)
        led.pop_round(step % 2, step)
    assert feed(led, [chunk(1, island="b")], 5000) == [] and led.tries == {} and led.pop_dropped() == []
    # ... but not for ever, and never more than MAX_TOMBSTONES of them (no growth)
    for step in (40 + PushLedger.TOMBSTONE_COMMITS, 41 + PushLedger.TOMBSTONE_COMMITS):
        led.pop_round(step % 2, step)
    assert led.closed(chunk(1, island="b")) is None and led._tombstones == {}
    small = PushLedger()
    small.MAX_TOMBSTONES = 2
    for n in range(4):
        feed(small, [chunk(0, island=f"i{n}")], 10 * n)
    small.pop_round(0, 1)
    assert len(small.pop_dropped()) == 4 and list(small._tombstones) == [key_of(chunk(0, island=f"i{n}")) for n in (2, 3)]


def test_quarantine_figures_sum_over_chunks_and_a_resent_chunk_counts_once():
    # issue 17: the shell hands each chunk's Σ value² and NaN/Inf count to the ledger as it arrives; the
    # complete try carries the push's L2 norm and non-finite count to the round machine
    led = PushLedger()
    assert led.add(chunk(0), 1, expected_total=36, chunk_ok=True, sumsq=9.0) is None
    assert led.add(chunk(0), 2, expected_total=36, chunk_ok=True, sumsq=9.0, non_finite=5) is None   # a resend
    assert led.add(chunk(2), 3, expected_total=36, chunk_ok=True, sumsq=16.0, non_finite=2) is None
    t = led.add(chunk(1), 4, expected_total=36, chunk_ok=True, sumsq=0.0)
    assert t is not None and t.norm == 5.0 and t.non_finite == 2 and t.invalid is None
