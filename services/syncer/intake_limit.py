"""Per-identity limits on the syncer's intake: pure token buckets, fed the time (no clock, no I/O).

An identity is the subject's island token (in a secured run the server lets an island publish only on
subjects that carry its own id). Without a bound, one island's flood of hellos, heartbeats or acks, or of
malformed messages that each cost a tape record, keeps the syncer's intake and its tape busy (seen: a
flood delayed honest heartbeats past the member timeout; the wedge wrote 730 tape records a second).
Owns two limits per identity:
- **messages** (`allow`): CTL and heartbeat messages beyond `rate`/s (bursts of `burst`) are acked and
  dropped before they are decoded, counted `rate_limited.<stream>`; pushes are not limited by count.
- **tape records** (`tape`): rejections beyond the tape's rate are still counted (`rejected`,
  `rejected.<code>`) but not taped one by one; a burst is taped once, as one record that says how many
  were left out (`take_summaries`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

CTL_RATE, CTL_BURST = 20.0, 60.0      # CTL + heartbeat messages per second per identity
TAPE_RATE, TAPE_BURST = 10.0, 100.0   # rejection records per second per identity


@dataclass
class Bucket:
    rate: float
    burst: float
    tokens: float = -1.0
    at: float = 0.0

    def take(self, now: float) -> bool:
        if self.tokens < 0:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class _Suppressed:
    count: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)

    def add(self, code: str, now: float) -> None:
        """One more rejection of the burst, not taped on its own."""
        self.count += 1
        self.last_at = now
        self.codes[code] = self.codes.get(code, 0) + 1


class IntakeLimits:
    def __init__(self, *, ctl_rate: float = CTL_RATE, ctl_burst: float = CTL_BURST, tape_rate: float = TAPE_RATE,
                 tape_burst: float = TAPE_BURST):
        self._ctl = (ctl_rate, ctl_burst)
        self._tape = (tape_rate, tape_burst)
        self._msg_buckets: dict[str, Bucket] = {}
        self._tape_buckets: dict[str, Bucket] = {}
        self._suppressed: dict[str, _Suppressed] = {}

    def allow(self, identity: str, now: float) -> bool:
        """Whether one more CTL / heartbeat message of `identity` may be handled now.

        An honest island sends one heartbeat per YETO_HEARTBEAT_S (2 s by default), one hello per process
        start and a few acks at the end: the defaults leave it two orders of magnitude of room. Pushes are
        not limited by count (an honest push is hundreds of chunks in a second): PUSH's max_bytes bounds
        them, and the tape limit bounds what a bad one costs."""
        b = self._msg_buckets.get(identity)
        if b is None:
            b = self._msg_buckets[identity] = Bucket(*self._ctl)
        return b.take(now)

    def tape(self, identity: str, code: str, now: float) -> bool:
        """Whether a rejection of `identity` is taped on its own; if not, it joins that identity's burst."""
        b = self._tape_buckets.get(identity)
        if b is None:
            b = self._tape_buckets[identity] = Bucket(*self._tape)
        if b.take(now):
            return True
        self._suppressed.setdefault(identity, _Suppressed(first_at=now)).add(code, now)
        return False

    def take_summaries(self, now: float, quiet_s: float = 1.0, *, force: bool = False) -> list[dict]:
        """One tape record per burst that has ended (nothing left out for `quiet_s`), or every open one
        with `force` (at exit, or when a burst goes on for long): {identity, count, first_at, last_at, codes}."""
        out = []
        for identity in sorted(self._suppressed):
            s = self._suppressed[identity]
            if force or now - s.last_at >= quiet_s or now - s.first_at >= 60.0:
                out.append({"identity": identity, "count": s.count, "first_at": s.first_at, "last_at": s.last_at,
                            "codes": dict(sorted(s.codes.items()))})
                del self._suppressed[identity]
        return out
