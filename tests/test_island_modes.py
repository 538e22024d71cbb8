"""learner/island_modes.py: each staging strategy and push sender read alone, over a fake communicator that
records what rank 0 announces to its ranks (no process group: these are the mode's decisions, and the ranks'
side of each operation is tested on real gloo ranks in tests/test_piece_io.py and tests/test_island_pieces.py).
The choice `background_mode` makes is checked for every combination the island can start in."""
from __future__ import annotations

import pytest

from yeto.learner.island_modes import (SendAtBoundary, SendKept, SendSnapshot, StageDeferred, StageDirect,
                                       StageOnGroup, background_mode, foreground_mode)
from yeto.learner.rank_ops import AbortOp, ExportOp, KeepOp, ResidualOp, SnapshotOp, StageOp

pytestmark = pytest.mark.pure


class FakeComm:
    """Stands in for a group's `lead` (announce, then run rank 0's part): records each operation, and
    answers a gather with two chunks whose draining it counts (the other ranks wait in that gather)."""

    def __init__(self, name: str):
        self.name, self.led, self.drained = name, [], 0

    def lead(self, op, payloads=None):
        self.led.append((op, payloads))
        if isinstance(op, (ExportOp, SnapshotOp)):
            return self._chunks(op)
        return None

    def _chunks(self, op):
        for k in range(2):
            yield (k, f"{op.fid}:{k}")
            self.drained += 1


class FakeWorker:
    """The sync worker's `submit`: keeps the job for the test to run, as the worker thread would later."""

    def __init__(self):
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)
        return "handle"


def stage(fid, begin, chunks=(0,)):
    return StageOp(fid, 3, "f32", tuple(chunks), begin)


def items(chunks):
    return [c for c in chunks]


def test_direct_staging_leads_every_batch_as_it_is_read():
    comm = FakeComm("island")
    s = StageDirect(comm.lead)
    s.stage(stage(0, True), {0: b"a"})
    s.abort(0)
    s.install(0)
    assert comm.led == [(stage(0, True), {0: b"a"}), (AbortOp(0), None)]
    assert not s.drop(0) and not s.holds_other(1) and s.release() == []


def test_group_staging_leads_on_the_staging_group_only():
    island, group = FakeComm("island"), FakeComm("staging")
    s = StageOnGroup(group.lead)
    s.stage(stage(1, True), {0: b"a"})
    s.abort(1)
    assert island.led == [] and [op for op, _ in group.led] == [stage(1, True), AbortOp(1)]


def test_deferred_staging_keeps_one_fragment_for_the_installing_boundary():
    comm = FakeComm("island")
    s = StageDeferred(comm.lead)
    s.stage(stage(0, True), {0: b"a"})
    s.stage(stage(0, False, (1,)), {1: b"b"})
    assert comm.led == [] and s.holds_other(1) and not s.holds_other(0)
    s.stage(stage(0, True), {0: b"c"})   # a newer version from chunk 0: the kept one goes
    s.install(0)
    assert comm.led == [(stage(0, True), {0: b"c"})] and s.kept == {}
    s.stage(stage(2, True), {0: b"d"})
    assert s.drop(2) and not s.drop(2) and comm.led == [(stage(0, True), {0: b"c"})]
    s.stage(stage(3, True), {0: b"e"})
    assert s.release() == [3] and s.kept == {}


def test_sending_at_the_boundary_gathers_and_publishes_there():
    comm = FakeComm("island")
    sent = []
    send = SendAtBoundary(comm.lead, lambda it: sent.append(list(it)) or "handle")
    assert send.send(ExportOp(1, "f32", "push"), items) == "handle"
    assert sent == [[(0, "1:0"), (1, "1:1")]] and [op for op, _ in comm.led] == [ExportOp(1, "f32", "push")]


@pytest.mark.parametrize("dtype", ["f32", "q4"])
def test_a_failed_publish_at_the_boundary_completes_the_gather(dtype):
    comm = FakeComm("island")

    def refuse(it):
        next(iter(it))
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        SendAtBoundary(comm.lead, refuse).send(ExportOp(1, dtype, "push"), iter)
    assert comm.drained == 2   # the other ranks are not left in the gather
    residual = [op for op, _ in comm.led if isinstance(op, ResidualOp)]
    assert residual == ([ResidualOp(1, False)] if dtype == "q4" else [])


def test_a_snapshot_is_taken_at_the_boundary_and_packed_and_sent_by_the_worker():
    comm, worker, sent = FakeComm("island"), FakeWorker(), []
    pack = lambda op, values: [(s, f"packed {v}") for s, v in values]  # noqa: E731
    send = SendSnapshot(comm.lead, pack, lambda it: sent.append(list(it)) or "inner", worker.submit)
    assert send.send(ExportOp(0, "bf16", "push"), items) == "handle"
    assert [op for op, _ in comm.led] == [SnapshotOp(0, "bf16", "push")] and sent == []
    assert worker.jobs[0]() == "inner"
    assert sent == [[(0, "packed 0:0"), (1, "packed 0:1")]]


def test_kept_pushes_are_kept_by_every_rank_and_gathered_on_the_staging_group():
    island, group, worker, sent = FakeComm("island"), FakeComm("staging"), FakeWorker(), []
    send = SendKept(island.lead, group.lead, lambda it: sent.append(list(it)) or "inner", worker.submit)
    send.send(ExportOp(2, "f32", "push"), items)
    assert [op for op, _ in island.led] == [KeepOp(2, "f32", "push")] and group.led == []
    assert worker.jobs[0]() == "inner"
    assert [op for op, _ in group.led] == [ExportOp(2, "f32", "push", kept=True)] and len(sent[0]) == 2


def test_a_failed_kept_push_completes_the_staging_groups_gather():
    island, group, worker = FakeComm("island"), FakeComm("staging"), FakeWorker()

    def refuse(it):
        raise ConnectionError("down")

    SendKept(island.lead, group.lead, refuse, worker.submit).send(ExportOp(2, "f32", "push"), items)
    with pytest.raises(ConnectionError):
        worker.jobs[0]()
    assert group.drained == 2


@pytest.mark.parametrize("staging_group,world,dtype,staging,sender", [
    (True, 4, "bf16", StageOnGroup, SendKept),
    (True, 4, "q4", StageOnGroup, SendAtBoundary),
    (False, 4, "bf16", StageDeferred, SendSnapshot),
    (False, 4, "q4", StageDeferred, SendAtBoundary),
    (False, 1, "f32", StageDirect, SendSnapshot),
    (False, 1, "q4", StageDirect, SendSnapshot),
])
def test_the_worker_mode_is_chosen_once_from_the_world_the_staging_group_and_the_push_dtype(
        staging_group, world, dtype, staging, sender):
    island, group, worker = FakeComm("island"), FakeComm("staging"), FakeWorker()
    mode = background_mode(lead=island.lead, stage_lead=group.lead if staging_group else None, world=world,
                           push_dtype=dtype, pack=None, publish=None, submit=worker.submit)
    assert type(mode.staging) is staging and type(mode.sender) is sender and mode.background
    fg = foreground_mode(island.lead, None)
    assert type(fg.staging) is StageDirect and type(fg.sender) is SendAtBoundary and not fg.background
