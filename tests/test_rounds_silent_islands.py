"""docs/design.md §4.4, "a wedge": every member leaves with a round in flight (both islands paused past the member
timeout). The machine must never leave a due time in the past (the shell's loop spun on it and never read
the heartbeats that would have brought the islands back), and the run must go on as soon as they return."""
from __future__ import annotations

from yeto.services.syncer.events import Heartbeat, Tick
from yeto.services.syncer.rounds import RoundMachine

from tests.test_rounds import GEN, Builder, cfg, pulls, push, start, tapes


def silent_run():
    m = RoundMachine(cfg(strict=False, quorum=2, member_timeout_s=20.0, quorum_timeout_s=30.0, total_steps=8),
                     session_builder=Builder())
    start(m, now=0.0)
    acts = []
    for isl in ("a", "b"):
        acts += m.handle(Heartbeat(isl, GEN[isl], 4, 0.1, 0.5))
    acts += m.handle(Tick(1.0))
    assert pulls(acts) and m.rounds, "round 1 is in flight"
    return m


def test_every_member_gone_leaves_no_due_time_in_the_past_and_no_restart_storm():
    m = silent_run()
    r = m.rounds[min(m.rounds)]
    m.handle(push(m, "a", r.step, now=2.0))          # one of two answers: the round needs b too
    # both islands paused: no heartbeat after 0.5 s; they leave at 20.5 s
    now, taped = 2.0, 0
    while now < 200.0:
        acts = m.handle(Tick(now))
        taped += len(tapes(acts))
        wake = m.next_wakeup()
        assert wake is None or wake > now, f"next_wakeup {wake} is not after the Tick at {now}: the shell would spin"
        now = min(wake if wake is not None else now + 1.0, now + 1.0)
    assert not any(mm.live for mm in m.members.values())
    # one "attempt stands" record per quorum timeout at most (the wedge wrote 730 a second), no early restarts
    assert m.counters["restart_early"] <= 1 and taped <= 20, (dict(m.counters), taped)


def test_islands_that_return_after_the_member_timeout_get_a_pull_within_seconds():
    m = silent_run()
    r = m.rounds[min(m.rounds)]
    for t in range(2, 60):                            # paused well past the 20 s member timeout
        m.handle(Tick(float(t)))
    assert not any(mm.live for mm in m.members.values())
    attempt = r.attempt
    out = []
    for isl in ("a", "b"):                             # resumed: same generations, heartbeats again
        out += m.handle(Heartbeat(isl, GEN[isl], 5, 0.1, 60.0))
    t = 60.0
    while t < 65.0 and not [p for p in pulls(out) if p["step"] == r.step]:
        t += 0.25
        out += m.handle(Tick(t))
    assert all(mm.live for mm in m.members.values())
    new = [p for p in pulls(out) if p["step"] == r.step]
    assert new and new[-1]["attempt"] > attempt, f"no new pull for round {r.step} within 5 s of the islands' return"
    assert sorted(x["island"] for x in new[-1]["members"]) == ["a", "b"]
