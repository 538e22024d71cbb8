"""The one waiting primitive (learner/waiting.py): a waiter wakes when another thread raises the flag,
not a poll interval later; without a flag it polls; it never waits past its deadline."""
from __future__ import annotations

import threading
import time

from yeto.learner.inbox import ChunkNotice, CutInbox, Inbox
from yeto.learner.waiting import Arrivals, wait_until


def test_a_waiter_wakes_on_arrival_well_before_its_poll_interval():
    arrivals = Arrivals()
    box = Inbox(arrivals)
    threading.Timer(0.05, lambda: box.put("pull")).start()  # the NATS thread's put
    t0 = time.monotonic()
    assert wait_until(lambda: len(box) > 0, t0 + 10, arrivals=arrivals, poll=5.0)
    assert time.monotonic() - t0 < 2.5  # the poll alone would have taken 5 s
    assert box.drain() == ["pull"]


def test_a_cut_notice_raises_the_flag_too():
    arrivals = Arrivals()
    inbox = CutInbox(arrivals)
    assert not arrivals.wait(0)
    inbox.put(ChunkNotice("bcast_chunk", "yeto.r.bcast.0.0", 0, 0, 1, 8, {}))
    assert arrivals.wait(0) and not arrivals.wait(0)  # taken down as the waiter returns


def test_without_arrivals_the_condition_is_polled_and_the_deadline_holds():
    calls = []
    t0 = time.monotonic()
    assert not wait_until(lambda: calls.append(1) and False, t0 + 0.2, poll=0.02)
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 2.5 and len(calls) >= 2


def test_a_condition_that_holds_returns_at_once():
    t0 = time.monotonic()
    assert wait_until(lambda: True, t0 + 10, arrivals=Arrivals(), poll=5.0)
    assert time.monotonic() - t0 < 0.1


def test_an_arrival_that_does_not_satisfy_the_condition_waits_on():
    arrivals = Arrivals()
    done = threading.Event()
    threading.Timer(0.02, arrivals.notify).start()  # something else landed
    threading.Timer(0.15, lambda: (done.set(), arrivals.notify())).start()
    t0 = time.monotonic()
    assert wait_until(done.is_set, t0 + 10, arrivals=arrivals, poll=5.0)
    assert 0.1 <= time.monotonic() - t0 < 2.5
