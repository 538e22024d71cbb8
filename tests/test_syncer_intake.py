"""The syncer's pure push ledger (services/syncer/intake.py): every method and rule, without a broker.

A try completes exactly once, valid only when its chunks agree with the session and with each other and
its push digest binds them; closed (released, tombstoned, redelivered-after-commit) chunks open nothing;
commits forget their rounds, sweep what stayed incomplete and report each dropped try once.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto.schemas.chunks import push_digest
from yeto.services.syncer.intake import PushLedger, PushTry, auto_push_memory_bytes, key_of


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
    assert t.invalid is None and [t.seqs[i] for i in range(3)] == [1, 3, 2]
    assert feed(led, [chunk(1)], 10) == []                      # a resend of a chunk: the first stays
    assert sorted(led.pop_round(0, 1)) == [1, 2, 3] and led.tries == {}


def test_redelivered_chunks_after_pop_round_or_pop_try_open_no_try():
    # regression: chunks redelivered after pop_round / pop_try created tries that never completed and
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
    # regression: a try whose chunks straddle its round's commit never completed and was never taped
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
    # rounds may commit several a second (soak/hostile.py --seed 5: a try's last chunk came two commits
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


def test_a_chunk_whose_try_was_dropped_after_its_closed_check_opens_no_second_try():
    # The shell asks `closed`, then awaits (a bad chunk's rejection is taped) before `add`; a commit in
    # between dropped the try. A second try opened there was swept and taped again (soak/hostile.py).
    led = PushLedger()
    feed(led, [chunk(0), chunk(1)])
    last = chunk(2)
    assert led.closed(last) is None                             # asked before the await
    led.pop_round(0, 1)                                         # the commit, during the await
    (d,) = led.pop_dropped()
    assert d.key == key_of(last) and d.chunks_in == 2
    assert led.add(last, 9, expected_total=last["total"], chunk_ok=False, chunk_reason="overlap") is None
    assert led.tries == {}
    for step in (2, 3):                                         # nothing left to sweep and tape
        led.pop_round(step % 2, step)
    assert led.pop_dropped() == [] and led.pop_swept() == []


def test_quarantine_figures_sum_over_chunks_and_a_resent_chunk_counts_once():
    # docs/design.md §9: the shell hands each chunk's Σ value² and NaN/Inf count to the ledger as it arrives; the
    # complete try carries the push's L2 norm and non-finite count to the round machine
    led = PushLedger()
    assert led.add(chunk(0), 1, expected_total=36, chunk_ok=True, sumsq=9.0) is None
    assert led.add(chunk(0), 2, expected_total=36, chunk_ok=True, sumsq=9.0, non_finite=5) is None   # a resend
    assert led.add(chunk(2), 3, expected_total=36, chunk_ok=True, sumsq=16.0, non_finite=2) is None
    t = led.add(chunk(1), 4, expected_total=36, chunk_ok=True, sumsq=0.0)
    assert t is not None and t.norm == 5.0 and t.non_finite == 2 and t.invalid is None


# ---- every rule of add(), closed(), pop_try() and pop_round(), one at a time --------------------------

def add(led: PushLedger, meta: dict, seq: int, **kw):
    kw.setdefault("expected_total", meta["total"])
    kw.setdefault("chunk_ok", True)
    return led.add(meta, seq, **kw)


def test_key_of_is_the_try_identity_and_complete_tries_report_their_figures():
    assert key_of(chunk(0, island="x", gen="g9", fragment=2, step=7, attempt=3, try_=4)) == ("x", "g9", 2, 7, 3, 4)
    t = PushTry(key=("a",), chunks=2, total=8, dtype="f32", base_version=0, local_step=1, c_steps=1, c_tokens=1,
                sumsq=25.0)
    assert not t.complete and t.norm == 5.0
    t.seqs = {0: 1, 1: 2}
    assert t.complete


def test_a_try_is_returned_once_when_complete_and_keeps_the_headers_of_its_first_chunk():
    led = PushLedger()
    first = chunk(0) | {"base_version": 3, "local_step": 17, "c_steps": 8, "c_tokens": 640}
    assert add(led, first, 1) is None and add(led, chunk(1), 2) is None
    t = add(led, chunk(2), 3)
    assert t is not None and t.done and t.invalid is None
    assert (t.base_version, t.local_step, t.c_steps, t.c_tokens, t.dtype) == (3, 17, 8, 640, "f32")
    assert t.digests == {0: "d0", 1: "d1", 2: "d2"} and t.push_digest == chunk(2)["push_digest"]
    # a done try takes nothing more: a resend of any chunk, even one carrying other bytes, changes nothing
    assert add(led, chunk(0) | {"digest": "other"}, 9) is None and t.seqs == {0: 1, 1: 2, 2: 3}


@pytest.mark.parametrize("case, expect", [
    ("total_vs_session", "push total 36 bytes, the session's fragment takes 24"),
    ("unknown_fragment", "unknown fragment 0"),
    ("bad_chunk", "chunk 1 failed its digest"),
    ("bad_chunk_no_reason", "chunk 1 rejected"),
    ("dtype_refused_before_planning", "push dtype must be the session's"),
    ("chunks_changed", "chunks/total changed within one push (4/36 vs 3/36)"),
    ("total_changed", "chunks/total changed within one push (3/40 vs 3/36)"),
    ("push_digest_wrong", "push_digest 00 does not match its chunks"),
    ("push_digest_missing", "push_digest None does not match its chunks"),
])
def test_an_invalid_try_still_completes_once_with_the_first_reason(case, expect):
    """An invalid try is still returned when complete: the machine tapes its disposition (rejected, with
    the reason) instead of the try sitting in the ledger for ever."""
    led = PushLedger()
    metas = [chunk(i) for i in range(3)]
    kws = [{} for _ in range(3)]
    if case == "total_vs_session":
        kws = [{"expected_total": 24}] * 3
    elif case == "unknown_fragment":
        kws = [{"expected_total": None}] * 3
    elif case == "bad_chunk":
        kws[1] = {"chunk_ok": False, "chunk_reason": "chunk 1 failed its digest"}
    elif case == "bad_chunk_no_reason":
        kws[1] = {"chunk_ok": False}
    elif case == "dtype_refused_before_planning":
        # the shell refused the first chunk before it could plan (no expected_total): the chunk's own reason
        # names the fault, not "unknown fragment"
        kws[0] = {"expected_total": None, "chunk_ok": False, "chunk_reason": "push dtype must be the session's f32"}
    elif case == "chunks_changed":
        metas[1] = chunk(1, chunks=4) | {"total": 36}
    elif case == "total_changed":
        metas[1] = chunk(1) | {"total": 40}
    elif case == "push_digest_wrong":
        metas[2] = chunk(2) | {"push_digest": "00"}
    elif case == "push_digest_missing":
        del metas[2]["push_digest"]
    done = [t for i in range(3) if (t := add(led, metas[i], i + 1, **kws[i])) is not None]
    assert len(done) == 1 and done[0].invalid is not None and done[0].invalid.startswith(expect), done[0].invalid


def test_the_first_reason_wins_and_the_push_digest_is_not_judged_for_an_invalid_try():
    led = PushLedger()
    add(led, chunk(0), 1, chunk_ok=False, chunk_reason="chunk 0: NaN")
    add(led, chunk(1), 2, chunk_ok=False, chunk_reason="chunk 1: short")
    t = add(led, chunk(2) | {"push_digest": "00"}, 3)
    assert t.invalid == "chunk 0: NaN"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_any_arrival_order_with_resends_completes_once_with_the_first_sequence_per_chunk(n, data):
    resends = data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n))
    arrivals = data.draw(st.permutations(list(range(n)) + resends))  # every chunk at least once, any order
    led = PushLedger()
    first_seq: dict[int, int] = {}
    done = []
    for seq, i in enumerate(arrivals, start=1):
        first_seq.setdefault(i, seq)
        t = add(led, chunk(i, chunks=n), seq, sumsq=1.0)
        if t is not None:
            done.append((seq, t))
    assert len(done) == 1
    seq_done, t = done[0]
    assert seq_done == max(first_seq.values()), "complete exactly when the last missing chunk arrives"
    assert t.invalid is None and t.seqs == {i: first_seq[i] for i in range(n)} and t.sumsq == n


def test_closed_names_why_a_chunk_can_never_count():
    led = PushLedger(committed_step=4)
    assert led.closed(chunk(0, step=5)) is None
    assert led.closed(chunk(0, step=4)) is None, "a fresh late push still completes (out_of_round on the tape)"
    assert "redelivered chunk of committed round 4" in led.closed(chunk(0, step=4), redelivered=True)
    assert led.closed(chunk(0, step=5), redelivered=True) is None
    add(led, chunk(0, step=5, try_=1), 1)
    led.pop_try(key_of(chunk(0, step=5, try_=1)))
    assert "released" in led.closed(chunk(1, step=5, try_=1))
    assert led.closed(chunk(1, step=5, try_=2)) is None, "another try of the same member is its own"
    # a released try takes nothing even if the shell adds without asking closed() first
    assert add(led, chunk(1, step=5, try_=1), 2) is None and led.tries == {}
    add(led, chunk(0, island="b", step=5), 3)
    led.pop_round(0, 5)
    assert "dropped incomplete when round 5 committed" in led.closed(chunk(1, island="b", step=5))


def test_pop_try_returns_the_sequences_and_closes_only_what_could_come_back():
    led = PushLedger(committed_step=2)
    feed(led, [chunk(i, step=3) for i in range(3)], 10)
    assert sorted(led.pop_try(key_of(chunk(0, step=3)))) == [10, 11, 12] and led.tries == {}
    assert key_of(chunk(0, step=3)) in led.released
    # a late try of a committed round, still open when released: closed too (its chunks may still come)
    add(led, chunk(0, step=2), 20)
    assert led.pop_try(key_of(chunk(0, step=2))) == [20] and key_of(chunk(0, step=2)) in led.released
    # a key the ledger never held, of a committed round: nothing to close, nothing returned
    assert led.pop_try(key_of(chunk(0, island="z", step=1))) == []
    assert key_of(chunk(0, island="z", step=1)) not in led.released


def test_pop_round_forgets_only_its_round_and_advances_committed_step_monotonically():
    led = PushLedger()
    feed(led, [chunk(i, fragment=0, step=1) for i in range(3)], 1)
    feed(led, [chunk(i, fragment=1, step=2) for i in range(3)], 10)
    feed(led, [chunk(i, fragment=0, step=1, attempt=2, island="b") for i in range(3)], 20)
    assert sorted(led.pop_round(0, 1)) == [1, 2, 3, 20, 21, 22], "every attempt and member of the round"
    assert list(led.tries) == [key_of(chunk(0, fragment=1, step=2))] and led.committed_step == 1
    assert sorted(led.pop_round(1, 2)) == [10, 11, 12] and led.committed_step == 2
    assert led.pop_round(0, 1) == [] and led.committed_step == 2, "never goes back"
    assert led.pop_dropped() == [] and led.pop_swept() == [], "complete tries leave no record"


def test_pop_dropped_and_pop_swept_hand_each_item_over_once():
    led = PushLedger()
    add(led, chunk(0, island="x"), 7)
    led.pop_round(0, 1)
    (d,) = led.pop_dropped()
    assert (d.key, d.chunks_in, d.chunks, d.base_version, d.local_step) == (key_of(chunk(0, island="x")), 1, 3, 0, 1)
    assert led.pop_dropped() == []
    add(led, chunk(0, island="y"), 8)          # a late partial try of the committed round 1
    for step in (2, 3):
        led.pop_round(step % 2, step)
    assert led.pop_swept() == [8] and led.pop_swept() == []


def _feed_held(ledger: PushLedger, metas, seq0: int = 1, *, ok=lambda meta: True):
    """As the shell does with a payload: each chunk's bytes (12 bytes, named after its try and index)."""
    done = []
    for n, meta in enumerate(metas):
        payload = f"{meta['island']}{meta['try']}:{meta['chunk']:02d}".encode().ljust(12, b".")
        t = ledger.add(meta, seq0 + n, expected_total=meta["total"], chunk_ok=ok(meta),
                       chunk_reason=None if ok(meta) else "digest mismatch", payload=payload)
        if t is not None:
            done.append(t)
    return done


def test_pushes_are_kept_for_the_merge_within_the_budget_first_come_first_kept():
    led = PushLedger(hold_bytes=12 * 4)           # room for 4 of the 6 chunks below
    (a,) = _feed_held(led, [chunk(i) for i in range(3)])
    (b,) = _feed_held(led, [chunk(i, island="b") for i in range(3)], 10)
    assert sorted(a.held) == [0, 1, 2] and sorted(b.held) == [0] and led.held_bytes == 48
    assert led.take(a, 1) == b"a0:01......." and led.take(a, 1) is None    # handed over once
    assert led.held_bytes == 36
    assert led.take(b, 2) is None                   # not kept: the merge reads it back from PUSH
    # a commit forgets the round's tries and with them what is still held
    led.pop_round(0, 1)
    assert led.held_bytes == 0 and a.held == {} and b.held == {}


def test_an_invalid_or_released_try_holds_nothing_and_no_budget_keeps_nothing():
    led = PushLedger(hold_bytes=1 << 20)
    (bad,) = _feed_held(led, [chunk(i) for i in range(3)], ok=lambda m: m["chunk"] != 1)
    assert bad.invalid and bad.held == {} and led.held_bytes == 0      # never merged: its bytes go at once
    _feed_held(led, [chunk(i, island="b") for i in range(2)], 10)      # incomplete, then released
    assert led.held_bytes == 24
    led.pop_try(("b", "g1", 0, 1, 1, 0))
    assert led.held_bytes == 0
    none = PushLedger()                                                 # the default: nothing kept
    (t,) = _feed_held(none, [chunk(i) for i in range(3)])
    assert t.held == {} and none.take(t, 0) is None and none.held_bytes == 0
    with pytest.raises(ValueError, match="hold_bytes must be >= 0, got -1"):
        PushLedger(hold_bytes=-1)


def test_auto_push_memory_is_half_the_own_fragments_f32_bytes_within_its_floor_and_cap():
    MiB = 1 << 20
    # 1 GiB of f32 parameters (256 Mi of them): one syncer owns all, each of 4 shards one 256 MiB fragment
    assert auto_push_memory_bytes(256 * MiB) == 512 * MiB            # 1 syncer: 1 GiB / 2
    assert auto_push_memory_bytes(64 * MiB) == 128 * MiB             # a shard of 4: 256 MiB / 2
    assert auto_push_memory_bytes(2 * 64 * MiB) == 256 * MiB         # a shard owning two such fragments
    assert auto_push_memory_bytes(1000) == 64 * MiB                  # a small model: every push kept
    assert auto_push_memory_bytes(0) == 64 * MiB
    assert auto_push_memory_bytes(16 * 1024 * MiB) == 1024 * MiB     # 64 GiB of f32: capped
    with pytest.raises(ValueError, match="own_numel must be >= 0"):
        auto_push_memory_bytes(-1)
