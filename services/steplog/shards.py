"""Per-shard syncer state for the viewers (pure: records in, rows out; the clock is an argument).

Reads: the status record every syncer writes to the run's `state` KV every `--status-every` seconds (key
`syncer`, or `syncer.<K>` for shard K of N, schemas.shards.state_key: phase, committed step, versions of
its fragments, rounds in flight, `rss_bytes`, `updated_at`, `exited`, and on the coordinator the shards
it judges missing) and each shard's commit record (`commit` / `commit.<K>`).
`ShardBoard.put(key, value)` takes those entries (other keys ignored; a malformed record is counted in
`malformed` and the previous one kept); `rows(now)` gives one row per expected shard 0..N-1 (N: the largest
`shards` any record names), so a shard whose record never came still has a row.
Invariants: a shard is **missing** when its record is absent, older than `STALE_S`, exited before its
final cut, or listed missing by the coordinator; one that exited done is `exited`. A record's age is
measured on the viewer's clock from when it arrived (a host with a skewed clock cannot look missing or
fresh); only a record read at the viewer's start falls back to its `updated_at`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import orjson

# A shard refreshes its record every --status-every (5 s by default); the coordinator calls a shard
# missing after 3 x status-every, at least 15 s. The viewers use the same 15 s.
STALE_S = 15.0

OK, MISSING, EXITED = "ok", "missing", "exited"


def _key(key: str) -> tuple[str, int | None] | None:
    """('syncer'|'commit', shard or None for the unsharded key), or None for any other key."""
    base, dot, rest = key.partition(".")
    if base not in ("syncer", "commit"):
        return None
    if not dot:
        return base, None
    if not rest.isdigit() or (len(rest) > 1 and rest[0] == "0"):
        return None
    return base, int(rest)


class RecordError(ValueError):
    """A status or commit record of the wrong shape; the message names the key and the field."""


def _int(rec: Mapping, name: str, key: str, *, lo: int = 0, required: bool = True) -> int | None:
    v = rec.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise RecordError(f"{key}: field {name!r} must be an integer >= {lo}, got {v!r}")
    return v


def _num(rec: Mapping, name: str, key: str, *, required: bool = True) -> float | None:
    v = rec.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise RecordError(f"{key}: field {name!r} must be a finite number, got {v!r}")
    return float(v)


def _versions(rec: Mapping, key: str) -> dict[int, int]:
    v = rec.get("versions", {})
    if not isinstance(v, dict):
        raise RecordError(f"{key}: field 'versions' must be an object, got {type(v).__name__}")
    out = {}
    for f, ver in v.items():
        if not (isinstance(f, str) and f.isdigit()) or not isinstance(ver, int) or isinstance(ver, bool) or ver < 0:
            raise RecordError(f"{key}: versions entry {f!r}: {ver!r} is not fragment id -> version >= 0")
        out[int(f)] = ver
    return out


@dataclass
class Status:
    """One shard's status record, validated (only what the viewers show)."""

    shard: int
    shards: int
    updated_at: float
    phase: str
    committed_step: int
    versions: dict[int, int]
    rounds_in_flight: list[dict]
    rss_bytes: int | None = None
    exited: bool = False
    fragments: list[int] | None = None
    shards_missing: list[int] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    total_steps: int | None = None  # the run's --total-steps (the dashboard's progress)
    seen_at: float | None = None  # when this viewer saw it arrive live (its own clock)

    def age(self, now: float) -> float:
        return max(0.0, now - (self.seen_at if self.seen_at is not None else self.updated_at))


def parse_status(key: str, shard: int | None, rec: Any, seen_at: float | None = None) -> Status:
    if not isinstance(rec, dict):
        raise RecordError(f"{key}: a status record is an object, got {type(rec).__name__}")
    if shard is None:  # the unsharded key: a record from before shards has no shard fields
        shard_v, shards_v = _int(rec, "shard", key, required=False) or 0, _int(rec, "shards", key, lo=1, required=False) or 1
        if (shard_v, shards_v) != (0, 1):
            raise RecordError(f"{key}: the unsharded key holds shard {shard_v} of {shards_v}")
    else:
        shard_v, shards_v = _int(rec, "shard", key), _int(rec, "shards", key, lo=2)
        if shard_v != shard:
            raise RecordError(f"{key}: field 'shard' is {shard_v}, the key names shard {shard}")
        if shard_v >= shards_v:
            raise RecordError(f"{key}: shard {shard_v} is not below shards {shards_v}")
    phase = rec.get("phase")
    if not isinstance(phase, str) or not phase:
        raise RecordError(f"{key}: field 'phase' must be a non-empty string, got {phase!r}")
    flight = rec.get("rounds_in_flight", [])
    if not isinstance(flight, list) or not all(isinstance(r, dict) for r in flight):
        raise RecordError(f"{key}: field 'rounds_in_flight' must be a list of objects")
    for r in flight:
        _int(r, "step", f"{key} rounds_in_flight", lo=1)
    missing = rec.get("shards_missing", [])
    if not isinstance(missing, list) or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < shards_v
                                                 for k in missing):
        raise RecordError(f"{key}: field 'shards_missing' must be a list of shard numbers below {shards_v}, got {missing!r}")
    frags = rec.get("fragments")
    if frags is not None and (not isinstance(frags, list)
                              or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 0 for f in frags)):
        raise RecordError(f"{key}: field 'fragments' must be a list of fragment ids, got {frags!r}")
    live = rec.get("live", [])
    if not isinstance(live, list) or not all(isinstance(i, str) for i in live):
        raise RecordError(f"{key}: field 'live' must be a list of island ids")
    exited = rec.get("exited", False)
    if not isinstance(exited, bool):
        raise RecordError(f"{key}: field 'exited' must be true or false, got {exited!r}")
    return Status(shard=shard_v, shards=shards_v, updated_at=_num(rec, "updated_at", key), phase=phase,
                  committed_step=_int(rec, "committed_step", key), versions=_versions(rec, key),
                  rounds_in_flight=flight, rss_bytes=_int(rec, "rss_bytes", key, required=False), exited=exited,
                  fragments=frags, shards_missing=sorted(set(missing)), live=live,
                  total_steps=_int(rec, "total_steps", key, lo=1, required=False), seen_at=seen_at)


@dataclass
class Commit:
    committed_step: int
    versions: dict[int, int]


def parse_commit(key: str, rec: Any) -> Commit:
    if not isinstance(rec, dict):
        raise RecordError(f"{key}: a commit record is an object, got {type(rec).__name__}")
    return Commit(committed_step=_int(rec, "committed_step", key), versions=_versions(rec, key))


@dataclass
class ShardRow:
    """What a viewer shows for one shard."""

    shard: int
    shards: int
    state: str  # OK, MISSING or EXITED
    reason: str = ""
    phase: str | None = None
    committed_step: int | None = None  # the newer of the status and the commit record (both only grow)
    versions: dict[int, int] = field(default_factory=dict)
    rounds_in_flight: list[int] = field(default_factory=list)  # steps
    rss_bytes: int | None = None
    age_s: float | None = None  # the status record's age (see the module doc)
    fragments: list[int] | None = None

    def to_json(self) -> dict:
        return {"shard": self.shard, "shards": self.shards, "state": self.state, "reason": self.reason,
                "phase": self.phase, "committed_step": self.committed_step,
                "versions": {str(f): v for f, v in sorted(self.versions.items())},
                "rounds_in_flight": self.rounds_in_flight, "rss_bytes": self.rss_bytes,
                "age_s": None if self.age_s is None else round(self.age_s, 3), "fragments": self.fragments}


class ShardBoard:
    """The newest status and commit record of every shard (see the module doc)."""

    def __init__(self, stale_s: float = STALE_S):
        self.stale_s = stale_s
        self.status: dict[int | None, Status] = {}  # None: the unsharded `syncer` key
        self.commits: dict[int | None, Commit] = {}
        self.malformed = 0
        self.last_malformed: str | None = None
        self.changes = 0  # records taken (viewers refresh when it moves)

    def put(self, key: str, value: bytes | bytearray | None, *, seen_at: float | None = None) -> bool:
        """Take one state KV entry (None or b"": the key was deleted). `seen_at`: the viewer's time when
        the entry arrived as a live update (None for a value read at start). True if it was a shard record."""
        parsed = _key(key)
        if parsed is None:
            return False
        base, shard = parsed
        table = self.status if base == "syncer" else self.commits
        if not value:
            table.pop(shard, None)
            self.changes += 1
            return True
        try:
            rec = orjson.loads(value)
            if base == "syncer":
                table[shard] = parse_status(key, shard, rec, seen_at)
            else:
                table[shard] = parse_commit(key, rec)
        except (orjson.JSONDecodeError, RecordError) as exc:
            self.malformed += 1
            text = f"{key}: {exc}" if isinstance(exc, orjson.JSONDecodeError) else str(exc)
            self.last_malformed = text if len(text) <= 300 else text[:297] + "..."
            return True
        self.changes += 1
        return True

    @property
    def sharded(self) -> bool:
        return any(k is not None for k in self.status) or any(k is not None for k in self.commits)

    def shards(self) -> int:
        """N: the largest `shards` a sharded record names, or 1 for an unsharded run; 0 before any record."""
        sharded = [s.shards for k, s in self.status.items() if k is not None]
        if sharded or any(k is not None for k in self.commits):
            n = max(sharded, default=0)
            return max([n] + [k + 1 for k in self.commits if k is not None] + [k + 1 for k in self.status if k is not None])
        return 1 if (None in self.status or None in self.commits) else 0

    def rows(self, now: float) -> list[ShardRow]:
        n = self.shards()
        if n == 0:
            return []
        sharded = self.sharded
        coord = self.status.get(0 if sharded else None)
        # the coordinator's word counts while it is itself reporting: a stale list would keep a shard
        # that came back "missing" for as long as the coordinator is down
        fresh = coord is not None and not coord.exited and coord.age(now) <= self.stale_s
        judged = set(coord.shards_missing) if fresh else set()
        out = []
        for k in range(n):
            key = k if sharded else None
            st, cm = self.status.get(key), self.commits.get(key)
            row = ShardRow(shard=k, shards=n, state=OK)
            if st is not None:
                row.phase, row.committed_step, row.versions = st.phase, st.committed_step, dict(st.versions)
                row.rounds_in_flight = sorted(r["step"] for r in st.rounds_in_flight)
                row.rss_bytes, row.fragments = st.rss_bytes, st.fragments
                row.age_s = st.age(now)
            if cm is not None:  # both only grow; whichever was written last is the newer, per field
                row.committed_step = max(row.committed_step or 0, cm.committed_step)
                for f, v in cm.versions.items():
                    row.versions[f] = max(v, row.versions.get(f, v))
            name = f"syncer.{k}" if sharded else "syncer"
            if st is None:
                row.state, row.reason = MISSING, f"no status record ({name})"
            elif st.exited and st.phase != "done":
                row.state, row.reason = MISSING, f"exited in phase {st.phase}"
            elif st.exited:
                row.state, row.reason = EXITED, "exited"
            elif row.age_s > self.stale_s:
                row.state, row.reason = MISSING, f"no status for {row.age_s:.0f} s"
            if k in judged and row.state != EXITED:
                why = "the coordinator counts it missing"
                row.state, row.reason = MISSING, f"{row.reason}; {why}" if row.state == MISSING else why
            out.append(row)
        return out

    def missing(self, now: float) -> list[int]:
        return [r.shard for r in self.rows(now) if r.state == MISSING]
