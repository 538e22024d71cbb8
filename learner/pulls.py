"""The island's pending-pull ledger (docs/design.md §5.3) — pure logic, no I/O.

Owns `PullBook`: which pulls this island process (island id + generation) answers, when, and with which
try. The NATS thread feeds it every pull read from the island's CTL consumer (`offer`); at a boundary the
loop asks `take_ready` which pulls to answer now, pushes them and reports each outcome (`sent`: every
chunk acknowledged, `failed`: pending again with try + 1).
Invariants (the rules and their reasons are `PullBook`'s doc): a pull is answered only if its members name
this (island, gen); per round only the newest (attempt, seq) counts, and one push per attempt; applying
version v of a fragment drops its rounds with base_version < v; implausible pulls are refused (WireError
naming the field) and what the book remembers stays bounded, so forged pulls cannot hold real ones back.
Lockstep (test mode): `max_due_step` and `due_round` name the round a boundary must block on.
Pull dicts are the decoded `pull` messages (schemas/json/pull.schema.json): the codec validates the wire
form; the book re-checks only what it relies on.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from yeto.schemas.dtypes import PUSH_DTYPES
from yeto.schemas.errors import WireError

WAITING = "waiting"
MAX_COUNT = 2**31 - 1
MAX_ATTEMPT_JUMP = 16
MAX_ROUNDS = 1024  # rounds kept for dedup only
INFLIGHT = "inflight"
DONE = "done"  # every chunk of a try acknowledged by JetStream


@dataclass(frozen=True, slots=True)
class PendingPull:
    """A pull to answer now. `try_` goes into the push's header (`try`) and its Nats-Msg-Ids.

    `base_version` is the pull's (the version the syncer had when it launched the round); the push
    carries the island's own anchor version instead."""

    fragment: int
    step: int
    attempt: int
    seq: int
    base_version: int
    try_: int
    push_dtype: str | None = None   # the pull's (`yeto run set push_dtype`); None: the session's


@dataclass(slots=True)
class _Round:
    fragment: int
    step: int
    attempt: int  # newest attempt seen for this round, whoever it names
    seq: int  # newest seq seen of that attempt
    base_version: int
    mine: bool  # the newest (attempt, seq) names this (island, gen)
    state: str | None  # WAITING / INFLIGHT / DONE when mine, else None
    try_: int = 0  # the in-flight try, or the next one to send
    push_dtype: str | None = None  # the pull's dtype when it names one (a runtime change), else None

    # the book's transitions of one round (PullBook's rules say when each applies)
    def republished(self, seq: int) -> None:
        self.seq = seq

    def claim(self) -> None:
        """The held attempt now names this process: pending afresh, from try 0."""
        self.mine, self.state, self.try_ = True, WAITING, 0

    def release(self) -> None:
        """The held attempt no longer names this process: kept for dedup only."""
        self.mine, self.state = False, None

    def take(self) -> PendingPull:
        self.state = INFLIGHT
        return PendingPull(self.fragment, self.step, self.attempt, self.seq, self.base_version, self.try_,
                           self.push_dtype)

    def done(self) -> None:
        self.state = DONE

    def retry(self) -> None:
        self.state = WAITING
        self.try_ += 1


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """What the book knows of one round (for lockstep waits and logs)."""

    fragment: int
    step: int
    attempt: int
    seq: int
    base_version: int
    mine: bool
    state: str | None
    try_: int


def _int_field(pull: Mapping, key: str, minimum: int) -> int:
    value = pull.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise WireError(f"pull field must be an integer in [{minimum}, {MAX_COUNT}]", field=key, value=value)
    return value


def _steps_per_round(sync_every: int, fragments: int) -> int:
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise WireError("must be a positive integer", field="fragments", value=fragments)
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1 or sync_every % fragments:
        raise WireError(f"H must be a positive multiple of the fragment count {fragments}", field="sync_every",
                        value=sync_every)
    return sync_every // fragments


def max_due_step(local_step: int, sync_every: int, fragments: int) -> int:
    """The newest round due at or before `local_step` (round t is due at local step t·H/P); 0 if none."""
    return local_step // _steps_per_round(sync_every, fragments)


def due_round(local_step: int, sync_every: int, fragments: int) -> int | None:
    """The round due exactly at `local_step` (the one a lockstep boundary blocks on), or None."""
    per = _steps_per_round(sync_every, fragments)
    if local_step < 1 or local_step % per:
        return None
    return local_step // per


class PullBook:
    """Pending pulls of one island process (island id + connection generation). The rules, and why:

    * **Members.** A pull is answered only if its `members` name this island *with this process's
      generation*. An entry naming this island with another generation is a slot bound to an earlier
      process (or, once the syncer has rebound it, to a later one): it is never answered here.
    * **One live attempt per round.** A round is (fragment, step). For each round the book remembers the
      newest (attempt, seq) it has seen, whoever it names; a pull older than that, or equal to it, is a
      redelivery or a stale re-publication and is dropped. A newer *attempt* means the syncer restarted the
      round and discarded its partial pushes, so it replaces whatever this island held for the round
      (pending, in flight, or pushed) — even when it does not name this island, since a push for the old
      attempt would only be disposed of as "out of round".
    * **One copy per attempt.** A re-publication of the same attempt (seq + 1, sent when the syncer rebinds
      a slot to a new generation) that still names this (island, gen) changes nothing: the copy held keeps
      its state and try counter, and a push already acknowledged is not sent again. One that newly names
      this generation (our slot was just rebound to us) becomes pending; one that no longer names it (the
      slot went to another generation of the island id) drops the held copy.
    * **Generations across a restart.** A restarted learner has a new generation and a fresh book, and its
      consumer `pull-I` delivers from its hello on. For a round it belonged to before, it may see (a) the
      attempt still naming the old generation: it only raises the round's (attempt, seq) high-water mark
      and is not queued, so it cannot occupy the round's slot; (b) the syncer's re-publication (seq + 1)
      naming the new generation: queued; (c) a later attempt naming it: queued, replacing (b). A
      redelivered (a) after (b) or (c) is below the mark and dropped. Contract with the syncer: attempt
      numbers of a round only grow, across a syncer restart too; otherwise a re-launched attempt with a
      number seen already is taken for a duplicate until the round's deadline restarts it higher.
    * **Supersession by commit.** A pull of round t of fragment F carries `base_version` b, the version
      committed when it was launched. The syncer runs one round of a fragment at a time and commits in
      order, so a version of F newer than b exists only once round t committed: applying version v of F
      (`committed(F, v)`: bytes whose digest matched) drops every round of F with base_version < v, and
      later copies of those are dropped on arrival. A pull's own `base_version` is *not* proof: without
      server permissions (docs/design.md §13) anyone on the bus may publish a pull, and one claiming base
      2^53−1 would make the island drop every real pull of its fragment. Broadcasts are applied before
      pulls are answered, so the commit rule alone rarely lets a moot push out (the syncer disposes of it).
    * **Plausibility** (hostile pulls), refused with a WireError naming the field (counted by the shell): a
      number above MAX_COUNT (2^31 − 1: no run gets near it; values near 2^53 lose precision in JSON
      readers); with the session's fragment count P, a step that targets another fragment, or a
      base_version above the rounds of the fragment before it, (t − 1 − F) // P (each committed round adds
      one version); a new attempt more than MAX_ATTEMPT_JUMP above the newest seen (the syncer adds 1 per
      restart and every island reads every pull in order), which would make the real attempts look stale.
      Rounds that do not name this island are remembered for dedup only, at most 2·MAX_ROUNDS of them
      (trimmed to MAX_ROUNDS, newest steps first), so a flood of forged pulls cannot grow the book.
    * **Readiness.** A pull waits while its fragment has no anchor or no local step since the anchor was
      installed (`ready(fragment)` is False): the push d = local − anchor would be meaningless or zero.
    * **Tries.** A taken pull is in flight until `sent` (the round is done for this island) or `failed`
      (pending again; the next push of it uses try + 1, recomputed from scratch). Reports about an attempt
      or try the book no longer holds (superseded meanwhile) are ignored and return False.
    * **Lockstep** (test mode): pass `max_step` to `take_ready` so a round is not answered before its due
      local step (`max_due_step(local_step, H, P)`); `due_round` names the round a boundary must block on.
    """

    def __init__(self, island: str, gen: str, *, fragments: int | None = None):
        self.island = island
        self.gen = gen
        # With the session's fragment count the book also checks that a pull's step targets its
        # fragment ((t − 1) mod P), catching a syncer/learner disagreement on the session early.
        self.fragments = fragments
        self._rounds: dict[tuple[int, int], _Round] = {}
        self._floor: dict[int, int] = {}  # fragment -> newest version known to exist
        # Disposition counters (offer drops by reason, supersessions) for logs and the step log.
        self.counters: Counter[str] = Counter()

    # ---- intake ---------------------------------------------------------------------------------

    def _names(self, members: Iterable) -> bool:
        for i, m in enumerate(members):
            if not isinstance(m, Mapping):
                raise WireError("pull member must be an object", field=f"members.{i}", value=m)
            if m.get("island") == self.island and m.get("gen") == self.gen:
                return True
        return False

    def offer(self, pull: Mapping) -> bool:
        """Take one pull from the wire. True when it became (or replaced) a pull this island must
        answer; False when it was dropped (reason counted in `counters`) or is a copy already held."""
        fragment = _int_field(pull, "fragment", 0)
        step = _int_field(pull, "step", 1)
        attempt = _int_field(pull, "attempt", 1)
        seq = _int_field(pull, "seq", 0)
        base = _int_field(pull, "base_version", 0)
        push_dtype = pull.get("push_dtype")
        if push_dtype is not None and push_dtype not in PUSH_DTYPES:
            raise WireError(f"pull push_dtype must be one of {PUSH_DTYPES}", field="push_dtype", value=push_dtype)
        members = pull.get("members")
        if not isinstance(members, (list, tuple)):
            raise WireError("pull members must be a list", field="members", value=members)
        if self.fragments is not None:
            if fragment >= self.fragments:
                raise WireError(f"fragment must be below {self.fragments}", field="fragment", value=fragment)
            if (step - 1) % self.fragments != fragment:
                raise WireError(f"round {step} targets fragment {(step - 1) % self.fragments}", field="fragment",
                                value=fragment)
            if base > (step - 1 - fragment) // self.fragments:
                raise WireError(f"round {step} of fragment {fragment} follows {(step - 1 - fragment) // self.fragments} "
                                f"rounds of it: its base version cannot be higher", field="base_version", value=base)
        mine = self._names(members)

        if base < self._floor.get(fragment, -1):
            self.counters["committed"] += 1
            return False

        key = (fragment, step)
        r = self._rounds.get(key)
        if r is not None and (attempt, seq) <= (r.attempt, r.seq):
            self.counters["duplicate" if (attempt, seq) == (r.attempt, r.seq) else "stale"] += 1
            return False
        if r is not None and attempt > r.attempt + MAX_ATTEMPT_JUMP:
            raise WireError(f"round {step} is at attempt {r.attempt}: a jump of more than {MAX_ATTEMPT_JUMP}",
                            field="attempt", value=attempt)

        if r is not None and attempt == r.attempt:
            # A re-publication of the attempt held (a slot was rebound).
            r.republished(seq)
            if mine and r.mine:
                self.counters["republished"] += 1
                return False
            if mine:
                r.claim()
                return True
            if r.mine:
                self.counters["slot_lost"] += 1
            r.release()
            self.counters["not_member"] += 1
            return False

        if r is not None and r.mine and r.state != DONE:
            self.counters["superseded_attempt"] += 1
        self._rounds[key] = _Round(fragment, step, attempt, seq, base, mine, WAITING if mine else None,
                                   push_dtype=push_dtype)
        if not mine:
            self.counters["not_member"] += 1
        self._trim()
        return mine

    def _trim(self) -> None:
        """At most MAX_ROUNDS rounds kept only for dedup (not naming this island, or answered); the
        newest steps (the likeliest forged) are forgotten first."""
        if len(self._rounds) <= 2 * MAX_ROUNDS:  # trimmed in batches: amortized O(1) per pull
            return
        others = [k for k, r in self._rounds.items() if not r.mine or r.state == DONE]
        if len(others) <= MAX_ROUNDS:
            return
        for k in sorted(others, key=lambda k: (k[1], k[0]))[MAX_ROUNDS:]:
            del self._rounds[k]
            self.counters["forgotten"] += 1

    # ---- supersession ---------------------------------------------------------------------------

    def _raise_floor(self, fragment: int, version: int) -> None:
        if version <= self._floor.get(fragment, -1):
            return
        self._floor[fragment] = version
        for key in [k for k, r in self._rounds.items() if k[0] == fragment and r.base_version < version]:
            r = self._rounds.pop(key)
            if r.mine and r.state != DONE:
                self.counters["superseded_commit"] += 1

    def committed(self, fragment: int, version: int) -> int:
        """The island holds version `version` of `fragment` (it applied a broadcast): every round of
        the fragment launched on an older version has committed, so its pull is dropped. Returns the
        number of unanswered pulls dropped."""
        before = self.counters["superseded_commit"]
        self._raise_floor(fragment, version)
        return self.counters["superseded_commit"] - before

    # ---- the boundary ---------------------------------------------------------------------------

    def take_ready(self, ready: Callable[[int], bool], *, max_step: int | None = None) -> list[PendingPull]:
        """Pulls to answer now, oldest round first; each moves to in flight with its try number.

        `ready(fragment)`: the fragment has an anchor and at least one local step since it was
        installed. `max_step` (lockstep): rounds after it are not due yet and wait."""
        out = []
        for r in sorted(self._rounds.values(), key=lambda r: (r.step, r.fragment)):
            if not r.mine or r.state != WAITING:
                continue
            if max_step is not None and r.step > max_step:
                continue
            if not ready(r.fragment):
                continue
            out.append(r.take())
        return out

    def _inflight(self, fragment: int, step: int, attempt: int, try_: int) -> _Round | None:
        r = self._rounds.get((fragment, step))
        if r is None or not r.mine or r.state != INFLIGHT or r.attempt != attempt or r.try_ != try_:
            return None
        return r

    def live(self, fragment: int, step: int, attempt: int, try_: int) -> bool:
        """Whether this try is still the one in flight: a shell streaming a push's chunks can stop
        early when a newer attempt or a commit superseded it."""
        return self._inflight(fragment, step, attempt, try_) is not None

    def sent(self, fragment: int, step: int, attempt: int, try_: int) -> bool:
        """Every chunk of this try was acknowledged by JetStream: the round is answered."""
        r = self._inflight(fragment, step, attempt, try_)
        if r is None:
            self.counters["late_report"] += 1
            return False
        r.done()
        return True

    def failed(self, fragment: int, step: int, attempt: int, try_: int) -> bool:
        """This try could not be delivered: the pull is pending again and its next push is try + 1."""
        r = self._inflight(fragment, step, attempt, try_)
        if r is None:
            self.counters["late_report"] += 1
            return False
        r.retry()
        self.counters["failed"] += 1
        return True

    # ---- queries --------------------------------------------------------------------------------

    def pending(self) -> int:
        """Pulls this island still owes (waiting or in flight), for the step log's `pending_pulls`."""
        return sum(1 for r in self._rounds.values() if r.mine and r.state in (WAITING, INFLIGHT))

    def record(self, fragment: int, step: int) -> RoundRecord | None:
        """The round as the book knows it, or None (never seen, or dropped once committed)."""
        r = self._rounds.get((fragment, step))
        if r is None:
            return None
        return RoundRecord(r.fragment, r.step, r.attempt, r.seq, r.base_version, r.mine, r.state, r.try_)

    def floor(self, fragment: int) -> int | None:
        """The newest version of `fragment` the book knows to be committed."""
        return self._floor.get(fragment)
