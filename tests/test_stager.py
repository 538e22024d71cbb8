"""learner/stager.py's Fence, fed directly: rank 0's issue order of the island group's and the staging
group's operations, kept on another rank that runs each stream on a thread of its own, where they touch
the same fragment's staging or kept push."""
from __future__ import annotations

import threading
import time

import pytest

from yeto.learner.errors import IslandUnhealthy
from yeto.learner.rank_ops import (AbortOp, CommitOp, EndOp, ExportOp, KeepOp, ResidualOp, SnapshotOp, StageOp,
                                    StopOp)
from yeto.learner.stager import Fence, resource

pytestmark = pytest.mark.pure


def stage(fid, after=0, begin=False):
    return StageOp(fid, 1, "f32", (0,), begin, after=after)


def commit(fid, after=0):
    return CommitOp(fid, 1, "d", "blend", after=after)


def test_what_an_operation_touches():
    assert resource(stage(2, begin=True)) == resource(commit(2)) == ("staging", 2)
    assert resource(AbortOp(1)) == ("staging", 1)
    assert resource(KeepOp(3, "f32", "push")) == resource(ExportOp(3, "f32", "push", kept=True)) == ("kept", 3)
    for op in (EndOp({}), ExportOp(3, "f32", "push"), SnapshotOp(0, "f32", "push"), ResidualOp(0, True), StopOp()):
        assert resource(op) is None


def test_rank0_stamps_each_operation_with_the_other_streams_count_on_the_same_thing():
    f = Fence()
    assert f.stamp("island", EndOp({})) == EndOp({})   # touches nothing: never waits
    assert f.stamp("island", commit(0)).after == 0
    assert [f.stamp("staging", stage(0)).after for _ in range(3)] == [1, 1, 1]
    assert f.stamp("staging", stage(1)).after == 0   # another fragment
    assert f.stamp("island", commit(0)).after == 3
    assert f.stamp("island", commit(1)).after == 1
    assert f.stamp("island", KeepOp(0, "f32", "push")).after == 0   # another thing of fragment 0
    assert f.stamp("staging", ExportOp(0, "f32", "push", kept=True)).after == 1


def _run_later(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_commit_waits_for_its_versions_staging_and_nothing_else():
    """A commit stamped after 2 staging operations on its fragment runs only once this rank finished
    both; staging of another fragment and operations that touch nothing do not count."""
    f = Fence()
    f.wait("island", EndOp({}))   # returns at once
    ran = []
    op = commit(0, after=2)
    t = _run_later(lambda: (f.wait("island", op), ran.append("commit")))
    f.finish("staging", stage(0))
    f.finish("staging", stage(1))
    f.finish("staging", StopOp())
    time.sleep(0.1)
    assert ran == [] and t.is_alive()   # one of its two staging operations done: still waiting
    f.finish("staging", stage(0))
    t.join(5)
    assert ran == ["commit"]


def test_the_streams_wait_for_each_other_in_rank0s_order():
    """Rank 0 issued: commit v of fragment 1 (island), staging of v+1 of fragment 1 (staging), the
    next commit of fragment 1 (island). On this rank the staging thread gets its op first, and waits
    for the commit; the next commit waits for the staging."""
    src = Fence()
    commit1 = src.stamp("island", commit(1))
    begin = src.stamp("staging", stage(1, begin=True))
    commit2 = src.stamp("island", commit(1))
    dst, order = Fence(), []

    def staging_thread():
        dst.wait("staging", begin)
        order.append("stage v+1")
        dst.finish("staging", begin)

    t = _run_later(staging_thread)
    time.sleep(0.1)
    assert order == []   # the commit has not run on this rank yet
    dst.wait("island", commit1)
    order.append("commit v")
    dst.finish("island", commit1)
    dst.wait("island", commit2)
    order.append("commit v+1")
    t.join(5)
    assert order == ["commit v", "stage v+1", "commit v+1"]


def test_a_failed_stream_makes_the_waiters_raise():
    f = Fence()
    err = []

    def waiter():
        try:
            f.wait("island", commit(0, after=1))
        except IslandUnhealthy as exc:
            err.append(str(exc))

    t = _run_later(waiter)
    time.sleep(0.05)
    f.fail("RuntimeError('gloo: connection closed')")
    t.join(5)
    assert err and "staging operations of this rank failed" in err[0] and "connection closed" in err[0]
    with pytest.raises(IslandUnhealthy):
        f.wait("staging", stage(0))   # even with nothing to wait for
