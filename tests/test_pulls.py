"""PullBook: every take_ready_pulls rule of docs/design.md §5.3, including the generation rule across restarts."""
from __future__ import annotations

import pytest

from yeto.learner.pulls import DONE, INFLIGHT, WAITING, PendingPull, PullBook, due_round, max_due_step
from yeto.schemas.errors import WireError

ISL = "isl-a"
GEN = "00000000000000a1"
OLD_GEN = "00000000000000a0"
NEW_GEN = "00000000000000a2"
OTHER = {"island": "isl-b", "gen": "00000000000000b1"}
ME = {"island": ISL, "gen": GEN}


def pull(fragment=0, step=1, attempt=1, seq=0, base=0, members=(ME, OTHER)):
    return {"type": "pull", "v": 1, "run": "r", "fragment": fragment, "step": step, "attempt": attempt, "seq": seq,
            "base_version": base, "members": [dict(m) for m in members]}


ALWAYS = lambda fid: True  # noqa: E731


def keys(taken):
    return [(p.fragment, p.step, p.attempt, p.try_) for p in taken]


# ---- members and generations ----------------------------------------------------------------------

def test_answers_only_pulls_naming_this_island_and_generation():
    book = PullBook(ISL, GEN)
    assert book.offer(pull(step=1, fragment=0, members=[ME, OTHER])) is True
    assert book.offer(pull(step=2, fragment=1, members=[OTHER])) is False
    assert book.offer(pull(step=3, fragment=2, members=[{"island": ISL, "gen": OLD_GEN}, OTHER])) is False
    assert book.offer(pull(step=4, fragment=3, members=[{"island": "isl-a2", "gen": GEN}])) is False
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 1, 0)]
    assert book.counters["not_member"] == 3


def test_restart_old_generation_pull_never_shadows_the_new_generations_pull():
    # The new process (NEW_GEN) sees, for round 5 it belonged to before the restart: the attempt still
    # naming its old generation, then the syncer's re-publication (seq 1) naming the new one.
    me_new = {"island": ISL, "gen": NEW_GEN}
    me_old = {"island": ISL, "gen": OLD_GEN}
    book = PullBook(ISL, NEW_GEN)
    assert book.offer(pull(fragment=0, step=5, attempt=2, seq=0, members=[me_old, OTHER])) is False
    assert book.pending() == 0
    assert book.offer(pull(fragment=0, step=5, attempt=2, seq=1, members=[me_new, OTHER])) is True
    # A redelivery of the old-generation copy arrives after: it must not take the round's slot back.
    assert book.offer(pull(fragment=0, step=5, attempt=2, seq=0, members=[me_old, OTHER])) is False
    assert keys(book.take_ready(ALWAYS)) == [(0, 5, 2, 0)]
    # A later attempt naming the new generation replaces it; the old-gen one, redelivered, still loses.
    assert book.offer(pull(fragment=0, step=5, attempt=3, seq=0, members=[me_new, OTHER])) is True
    assert book.offer(pull(fragment=0, step=5, attempt=2, seq=1, members=[me_new, OTHER])) is False
    assert keys(book.take_ready(ALWAYS)) == [(0, 5, 3, 0)]
    assert book.pending() == 1


def test_old_process_drops_its_slot_when_it_is_rebound_to_a_new_generation():
    # A zombie old process (OLD_GEN) holding attempt 1 sees the re-publication naming NEW_GEN.
    book = PullBook(ISL, OLD_GEN)
    assert book.offer(pull(seq=0, members=[{"island": ISL, "gen": OLD_GEN}])) is True
    assert book.offer(pull(seq=1, members=[{"island": ISL, "gen": NEW_GEN}])) is False
    assert book.pending() == 0
    assert book.take_ready(ALWAYS) == []
    assert book.counters["slot_lost"] == 1


def test_republication_that_newly_names_us_is_queued():
    book = PullBook(ISL, GEN)
    assert book.offer(pull(seq=0, members=[OTHER])) is False
    assert book.offer(pull(seq=1, members=[OTHER, ME])) is True
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 1, 0)]


# ---- newest attempt, one copy per attempt ---------------------------------------------------------

def test_newest_attempt_wins_and_older_attempts_are_dropped():
    book = PullBook(ISL, GEN)
    assert book.offer(pull(attempt=2)) is True
    assert book.offer(pull(attempt=1)) is False  # late redelivery of the older attempt
    assert book.offer(pull(attempt=3)) is True  # restart: replaces attempt 2
    taken = book.take_ready(ALWAYS)
    assert keys(taken) == [(0, 1, 3, 0)]
    assert book.counters["stale"] == 1 and book.counters["superseded_attempt"] == 1


def test_newer_attempt_replaces_an_inflight_push_and_late_reports_are_ignored():
    book = PullBook(ISL, GEN)
    book.offer(pull(attempt=1))
    (p1,) = book.take_ready(ALWAYS)
    assert book.live(0, 1, 1, 0)
    book.offer(pull(attempt=2))
    assert not book.live(0, 1, 1, 0)  # the shell can stop streaming attempt 1
    assert book.sent(0, 1, 1, 0) is False  # attempt 1's acks arrive late: ignored
    assert book.record(0, 1).state == WAITING
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 2, 0)]


def test_newer_attempt_not_naming_us_drops_our_pending_one():
    # Attempt 2 was re-captured without this island: a push for attempt 1 would be "out of round".
    book = PullBook(ISL, GEN)
    book.offer(pull(attempt=1))
    assert book.offer(pull(attempt=2, members=[OTHER])) is False
    assert book.pending() == 0
    assert book.take_ready(ALWAYS) == []


def test_republished_same_attempt_is_kept_once():
    book = PullBook(ISL, GEN)
    assert book.offer(pull(seq=0)) is True
    assert book.offer(pull(seq=0)) is False  # exact redelivery
    assert book.offer(pull(seq=1)) is False  # re-publication, still naming us: one copy
    assert book.pending() == 1
    assert len(book.take_ready(ALWAYS)) == 1
    assert book.offer(pull(seq=2)) is False  # while in flight
    assert book.take_ready(ALWAYS) == []
    assert book.counters["duplicate"] == 1 and book.counters["republished"] == 2


def test_answered_attempt_is_not_answered_again_when_republished():
    book = PullBook(ISL, GEN)
    book.offer(pull(seq=0))
    (p,) = book.take_ready(ALWAYS)
    assert book.sent(p.fragment, p.step, p.attempt, p.try_) is True
    assert book.pending() == 0
    assert book.offer(pull(seq=1)) is False
    assert book.take_ready(ALWAYS) == []
    assert book.record(0, 1).state == DONE
    # ...but a new attempt of the same round (restart after our push) is answered again, try 0.
    assert book.offer(pull(attempt=2)) is True
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 2, 0)]


# ---- readiness ------------------------------------------------------------------------------------

def test_pull_waits_until_its_fragment_is_ready():
    book = PullBook(ISL, GEN)
    book.offer(pull(fragment=0, step=1))
    book.offer(pull(fragment=1, step=2))
    ready = {0: False, 1: True}
    assert keys(book.take_ready(ready.__getitem__)) == [(1, 2, 1, 0)]
    assert book.pending() == 2  # one waiting, one in flight
    assert book.record(0, 1).state == WAITING and book.record(1, 2).state == INFLIGHT
    ready[0] = True
    assert keys(book.take_ready(ready.__getitem__)) == [(0, 1, 1, 0)]


def test_take_ready_returns_oldest_round_first():
    book = PullBook(ISL, GEN)
    for step in (7, 5, 6):
        book.offer(pull(fragment=(step - 1) % 4, step=step))
    assert [p.step for p in book.take_ready(ALWAYS)] == [5, 6, 7]


# ---- tries ----------------------------------------------------------------------------------------

def test_failed_push_is_retried_with_the_next_try_until_sent():
    book = PullBook(ISL, GEN)
    book.offer(pull(base=3))
    (p,) = book.take_ready(ALWAYS)
    assert p == PendingPull(fragment=0, step=1, attempt=1, seq=0, base_version=3, try_=0)
    assert book.take_ready(ALWAYS) == []  # in flight: not handed out twice
    assert book.failed(0, 1, 1, 0) is True
    assert book.pending() == 1
    (p,) = book.take_ready(ALWAYS)
    assert p.try_ == 1
    assert book.failed(0, 1, 1, 0) is False  # a report for a try no longer in flight
    assert book.failed(0, 1, 1, 1) is True
    (p,) = book.take_ready(ALWAYS)
    assert p.try_ == 2
    assert book.sent(0, 1, 1, 2) is True
    assert book.pending() == 0
    assert book.sent(0, 1, 1, 2) is False  # reported twice


def test_failed_push_waits_for_readiness_again():
    book = PullBook(ISL, GEN)
    book.offer(pull())
    book.take_ready(ALWAYS)
    book.failed(0, 1, 1, 0)
    assert book.take_ready(lambda fid: False) == []
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 1, 1)]


# ---- supersession by commit -----------------------------------------------------------------------

def test_commit_supersedes_rounds_launched_on_older_versions():
    book = PullBook(ISL, GEN)
    book.offer(pull(fragment=0, step=1, base=4))
    book.offer(pull(fragment=1, step=2, base=4))
    book.offer(pull(fragment=2, step=3, base=4))
    assert keys(book.take_ready(lambda fid: fid == 1)) == [(1, 2, 1, 0)]  # 0, 2 wait; 1 in flight
    assert book.committed(0, 5) == 1  # round 1 of fragment 0 committed
    assert book.committed(1, 5) == 1  # fragment 1's in-flight push is moot too
    assert book.committed(2, 4) == 0  # the version the round started from: still live
    assert book.record(0, 1) is None and book.record(1, 2) is None and book.record(2, 3) is not None
    assert book.failed(1, 2, 1, 0) is False  # its late failure report does not resurrect it
    assert keys(book.take_ready(ALWAYS)) == [(2, 3, 1, 0)]
    # Redeliveries of the committed rounds' pulls are dropped on arrival.
    assert book.offer(pull(fragment=0, step=1, base=4)) is False
    assert book.offer(pull(fragment=1, step=2, base=4, attempt=2)) is False
    assert book.counters["committed"] == 2
    assert book.floor(0) == 5


def test_a_pull_claiming_a_later_base_does_not_drop_other_rounds_on_its_own_word():
    # Regression: a pull's base_version was taken as proof that the version was committed; one forged
    # pull (base 2^53-1) made the island drop every real pull of its fragment for good. Now only an
    # applied version (committed) supersedes rounds; the real round goes on being answered.
    book = PullBook(ISL, GEN, fragments=4)
    book.offer(pull(fragment=0, step=5, base=1))
    assert book.offer(pull(fragment=0, step=4 * 10**6 + 1, base=10**6, members=(OTHER,))) is False
    assert keys(book.take_ready(ALWAYS)) == [(0, 5, 1, 0)]
    assert book.offer(pull(fragment=0, step=5, attempt=2, base=1)) is True  # its restart still counts
    assert book.counters["superseded_commit"] == 0 and book.floor(0) is None
    assert book.committed(0, 2) == 1  # the round committed: the book learns it from the broadcast
    assert book.pending() == 0


@pytest.mark.parametrize("field,value", [("step", 2**53 - 1), ("attempt", 2**53 - 1), ("base_version", 2**53 - 1),
                                         ("seq", 2**31)])
def test_absurd_numbers_in_a_pull_are_refused_and_change_nothing(field, value):
    book = PullBook(ISL, GEN)
    book.offer(pull(fragment=0, step=1))
    forged = pull(fragment=0, step=1)
    forged[field] = value
    with pytest.raises(WireError) as e:
        book.offer(forged)
    assert e.value.field == field
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 1, 0)]


def test_a_base_version_the_round_cannot_have_is_refused():
    book = PullBook(ISL, GEN, fragments=4)
    assert book.offer(pull(fragment=2, step=11, base=2)) is True  # rounds 3 and 7 of fragment 2 came before
    with pytest.raises(WireError) as e:
        book.offer(pull(fragment=2, step=15, base=4))
    assert e.value.field == "base_version"


def test_an_attempt_jump_is_refused_and_the_real_attempts_still_count():
    # A forged attempt 2^31-1 of a real round would make every real restart look stale.
    book = PullBook(ISL, GEN)
    book.offer(pull(fragment=0, step=1, attempt=3))
    with pytest.raises(WireError) as e:
        book.offer(pull(fragment=0, step=1, attempt=3 + 17, members=(OTHER,)))
    assert e.value.field == "attempt"
    assert book.offer(pull(fragment=0, step=1, attempt=4)) is True
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 4, 0)]


def test_a_flood_of_pulls_not_naming_this_island_does_not_grow_the_book():
    book = PullBook(ISL, GEN)
    book.offer(pull(fragment=0, step=1))
    for step in range(2, 5000):
        book.offer(pull(fragment=0, step=step, members=(OTHER,)))
    assert len(book._rounds) <= 1 + 2 * 1024 and book.counters["forgotten"] > 0
    assert keys(book.take_ready(ALWAYS)) == [(0, 1, 1, 0)]  # the island's own round survives


def test_done_rounds_are_forgotten_once_committed():
    book = PullBook(ISL, GEN)
    for step in range(1, 41):
        book.offer(pull(fragment=0, step=step, base=step - 1))
        (p,) = book.take_ready(ALWAYS)
        book.sent(p.fragment, p.step, p.attempt, p.try_)
        book.committed(0, step)
    assert len(book._rounds) == 0  # the ledger does not grow with the run's length


# ---- lockstep -------------------------------------------------------------------------------------

def test_lockstep_answers_a_round_only_from_its_due_step():
    h, p = 8, 4  # round t due at local step 2t
    assert [max_due_step(s, h, p) for s in range(7)] == [0, 0, 1, 1, 2, 2, 3]
    assert [due_round(s, h, p) for s in range(7)] == [None, None, 1, None, 2, None, 3]
    book = PullBook(ISL, GEN, fragments=p)
    book.offer(pull(fragment=0, step=1))
    book.offer(pull(fragment=1, step=2))
    assert book.take_ready(ALWAYS, max_step=max_due_step(1, h, p)) == []
    assert keys(book.take_ready(ALWAYS, max_step=max_due_step(2, h, p))) == [(0, 1, 1, 0)]
    assert book.take_ready(ALWAYS, max_step=max_due_step(3, h, p)) == []
    assert keys(book.take_ready(ALWAYS, max_step=max_due_step(4, h, p))) == [(1, 2, 1, 0)]


def test_lockstep_helpers_refuse_h_not_a_multiple_of_p():
    with pytest.raises(WireError) as e:
        max_due_step(3, 6, 4)
    assert e.value.field == "sync_every"


# ---- malformed pulls ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("step", 0), ("attempt", 0), ("seq", -1), ("base_version", None),
                                         ("fragment", True), ("members", "isl-a")])
def test_malformed_pull_names_the_field(field, value):
    bad = pull()
    bad[field] = value
    with pytest.raises(WireError) as e:
        PullBook(ISL, GEN).offer(bad)
    assert e.value.field == field


def test_pull_whose_step_targets_another_fragment_is_refused():
    with pytest.raises(WireError) as e:
        PullBook(ISL, GEN, fragments=4).offer(pull(fragment=1, step=1))
    assert e.value.field == "fragment"
    with pytest.raises(WireError):
        PullBook(ISL, GEN, fragments=4).offer(pull(fragment=4, step=5))


def test_a_pull_naming_a_push_dtype_hands_it_to_the_push_and_a_bad_one_is_refused():
    book = PullBook(ISL, GEN)
    assert book.offer(dict(pull(step=1), push_dtype="bf16")) and book.offer(pull(step=2, fragment=1))
    first, second = book.take_ready(ALWAYS)
    assert (first.step, first.push_dtype) == (1, "bf16") and (second.step, second.push_dtype) == (2, None)
    with pytest.raises(WireError) as exc:
        book.offer(dict(pull(step=3, fragment=2), push_dtype="fp8"))
    assert exc.value.field == "push_dtype" and exc.value.value == "fp8"
    # a restarted attempt asks for its own dtype
    assert book.offer(dict(pull(step=1, attempt=2), push_dtype="f32"))
    assert [(p.step, p.attempt, p.push_dtype) for p in book.take_ready(ALWAYS)] == [(1, 2, "f32")]
