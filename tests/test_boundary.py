"""The boundary machine (learner/boundary.py) on its own: no broker, no threads, no torch.distributed.

Each test feeds events and reads the operations back. `World` answers the machine's requests the way
the shell would, from lists the test fills (control messages, pulls, broadcast versions that read
whole, FINAL chunk-0 headers) and a clock it advances by hand; it keeps every operation in `ops`.
The rules are the ones the e2e tests (tests/test_island_*.py, test_lockstep_reference.py,
test_island_after_run.py) exercise through real brokers and processes.
"""
from __future__ import annotations

import pytest

from yeto.learner import boundary_ops as O
from yeto.learner.boundary import Boundary, LockstepTimeout, Phase, Rules
from yeto.learner.sync_state import ProtocolError

ISLAND, GEN = "a", "g1"
P = 2
SESSION = {"fragments": [{"id": f, "numel": 4} for f in range(P)]}


def rules(**kw) -> Rules:
    base = dict(island=ISLAND, gen=GEN, fragments=tuple(range(P)), sync_every=P, alpha=0.5, init_island=False,
                lockstep_timeout_s=10.0, init_v0_timeout_s=30.0, final_timeout_s=20.0, shutdown_timeout_s=15.0,
                ack_resend_s=5.0)
    base.update(kw)
    return Rules(**base)


def pull(step: int, attempt: int = 1, seq: int = 0, base: int = 0, gen: str = GEN) -> dict:
    return {"fragment": (step - 1) % P, "step": step, "attempt": attempt, "seq": seq, "base_version": base,
            "members": [{"island": ISLAND, "gen": gen}]}


def digest(fid: int, v: int) -> str:
    return f"d{fid}.{v}"


def manifest(final_step: int, versions: dict[int, int]) -> dict:
    return {"final_step": final_step, "versions": {str(f): v for f, v in versions.items()},
            "version_digests": {str(f): digest(f, v) for f, v in versions.items()}}


def head(m: dict, fid: int) -> dict:
    """FINAL chunk 0's header backing manifest `m` for fragment `fid`."""
    return {"version": m["versions"][str(fid)], "version_digest": m["version_digests"][str(fid)],
            "final_step": m["final_step"]}


class World:
    """Answers requests like the shell (see the module doc)."""

    def __init__(self, machine: Boundary, *, tick: float = 0.05):
        self.m = machine
        self.now = 0.0
        self.tick = tick  # how far a Wait moves the clock
        self.control: list = []
        self.pulls: list = []
        self.bcast: list = []  # (fid, version) read whole at the next ReadBroadcasts
        self.final_heads: dict[int, dict] = {}  # FINAL chunk 0 headers
        self.final_ready = True  # the final cut reads whole at the first ReadFinal
        self.connected = True
        self.push_error: str | None = None  # the next Push fails to be handed over
        self.acks_in = True  # pushes handed over settle (acked) at the next Reap
        self.handed: list = []  # pulls pushed, not settled yet
        self.on_wait = None  # called at each Wait (the test makes things arrive)
        self.ops: list = []

    def drive(self, event) -> dict:
        ops = self.m.feed(event)
        while True:
            for op in ops:
                self.ops.append(op)
                if isinstance(op, O.End):
                    return op.decision
                if isinstance(op, O.Fail):
                    raise op.error
            ops = self.m.feed(self.answer(ops[-1]))

    def begin(self, **kw) -> dict:
        return self.drive(O.Begin(self.now, **kw))

    def step(self, tokens: int = 10, loss: float | None = None) -> dict:
        self.now += 1.0
        return self.drive(O.StepDone(tokens, loss, self.now))

    def answer(self, req):
        if isinstance(req, O.ReadControl):
            msgs, self.control = self.control, []
            return O.Control(msgs, self.now)
        if isinstance(req, O.VerifyManifest):
            return O.ManifestChecked([self.final_heads.get(f) for f in req.fragments] if self.connected else None)
        if isinstance(req, O.ReadBroadcasts):
            applied = []
            for fid, v in self.bcast:
                (commit,) = self.m.feed(O.VersionComplete(fid, v, digest(fid, v)))
                self.ops.append(commit)
                applied.append(fid)
            self.bcast = []
            return O.BroadcastsRead(applied, self.now)
        if isinstance(req, O.TakePulls):
            ps, self.pulls = self.pulls, []
            return O.Pulls(ps)
        if isinstance(req, O.Reap):
            settled = []
            if self.acks_in:
                settled = [(p, 100, None) for p in self.handed]
                self.handed = []
            return O.Pushes(settled, self.connected)
        if isinstance(req, O.Push):
            err, self.push_error = self.push_error, None
            if err is None:
                self.handed.append(req.pull)
            return O.PushHanded(err)
        if isinstance(req, O.ReadFinal):
            begin = [op for op in self.ops if isinstance(op, O.BeginFinal)][-1]
            done = []
            if self.final_ready:
                for fid, (v, d) in sorted(begin.want.items()):
                    if not any(isinstance(op, O.Commit) and op.mode == "final" and op.fragment == fid for op in self.ops):
                        (commit,) = self.m.feed(O.VersionComplete(fid, v, d))
                        self.ops.append(commit)
                        done.append(fid)
            return O.FinalRead(done, bool(done), self.now)
        if isinstance(req, O.Wait):
            assert req.deadline >= self.now
            self.now = min(req.deadline + 0.01, self.now + self.tick)
            if self.on_wait is not None:
                self.on_wait(self)
            return O.Tick(self.now)
        raise AssertionError(f"unexpected request {req!r}")

    def of(self, kind) -> list:
        return [op for op in self.ops if isinstance(op, kind)]

    def since(self, n: int) -> list:
        return self.ops[n:]


def started(**kw) -> World:
    """A machine past its start with every fragment at version 0: installed before the first step in
    lockstep (local step 0), else at the first boundary (local step 1)."""
    w = World(Boundary(SESSION, rules(**kw)))
    w.bcast = [(f, 0) for f in range(P)]
    w.begin()
    if not w.m.rules.lockstep:
        w.step()
    assert w.m.state.versions() == {str(f): 0 for f in range(P)}
    return w


def pushes(ops) -> list[tuple[int, int, int]]:
    """(step, attempt, try) of every Push among `ops`."""
    return [(op.pull.step, op.pull.attempt, op.pull.try_) for op in ops if isinstance(op, O.Push)]


# ---- apply before pull ------------------------------------------------------------------------------


def test_a_broadcast_that_arrived_is_applied_before_a_pull_is_answered():
    w = started()
    w.step()  # a local step since v0: fragment 1 can be pushed
    n = len(w.ops)
    # Round 2 (fragment 1) is pulled, and v1 of fragment 0 (round 1's commit) lands in the same boundary.
    w.pulls = [pull(2)]
    w.bcast = [(0, 1)]
    w.step()
    ops = w.since(n)
    kinds = [type(op) for op in ops]
    commit = kinds.index(O.Commit)
    push = kinds.index(O.Push)
    assert commit < push
    assert ops[commit] == O.Commit(0, 1, digest(0, 1), "blend")
    assert ops[push].base_version == 0 and ops[push].pull.step == 2


def test_a_pull_of_a_round_that_committed_meanwhile_is_never_answered():
    w = started()
    w.step()
    n = len(w.ops)
    # Round 3 (fragment 0, base 0) and the broadcast of its commit (v1) arrive together: the broadcast is
    # applied first, so the pull is moot and dropped rather than answered with a stale anchor.
    w.pulls = [pull(3, base=0)]
    w.bcast = [(0, 1)]
    w.step()
    assert pushes(w.since(n)) == [] and w.m.book.pending() == 0
    # Dropped on arrival (the version was applied first), not superseded after being taken.
    assert w.m.book.counters["committed"] == 1 and w.m.book.counters["superseded_commit"] == 0


def test_after_applying_a_version_a_pull_waits_for_a_local_step_and_then_carries_that_anchor():
    w = started()
    w.bcast = [(0, 1)]
    w.pulls = [pull(3, base=1)]
    n = len(w.ops)
    w.step()  # v1 applied at this boundary: no step taken on top of it yet
    assert pushes(w.since(n)) == [] and w.m.book.pending() == 1
    n = len(w.ops)
    w.step(tokens=7)
    (push,) = w.of(O.Push)[-1:]
    assert pushes(w.since(n)) == [(3, 1, 0)]
    assert (push.base_version, push.c_steps, push.c_tokens, push.local_step) == (1, 1, 7, w.m.local_step)


# ---- the newest attempt, one copy per attempt ---------------------------------------------------------


def test_the_newest_attempt_of_a_round_wins():
    w = started()
    w.step()
    n = len(w.ops)
    w.pulls = [pull(2, attempt=1), pull(2, attempt=3), pull(2, attempt=2)]
    w.step()
    assert pushes(w.since(n)) == [(2, 3, 0)]
    assert w.m.book.counters["stale"] == 1


def test_a_newer_attempt_after_a_push_is_answered_again():
    w = started()
    w.step()
    w.pulls = [pull(2, attempt=1)]
    w.step()
    n = len(w.ops)
    w.pulls = [pull(2, attempt=2)]  # the syncer restarted the round
    w.step()
    assert pushes(w.since(n)) == [(2, 2, 0)]


def test_one_push_per_attempt_however_often_its_pull_is_delivered():
    w = started()
    w.step()
    n = len(w.ops)
    w.pulls = [pull(2), pull(2), pull(2, seq=1)]  # a redelivery and a re-publication (slot rebound)
    w.step()
    w.pulls = [pull(2), pull(2, seq=1)]
    w.step()
    w.step()
    assert pushes(w.since(n)) == [(2, 1, 0)]
    assert w.m.book.counters["duplicate"] == 2 and w.m.book.counters["republished"] == 1
    assert w.m.book.counters["stale"] == 1  # seq 0 again after seq 1
    assert w.m.counters["pushes"] == 1 and w.m.counters["bytes_out"] == 100


def test_a_push_that_failed_is_sent_again_with_the_next_try():
    w = started()
    w.step()
    n = len(w.ops)
    w.pulls = [pull(2)]
    w.push_error = "TimeoutError()"
    w.step()
    assert w.m.book.pending() == 1 and w.m.counters["push_failed"] == 1
    w.step()
    assert pushes(w.since(n)) == [(2, 1, 0), (2, 1, 1)] and w.m.book.pending() == 0


def test_a_push_awaiting_its_acks_holds_the_next_pull_of_its_fragment():
    w = started()
    w.step()
    w.acks_in = False
    w.pulls = [pull(2)]
    w.step()
    n = len(w.ops)
    w.pulls = [pull(4, base=0)]  # the next round of fragment 1
    w.step()
    assert pushes(w.since(n)) == [] and set(w.m.pushing) == {1}
    w.acks_in = True
    w.step()
    assert pushes(w.since(n)) == [(4, 1, 0)]


def test_no_push_while_disconnected_and_no_try_is_spent():
    w = started()
    w.step()
    w.connected = False
    w.pulls = [pull(2)]
    n = len(w.ops)
    w.step()
    w.step()
    assert pushes(w.since(n)) == [] and w.m.book.pending() == 1
    w.connected = True
    w.step()
    assert pushes(w.since(n)) == [(2, 1, 0)]


def test_a_pull_naming_another_generation_is_not_answered_and_bad_pulls_are_counted():
    w = started()
    w.step()
    n = len(w.ops)
    bad = dict(pull(2), fragment=0)  # round 2 targets fragment 1
    w.pulls = [pull(2, gen="old"), bad]
    dec = w.step()
    assert pushes(w.since(n)) == [] and dec == {"final": None, "stop": False}
    assert w.m.counters["rejected.invalid"] == 1
    (log,) = w.of(O.StepLog)[-1:]
    assert log.rejected == 1


# ---- the initial cut --------------------------------------------------------------------------------


def test_lockstep_waits_for_the_whole_cut_before_the_first_step():
    w = World(Boundary(SESSION, rules(lockstep=True)))
    w.bcast = [(0, 0)]

    def second_lands(world):
        if world.now >= 2.0 and not world.m.state.versions().get("1"):
            world.bcast = [(1, 0)]

    w.on_wait = second_lands
    dec = w.begin()
    assert dec == {"gen": GEN, "installed": [0, 1], "stop": False}
    assert w.now >= 2.0 and w.of(O.Commit) == [O.Commit(0, 0, digest(0, 0), "first"), O.Commit(1, 0, digest(1, 0), "first")]
    assert all(isinstance(op, O.Wait) and op.on == ("bcast",) for op in w.of(O.Wait))


def test_lockstep_fails_when_the_cut_does_not_come():
    w = World(Boundary(SESSION, rules(lockstep=True, lockstep_timeout_s=3.0)))
    w.bcast = [(0, 0)]
    with pytest.raises(LockstepTimeout, match=r"fragments \[1\] have no version after 3s"):
        w.begin()
    assert w.m.phase is Phase.FAILED


def test_the_init_island_streams_init_then_waits_for_v0_up_to_its_timeout():
    w = World(Boundary(SESSION, rules(init_island=True, init_v0_timeout_s=2.0)))
    dec = w.begin(committed=False)
    assert isinstance(w.ops[0], O.StreamInit)
    assert dec["installed"] == [] and 2.0 <= w.now < 2.5  # gave up waiting, trains on
    assert any(isinstance(op, O.Log) and "will be installed at a step boundary" in op.text for op in w.ops)
    w.bcast = [(0, 0), (1, 0)]
    w.step()  # what was missing overwrites at a boundary
    assert [op.mode for op in w.of(O.Commit)] == ["first", "first"]


def test_a_restarted_init_island_skips_init_when_versions_were_committed():
    w = World(Boundary(SESSION, rules(init_island=True)))
    w.bcast = [(0, 0), (1, 0)]
    dec = w.begin(committed=True)
    assert not w.of(O.StreamInit) and dec["installed"] == [0, 1]


def test_an_island_without_an_initial_cut_timeout_starts_at_once():
    w = World(Boundary(SESSION, rules()))
    assert w.begin() == {"gen": GEN, "installed": [], "stop": False}
    assert w.ops == [O.End({"gen": GEN, "installed": [], "stop": False})]


def test_an_initial_cut_timeout_installs_what_lands_in_time():
    w = World(Boundary(SESSION, rules(initial_cut_timeout=1.0)))
    w.bcast = [(1, 0)]
    assert w.begin()["installed"] == [1]
    assert w.m.state.versions() == {"1": 0} and w.m.counters["applies"] == 1


# ---- lockstep -----------------------------------------------------------------------------------------


def test_lockstep_blocks_for_the_due_rounds_pull_answers_it_and_blocks_for_its_broadcast():
    w = started(lockstep=True)  # H/P = 1: local step 1 is the boundary of round 1 (fragment 0)
    t0 = w.now
    arrivals = [(2.0, "pull", pull(1)), (3.0, "bcast", (0, 1))]  # seconds after the step began

    def arrive(world):
        while arrivals and world.now - t0 >= 1.0 + arrivals[0][0]:  # the step itself moved the clock by 1
            _, kind, x = arrivals.pop(0)
            (world.pulls if kind == "pull" else world.bcast).append(x)

    w.on_wait = arrive
    n = len(w.ops)
    dec = w.step()
    ops = w.since(n)
    assert dec == {"final": None, "stop": False} and not arrivals and w.now - t0 >= 4.0
    push = next(i for i, op in enumerate(ops) if isinstance(op, O.Push))
    commit = next(i for i, op in enumerate(ops) if isinstance(op, O.Commit))
    assert push < commit and ops[commit] == O.Commit(0, 1, digest(0, 1), "blend")
    assert pushes(ops) == [(1, 1, 0)] and ops[push].base_version == 0
    assert w.m.seen_rounds == {} and w.m.phase is Phase.TRAINING
    waits = [op for op in ops if isinstance(op, O.Wait)]
    assert waits[0].what == "the pull of round 1" and waits[-1].what.startswith("the broadcast of round 1")
    assert all(op.on == ("control", "bcast", "pulls", "pushes") for op in waits)


def test_lockstep_does_not_answer_a_round_before_its_due_step():
    w = started(lockstep=True, sync_every=4)  # H/P = 2: round t is due at local step 2t
    w.pulls = [pull(2)]  # due at local step 4
    n = len(w.ops)
    assert w.step() == {"final": None, "stop": False}  # local step 1: nothing due, nothing blocks
    assert pushes(w.since(n)) == [] and not any(isinstance(op, O.Wait) for op in w.since(n))
    assert w.m.book.pending() == 1


def test_lockstep_fails_when_the_due_round_does_not_come():
    w = started(lockstep=True, lockstep_timeout_s=4.0)
    t0 = w.now
    with pytest.raises(LockstepTimeout, match="the pull of round 1 did not come within 4s"):
        w.step()
    assert w.now - t0 > 4.0 and w.m.phase is Phase.FAILED


def test_a_manifest_while_blocked_finalizes_at_that_boundary():
    w = started(lockstep=True)
    m = manifest(4, {0: 0, 1: 0})
    w.final_heads = {f: head(m, f) for f in range(P)}
    w.on_wait = lambda world: world.control.append(("manifest", m)) if world.now > 3.0 and not world.m.offered \
        and world.m.manifest is None else None
    dec = w.step()
    assert dec == {"final": 4, "stop": True, "after_run": False}
    assert [op.mode for op in w.of(O.Commit)][-2:] == ["final", "final"] and not w.of(O.Push)


# ---- the final cut ----------------------------------------------------------------------------------


def test_a_manifest_installs_the_f32_final_cut_acks_and_waits_for_the_shutdown():
    w = started()
    m = manifest(6, {0: 2, 1: 3})
    w.final_heads = {f: head(m, f) for f in range(P)}
    w.control = [("manifest", m)]
    n = len(w.ops)
    dec = w.step(loss=1.5)
    ops = w.since(n)
    assert dec == {"final": 6, "stop": True, "after_run": False}
    assert w.of(O.BeginFinal)[-1].want == {0: (2, digest(0, 2)), 1: (3, digest(1, 3))}
    assert [(op.fragment, op.version, op.mode) for op in ops if isinstance(op, O.Commit)] == [(0, 2, "final"), (1, 3, "final")]
    assert not pushes(ops) and not any(isinstance(op, O.ReadBroadcasts) for op in ops)
    (log,) = [op for op in ops if isinstance(op, O.StepLog)]
    assert log.versions == {"0": 2, "1": 3} and log.applies == 2 and log.loss == 1.5 and log.extra is None
    assert not w.of(O.Ack)  # not before every rank holds it
    # The shell shared the decision: ack, re-send the ack while no shutdown comes, stop when it does.
    t0 = w.now
    w.on_wait = lambda world: world.control.append(("shutdown", {"reason": "done"})) if world.now > t0 + 7 else None
    n = len(w.ops)
    assert w.drive(O.FinalShared(w.now)) == {"stop": True}
    acks = [op for op in w.since(n) if isinstance(op, O.Ack)]
    assert acks == [O.Ack(6, 0), O.Ack(6, 1)]  # one re-send after ack_resend_s (5 s)
    assert w.m.phase is Phase.STOPPED


def test_no_shutdown_within_the_timeout_stops_anyway():
    w = started(shutdown_timeout_s=3.0)
    m = manifest(2, {0: 0, 1: 0})
    w.final_heads = {f: head(m, f) for f in range(P)}
    w.control = [("manifest", m)]
    w.step()
    t0 = w.now
    assert w.drive(O.FinalShared(w.now)) == {"stop": True}
    assert 3.0 < w.now - t0 < 3.2 and any("no shutdown" in op.text for op in w.of(O.Log))


def test_the_final_record_after_the_run_installs_and_stops_without_an_ack():
    w = started()
    m = manifest(8, {0: 3, 1: 3})
    w.final_heads = {f: head(m, f) for f in range(P)}
    w.control = [("final", m)]  # the client found the run's final record (the syncer has exited)
    dec = w.step()
    assert dec == {"final": 8, "stop": True, "after_run": True}
    assert w.of(O.StepLog)[-1].extra == {"final_after_run": True, "final_step": 8}
    assert not w.of(O.Ack)


def test_a_run_that_had_finished_at_start_skips_init_and_the_cut():
    w = World(Boundary(SESSION, rules(init_island=True, lockstep=True)))
    m = manifest(8, {0: 3, 1: 3})
    dec = w.begin(final_record=m)
    assert dec == {"gen": GEN, "installed": [], "stop": False, "run_finished": 8}
    assert not w.of(O.StreamInit) and not w.of(O.ReadBroadcasts)
    w.final_heads = {f: head(m, f) for f in range(P)}
    assert w.step() == {"final": 8, "stop": True, "after_run": True}


def test_an_unbacked_manifest_is_dropped_after_the_final_timeout_and_training_goes_on():
    w = started(final_timeout_s=3.0)
    m = manifest(6, {0: 2, 1: 3})
    w.final_heads = {0: head(m, 0), 1: dict(head(m, 1), version_digest="forged")}
    w.control = [("manifest", m)]
    assert w.step() == {"final": None, "stop": False} and w.m.offered is not None
    since = w.now
    while w.m.offered is not None:
        assert w.step() == {"final": None, "stop": False}
        assert w.now - since <= 4.0
    assert w.now - since > 3.0 and w.m.counters["rejected.manifest_unbacked"] == 1
    assert w.of(O.StepLog)[-1].rejected == 1


def test_a_manifest_naming_unknown_fragments_is_rejected_and_a_shutdown_stops():
    w = started()
    w.control = [("manifest", manifest(6, {0: 2, 5: 1}))]
    assert w.step() == {"final": None, "stop": False} and w.m.offered is None
    assert w.m.counters["rejected.invalid"] == 1
    w.control = [("shutdown", {"reason": "bye"})]
    n = len(w.ops)
    assert w.step() == {"final": None, "stop": True}
    assert pushes(w.since(n)) == [] and not any(isinstance(op, O.ReadBroadcasts) for op in w.since(n))
    assert w.m.phase is Phase.STOPPED


def test_the_final_cut_that_does_not_come_fails():
    w = started(final_timeout_s=2.0)
    m = manifest(6, {0: 2, 1: 3})
    w.final_heads = {f: head(m, f) for f in range(P)}
    w.final_ready = False
    w.control = [("manifest", m)]
    with pytest.raises(TimeoutError, match=r"final cut incomplete after 2s: fragments \[0, 1\] missing"):
        w.step()


# ---- time, the step log, the protocol -----------------------------------------------------------------


def test_step_time_is_an_ema_of_the_times_fed_and_heartbeats_get_it():
    w = started()
    w.step()
    w.now += 2.0
    w.step()
    prog = w.of(O.Progress)
    assert [p.local_step for p in prog] == [1, 2, 3]
    assert prog[1].step_time_s == pytest.approx(1.0) and prog[2].step_time_s == pytest.approx(0.9 + 0.3)


def test_every_boundary_emits_one_step_log_event_with_what_it_did():
    w = started()
    w.step()
    w.pulls = [pull(2)]
    w.step(loss=0.25)
    logs = w.of(O.StepLog)
    assert [e.step for e in logs] == [1, 2, 3]
    assert (logs[0].applies, logs[2].pushes, logs[2].bytes_out, logs[2].loss) == (2, 1, 100, 0.25)
    assert logs[2].pending_pulls == 0 and logs[2].versions == {"0": 0, "1": 0}
    # The totals carry every step-log counter from the first event on, 0 or not (islands print them).
    assert {k: w.m.counters[k] for k in ("pushes", "applies", "bytes_out", "rejected")} == \
        {"pushes": 1, "applies": 2, "bytes_out": 100, "rejected": 0}
    assert "rejected" in w.m.counters


def test_an_answer_out_of_turn_is_a_protocol_error():
    m = Boundary(SESSION, rules())
    with pytest.raises(ProtocolError, match="Tick fed while awaiting nothing"):
        m.feed(O.Tick(0.0))
    m.feed(O.Begin(0.0))
    ops = m.feed(O.StepDone(1, None, 1.0))
    assert isinstance(ops[-1], O.ReadControl)
    with pytest.raises(ProtocolError, match="Pulls fed while awaiting Control"):
        m.feed(O.Pulls([]))
    with pytest.raises(ProtocolError, match="StepDone fed while awaiting Control"):
        m.feed(O.StepDone(1, None, 2.0))


def test_a_version_completing_outside_a_reading_is_a_protocol_error():
    w = started()
    with pytest.raises(ProtocolError, match="outside a reading"):
        w.m.feed(O.VersionComplete(0, 1, digest(0, 1)))
    assert w.m.state.version(0) == 0
