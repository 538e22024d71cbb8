"""Rounds in flight: deadlines, hopeless attempts, restarts, re-broadcasts, the commit order, launches and
pacing (rules of `RoundMachine`).

Rule functions of services/syncer/rounds.RoundMachine over (state, config, output): see machine_state.py. The
choices the design (docs/design.md §4.4, §4.5) leaves open are decided in their docs: the commit order
(`emit_merge`), pacing (`launch_time`), strict mode, hopeless attempts and a restart with no live member
(`check_round`); re-broadcasts are rebroadcasts.py's.
"""
from __future__ import annotations

import math

from yeto.services.syncer.actions import PublishPull, Release
from yeto.services.syncer import pushes
from yeto.services.syncer.config import FIRST_ATTEMPT, HOPELESS_RESTART_S, SyncerConfig
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.rebroadcasts import rebroadcast
from yeto.services.syncer.state import Member, Round, _Slot


def due(s: MachineState, cfg: SyncerConfig, out: Output, r: Round) -> float:
    """When an attempt below quorum restarts: its deadline, or soon after it became hopeless."""
    if r.hopeless_at is None:
        return r.deadline
    return min(r.deadline, r.hopeless_at + min(cfg.quorum_timeout_s, HOPELESS_RESTART_S))


def _hopeful(s: MachineState, cfg: SyncerConfig, out: Output, r: Round) -> int:
    """Slots that may still answer this attempt: not answered, not refused, member still live."""
    return sum(1 for i, slot in r.slots.items()
               if slot.answer is None and slot.refused is None and i in s.members and s.members[i].live)


def check_round(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> None:
    """Complete, restart or keep waiting for one round in flight.

    - **Strict (lockstep)**: a round completes only when every expected member answered (no quorum, no
      grace); a passed deadline tapes an error and moves the deadline one timeout on (no attempt bump).
    - **Hopeless attempts restart early** (not strict): while the answers still possible (slots not
      answered, not refused as stale/future/invalid, member still live) cannot reach quorum, the attempt
      restarts `HOPELESS_RESTART_S` after that began (counted `restart_early`), not at its deadline.
    - **Restart with no live member** keeps the attempt and moves the deadline on (nobody to ask): such a
      round is never hopeless, it waits for a hello or a heartbeat, and time only ever moves its due time
      forward (`next_wakeup()` is never in the past after a Tick).
    """
    # A member that said it leaves will not answer: excused from the quorum (pushes.excuse), so the round
    # completes with the others' pushes now instead of restarting and asking them again (docs/design.md §7.1).
    if not cfg.strict and any(slot.answer is None and pushes.left_on_purpose(s, i, slot.gen)
                              for i, slot in r.slots.items()):
        pushes.excuse(s, cfg, out, r, now)
    # Outliers are judged when the round would complete; removing one re-judges the round below.
    if r.answered == len(r.slots) and not pushes.screen_outliers(s, cfg, out, r, now):
        pushes.complete(s, cfg, out, r, now)
        return
    # Quorum out of reach (pushes refused as stale after a broker restart, a member gone): waiting for
    # the deadline only wastes a quorum timeout (60 s per such round was measured by soak/chaos.py).
    # Restart soon instead, leaving a moment for the re-broadcast that the refusals triggered to land
    # before the new pull (islands apply broadcasts before answering pulls). Re-judged at every event:
    # a member that comes back makes the attempt hopeful again.
    # With no live member at all a restart has nobody to ask: the round waits for a hello or a
    # heartbeat (which re-judge it), not for a restart time that would already be past.
    if not cfg.strict and r.quorum_at is None and r.answered + _hopeful(s, cfg, out, r) < r.quorum and s.any_live():
        r.hopeless_at = now if r.hopeless_at is None else r.hopeless_at
    else:
        r.hopeless_at = None
    if not cfg.strict and r.quorum_at is not None and now >= r.quorum_at + r.grace_s \
            and not pushes.screen_outliers(s, cfg, out, r, now):
        pushes.complete(s, cfg, out, r, now)
    elif now >= due(s, cfg, out, r) and (cfg.strict or r.quorum_at is None):
        s.counters["restart_early" if r.hopeless_at is not None else "quorum_timeout"] += 1
        if cfg.strict:
            r.deadline = now + cfg.quorum_timeout_s
            out.tape("error", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                          reason=f"quorum_timeout (strict: attempt stands): {r.answered}/{len(r.slots)} answered")
            rebroadcast(s, cfg, out, r.fragment, now, f"round {r.step} passed its deadline below quorum (strict)")
        else:
            _restart(s, cfg, out, r, now)


def _restart(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> None:
    live = s.live()
    old_responded, old_attempt = r.responded(), r.attempt
    if not live:
        # Time only moves a due time forward: the next look is one quorum timeout on (or at the first
        # hello or heartbeat, which re-judges the round), never a hopeless time already past. Kept,
        # that past time made next_wakeup() stay in the past and the shell's loop spin.
        r.deadline = now + cfg.quorum_timeout_s
        r.hopeless_at = None
        out.tape("error", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                      reason="deadline passed below quorum and no member is live: attempt stands")
        return
    for island, slot in sorted(r.slots.items()):
        if slot.answer is not None:
            out.emit(Release(island, slot.answer.gen, r.step, r.fragment, old_attempt, slot.answer.try_, "restart"))
    # Before the new pull: islands that missed the base version can read it before they answer.
    rebroadcast(s, cfg, out, r.fragment, now, f"round {r.step} restarts below quorum (attempt {old_attempt})")
    r.attempt += 1
    r.seq = 0
    r.slots = {m.island: _Slot(m.gen) for m in live}
    r.quorum = _quorum_for(s, cfg, out, len(live))
    r.launched_at = now
    r.deadline = now + cfg.quorum_timeout_s
    r.quorum_at = r.grace_s = r.hopeless_at = None
    r.norms = {}
    r.push_dtype = round_push_dtype(s, cfg)
    s.counters["restart"] += 1
    out.emit(PublishPull(r.pull()))
    out.tape("restart", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                  base_version=r.base_version, expected=r.members(), responded=old_responded, quorum=r.quorum,
                  reason=f"deadline passed below quorum: {len(old_responded)} of {r.quorum} needed answered attempt {old_attempt}")


def round_push_dtype(s: MachineState, cfg: SyncerConfig) -> str | None:
    """The dtype a round launched now asks for when `yeto run set` made it differ from the session's (its
    pull then says so); None: the session's."""
    pinned = (s.session or {}).get("push_dtype")
    return cfg.push_dtype if pinned is not None and cfg.push_dtype != pinned else None


def _quorum_for(s: MachineState, cfg: SyncerConfig, out: Output, expected: int) -> int:
    k = cfg.quorum if cfg.quorum is not None else expected
    return max(1, min(k, expected))


def emit_merge(s: MachineState, cfg: SyncerConfig, out: Output, now: float) -> None:
    """The commit order: at most one `Merge` is outstanding; it is emitted for the lowest in-flight step
    only once that round is complete, and the next one only after its `MergeDone`. Rounds that complete
    early wait (they stop accepting pushes). A round stays in flight (holding a pipeline slot and its
    fragment) until its `MergeDone`, so the next round on that fragment always has the new base version."""
    if s.merging is not None or not s.rounds:
        return
    r = s.rounds[min(s.rounds)]
    if not r.accepting:
        s.merging = r.step
        r.merge_at = now
        out.emit(r.merge)


def can_launch_now(s: MachineState, cfg: SyncerConfig, out: Output) -> tuple[int, list[Member]] | None:
    """(step, live members) if capacity allows launching the next round; pacing aside."""
    t = s.next_step
    if t > cfg.total_steps or len(s.rounds) >= cfg.pipeline:
        return None
    if any(r.fragment == cfg.fragment_of(t) for r in s.rounds.values()):
        return None
    live = s.live()
    return (t, live) if live else None


def launch_time(s: MachineState, cfg: SyncerConfig, out: Output, t: int, live: list[Member]) -> float:
    """Earliest time the pacing rules allow round t (outside strict mode; strict launches as soon as the
    pipeline and the fragment allow). Round t is due H/P inner steps after round t-1; it launches when
    the pipeline and the fragment allow AND either
        (time)     now >= previous launch (or V0Done) + (H/P) · slowest live member's EMA step time, or
        (progress) every live member's estimated progress reached its due point:
                   est_local(now) >= ref_local + (t - ref_step)·H/P - launch_lead_steps,
    where a member's (ref_step, ref_local) is (0, its estimated local step) at V0Done, and (last launched
    step, 0) when it is admitted later or returns with a new generation (its local step restarts at 0).
    est_local extrapolates the last reported local step with the EMA step time. The time rule alone always
    makes progress once step times are known; the progress rule lets the syncer catch up when islands are
    ahead (e.g. after a slow merge) and never waits on a newcomer's load time. Without any step-time
    report and no progress, no round launches (islands heartbeat every few seconds, so this only delays
    the first round). `launch_lead_steps` (default 1) makes the pull arrive one step before the boundary
    it is due at."""
    spr = cfg.steps_per_round
    emas = [m.ema_step_s for m in live if m.ema_step_s]
    # A shard's consecutive rounds are (t - its last launched step) rounds apart (1 unsharded).
    by_time = s.last_launch_at + (t - s.last_launch_step) * spr * max(emas) if emas else math.inf
    by_progress = -math.inf
    for m in live:
        due = m.ref_local + (t - m.ref_step) * spr - cfg.launch_lead_steps
        if m.reported_step >= due:
            continue
        if not m.ema_step_s:
            by_progress = math.inf
            break
        by_progress = max(by_progress, m.reported_at + (due - m.reported_step) * m.ema_step_s)
    return min(by_time, by_progress)


def launch(s: MachineState, cfg: SyncerConfig, out: Output, now: float) -> None:
    while (cap := can_launch_now(s, cfg, out)) is not None:
        t, live = cap
        if not cfg.strict and now < launch_time(s, cfg, out, t, live):
            return
        frag = cfg.fragment_of(t)
        attempt = max(FIRST_ATTEMPT, s.min_attempts.get(t, FIRST_ATTEMPT))
        r = Round(step=t, fragment=frag, attempt=attempt, base_version=s.versions[frag],
                  launched_at=now, deadline=now + cfg.quorum_timeout_s, quorum=_quorum_for(s, cfg, out, len(live)),
                  slots={m.island: _Slot(m.gen) for m in live}, push_dtype=round_push_dtype(s, cfg))
        s.rounds[t] = r
        s.next_step = cfg.next_own_step(t)
        s.last_launch_at = now
        s.last_launch_step = t
        s.counters["launch"] += 1
        out.emit(PublishPull(r.pull()))

