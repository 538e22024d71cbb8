"""The syncer's round state machine: pure, deterministic, no I/O, no clock.

The I/O shell (services/syncer/service.py) turns what it reads from NATS into *events*, feeds them to
`RoundMachine.handle(event)` one at a time, and carries out the *actions* it gets back, in order.
Time comes only with events (`now`, seconds; use wall-clock `time.time()` so tape times and the members
KV read sensibly across restarts). A `now` older than one already seen is treated as the newest seen,
so a late event never moves the machine's clock backwards. Every event, whatever its kind, also runs
the time-driven checks (liveness, grace windows, deadlines, pacing, final timeout); `Tick(now)` carries
nothing else. `next_wakeup()` says when the next of those fires, so the shell can sleep until then
(but should still tick every second or so).

Lifecycle (`phase`):
  pinning -> init -> committing_v0 -> running -> finalizing -> done

Choices the design leaves open, decided here:
- **init_island named**: hellos from other islands are *queued* (not refused, not admitted) until the
  INIT island's hello pins the session; then they are re-examined in arrival order. A dtype mismatch
  is refused at once (it does not depend on the session). A queued island that sends a newer
  generation replaces its queued hello.
- **Pinning checks the hello's own fingerprint**: the session builder recomputes the layout
  fingerprint; if it differs from the one the hello claims, the hello is refused (layout_mismatch).
  A layout the builder refuses (WireError / ValueError) is refused with the error's code.
- **Version 0**: the machine emits `CommitV0(fragments)` once every fragment is initialized and
  `islands` members are live; the shell commits v0 of every fragment durably, broadcasts it, then
  feeds back a single `V0Done(now)`. Rounds launch only after that.
- **INIT and generations**: version 0 comes from one process of the INIT island. The shell feeds
  each INIT chunk whose framing it checked as `InitChunk` and keeps its bytes until the machine
  answers `InitStore` (write them) or `InitDrop` (free them) — exactly one per chunk. A fragment's
  chunks come from one generation; a chunk of a retired generation is refused (`stale_gen`), one of
  another island (`not_init_island`) or fragment (`unknown_fragment`) too: counted and taped, no
  error message (a flood of chunks must not become a flood of errors). A chunk of a generation not
  seen yet (its hello comes through another consumer, so it may arrive later) is *held* — no
  waiting — and replayed when that generation's hello is admitted; at most `MAX_HELD_GENS` unseen
  generations are held (a further one is refused, `unknown_gen`), and held chunks are dropped when
  their generation is retired or version 0 is decided. A new generation of the INIT island while
  `phase == "init"` clears every initialized fragment (counter `init.restart`, a `session` tape
  record): INIT restarts with the new process, which sends everything again. `InitComplete` (a whole
  fragment at once) follows the same generation rules for callers that check fragments themselves:
  one of a retired generation is ignored (`ignored.init_stale_gen`), one of an unseen generation held
  (`init.held`) and replayed at its hello. Once `CommitV0` is out, INIT is over: a new generation
  changes nothing about version 0.
- **Attempts are 1-based, pull `seq` and push `try` 0-based** (as the schemas say).
- **Commit order**: at most one `Merge` is outstanding; it is emitted for the lowest in-flight step
  only once that round is complete, and the next one only after its `MergeDone`. Rounds that complete
  early wait (they stop accepting pushes). A round stays in flight (holding a pipeline slot and its
  fragment) until its `MergeDone`, so the next round on that fragment always has the new base version.
- **Pacing outside strict mode** (round t, due H/P inner steps after round t-1): launch when the
  pipeline and the fragment allow AND either
    (time)     now >= previous launch (or V0Done) + (H/P) · slowest live member's EMA step time, or
    (progress) every live member's estimated progress reached its due point:
               est_local(now) >= ref_local + (t - ref_step)·H/P - launch_lead_steps,
  where a member's (ref_step, ref_local) is (0, its estimated local step) at V0Done, and
  (last launched step, 0) when it is admitted later or returns with a new generation (its local
  step restarts at 0). est_local extrapolates the last reported local step with the EMA step time.
  The time rule alone always makes progress once step times are known; the progress rule lets the
  syncer catch up when islands are ahead (e.g. after a slow merge) and never waits on a newcomer's
  load time. Without any step-time report and no progress, no round launches (islands heartbeat
  every few seconds, so this only delays the first round). `launch_lead_steps` (default 1) makes the
  pull arrive one step before the boundary it is due at.
- **EMA step time**: from heartbeats: their `step_time_s` when given (> 0), else derived from two
  heartbeats (Δtime / Δlocal_step). Pushes update progress only (their arrival lags their local step
  by the transfer time, which would bias a derived step time).
- **Strict (lockstep)**: launch as soon as pipeline and fragment allow; a round completes only when
  every expected member answered (no quorum, no grace); a passed deadline tapes an error and moves
  the deadline one timeout on (no attempt bump).
- **Restart with no live member** keeps the attempt and moves the deadline on (nobody to ask).
- **Hopeless attempts restart early** (not strict): while the answers still possible (slots not answered,
  not refused as stale/future/invalid, member still live) cannot reach quorum, the attempt restarts
  `HOPELESS_RESTART_S` after that began (counted `restart_early`), not at its deadline.
- **Members**: any number of islands may join (N only gates version 0). A member silent for
  `member_timeout_s` or longer leaves; a heartbeat of its current generation brings it back.
  A hello with a generation the island had before is a stale replay and is ignored.
- **Weights**: c_tokens (or 1 with equal_weights), normalized; all zero -> equal (outer.weights_for).
  A claim is bounded before it weighs (`max_token_factor`, default 4): at most that many times the
  round's *lower median positive claim* among the pushes being merged (the smaller middle value for an
  even count; claims of 0 take no part, so an island that counts no tokens changes nothing). The syncer
  cannot check a claim (tokens per step differ per island, and c_steps is claimed too), but it can
  refuse to let one island's word outweigh the others': with the lower median, one island of a round
  of two or more never moves the cap by lying, so its weight is at most factor × an honest member's.
  A clamped claim is counted (`tokens.clamped`) and shown in the merge record (`weights` hold the
  used values, `detail.token_clamp` {island: {claimed, used, limit}}).
- **Quarantine** (defence in depth against a compromised or buggy island): the shell reports each
  complete push's L2 norm and count of non-finite values (summed chunk by chunk as they arrive; no
  whole-model copy). A push that would be accepted is instead `quarantined` when it holds any NaN/Inf
  (always), when its norm exceeds `max_push_norm` (off by default), or — judged when the round is
  about to complete, against the pushes accepted this attempt — when its norm exceeds
  `outlier_factor` × the round's lower median norm (off by default; it needs at least
  `OUTLIER_MIN_PUSHES` = 3 accepted pushes, since with two neither is a reference for the other, and
  a median of 0 judges nothing). A quarantined push is taped (rule, figure, limit), counted
  (`disposition.quarantined`, `quarantine.<rule>`), released and never merged; its slot counts as
  refused (like a stale base): the round goes on with the others, and if that leaves it below quorum
  it restarts as for a missing member (strict mode, having no quorum, waits for another try). An
  outlier was first taped `accepted`; its `quarantined` record follows and supersedes it.
- **Finalization** is decided here, carried out by the shell: once every step is committed the
  machine emits one `PublishFinal` (the f32 cut; never a second one), and only after its
  `FinalPublished` a `SendManifest` per target (live members), so a manifest always carries every
  fragment's digest. A known island heard from during finalization with a generation that is not the
  target (a new generation, or a heartbeat of a member that was not live when finalization began)
  becomes the target and gets the manifest as soon as the cut is out — even if an earlier generation
  acked — so no process trains on after the syncer exits. Hellos of unknown islands get a fatal
  `run_finishing` error. `RecordFinal` keeps targets and acks durable so a resumed syncer continues
  finalization (or, when the run finished, exits at once).
- **Unknown members**: a heartbeat of an island, or of a generation of it, the machine has no record
  of (a resumed syncer that lost the members record, a hello lost with a killed syncer) gets a
  non-fatal `SendError` with code `unknown_member` (at most once per member timeout per generation):
  the island must send hello again.
- **Re-broadcast**: BCAST keeps one message per chunk subject, so a forged chunk, a purge or a broker
  that lost its last writes can leave a fragment's committed version incomplete there for good: the
  islands stay on an older version, push stale bases, and no round of that fragment commits again.
  The machine emits `Rebroadcast(fragment, version)` of the committed version when a round of that
  fragment passes its deadline below quorum (restart, or strict deadline) or a push of it is
  `stale_base`; at most once per `quorum_timeout_s` per fragment, and never while that fragment's
  merge is due or under way (its params are changing and the next broadcast comes anyway).
- **Release**: the machine tells the shell which push payloads it may delete from the PUSH stream at
  once (rejected pushes, pushes discarded by a restart). It never releases the identity of a push that
  a pending merge still needs; the shell deletes accepted pushes after `MergeDone` itself. Release may
  repeat for the same identity: make deletion idempotent.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from schemas.codec import load_schema
from services.syncer.outer import weights_for

_CHUNK_BYTES_RANGE = tuple(load_schema("session")["properties"]["chunk_bytes"][k] for k in ("minimum", "maximum"))

__all__ = [
    "SyncerConfig", "RoundMachine", "Member", "Round",
    # events
    "Event", "Hello", "InitComplete", "PushComplete", "Heartbeat", "MergeDone", "V0Done", "Tick", "FinalAck",
    "FinalPublished", "InitChunk",
    # actions
    "Action", "WriteSession", "WriteMember", "PublishPull", "SendError", "MergeInput", "Merge", "Release",
    "Tape", "CommitV0", "InitStore", "InitDrop", "PublishFinal", "SendManifest", "RecordFinal", "Shutdown", "Done",
    "Rebroadcast",
    "PUSH_DTYPES", "BULK_DTYPES", "FIRST_ATTEMPT", "DISPOSITIONS", "OUTLIER_MIN_PUSHES",
]

PUSH_DTYPES = ("f32", "bf16", "q4")
BULK_DTYPES = ("f32", "bf16")
FIRST_ATTEMPT = 1
EMA_ALPHA = 0.3
UNKNOWN_MEMBER = "unknown_member"   # SendError code: the island must send hello again (non-fatal)
DISPOSITIONS = ("accepted", "duplicate", "unexpected_member", "future_base", "stale_base", "out_of_round", "invalid",
                "quarantined")
# Refusals of a slot's own push: the island saw its push acknowledged and will not answer this attempt again.
HOPELESS_DISPOSITIONS = ("future_base", "stale_base", "invalid", "quarantined")
# The outlier rule needs this many accepted pushes in a round: with two, neither is a reference.
OUTLIER_MIN_PUSHES = 3
# Restart this soon once quorum is out of reach (capped by the quorum timeout).
HOPELESS_RESTART_S = 2.0


# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyncerConfig:
    run: str
    islands: int                      # N: live members needed before version 0
    fragments: int                    # P
    sync_every: int                   # H: inner steps between two syncs of one fragment, multiple of P
    total_steps: int                  # global rounds to commit before finalization
    pipeline: int = 1                 # rounds in flight at most (never two on one fragment)
    quorum: int | None = None         # K; None = every expected member
    quorum_timeout_s: float = 900.0   # a round below quorum this long after launch restarts
    grace_ms: float = 10_000.0        # cap of the adaptive grace window
    grace_gamma: float = 1.0          # γ
    grace_tau: int | None = None      # τ, inner steps a push may lag; None = H/P
    strict: bool = False              # lockstep test mode
    max_base_lag: int = 1             # a push whose base is older than current - lag is stale
    equal_weights: bool = False
    push_dtype: str = "f32"
    bulk_dtype: str = "f32"
    chunk_bytes: int = 1 << 20
    init_island: str | None = None    # None = the first admitted hello's island
    member_timeout_s: float = 30.0
    final_timeout_s: float = 600.0
    launch_lead_steps: int = 1
    max_push_norm: float | None = None     # quarantine a push whose L2 norm exceeds this; None = off
    outlier_factor: float | None = None    # quarantine a push above this x the round's median norm; None = off
    max_token_factor: float | None = 4.0   # cap a c_tokens claim at this x the round's median claim; None = off

    def __post_init__(self) -> None:
        def bad(flag: str, why: str, value: Any) -> None:
            raise ValueError(f"{flag} {why}, got {value!r}")

        for name in ("islands", "fragments", "sync_every", "total_steps", "pipeline", "chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad("--" + name.replace("_", "-"), "must be an integer >= 1", value)
        # The session record's schema bounds the chunk size: checked here so a bad flag is a one-line
        # error at start-up, not a schema error when the first hello arrives.
        lo, hi = _CHUNK_BYTES_RANGE
        if not lo <= self.chunk_bytes <= hi:
            bad("--chunk-bytes", f"must be between {lo} and {hi} (the session schema's bounds)", self.chunk_bytes)
        if self.sync_every % self.fragments:
            bad("--sync-every", f"(H) must be a multiple of --fragments (P = {self.fragments})", self.sync_every)
        if self.quorum is not None and (not isinstance(self.quorum, int) or self.quorum < 1):
            bad("--quorum", "must be an integer >= 1 (or unset for all)", self.quorum)
        for name in ("quorum_timeout_s", "member_timeout_s", "final_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                bad("--" + name.replace("_", "-"), "must be a number > 0", value)
        for name in ("grace_ms", "grace_gamma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                bad("--" + name.replace("_", "-"), "must be a number >= 0", value)
        for name in ("grace_tau", "max_base_lag", "launch_lead_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                bad("--" + name.replace("_", "-"), "must be an integer >= 0", value)
        # Defence in depth: None = off. A factor of 1 would quarantine half of every round as outliers.
        for name, low, low_ok, off in (("max_push_norm", 0.0, False, "unset"), ("outlier_factor", 1.0, False, "unset"),
                                       ("max_token_factor", 1.0, True, "0")):
            value = getattr(self, name)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and (value > low or (low_ok and value == low))):
                bad("--" + name.replace("_", "-"), f"must be a number {'>=' if low_ok else '>'} {low:g} ({off} for off)",
                    value)
        if self.push_dtype not in PUSH_DTYPES:
            bad("--push-dtype", f"must be one of {PUSH_DTYPES}", self.push_dtype)
        if self.bulk_dtype not in BULK_DTYPES:
            bad("--bulk-dtype", f"must be one of {BULK_DTYPES}", self.bulk_dtype)

    @property
    def steps_per_round(self) -> int:
        """H/P: inner steps between two consecutive rounds (of different fragments)."""
        return self.sync_every // self.fragments

    @property
    def tau(self) -> int:
        return self.steps_per_round if self.grace_tau is None else self.grace_tau

    def fragment_of(self, step: int) -> int:
        """Round t (1-based) targets fragment (t-1) mod P."""
        return (step - 1) % self.fragments


# ---- events (shell -> machine) --------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    pass


@dataclass(frozen=True)
class Hello(Event):
    island: str
    gen: str
    layout: Sequence[Mapping[str, Any]]
    layout_fingerprint: str
    push_dtype: str
    bulk_dtype: str
    now: float


@dataclass(frozen=True)
class InitComplete(Event):
    """The INIT island's chunks of `fragment` are all in (the shell checked them)."""
    island: str
    gen: str
    fragment: int
    now: float


@dataclass(frozen=True)
class InitChunk(Event):
    """One INIT chunk whose framing the shell checked (run, known fragment, dtype, chunk plan, size,
    digest, finite values). The shell keeps its bytes until the machine answers with InitStore (write
    them into the fragment) or InitDrop (free them): every InitChunk gets exactly one of the two, at
    once or — for a chunk held until its generation's hello — later."""
    island: str
    gen: str
    fragment: int
    chunk: int
    chunks: int
    now: float


@dataclass(frozen=True)
class PushComplete(Event):
    """Every chunk of one push try is in; the shell checked chunk digests, push digest and sizes and
    reports the outcome in `valid` / `reason`. `norm` (the try's L2 norm, None when not measured) and
    `non_finite` (how many NaN/Inf values it holds) are the figures the machine's quarantine rules
    judge: the shell sums them chunk by chunk as the chunks arrive."""
    island: str
    gen: str
    fragment: int
    step: int
    attempt: int
    try_: int
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    valid: bool
    reason: str | None
    now: float
    norm: float | None = None
    non_finite: int = 0


@dataclass(frozen=True)
class Heartbeat(Event):
    island: str
    gen: str
    local_step: int
    step_time_s: float | None
    now: float


@dataclass(frozen=True)
class MergeDone(Event):
    """The shell finished the merge, the outer step, the durable checkpoint, the state KV and the
    broadcast of `version` of `fragment` for round `step`; `sync_s` is how long that took. Adaptive
    grace subtracts the larger of `sync_s` and the time from the Merge action to this event (the whole
    sync as the machine saw it: merge, checkpoint, broadcast)."""
    step: int
    fragment: int
    version: int
    sync_s: float
    now: float


@dataclass(frozen=True)
class V0Done(Event):
    """Version 0 of every fragment is durable and broadcast (answer to CommitV0)."""
    now: float


@dataclass(frozen=True)
class Tick(Event):
    now: float


@dataclass(frozen=True)
class FinalAck(Event):
    island: str
    gen: str
    final_step: int
    now: float


@dataclass(frozen=True)
class FinalPublished(Event):
    """The f32 final cut (answer to PublishFinal) is in FINAL and the checkpoint says final."""
    now: float


# ---- actions (machine -> shell) -------------------------------------------------------------------

@dataclass(frozen=True)
class Action:
    pass


@dataclass(frozen=True)
class WriteSession(Action):
    session: dict


@dataclass(frozen=True)
class WriteMember(Action):
    """Members KV: island -> {gen, layout_fingerprint, last_step, last_heartbeat, admitted_at, live}."""
    island: str
    record: dict


@dataclass(frozen=True)
class PublishPull(Action):
    """pull: {fragment, step, attempt, seq, base_version, members: [{island, gen}] sorted by island};
    the shell adds type/v/run and the msg id pull.F.step.attempt.seq."""
    pull: dict


@dataclass(frozen=True)
class SendError(Action):
    island: str
    gen: str
    code: str
    message: str
    fatal: bool
    field: str | None = None


@dataclass(frozen=True)
class MergeInput:
    """One accepted push of a merge; (island, gen, step, fragment, attempt, try_) names its chunks."""
    island: str
    gen: str
    weight: float          # normalized merge weight (the members' weights sum to 1)
    try_: int
    c_tokens: int          # the claim as used for the weight (after the max_token_factor clamp)
    c_steps: int
    base_version: int
    local_step: int


@dataclass(frozen=True)
class Merge(Action):
    """Merge the accepted pushes (sorted by island), apply the outer step, commit `version` of
    `fragment` durably, update `state`, broadcast, then feed back MergeDone(step, fragment, version).

    `record` is the round's `merge` tape record, less `t` and `sync_s` (the shell adds both at the
    durable commit: launch to commit, `launched_at` being the round's launch time). The shell keeps it
    in the checkpoint with the commit, so the record reaches the tape exactly once even when the syncer
    dies between the commit and the tape write."""
    step: int
    fragment: int
    attempt: int
    version: int
    base_version: int
    members: tuple[MergeInput, ...]
    record: dict = field(default_factory=dict, compare=False)
    launched_at: float = 0.0


@dataclass(frozen=True)
class Release(Action):
    """The payload of this push will never be merged: its chunks may be deleted from PUSH."""
    island: str
    gen: str
    step: int
    fragment: int
    attempt: int
    try_: int
    reason: str


@dataclass(frozen=True)
class Tape(Action):
    """One record for EVENTS (`events.<kind>`); the shell adds v and run."""
    event: dict


@dataclass(frozen=True)
class CommitV0(Action):
    """Commit version 0 of every fragment from the INIT data (durably), broadcast it, then feed V0Done."""
    fragments: tuple[int, ...]


@dataclass(frozen=True)
class InitStore(Action):
    """Write the held bytes of this INIT chunk into the fragment's values."""
    gen: str
    fragment: int
    chunk: int


@dataclass(frozen=True)
class InitDrop(Action):
    """Free the held bytes of this INIT chunk: they never become part of version 0."""
    gen: str
    fragment: int
    chunk: int
    reason: str


@dataclass(frozen=True)
class PublishFinal(Action):
    """Publish the f32 final cut of `versions` and mark the checkpoint final (with `record`, the
    finalization record RecordFinal describes), then feed back FinalPublished. Emitted once per run:
    the machine owns the decision, so no second publication runs beside the first."""
    final_step: int
    versions: dict
    record: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class SendManifest(Action):
    """Send the manifest (final step, version per fragment, the f32 cut's digests) to one island
    generation. Emitted only once the final cut is out (after FinalPublished), so the shell always
    holds every fragment's digest."""
    island: str
    gen: str
    final_step: int
    versions: dict


@dataclass(frozen=True)
class RecordFinal(Action):
    """Keep the finalization record durably (checkpoint): {final_step, versions, targets {island: gen},
    acked [island], finished}. `RoundMachine.restore(final=record)` continues from it: a finished run
    ends at once, an unfinished one re-sends the manifest to the targets that have not acked."""
    record: dict


@dataclass(frozen=True)
class Rebroadcast(Action):
    """Publish the committed bytes of `version` of `fragment` to BCAST again: the bulk dtype, the same
    version and version_digest, Nats-Msg-Ids that differ per re-send (the duplicate window would drop
    the original ids). Tape a `rebroadcast` record once it is out. The fragment's params are not
    changing while this is pending (no merge of it is due), so carry it out before the next action."""
    fragment: int
    version: int
    reason: str


@dataclass(frozen=True)
class Shutdown(Action):
    island: str
    gen: str
    reason: str


@dataclass(frozen=True)
class Done(Action):
    """The syncer may exit; ok=False names the targets that never acked."""
    ok: bool
    missing: tuple[str, ...]


# ---- state ----------------------------------------------------------------------------------------

@dataclass
class Member:
    island: str
    gen: str
    layout_fingerprint: str
    admitted_at: float
    last_heartbeat: float
    live: bool = True
    reported_step: int = 0            # highest local step heard of (heartbeat or push)
    reported_at: float = 0.0          # when that progress was last confirmed
    ema_step_s: float | None = None
    ref_step: int = 0                 # pacing reference: global step ...
    ref_local: float = 0.0            # ... and the member's local step at that point
    retired_gens: set[str] = field(default_factory=set)
    _hb_step: int | None = None
    _hb_at: float | None = None

    def est_local(self, now: float) -> float:
        if self.ema_step_s:
            return self.reported_step + max(0.0, now - self.reported_at) / self.ema_step_s
        return float(self.reported_step)

    def observe_heartbeat(self, local_step: int, step_time_s: float | None, now: float) -> None:
        sample = None
        if step_time_s is not None and math.isfinite(step_time_s) and step_time_s > 0:
            sample = float(step_time_s)
        elif self._hb_step is not None and local_step > self._hb_step and now > self._hb_at:
            sample = (now - self._hb_at) / (local_step - self._hb_step)
        if sample is not None:
            self.ema_step_s = sample if self.ema_step_s is None else EMA_ALPHA * sample + (1 - EMA_ALPHA) * self.ema_step_s
        self._hb_step, self._hb_at = local_step, now
        # a heartbeat is current: the island is at local_step *now* (even if it did not move)
        if local_step >= self.reported_step:
            self.reported_step, self.reported_at = local_step, now

    def observe_push(self, local_step: int, now: float) -> None:
        # a push's local step is older than its arrival: only ever raise progress, never confirm it
        if local_step > self.reported_step:
            self.reported_step, self.reported_at = local_step, now

    def record(self) -> dict:
        return {
            "gen": self.gen,
            "layout_fingerprint": self.layout_fingerprint,
            "last_step": self.reported_step,
            "last_heartbeat": self.last_heartbeat,
            "admitted_at": self.admitted_at,
            "live": self.live,
        }


@dataclass
class _Answer:
    gen: str
    try_: int
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    norm: float | None = None


@dataclass
class _Slot:
    gen: str
    answer: _Answer | None = None
    refused: str | None = None     # its push of this attempt was refused: it will not answer this attempt
    quarantined: set[tuple[str, int]] = field(default_factory=set)   # (gen, try) quarantined this attempt


@dataclass
class Round:
    step: int
    fragment: int
    attempt: int
    base_version: int
    launched_at: float
    deadline: float
    quorum: int
    slots: dict[str, _Slot]
    seq: int = 0
    quorum_at: float | None = None
    grace_s: float | None = None
    complete_at: float | None = None
    merge: Merge | None = None
    merge_at: float | None = None     # when the Merge action went out
    hopeless_at: float | None = None  # when quorum became out of reach for this attempt
    norms: dict[str, float] = field(default_factory=dict)  # island -> norm of its push accepted this attempt

    @property
    def accepting(self) -> bool:
        return self.complete_at is None

    @property
    def answered(self) -> int:
        return sum(1 for s in self.slots.values() if s.answer is not None)

    def members(self) -> list[dict]:
        return [{"island": i, "gen": self.slots[i].gen} for i in sorted(self.slots)]

    def responded(self) -> list[dict]:
        return [{"island": i, "gen": s.answer.gen} for i, s in sorted(self.slots.items()) if s.answer]

    def pull(self) -> dict:
        return {
            "fragment": self.fragment, "step": self.step, "attempt": self.attempt, "seq": self.seq,
            "base_version": self.base_version, "members": self.members(),
        }


@dataclass
class _Final:
    final_step: int
    started_at: float
    targets: dict[str, str]           # island -> gen that must install the cut and ack
    versions: dict[int, int] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    cut_out: bool = False             # FinalPublished seen: manifests may go out

    def record(self, *, finished: bool = False) -> dict:
        return {"final_step": self.final_step, "versions": {str(k): v for k, v in sorted(self.versions.items())},
                "targets": dict(sorted(self.targets.items())), "acked": sorted(self.acked), "finished": finished}


def _lower_median(values: Sequence[float]) -> float:
    """The middle value; for an even count the smaller of the two middle ones, so that one high value
    (a liar in a round of two) never raises it."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _default_builder() -> Callable[..., dict]:
    from schemas.layout import build_session  # lazily: the machine is testable without it
    return build_session


# ---- the machine ----------------------------------------------------------------------------------

class RoundMachine:
    """See the module docstring. Feed events with `handle`, carry out the returned actions in order."""

    def __init__(self, config: SyncerConfig, *, session_builder: Callable[..., dict] | None = None):
        self.config = config
        self.counters: Counter[str] = Counter()
        self._builder = session_builder
        self.phase = "pinning"
        self.session: dict | None = None
        self.init_island: str | None = None
        self._layout_fp: str | None = None
        self.members: dict[str, Member] = {}
        self._queued: dict[str, Hello] = {}
        self._initialized: set[int] = set()
        self._held_init: dict[str, dict[int, InitComplete]] = {}   # unseen gen -> fragment -> event
        self._init_chunks: dict[int, tuple[str, int, set[int]]] = {}  # fragment -> (gen, chunks, indexes stored)
        self._held_chunks: dict[str, dict[tuple[int, int], InitChunk]] = {}  # unseen gen -> (fragment, chunk) -> event
        self.versions: dict[int, int] = {}
        self.committed_step = 0
        self._next_step = 1
        self.rounds: dict[int, Round] = {}          # in flight (launched, not yet committed), by step
        self._merging: int | None = None
        self._last_launch_at: float | None = None
        self._last_sync_s = 0.0
        self._min_attempts: dict[int, int] = {}
        self._final: _Final | None = None
        self._hello_asked: dict[tuple[str, str], float] = {}
        self._rebroadcast_at: dict[int, float] = {}   # fragment -> when its last Rebroadcast went out
        self._restored_finished = False
        self._resend_manifests = False
        self._now = -math.inf
        self._out: list[Action] = []

    # -- public ------------------------------------------------------------------------------------

    @classmethod
    def restore(
        cls,
        config: SyncerConfig,
        session: Mapping[str, Any],
        versions: Mapping[Any, int],
        committed_step: int,
        members: Mapping[str, Mapping[str, Any]],
        *,
        now: float,
        min_attempts: Mapping[int, int] | None = None,
        session_builder: Callable[..., dict] | None = None,
        final: Mapping[str, Any] | None = None,
    ) -> "RoundMachine":
        """A machine that continues a run (`--resume`) from `committed_step` + 1 with `versions`
        (fragment -> committed version; JSON string keys accepted) and the members KV records.
        No version 0 again. Restored members count as heard from at `now` (each gets a full
        member_timeout_s to heartbeat). `min_attempts` (step -> lowest attempt) lets the shell make a
        relaunched round use an attempt above the ones already published for that step before the
        restart (e.g. the last pull per step in CTL + 1), so no pull id is reused with other members.
        Feed a Tick(now) right after: it launches rounds, or finalizes if every step is committed.
        `final` is the last RecordFinal record (the final cut is out): a finished run emits Done(True)
        at once; an unfinished one continues finalization, re-sending the manifest to every target
        that has not acked (targets that acked stay acked and get their Shutdown at the end).
        """
        cfg = config
        frags = session.get("fragments")
        if not isinstance(frags, Sequence) or len(frags) != cfg.fragments:
            raise ValueError(f"--fragments {cfg.fragments} does not match the session's "
                             f"{len(frags) if isinstance(frags, Sequence) else frags!r} fragments")
        for key, flag in (("push_dtype", "--push-dtype"), ("bulk_dtype", "--bulk-dtype"), ("sync_every", "--sync-every")):
            if key in session and session[key] != getattr(cfg, key):
                raise ValueError(f"{flag} {getattr(cfg, key)!r} does not match the session's {key} {session[key]!r}")
        vers = {int(k): int(v) for k, v in versions.items()}
        if sorted(vers) != list(range(cfg.fragments)) or any(v < 0 for v in vers.values()):
            raise ValueError(f"versions must give a version >= 0 for every fragment 0..{cfg.fragments - 1}, got {dict(versions)!r}")
        if not (0 <= committed_step <= cfg.total_steps):
            raise ValueError(f"committed step {committed_step} outside 0..--total-steps {cfg.total_steps}")
        m = cls(cfg, session_builder=session_builder)
        m.session = dict(session)
        m.init_island = session.get("init_island")
        m._layout_fp = session["layout_fingerprint"]
        m._initialized = set(range(cfg.fragments))
        m.versions = vers
        m.committed_step = committed_step
        m._next_step = committed_step + 1
        m._now = now
        m._last_launch_at = now
        m._min_attempts = {int(k): int(v) for k, v in (min_attempts or {}).items()}
        for island, rec in sorted(members.items()):
            fp = rec.get("layout_fingerprint", m._layout_fp)
            if fp != m._layout_fp:
                raise ValueError(f"member {island!r} has layout_fingerprint {fp!r}, the session {m._layout_fp!r}")
            last = int(rec.get("last_step", 0))
            m.members[island] = Member(
                island=island, gen=str(rec["gen"]), layout_fingerprint=fp,
                admitted_at=float(rec.get("admitted_at", now)), last_heartbeat=now,
                live=bool(rec.get("live", True)), reported_step=last, reported_at=now,
                ref_step=committed_step, ref_local=float(last),
            )
        m.phase = "running"
        if final is not None:
            if final.get("finished"):
                m._restored_finished = True
            else:
                targets = {str(i): str(g) for i, g in (final.get("targets") or {}).items()}
                m._final = _Final(final_step=int(final.get("final_step", committed_step)), started_at=now,
                                  targets=targets, versions=dict(vers), cut_out=True,
                                  acked={str(i) for i in final.get("acked") or () if str(i) in targets})
                m.phase = "finalizing"
                m._resend_manifests = True
        return m

    def handle(self, event: Event) -> list[Action]:
        if self.phase == "done":
            self.counters["ignored.after_done"] += 1
            return []
        now = max(float(event.now), self._now)
        handler = self._HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event {type(event).__name__}")
        self._out = []
        handler(self, event, now)   # may raise on a shell contract violation, before any change
        self._now = now
        self._pump(now)
        out, self._out = self._out, []
        return out

    def next_wakeup(self) -> float | None:
        """The earliest time at which a Tick would change something (None: nothing pending)."""
        cfg, cands = self.config, []
        if self.phase == "done":
            return None
        for m in self.members.values():
            if m.live:
                cands.append(m.last_heartbeat + cfg.member_timeout_s)
        for r in self.rounds.values():
            if r.accepting:
                cands.append(self._due(r))
                if not cfg.strict and r.quorum_at is not None:
                    cands.append(r.quorum_at + r.grace_s)
        cap = self._can_launch_now() if self.phase == "running" and not cfg.strict else None
        if cap is not None:
            cands.append(self._launch_time(*cap))
        if self._final is not None:
            cands.append(self._final.started_at + cfg.final_timeout_s)
        cands = [c for c in cands if math.isfinite(c)]
        return min(cands) if cands else None

    @property
    def next_step(self) -> int:
        return self._next_step

    # -- helpers for actions -----------------------------------------------------------------------

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    def _tape(self, kind: str, now: float, **fields: Any) -> None:
        self._emit(Tape({"kind": kind, "t": now, **{k: v for k, v in fields.items() if v is not None}}))

    def _write_member(self, m: Member) -> None:
        self._emit(WriteMember(m.island, m.record()))

    def _reject(self, island: str, gen: str, code: str, message: str, now: float, *,
                fatal: bool, field: str | None = None) -> None:
        self.counters[f"rejected.{code}"] += 1
        self._emit(SendError(island, gen, code, message, fatal, field))
        self._tape("error", now, island=island, gen=gen, reason=f"{code}: {message}",
                   detail={"code": code, "field": field})

    def _live(self) -> list[Member]:
        return [self.members[i] for i in sorted(self.members) if self.members[i].live]

    # -- hello, session, members -------------------------------------------------------------------

    def _on_hello(self, ev: Hello, now: float) -> None:
        cfg = self.config
        m = self.members.get(ev.island)
        if m is not None and ev.gen in m.retired_gens:
            self.counters["ignored.hello_stale_gen"] += 1
            return
        if m is not None and ev.gen == m.gen:
            self.counters["ignored.hello_duplicate"] += 1
            return
        for key, flag in (("push_dtype", "--push-dtype"), ("bulk_dtype", "--bulk-dtype")):
            asked = getattr(ev, key)
            if asked != "auto" and asked != getattr(cfg, key):
                self._reject(ev.island, ev.gen, "dtype_mismatch",
                             f"hello asks {key} {asked!r}, the session uses {getattr(cfg, key)!r} ({flag})",
                             now, fatal=True, field=key)
                return
        if self.phase == "finalizing" and m is None:
            self._reject(ev.island, ev.gen, "run_finishing",
                         f"run is finalizing at step {self._final.final_step}; no rounds left to join",
                         now, fatal=True)
            return
        if self.session is None:
            if cfg.init_island is not None and ev.island != cfg.init_island:
                self._queued[ev.island] = ev      # a newer generation replaces the queued one
                self.counters["hello.queued"] += 1
                return
            if self._pin(ev, now):
                self._admit(ev, now)
                queued, self._queued = self._queued, {}
                for q in queued.values():
                    self._on_hello(q, now)
            return
        if ev.layout_fingerprint != self._layout_fp:
            self._reject(ev.island, ev.gen, "layout_mismatch",
                         f"layout_fingerprint {ev.layout_fingerprint} differs from the session's {self._layout_fp}",
                         now, fatal=True, field="layout_fingerprint")
            return
        if m is None:
            self._admit(ev, now)
        else:
            self._new_generation(m, ev, now)

    def _pin(self, ev: Hello, now: float) -> bool:
        cfg = self.config
        builder = self._builder or _default_builder()
        try:
            session = builder(
                list(ev.layout), cfg.fragments, run=cfg.run, push_dtype=cfg.push_dtype,
                bulk_dtype=cfg.bulk_dtype, chunk_bytes=cfg.chunk_bytes, init_island=ev.island,
                sync_every=cfg.sync_every, created=now,
            )
        except ValueError as exc:  # WireError is a ValueError: a layout the builder cannot use
            code = getattr(exc, "code", "bad_layout")
            code = "bad_layout" if code in (None, "invalid") else code
            self._reject(ev.island, ev.gen, code, f"layout refused: {exc}", now, fatal=True,
                         field=getattr(exc, "field", None) or "layout")
            return False
        fp = session.get("layout_fingerprint", ev.layout_fingerprint)
        if fp != ev.layout_fingerprint:
            self._reject(ev.island, ev.gen, "layout_mismatch",
                         f"layout_fingerprint {ev.layout_fingerprint} is not the layout's fingerprint {fp}",
                         now, fatal=True, field="layout_fingerprint")
            return False
        if len(session.get("fragments", ())) != cfg.fragments:
            self._reject(ev.island, ev.gen, "bad_layout",
                         f"layout gives {len(session.get('fragments', ()))} fragments, --fragments is {cfg.fragments}",
                         now, fatal=True, field="layout")
            return False
        self.session = session
        self.init_island = ev.island
        self._layout_fp = fp
        self.phase = "init"
        self._emit(WriteSession(session))
        self._tape("session", now, island=ev.island, gen=ev.gen,
                   reason=f"session pinned by {ev.island}, the INIT island",
                   detail={"session_fingerprint": session.get("session_fingerprint"), "layout_fingerprint": fp})
        return True

    def _admit(self, ev: Hello, now: float) -> None:
        m = Member(island=ev.island, gen=ev.gen, layout_fingerprint=ev.layout_fingerprint,
                   admitted_at=now, last_heartbeat=now, reported_at=now)
        if self.phase in ("running", "finalizing"):
            m.ref_step, m.ref_local = self._next_step - 1, 0.0
        self.members[ev.island] = m
        self.counters["join"] += 1
        self._write_member(m)
        self._tape("join", now, island=ev.island, gen=ev.gen, reason="admitted")
        self._replay_held_init(m, now)

    def _new_generation(self, m: Member, ev: Hello, now: float) -> None:
        old = m.gen
        m.retired_gens.add(old)
        m.gen, m.live = ev.gen, True
        m.admitted_at = m.last_heartbeat = m.reported_at = now
        m.reported_step, m._hb_step, m._hb_at = 0, None, None   # local steps restart with the process
        if self.phase in ("running", "finalizing"):
            m.ref_step, m.ref_local = self._next_step - 1, 0.0
        self.counters["join.new_gen"] += 1
        self._write_member(m)
        self._tape("join", now, island=m.island, gen=m.gen, reason=f"new generation (was {old})")
        if m.island == self.init_island and self.phase == "init":
            # The new process sends every fragment again; what the old one sent must not be mixed in.
            dropped = sorted(self._initialized)
            self._initialized.clear()
            self._init_chunks.clear()
            self._held_init.pop(old, None)
            self._drop_held_chunks(old, "generation retired")
            self.counters["init.restart"] += 1
            self._tape("session", now, island=m.island, gen=m.gen,
                       reason=f"INIT restarts with the INIT island's new generation {m.gen} (was {old})",
                       detail={"dropped_fragments": dropped})
            self._replay_held_init(m, now)
        # rebind unanswered slots; an answered slot keeps the old generation's accepted push
        for step in sorted(self.rounds):
            r = self.rounds[step]
            slot = r.slots.get(m.island)
            if r.accepting and slot is not None and slot.answer is None and slot.gen != m.gen:
                slot.gen, slot.refused = m.gen, None   # the new generation answers afresh
                r.seq += 1
                self.counters["pull.rebound"] += 1
                self._emit(PublishPull(r.pull()))
        if self._final is not None:
            # A new process trains on unless it installs the final cut: it becomes the target, even
            # if its previous generation had acked.
            self._final.acked.discard(m.island)
            self._final_target(m, now)

    def _on_heartbeat(self, ev: Heartbeat, now: float) -> None:
        m = self.members.get(ev.island)
        if m is None or (ev.gen != m.gen and ev.gen not in m.retired_gens):
            # The syncer has no record of this generation (e.g. a resumed syncer whose members KV
            # missed it, or a hello lost with a killed syncer): the island trains, pushes nothing
            # useful and is never asked. Tell it to say hello again.
            self.counters["heartbeat.unknown"] += 1
            self._ask_hello(ev.island, ev.gen, now)
            return
        if ev.gen != m.gen:
            self.counters["ignored.heartbeat_stale_gen"] += 1
            return
        m.last_heartbeat = now
        m.observe_heartbeat(int(ev.local_step), ev.step_time_s, now)
        if not m.live:
            m.live = True
            self.counters["join.resumed"] += 1
            self._tape("join", now, island=m.island, gen=m.gen, reason="heartbeat resumed")
        self._write_member(m)
        f = self._final
        if f is not None and f.targets.get(m.island) != m.gen:
            self._final_target(m, now)

    def _ask_hello(self, island: str, gen: str, now: float) -> None:
        # Once per member timeout per generation: heartbeats come every few seconds, errors need not.
        last = self._hello_asked.get((island, gen))
        if last is not None and now - last < self.config.member_timeout_s:
            return
        self._hello_asked[(island, gen)] = now
        self._reject(island, gen, UNKNOWN_MEMBER,
                     f"island {island!r} generation {gen} is not a member of run {self.config.run} (the syncer has no "
                     f"record of it, e.g. after a restart): send hello again", now, fatal=False, field="gen")

    # -- INIT and version 0 ------------------------------------------------------------------------

    def _on_init(self, ev: InitComplete, now: float) -> None:
        if self.session is None or ev.island != self.init_island:
            self._reject(ev.island, ev.gen, "not_init_island",
                         f"INIT data is taken only from the INIT island {self.init_island!r}",
                         now, fatal=False, field="island")
            return
        m = self.members[ev.island]
        if ev.gen in m.retired_gens:
            self.counters["ignored.init_stale_gen"] += 1
            self._tape("error", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                       reason="INIT of fragment from a stale generation ignored")
            return
        if self.phase != "init":
            self.counters["ignored.init_late"] += 1
            return
        if ev.gen != m.gen:
            # Its hello is not in yet (another consumer): keep it until that generation is admitted.
            self._held_init.setdefault(ev.gen, {})[ev.fragment] = ev
            self.counters["init.held"] += 1
            return
        if not 0 <= ev.fragment < self.config.fragments:
            self._reject(ev.island, ev.gen, "bad_fragment",
                         f"fragment {ev.fragment} outside 0..{self.config.fragments - 1}", now,
                         fatal=False, field="fragment")
            return
        if ev.fragment in self._initialized:
            self.counters["ignored.init_duplicate"] += 1
            return
        self._initialized.add(ev.fragment)
        self.counters["init.fragment"] += 1

    def _replay_held_init(self, m: Member, now: float) -> None:
        held = self._held_init.pop(m.gen, None) if m.island == self.init_island else None
        for f in sorted(held or ()):
            self.counters["init.replayed"] += 1
            self._on_init(held[f], now)
        if m.island == self.init_island:
            for g in sorted(m.retired_gens & set(self._held_chunks)):
                self._drop_held_chunks(g, "generation retired")
            chunks = self._held_chunks.pop(m.gen, {})
            for key in sorted(chunks):
                self.counters["init.chunk_replayed"] += 1
                self._on_init_chunk(chunks[key], now)

    def _drop_held_chunks(self, gen: str, reason: str) -> None:
        for (f, k) in sorted(self._held_chunks.pop(gen, {})):
            self.counters["init.held_dropped"] += 1
            self._emit(InitDrop(gen, f, k, reason))

    def _refuse_init_chunk(self, ev: InitChunk, code: str, message: str, now: float, field: str) -> None:
        # Counted and taped, never answered on ctl.to: a flood of bad chunks must not become a flood
        # of error messages (and the process that sent a stale generation's chunks is gone).
        self.counters[f"rejected.{code}"] += 1
        self._tape("error", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                   reason=f"{code}: {message}", detail={"code": code, "field": field, "chunk": ev.chunk})
        self._emit(InitDrop(ev.gen, ev.fragment, ev.chunk, code))

    MAX_HELD_GENS = 2   # unseen INIT generations whose chunks are held at once (a restart races its hello)

    def _on_init_chunk(self, ev: InitChunk, now: float) -> None:
        """Version 0 comes from one process (generation) of the INIT island: a fragment's chunks are
        taken from one generation; a chunk of the island's current generation starts a fragment that
        holds another generation's chunks over; a retired generation's chunk is refused; a chunk of a
        generation not seen yet is held until its hello (CTL and INIT are separate consumers)."""
        if self.session is None or ev.island != self.init_island:
            self._refuse_init_chunk(ev, "not_init_island",
                                    f"INIT data is taken only from the INIT island {self.init_island!r}", now, "island")
            return
        m = self.members[ev.island]
        if ev.gen in m.retired_gens:
            self._refuse_init_chunk(ev, "stale_gen", f"INIT chunk of a retired generation of {ev.island} (a restarted "
                                    f"process resends everything)", now, "gen")
            return
        if not 0 <= ev.fragment < self.config.fragments:
            self._refuse_init_chunk(ev, "unknown_fragment", f"fragment {ev.fragment} outside "
                                    f"0..{self.config.fragments - 1}", now, "fragment")
            return
        if self.phase != "init":
            # Version 0 is decided (or committed): INIT bytes can no longer change it.
            self.counters["init.late_chunk"] += 1
            self._emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "late"))
            return
        if ev.gen != m.gen:
            held = self._held_chunks.get(ev.gen)
            if held is None and len(self._held_chunks) >= self.MAX_HELD_GENS:
                self._refuse_init_chunk(ev, "unknown_gen", f"INIT chunk of generation {ev.gen}, whose hello the syncer "
                                        f"has not admitted ({self.MAX_HELD_GENS} unseen generations held already)",
                                        now, "gen")
                return
            key = (ev.fragment, ev.chunk)
            if held is not None and key in held:
                self.counters["init.duplicate_chunk"] += 1
                self._emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "duplicate"))
                return
            self._held_chunks.setdefault(ev.gen, {})[key] = ev
            self.counters["init.held_chunk"] += 1
            return
        gen, count, stored = self._init_chunks.get(ev.fragment, (None, ev.chunks, set()))
        if gen is not None and gen != ev.gen:
            self.counters["init.restart_fragment"] += 1
            self._tape("session", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                       reason=f"INIT of fragment {ev.fragment} starts over with generation {ev.gen} "
                              f"(had {len(stored)}/{count} chunks of generation {gen})")
            self._initialized.discard(ev.fragment)
            gen, count, stored = None, ev.chunks, set()
        if ev.fragment in self._initialized or ev.chunk in stored or ev.chunks != count or not 0 <= ev.chunk < count:
            self.counters["init.duplicate_chunk"] += 1
            self._emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "duplicate"))
            return
        stored.add(ev.chunk)
        self._init_chunks[ev.fragment] = (ev.gen, count, stored)
        self._emit(InitStore(ev.gen, ev.fragment, ev.chunk))
        if len(stored) == count:
            self._initialized.add(ev.fragment)
            self.counters["init.fragment"] += 1

    def _on_v0_done(self, ev: V0Done, now: float) -> None:
        if self.phase != "committing_v0":
            raise ValueError(f"V0Done in phase {self.phase!r}: no CommitV0 outstanding")
        self.versions = {f: 0 for f in range(self.config.fragments)}
        self.phase = "running"
        self._last_launch_at = now
        for m in self.members.values():
            m.ref_step, m.ref_local = 0, m.est_local(now)
        self._tape("session", now, reason="version 0 committed", detail={"versions": {str(k): v for k, v in self.versions.items()}})

    # -- pushes ------------------------------------------------------------------------------------

    def _on_push(self, ev: PushComplete, now: float) -> None:
        quarantine = None
        m = self.members.get(ev.island)
        if m is not None and ev.gen == m.gen:
            m.observe_push(int(ev.local_step), now)
        r = self.rounds.get(ev.step)
        current = self.versions.get(ev.fragment)
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
            elif current - ev.base_version > self.config.max_base_lag:
                disposition, reason = "stale_base", (f"base_version {ev.base_version} lags current version "
                                                     f"{current} by more than {self.config.max_base_lag}")
            elif (ev.gen, ev.try_) in slot.quarantined:
                # A released try never completes again in the shell; should it, it stays out of the merge.
                disposition, reason = "quarantined", f"try {ev.try_} was quarantined already this attempt"
            elif (quarantine := self._quarantine_rule(ev)) is not None:
                disposition, reason = "quarantined", quarantine.pop("reason")
                self.counters[f"quarantine.{quarantine['rule']}"] += 1
                slot.quarantined.add((ev.gen, ev.try_))
            else:
                disposition = "accepted"
                slot.answer = _Answer(ev.gen, ev.try_, ev.base_version, ev.local_step, ev.c_steps, ev.c_tokens,
                                      ev.norm)
                if ev.norm is not None:
                    r.norms[ev.island] = ev.norm
                if r.quorum_at is None and r.answered >= r.quorum:
                    self._reach_quorum(r, now)
            if disposition in HOPELESS_DISPOSITIONS:
                # The island's push was acknowledged by JetStream, so it will not send another for this
                # attempt: its slot cannot count towards quorum any more.
                slot.refused = disposition
        self.counters[f"disposition.{disposition}"] += 1
        staleness = current - ev.base_version if current is not None and ev.base_version <= current else None
        detail = {"staleness": staleness, "local_step": ev.local_step}
        if quarantine is not None:
            detail["quarantine"] = quarantine
        self._tape("disposition", now, step=ev.step, fragment=ev.fragment, attempt=ev.attempt, island=ev.island,
                   gen=ev.gen, disposition=disposition, reason=reason, base_version=ev.base_version,
                   detail=detail, **{"try": ev.try_})
        if disposition != "accepted" and not self._is_pending_merge_input(ev):
            self._emit(Release(ev.island, ev.gen, ev.step, ev.fragment, ev.attempt, ev.try_, disposition))
        if disposition == "stale_base":
            self._rebroadcast(ev.fragment, now, f"push of {ev.island} at step {ev.step} has stale base_version "
                                                f"{ev.base_version} (current {current})")

    def _quarantine_rule(self, ev: PushComplete) -> dict | None:
        """The rule a push breaks on its own (NaN/Inf, `max_push_norm`), with its figure and limit, or None.
        The outlier rule needs the round's other pushes: `_screen_outliers` judges it at completion."""
        if ev.non_finite or (ev.norm is not None and not math.isfinite(ev.norm)):
            return {"rule": "non_finite", "non_finite": int(ev.non_finite), "limit": 0,
                    "reason": f"quarantined: {ev.non_finite} non-finite values (NaN/Inf) in the push"}
        limit = self.config.max_push_norm
        if limit is not None and ev.norm is not None and ev.norm > limit:
            return {"rule": "max_push_norm", "norm": float(ev.norm), "limit": float(limit),
                    "reason": f"quarantined: push norm {ev.norm:.6g} exceeds --max-push-norm {limit:.6g}"}
        return None

    def _screen_outliers(self, r: Round, now: float) -> bool:
        """Before a round completes: quarantine every accepted push whose norm exceeds outlier_factor x
        the lower median of the norms accepted this attempt (outliers included, so removing one never
        lowers the reference for the rest). Returns True if it removed any (the round does not
        complete now; it goes on as if those members had not answered)."""
        factor = self.config.outlier_factor
        if factor is None or len(r.norms) < OUTLIER_MIN_PUSHES:
            return False
        median = _lower_median(list(r.norms.values()))
        if median <= 0:
            return False
        limit = factor * median
        removed = False
        for island, slot in sorted(r.slots.items()):
            a = slot.answer
            if a is None or a.norm is None or a.norm <= limit:
                continue
            slot.answer, slot.refused = None, "quarantined"
            slot.quarantined.add((a.gen, a.try_))
            removed = True
            self.counters["disposition.quarantined"] += 1
            self.counters["quarantine.outlier"] += 1
            self._tape("disposition", now, step=r.step, fragment=r.fragment, attempt=r.attempt, island=island,
                       gen=a.gen, disposition="quarantined", base_version=a.base_version,
                       reason=(f"quarantined: push norm {a.norm:.6g} exceeds --outlier-factor {factor:g} x the round's "
                               f"median norm {median:.6g} (limit {limit:.6g}); supersedes its accepted record"),
                       detail={"local_step": a.local_step,
                               "quarantine": {"rule": "outlier", "norm": float(a.norm), "limit": float(limit),
                                              "median": float(median), "pushes": len(r.norms)}},
                       **{"try": a.try_})
            self._emit(Release(island, a.gen, r.step, r.fragment, r.attempt, a.try_, "quarantined"))
        if removed and r.answered < r.quorum:
            r.quorum_at = r.grace_s = None   # below quorum again: a later push reaches it afresh
        return removed

    def _is_pending_merge_input(self, ev: PushComplete) -> bool:
        # a re-delivered copy of an accepted push has the same identity as the one the merge reads
        r = self.rounds.get(ev.step)
        if r is None or r.fragment != ev.fragment or r.attempt != ev.attempt:
            return False
        slot = r.slots.get(ev.island)
        return slot is not None and slot.answer is not None and (slot.answer.gen, slot.answer.try_) == (ev.gen, ev.try_)

    def _reach_quorum(self, r: Round, now: float) -> None:
        cfg = self.config
        r.quorum_at = now
        times = [self.members[i].ema_step_s for i in r.slots if i in self.members and self.members[i].ema_step_s]
        step_time = max(times) if times else 0.0
        raw = cfg.grace_gamma * (cfg.tau * step_time - (now - r.launched_at) - self._last_sync_s)
        r.grace_s = min(max(raw, 0.0), cfg.grace_ms / 1000.0)

    # -- merges ------------------------------------------------------------------------------------

    def _complete(self, r: Round, now: float) -> None:
        r.complete_at = now
        answers = [(i, s.answer) for i, s in sorted(r.slots.items()) if s.answer is not None]
        used, clamp = self._clamp_tokens(answers)
        weights = weights_for(used, self.config.equal_weights)
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
        version = self.versions[r.fragment] + 1
        record = {
            "kind": "merge", "step": r.step, "fragment": r.fragment, "attempt": r.attempt,
            "base_version": r.base_version, "version": version, "expected": r.members(),
            "responded": r.responded(), "quorum": r.quorum,
            "staleness": {mi.island: r.base_version - mi.base_version for mi in inputs},
            "weights": self._raw_weights(inputs),
            "quorum_s": (r.quorum_at - r.launched_at) if r.quorum_at is not None else None,
            "grace_s": r.grace_s,
            "detail": detail,
        }
        r.merge = Merge(step=r.step, fragment=r.fragment, attempt=r.attempt, version=version,
                        base_version=r.base_version, members=inputs,
                        record={k: v for k, v in record.items() if v is not None}, launched_at=r.launched_at)

    def _on_merge_done(self, ev: MergeDone, now: float) -> None:
        r = self.rounds.get(ev.step)
        if self._merging is None or ev.step != self._merging or r is None:
            raise ValueError(f"MergeDone for step {ev.step} but the outstanding merge is step {self._merging}")
        if ev.fragment != r.fragment or ev.version != r.merge.version:
            raise ValueError(f"MergeDone(step {ev.step}, fragment {ev.fragment}, version {ev.version}) does not match "
                             f"Merge(fragment {r.fragment}, version {r.merge.version})")
        del self.rounds[ev.step]
        self._merging = None
        self.versions[r.fragment] = ev.version
        self.committed_step = ev.step
        # Adaptive grace subtracts the last *whole* sync (merge + checkpoint + broadcast): the time from
        # the Merge action to its MergeDone covers all of it, whatever part of it the shell measured.
        self._last_sync_s = max(0.0, float(ev.sync_s), now - r.merge_at if r.merge_at is not None else 0.0)
        self.counters["merge"] += 1
        # The merge record goes to the tape from the shell, with the durable commit (Merge.record).

    def _clamp_tokens(self, answers: Sequence[tuple[str, _Answer]]) -> tuple[list[int], dict[str, dict]]:
        """The c_tokens each answer weighs with: its claim, capped at max_token_factor x the lower median
        of the positive claims (see the module docstring); and {island: {claimed, used, limit}} of the
        claims that were cut."""
        claims = [int(a.c_tokens) for _, a in answers]
        factor = self.config.max_token_factor
        positive = [c for c in claims if c > 0]
        if factor is None or self.config.equal_weights or not positive:
            return claims, {}
        limit = int(factor * _lower_median(positive))
        clamp = {}
        for (island, _), c in zip(answers, claims):
            if c > limit:
                clamp[island] = {"claimed": c, "used": limit, "limit": limit}
                self.counters["tokens.clamped"] += 1
        return [min(c, limit) for c in claims], clamp

    def _raw_weights(self, inputs: Sequence[MergeInput]) -> dict[str, float]:
        # the tape shows wᵢ before normalization: c_tokens, or 1 (equal weights, or all tokens zero)
        equal = self.config.equal_weights or all(mi.c_tokens == 0 for mi in inputs)
        return {mi.island: (1.0 if equal else mi.c_tokens) for mi in inputs}

    # -- finalization ------------------------------------------------------------------------------

    def _start_final(self, now: float) -> None:
        targets = {m.island: m.gen for m in self._live()}
        f = self._final = _Final(final_step=self.committed_step, started_at=now, targets=targets,
                                 versions=dict(self.versions))
        self.phase = "finalizing"
        self._emit(PublishFinal(f.final_step, dict(f.versions), f.record()))
        self._tape("final", now, step=self.committed_step, reason="final cut publishing",
                   detail={"versions": {str(k): v for k, v in self.versions.items()},
                           "targets": [{"island": i, "gen": g} for i, g in sorted(targets.items())]})

    def _on_final_published(self, ev: FinalPublished, now: float) -> None:
        f = self._final
        if f is None or f.cut_out:
            raise ValueError("FinalPublished without an outstanding PublishFinal")
        f.cut_out = True
        self._emit(RecordFinal(f.record()))
        self._tape("final", now, step=f.final_step, reason="final cut published",
                   detail={"targets": [{"island": i, "gen": g} for i, g in sorted(f.targets.items())]})
        for island, gen in sorted(f.targets.items()):
            if island not in f.acked:
                self._emit(SendManifest(island, gen, f.final_step, dict(f.versions)))
        if not f.targets or f.acked >= set(f.targets):
            self._finish(True, now)

    def _final_target(self, m: Member, now: float) -> None:
        """A known island heard from during finalization with a generation that is not the target:
        it must install the final cut and ack (once the cut is out, it gets the manifest now)."""
        f = self._final
        if m.island in f.acked:
            return
        f.targets[m.island] = m.gen
        self.counters["final.target_added"] += 1
        self._tape("final", now, step=f.final_step, island=m.island, gen=m.gen,
                   reason="manifest target: a known island came back during finalization")
        if f.cut_out:
            self._emit(RecordFinal(f.record()))
            self._emit(SendManifest(m.island, m.gen, f.final_step, dict(f.versions)))

    def _on_final_ack(self, ev: FinalAck, now: float) -> None:
        f = self._final
        if f is None or not f.cut_out or f.targets.get(ev.island) != ev.gen or ev.final_step != f.final_step:
            self.counters["rejected.final_ack"] += 1
            self._tape("error", now, island=ev.island, gen=ev.gen,
                       reason=f"final ack for step {ev.final_step} ignored: not a target of the final cut")
            return
        if ev.island in f.acked:
            self.counters["ignored.final_ack_duplicate"] += 1
            return
        f.acked.add(ev.island)
        self.counters["final.ack"] += 1
        if f.acked == set(f.targets):
            self._finish(True, now)
        else:
            self._emit(RecordFinal(f.record()))

    def _finish(self, ok: bool, now: float) -> None:
        f = self._final
        for island in sorted(f.acked):
            self._emit(Shutdown(island, f.targets[island], "final"))
        missing = tuple(sorted(set(f.targets) - f.acked))
        if f.cut_out:
            self._emit(RecordFinal(f.record(finished=True)))
        self._tape("final", now, step=f.final_step,
                   reason="all targets acked" if ok else f"final timeout: no ack from {', '.join(missing)}")
        self._emit(Done(ok, missing))
        self.phase = "done"

    # -- time-driven -------------------------------------------------------------------------------

    def _pump(self, now: float) -> None:
        cfg = self.config
        if self.phase == "done":
            return
        if self._restored_finished:
            self._tape("final", now, step=self.committed_step, reason="run already finished: nothing to do")
            self._emit(Done(True, ()))
            self.phase = "done"
            return
        if self._resend_manifests:
            self._resend_manifests = False
            f = self._final
            self._tape("final", now, step=f.final_step, reason="finalization resumed: manifest sent again",
                       detail={"targets": [{"island": i, "gen": g} for i, g in sorted(f.targets.items())],
                               "acked": sorted(f.acked)})
            for island, gen in sorted(f.targets.items()):
                if island not in f.acked:
                    self._emit(SendManifest(island, gen, f.final_step, dict(f.versions)))
            if f.acked >= set(f.targets):
                self._finish(True, now)
                return
        for m in self._live():
            if now - m.last_heartbeat >= cfg.member_timeout_s:
                m.live = False
                self.counters["leave"] += 1
                self._write_member(m)
                self._tape("leave", now, island=m.island, gen=m.gen,
                           reason=f"no heartbeat for {now - m.last_heartbeat:.1f}s")
        if self.phase == "init" and len(self._initialized) == cfg.fragments and len(self._live()) >= cfg.islands:
            self.phase = "committing_v0"
            for g in sorted(self._held_chunks):   # INIT is over: unseen generations' chunks never count
                self._drop_held_chunks(g, "version 0 decided")
            self._emit(CommitV0(tuple(range(cfg.fragments))))
        for step in sorted(self.rounds):
            r = self.rounds[step]
            if r.accepting:
                self._check_round(r, now)
        self._emit_merge(now)
        if self.phase == "running" and self.committed_step >= cfg.total_steps:
            self._start_final(now)          # after the last MergeDone, or at once after restore
        if self.phase == "running":
            self._launch(now)
        if self._final is not None and self.phase == "finalizing" and now - self._final.started_at >= cfg.final_timeout_s:
            self._finish(False, now)

    def _due(self, r: Round) -> float:
        """When an attempt below quorum restarts: its deadline, or soon after it became hopeless."""
        if r.hopeless_at is None:
            return r.deadline
        return min(r.deadline, r.hopeless_at + min(self.config.quorum_timeout_s, HOPELESS_RESTART_S))

    def _hopeful(self, r: Round) -> int:
        """Slots that may still answer this attempt: not answered, not refused, member still live."""
        return sum(1 for i, s in r.slots.items()
                   if s.answer is None and s.refused is None and i in self.members and self.members[i].live)

    def _check_round(self, r: Round, now: float) -> None:
        cfg = self.config
        # Outliers are judged when the round would complete; removing one re-judges the round below.
        if r.answered == len(r.slots) and not self._screen_outliers(r, now):
            self._complete(r, now)
            return
        # Quorum out of reach (pushes refused as stale after a broker restart, a member gone): waiting for
        # the deadline only wastes a quorum timeout (60 s per such round was measured by bench/chaos.py).
        # Restart soon instead, leaving a moment for the re-broadcast that the refusals triggered to land
        # before the new pull (islands apply broadcasts before answering pulls). Re-judged at every event:
        # a member that comes back makes the attempt hopeful again.
        if not cfg.strict and r.quorum_at is None and r.answered + self._hopeful(r) < r.quorum:
            r.hopeless_at = now if r.hopeless_at is None else r.hopeless_at
        else:
            r.hopeless_at = None
        if not cfg.strict and r.quorum_at is not None and now >= r.quorum_at + r.grace_s \
                and not self._screen_outliers(r, now):
            self._complete(r, now)
        elif now >= self._due(r) and (cfg.strict or r.quorum_at is None):
            self.counters["restart_early" if r.hopeless_at is not None else "quorum_timeout"] += 1
            if cfg.strict:
                r.deadline = now + cfg.quorum_timeout_s
                self._tape("error", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                           reason=f"quorum_timeout (strict: attempt stands): {r.answered}/{len(r.slots)} answered")
                self._rebroadcast(r.fragment, now, f"round {r.step} passed its deadline below quorum (strict)")
            else:
                self._restart(r, now)

    def _restart(self, r: Round, now: float) -> None:
        cfg = self.config
        live = self._live()
        old_responded, old_attempt = r.responded(), r.attempt
        if not live:
            r.deadline = now + cfg.quorum_timeout_s
            self._tape("error", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                       reason="deadline passed below quorum and no member is live: attempt stands")
            return
        for island, slot in sorted(r.slots.items()):
            if slot.answer is not None:
                self._emit(Release(island, slot.answer.gen, r.step, r.fragment, old_attempt, slot.answer.try_, "restart"))
        # Before the new pull: islands that missed the base version can read it before they answer.
        self._rebroadcast(r.fragment, now, f"round {r.step} restarts below quorum (attempt {old_attempt})")
        r.attempt += 1
        r.seq = 0
        r.slots = {m.island: _Slot(m.gen) for m in live}
        r.quorum = self._quorum_for(len(live))
        r.launched_at = now
        r.deadline = now + cfg.quorum_timeout_s
        r.quorum_at = r.grace_s = r.hopeless_at = None
        r.norms = {}
        self.counters["restart"] += 1
        self._emit(PublishPull(r.pull()))
        self._tape("restart", now, step=r.step, fragment=r.fragment, attempt=r.attempt,
                   base_version=r.base_version, expected=r.members(), responded=old_responded, quorum=r.quorum,
                   reason=f"deadline passed below quorum: {len(old_responded)} of {r.quorum} needed answered attempt {old_attempt}")

    def _rebroadcast(self, fragment: int, now: float, reason: str) -> None:
        if self.phase != "running" or fragment not in self.versions:
            return
        if any(r.fragment == fragment and not r.accepting for r in self.rounds.values()):
            self.counters["rebroadcast.merge_due"] += 1
            return
        last = self._rebroadcast_at.get(fragment)
        if last is not None and now - last < self.config.quorum_timeout_s:
            self.counters["rebroadcast.rate_limited"] += 1
            return
        self._rebroadcast_at[fragment] = now
        self.counters["rebroadcast"] += 1
        self._emit(Rebroadcast(fragment, self.versions[fragment], reason))

    def _quorum_for(self, expected: int) -> int:
        k = self.config.quorum if self.config.quorum is not None else expected
        return max(1, min(k, expected))

    def _emit_merge(self, now: float) -> None:
        if self._merging is not None or not self.rounds:
            return
        r = self.rounds[min(self.rounds)]
        if not r.accepting:
            self._merging = r.step
            r.merge_at = now
            self._emit(r.merge)

    def _can_launch_now(self) -> tuple[int, list[Member]] | None:
        """(step, live members) if capacity allows launching the next round; pacing aside."""
        cfg = self.config
        t = self._next_step
        if t > cfg.total_steps or len(self.rounds) >= cfg.pipeline:
            return None
        if any(r.fragment == cfg.fragment_of(t) for r in self.rounds.values()):
            return None
        live = self._live()
        return (t, live) if live else None

    def _launch_time(self, t: int, live: list[Member]) -> float:
        """Earliest time the pacing rules allow round t (outside strict mode)."""
        cfg = self.config
        spr = cfg.steps_per_round
        emas = [m.ema_step_s for m in live if m.ema_step_s]
        by_time = self._last_launch_at + spr * max(emas) if emas else math.inf
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

    def _launch(self, now: float) -> None:
        cfg = self.config
        while (cap := self._can_launch_now()) is not None:
            t, live = cap
            if not cfg.strict and now < self._launch_time(t, live):
                return
            frag = cfg.fragment_of(t)
            attempt = max(FIRST_ATTEMPT, self._min_attempts.get(t, FIRST_ATTEMPT))
            r = Round(step=t, fragment=frag, attempt=attempt, base_version=self.versions[frag],
                      launched_at=now, deadline=now + cfg.quorum_timeout_s, quorum=self._quorum_for(len(live)),
                      slots={m.island: _Slot(m.gen) for m in live})
            self.rounds[t] = r
            self._next_step += 1
            self._last_launch_at = now
            self.counters["launch"] += 1
            self._emit(PublishPull(r.pull()))

    _HANDLERS: dict[type, Callable[["RoundMachine", Any, float], None]] = {
        Hello: _on_hello,
        InitComplete: _on_init,
        InitChunk: _on_init_chunk,
        PushComplete: _on_push,
        Heartbeat: _on_heartbeat,
        MergeDone: _on_merge_done,
        V0Done: _on_v0_done,
        Tick: lambda self, ev, now: None,
        FinalAck: _on_final_ack,
        FinalPublished: _on_final_published,
    }
