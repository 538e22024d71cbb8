"""learner/stager.py's Fence, fed directly: rank 0's issue order of the island group's and the staging
group's operations, kept on another rank that runs each stream on a thread of its own."""
from __future__ import annotations

import threading
import time

import pytest

from yeto.learner.errors import IslandUnhealthy
from yeto.learner.stager import AFTER, Fence

pytestmark = pytest.mark.pure


def test_rank0_stamps_each_operation_with_the_other_streams_count():
    f = Fence()
    assert f.stamp("island", {"op": "end"}) == {"op": "end", AFTER: 0}
    assert [f.stamp("staging", {"op": "stage", "k": k})[AFTER] for k in range(3)] == [1, 1, 1]
    assert f.stamp("island", {"op": "commit"})[AFTER] == 3
    assert f.stamp("staging", {"op": "stage"})[AFTER] == 2


def _run_later(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_an_operation_waits_for_the_other_streams_operations_issued_before_it():
    """A commit stamped after 2 staging operations runs only once this rank finished both; an
    operation stamped after none never waits."""
    f = Fence()
    f.wait("island", {"op": "end", AFTER: 0})   # returns at once
    ran = []
    t = _run_later(lambda: (f.wait("island", {"op": "commit", AFTER: 2}), ran.append("commit")))
    time.sleep(0.1)
    f.finish("staging")
    time.sleep(0.1)
    assert ran == [] and t.is_alive()   # one of two staging operations done: still waiting
    f.finish("staging")
    t.join(5)
    assert ran == ["commit"]


def test_the_streams_wait_for_each_other_in_rank0s_order():
    """Rank 0 issued: island op 1 (commit v of fragment 1), then staging op 1 (begin v+1 of fragment 1),
    then island op 2. On this rank the staging thread gets its op first, and waits for the commit."""
    src = Fence()
    commit = src.stamp("island", {"op": "commit", "fid": 1})
    begin = src.stamp("staging", {"op": "stage", "fid": 1, "begin": True})
    end = src.stamp("island", {"op": "end"})
    dst, order = Fence(), []

    def staging_thread():
        dst.wait("staging", begin)
        order.append("begin v+1")
        dst.finish("staging")

    t = _run_later(staging_thread)
    time.sleep(0.1)
    assert order == []   # the commit has not run on this rank yet
    dst.wait("island", commit)
    order.append("commit v")
    dst.finish("island")
    t.join(5)
    dst.wait("island", end)   # stamped after the staging op: ran by now
    order.append("end")
    assert order == ["commit v", "begin v+1", "end"]


def test_a_failed_stream_makes_the_waiters_raise():
    f = Fence()
    err = []

    def waiter():
        try:
            f.wait("island", {"op": "commit", AFTER: 1})
        except IslandUnhealthy as exc:
            err.append(str(exc))

    t = _run_later(waiter)
    time.sleep(0.05)
    f.fail("RuntimeError('gloo: connection closed')")
    t.join(5)
    assert err and "staging operations of this rank failed" in err[0] and "connection closed" in err[0]
    with pytest.raises(IslandUnhealthy):
        f.wait("staging", {"op": "stage", AFTER: 0})   # even with nothing to wait for
