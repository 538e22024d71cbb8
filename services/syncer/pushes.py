"""Push dispositions, quarantine, quorum, merge weights and the Merge action (rules of `RoundMachine`).

Rule functions of services/syncer/rounds.RoundMachine over (state, config, output): see machine_state.py.

- **Weights**: c_tokens (or 1 with equal_weights), normalized; all zero -> equal (weights.weights_for).
  A claim is bounded before it weighs (`max_token_factor` F, default 4; how and why: weights.cap_claims).
  A clamped claim is counted (`tokens.clamped`) and shown in the merge record (`weights` hold the used
  values, `detail.token_clamp` {island: {claimed, used, limit}}).
- **Quarantine** (defence in depth against a compromised or buggy island, docs/design.md §9): the shell
  reports each complete push's L2 norm and count of non-finite values (summed chunk by chunk as they
  arrive; no whole-model copy). A push that would be accepted is instead `quarantined` on arrival when it
  holds any NaN/Inf or its norm exceeds `max_push_norm` (off by default) (`_quarantine_rule`), and when the
  round is about to complete when its norm is far above the others' (`screen_outliers`). It is taped
  (rule, figures, limit), counted (`disposition.quarantined`, `quarantine.<rule>`), released and never
  merged; its slot counts as refused (like a stale base) and its member is excused from the quorum (`excuse`).
"""
from __future__ import annotations

import math
from typing import Sequence

from yeto.schemas.run_settings import OUTER_KEYS
from yeto.services.syncer.actions import Merge, MergeInput, Release
from yeto.services.syncer.config import (HOPELESS_DISPOSITIONS, NORM_HISTORY, NORM_MIN_ISLANDS, NORM_PROBATION_SHARE,
                                         NORM_PROBATION_STEPS, OUTLIER_MIN_PUSHES, SyncerConfig)
from yeto.services.syncer.events import MergeDone, PushComplete
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.rebroadcasts import rebroadcast
from yeto.services.syncer.weights import cap_claims, weights_for
from yeto.services.syncer.state import Round, _Answer, lower_median


def on_push(s: MachineState, cfg: SyncerConfig, out: Output, ev: PushComplete, now: float) -> None:
    quarantine = None
    quarantined_now = False
    m = s.members.get(ev.island)
    if m is not None and ev.gen == m.gen:
        m.observe_push(int(ev.local_step), now)
    r = s.rounds.get(ev.step)
    current = s.versions.get(ev.fragment)
    disposition, reason = None, None
    if r is None:
        disposition, reason = "out_of_round", f"no round in flight for step {ev.step}"
    elif r.fragment != ev.fragment:
        disposition, reason = "out_of_round", f"step {ev.step} targets fragment {r.fragment}, not {ev.fragment}"
    elif r.attempt != ev.attempt:
        disposition, reason = "out_of_round", f"stale attempt {ev.attempt} (current {r.attempt})"
    elif not r.accepting:
        disposition, reason = "out_of_round", "round already complete"
    else:
        slot = r.slots.get(ev.island)
        if slot is None:
            disposition, reason = "unexpected_member", "island not expected in this round"
        elif slot.gen != ev.gen:
            disposition, reason = "unexpected_member", f"generation {ev.gen} does not hold this slot ({slot.gen} does)"
        elif slot.answer is not None:
            disposition, reason = "duplicate", f"first valid push wins (try {slot.answer.try_} accepted)"
        elif not ev.valid:
            disposition, reason = "invalid", ev.reason or "invalid push"
        elif ev.base_version > current:
            disposition, reason = "future_base", f"base_version {ev.base_version} > current version {current}"
        elif current - ev.base_version > cfg.max_base_lag:
            disposition, reason = "stale_base", (f"base_version {ev.base_version} lags current version "
                                                 f"{current} by more than {cfg.max_base_lag}")
        elif (ev.gen, ev.try_) in slot.quarantined:
            # A released try never completes again in the shell; should it, it stays out of the merge.
            disposition, reason = "quarantined", f"try {ev.try_} was quarantined already this attempt"
        elif (quarantine := _quarantine_rule(s, cfg, out, ev)) is not None:
            disposition, reason = "quarantined", quarantine.pop("reason")
            s.counters[f"quarantine.{quarantine['rule']}"] += 1
            slot.quarantined.add((ev.gen, ev.try_))
            quarantined_now = True
        else:
            disposition = "accepted"
            slot.answer = _Answer(ev.gen, ev.try_, ev.base_version, ev.local_step, ev.c_steps, ev.c_tokens,
                                  ev.norm)
            if ev.norm is not None:
                r.norms[ev.island] = ev.norm
            if r.quorum_at is None and r.answered >= r.quorum:
                _reach_quorum(s, cfg, out, r, now)
        if disposition in HOPELESS_DISPOSITIONS:
            # The island's push was acknowledged by JetStream, so it will not send another for this
            # attempt: its slot cannot count towards quorum any more.
            slot.refused = disposition
        if quarantined_now:
            excuse(s, cfg, out, r, now)
    s.counters[f"disposition.{disposition}"] += 1
    staleness = current - ev.base_version if current is not None and ev.base_version <= current else None
    detail = {"staleness": staleness, "local_step": ev.local_step}
    if quarantine is not None:
        detail["quarantine"] = quarantine
    out.tape("disposition", now, step=ev.step, fragment=ev.fragment, attempt=ev.attempt, island=ev.island,
                  gen=ev.gen, disposition=disposition, reason=reason, base_version=ev.base_version,
                  detail=detail, **{"try": ev.try_})
    if disposition != "accepted" and not _is_pending_merge_input(s, cfg, out, ev):
        out.emit(Release(ev.island, ev.gen, ev.step, ev.fragment, ev.attempt, ev.try_, disposition))
    if disposition == "stale_base":
        rebroadcast(s, cfg, out, ev.fragment, now, f"push of {ev.island} at step {ev.step} has stale "
                                             f"base_version {ev.base_version} (current {current})")


def _quarantine_rule(s: MachineState, cfg: SyncerConfig, out: Output, ev: PushComplete) -> dict | None:
    """The rule a push breaks on its own (NaN/Inf, `max_push_norm`), with its figure and limit, or None.
    The outlier rule needs the round's other pushes: `screen_outliers` judges it at completion."""
    if ev.non_finite or (ev.norm is not None and not math.isfinite(ev.norm)):
        return {"rule": "non_finite", "non_finite": int(ev.non_finite), "limit": 0,
                "reason": f"quarantined: {ev.non_finite} non-finite values (NaN/Inf) in the push"}
    limit = cfg.max_push_norm
    if limit is not None and ev.norm is not None and ev.norm > limit:
        return {"rule": "max_push_norm", "norm": float(ev.norm), "limit": float(limit),
                "reason": f"quarantined: push norm {ev.norm:.6g} exceeds --max-push-norm {limit:.6g}"}
    return None


def screen_outliers(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> bool:
    """Before a round completes: the rules that judge a push against others (the outlier rule, then the
    norm bound). Returns True if they removed any push (the round does not complete now; it goes on
    as if those members had not answered, each excused from the attempt's quorum)."""
    removed = _screen_outlier_rule(s, cfg, out, r, now)
    removed = _screen_norm_bound(s, cfg, out, r, now) or removed
    return removed


def _screen_outlier_rule(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> bool:
    """Quarantine every accepted push whose norm exceeds outlier_factor x the lower median of the norms
    accepted this attempt (outliers included, so removing one never lowers the reference for the rest).
    Off by default; it needs at least OUTLIER_MIN_PUSHES accepted pushes, and a median of 0 judges nothing."""
    factor = cfg.outlier_factor
    if factor is None or len(r.norms) < OUTLIER_MIN_PUSHES:
        return False
    median = lower_median(list(r.norms.values()))
    if median <= 0:
        return False
    limit = factor * median
    removed = False
    for island, slot in sorted(r.slots.items()):
        a = slot.answer
        if a is None or a.norm is None or a.norm <= limit:
            continue
        removed = True
        _quarantine_answer(
            s, cfg, out, r, island, now, rule={"rule": "outlier", "norm": float(a.norm), "limit": float(limit),
                                  "median": float(median), "pushes": len(r.norms)},
            reason=(f"quarantined: push norm {a.norm:.6g} exceeds --outlier-factor {factor:g} x the round's "
                    f"median norm {median:.6g} (limit {limit:.6g}); supersedes its accepted record"))
    return removed

# -- the norm bound (on by default) --------------------------------------------------------------


def _norm_history(s: MachineState, cfg: SyncerConfig, out: Output) -> dict[int, dict[str, list[float]]]:
    """fragment -> island -> the norms of its last NORM_HISTORY merged pushes of that fragment (oldest
    first): `MachineState.accepted_norms`. Kept by the machine, not the checkpoint: a machine made by
    `restore` (--resume) starts with none, and its first rounds judge against their own pushes, as a
    run's first rounds do."""
    return s.accepted_norms


def _norm_reference(s: MachineState, cfg: SyncerConfig, out: Output, r: Round) -> tuple[float, int] | None:
    """(reference norm, islands it came from) for round r's fragment, or None (fewer than
    NORM_MIN_ISLANDS islands have a value). Each expected member's value is the lower median of its
    own recent merged norms of the fragment and its push this attempt (if any); the reference is the
    lower median of those values over the members. So every island counts once however many pushes
    it made, the history holds only norms that passed every rule (an attacker's accepted pushes are
    at most factor x an honest reference, its quarantined ones never enter), and, the median being
    the lower one, a single island (one of two, or a minority) can never raise the reference: it
    can only lower it, which shrinks what the others may push but never lets anything large in."""
    hist = _norm_history(s, cfg, out).get(r.fragment, {})
    values = []
    for island in sorted(r.slots):
        own = [v for v in hist.get(island, ()) if v > 0]
        cur = r.norms.get(island)
        if cur is not None and math.isfinite(cur) and cur > 0:
            own.append(cur)
        if own:
            values.append(lower_median(own))
    if len(values) < NORM_MIN_ISLANDS:
        return None
    return lower_median(values), len(values)


def _screen_norm_bound(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> bool:
    """Quarantine every accepted push whose norm exceeds push_norm_factor x the reference norm
    (`_norm_reference`; this attempt's norms include pushes already removed, so a removal never moves
    the reference for the rest and a second screening removes nothing more).

    On by default (K = 4, `--push-norm-factor`): it needs no tuning and works from two islands and the
    first round on (in a round of two, the smaller member's value is the reference). Honest pushes are
    untouched while they stay within K x the others' (the demo's runs peak near 1.5, 1.85 loaded: soak/hostile.py
    --poison prints `max_norm_ratio`); an island whose pushes are honestly more than K x larger (more than
    K x faster, say) is quarantined: raise K or turn the bound off (`--push-norm-factor off`). When every
    push of an attempt (two or more) exceeds the history's limit, the attempt's own lower median is the
    reference instead (`norm_bound.history_stale`, below). `yeto replay` rebuilds the history from the
    recorded events."""
    factor = cfg.push_norm_factor
    if factor is None:
        return False
    ref = _norm_reference(s, cfg, out, r)
    if ref is None:
        return False
    reference, sources = ref
    limit = factor * reference
    basis = f"the lower median over {sources} members of their recent merged norms of fragment {r.fragment}"
    # this attempt's norms, those removed at an earlier screening included: the choice stays put
    judged = [n for n in r.norms.values() if n is not None and math.isfinite(n) and n > 0]
    if len(judged) >= NORM_MIN_ISLANDS and all(n > limit for n in judged):
        # Every push of the attempt is over the bound: the history is stale, not the islands hostile
        # (islands that trained unsynced through a broker outage push many steps' worth at once; judged
        # against the old rounds every attempt was quarantined and the run restarted for ever). The
        # attempt's own pushes are the reference then: their lower median, as for the outlier rule,
        # so one hostile push among them still cannot raise it.
        reference, sources = lower_median(judged), len(judged)
        limit = factor * reference
        basis = (f"the lower median of this attempt's {sources} pushes: every one exceeded the history's "
                 f"limit {factor * ref[0]:.6g}")
        s.counters["norm_bound.history_stale"] += 1
    removed = False
    for island, slot in sorted(r.slots.items()):
        a = slot.answer
        since = _on_probation(s, r, island)
        own_factor = max(1.0, factor * NORM_PROBATION_SHARE) if since is not None else factor
        own_limit = own_factor * reference
        if a is None or a.norm is None or a.norm <= own_limit:
            continue
        removed = True
        rule = {"rule": "norm_bound", "norm": float(a.norm), "limit": float(own_limit), "reference": float(reference),
                "islands": sources}
        why = f"--push-norm-factor {factor:g}"
        if since is not None:
            rule["probation_since"] = since
            why = f"{own_factor:g} (on probation: the norm bound quarantined it at step {since})"
        s.norm_quarantined_at[island] = r.step
        _quarantine_answer(
            s, cfg, out, r, island, now, rule=rule,
            reason=(f"quarantined: push norm {a.norm:.6g} exceeds {why} x the reference "
                    f"norm {reference:.6g} (limit {own_limit:.6g}: {basis}); supersedes its accepted record"))
    return removed


def _on_probation(s: MachineState, r: Round, island: str) -> int | None:
    """The step at which the norm bound last quarantined `island`, when round r is within
    NORM_PROBATION_STEPS after it (an earlier step: this round's own removal never tightens its own
    judgement), else None. On probation its pushes are judged against NORM_PROBATION_SHARE x the factor:
    an island that pushed more than K x the others' recently is not trusted up to K x again at once, so a
    steady attacker gets in only when its scaled push is within ~K/2 x an honest one. Kept by the machine
    (rebuilt by `yeto replay`), not the checkpoint, as the norm history is."""
    at = s.norm_quarantined_at.get(island)
    if at is None or not 0 < r.step - at <= NORM_PROBATION_STEPS:
        return None
    return at


def _quarantine_answer(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, island: str, now: float, *, rule: dict, reason: str) -> None:
    """Take back an accepted push judged at completion: taped `quarantined` (superseding its
    `accepted` record), counted, released; its member is excused from the attempt's quorum."""
    slot = r.slots[island]
    a = slot.answer
    slot.answer, slot.refused = None, "quarantined"
    slot.quarantined.add((a.gen, a.try_))
    s.counters["disposition.quarantined"] += 1
    s.counters[f"quarantine.{rule['rule']}"] += 1
    out.tape("disposition", now, step=r.step, fragment=r.fragment, attempt=r.attempt, island=island,
                  gen=a.gen, disposition="quarantined", base_version=a.base_version, reason=reason,
                  detail={"local_step": a.local_step, "quarantine": rule}, **{"try": a.try_})
    out.emit(Release(island, a.gen, r.step, r.fragment, r.attempt, a.try_, "quarantined"))
    excuse(s, cfg, out, r, now)
    if r.answered < r.quorum:
        r.quorum_at = r.grace_s = None   # below quorum again: a later push reaches it afresh


def left_on_purpose(s: MachineState, island: str, gen: str) -> bool:
    """The slot's process said it stops (its leaving heartbeat: membership.leave said=True) and no newer
    generation has taken the slot over: it will not answer."""
    m = s.members.get(island)
    return m is not None and m.gen == gen and m.left and not m.live


def excuse(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> None:
    """A member whose push was quarantined, or that said it leaves (a planned stop: SIGTERM, `close()`), is
    excused from the attempt's quorum (not in strict mode, which waits for every member): quorum becomes
    at most the members not excused (and at least 1), for the rest of the attempt (a later try of that
    member that is accepted is merged, but not waited for). Without this a compromised island that
    quarantines every push (NaN, a norm far out) would hold every round of a run whose quorum is every
    member below quorum, restarting for ever: a 2-island run with the default quorum never committed again;
    and a round whose member left restarted HOPELESS_RESTART_S later and asked the others to push again
    (soak/rolling.py measured a 3.9 s gap between two rounds' merges for it). The round completes with the
    others (after the grace window, as for a member that did not answer)."""
    if cfg.strict:
        return
    excused = sum(1 for i, slot in r.slots.items() if slot.answer is None and (
        slot.refused == "quarantined" or left_on_purpose(s, i, slot.gen)))
    r.quorum = max(1, min(r.quorum, len(r.slots) - excused))
    if r.quorum_at is None and r.answered >= r.quorum:
        _reach_quorum(s, cfg, out, r, now)


def _remember_norms(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, answers: Sequence[tuple[str, _Answer]]) -> None:
    """The merged pushes' norms join their islands' history of r's fragment (the newest NORM_HISTORY)."""
    hist = _norm_history(s, cfg, out).setdefault(r.fragment, {})
    for island, a in answers:
        if a.norm is not None and math.isfinite(a.norm) and a.norm > 0:
            own = hist.setdefault(island, [])
            own.append(float(a.norm))
            del own[:-NORM_HISTORY]


def _is_pending_merge_input(s: MachineState, cfg: SyncerConfig, out: Output, ev: PushComplete) -> bool:
    # a re-delivered copy of an accepted push has the same identity as the one the merge reads
    r = s.rounds.get(ev.step)
    if r is None or r.fragment != ev.fragment or r.attempt != ev.attempt:
        return False
    slot = r.slots.get(ev.island)
    return slot is not None and slot.answer is not None and (slot.answer.gen, slot.answer.try_) == (ev.gen, ev.try_)


def _reach_quorum(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> None:
    r.quorum_at = now
    times = [s.members[i].ema_step_s for i in r.slots if i in s.members and s.members[i].ema_step_s]
    step_time = max(times) if times else 0.0
    raw = cfg.grace_gamma * (cfg.tau * step_time - (now - r.launched_at) - s.last_sync_cost_s)
    r.grace_s = min(max(raw, 0.0), cfg.grace_ms / 1000.0)

# -- merges ------------------------------------------------------------------------------------


def complete(s: MachineState, cfg: SyncerConfig, out: Output, r: Round, now: float) -> None:
    r.complete_at = now
    answers = [(i, slot.answer) for i, slot in sorted(r.slots.items()) if slot.answer is not None]
    _remember_norms(s, cfg, out, r, answers)
    used, clamp = _clamp_tokens(s, cfg, out, answers)
    weights = weights_for(used, cfg.equal_weights)
    inputs = tuple(
        MergeInput(island=i, gen=a.gen, weight=w, try_=a.try_, c_tokens=u, c_steps=a.c_steps,
                   base_version=a.base_version, local_step=a.local_step)
        for (i, a), u, w in zip(answers, used, weights)
    )
    detail = {"normalized_weights": {mi.island: mi.weight for mi in inputs}}
    norms = {i: a.norm for i, a in answers if a.norm is not None}
    if norms:
        detail["norms"] = norms   # what an operator sizes --max-push-norm / --outlier-factor from
    if clamp:
        detail["token_clamp"] = clamp
    outer = {k: v for k, v in s.settings.items() if k in OUTER_KEYS}
    if outer:
        detail["outer"] = outer   # set at runtime (`yeto run set`): the hyper-parameters this merge ran with
    version = s.versions[r.fragment] + 1
    record = {
        "kind": "merge", "step": r.step, "fragment": r.fragment, "attempt": r.attempt,
        "base_version": r.base_version, "version": version, "expected": r.members(),
        "responded": r.responded(), "quorum": r.quorum,
        "staleness": {mi.island: r.base_version - mi.base_version for mi in inputs},
        "weights": _raw_weights(s, cfg, out, inputs),
        "quorum_s": (r.quorum_at - r.launched_at) if r.quorum_at is not None else None,
        "grace_s": r.grace_s,
        "detail": detail,
    }
    r.merge = Merge(step=r.step, fragment=r.fragment, attempt=r.attempt, version=version,
                    base_version=r.base_version, members=inputs,
                    record={k: v for k, v in record.items() if v is not None}, launched_at=r.launched_at,
                    outer={k: v for k, v in s.settings.items() if k in OUTER_KEYS})


def on_merge_done(s: MachineState, cfg: SyncerConfig, out: Output, ev: MergeDone, now: float) -> None:
    r = s.rounds.get(ev.step)
    if s.merging is None or ev.step != s.merging or r is None:
        raise ValueError(f"MergeDone for step {ev.step} but the outstanding merge is step {s.merging}")
    if ev.fragment != r.fragment or ev.version != r.merge.version:
        raise ValueError(f"MergeDone(step {ev.step}, fragment {ev.fragment}, version {ev.version}) does not match "
                         f"Merge(fragment {r.fragment}, version {r.merge.version})")
    del s.rounds[ev.step]
    s.merging = None
    s.versions[r.fragment] = ev.version
    s.committed_step = ev.step
    # Adaptive grace subtracts the last *whole* sync (merge + checkpoint + broadcast): the time from
    # the Merge action to its MergeDone covers all of it, whatever part of it the shell measured.
    s.last_sync_cost_s = max(0.0, float(ev.merge_to_broadcast_s), now - r.merge_at if r.merge_at is not None else 0.0)
    s.counters["merge"] += 1
    # The merge record goes to the tape from the shell, with the durable commit (Merge.record).


def _clamp_tokens(s: MachineState, cfg: SyncerConfig, out: Output, answers: Sequence[tuple[str, _Answer]]) -> tuple[list[int | float], dict[str, dict]]:
    """The c_tokens each answer weighs with, and the claims that were cut (weights.cap_claims)."""
    used, clamp = cap_claims([(island, a.c_tokens, a.c_steps) for island, a in answers],
                             cfg.max_token_factor, cfg.equal_weights)
    if clamp:
        s.counters["tokens.clamped"] += len(clamp)
    return used, clamp


def _raw_weights(s: MachineState, cfg: SyncerConfig, out: Output, inputs: Sequence[MergeInput]) -> dict[str, float]:
    # the tape shows wᵢ before normalization: c_tokens, or 1 (equal weights, or all tokens zero)
    equal = cfg.equal_weights or all(mi.c_tokens == 0 for mi in inputs)
    return {mi.island: (1.0 if equal else mi.c_tokens) for mi in inputs}
