"""Step-log and syncer-tape aggregation: raw messages in, state out (pure: no I/O, no clock).

Owns everything the dashboards show, so `tail`, `exporter` and `dashboard` agree and the logic is tested
without a broker:
* `Aggregator.feed(subject, data)` decodes one STEPLOG (`yeto.R.steplog.I`) or EVENTS
  (`yeto.R.events.<kind>`) message, checks it against its subject and folds it into per-island
  (`IslandState`), per-round (`RoundState`) and run totals; `feed_state(key, value)` takes the `state` KV's
  syncer status and commit records (`shards.ShardBoard`; `shard_rows(now)` is what the viewers show).
* `ChartModel`: the same records as bounded time series for the web dashboard (`snapshot()`,
  `take_delta()`).
Invariants: a message that is not JSON, fails its schema, names another run or contradicts its subject
is skipped and counted in `malformed` (by reason): a bad publisher never stops a dashboard. The syncer's
version of a fragment is the highest seen in a merge or commit record, the commit record, or held by
any island (islands hold committed versions only), so version lag is never negative.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from yeto.schemas import codec, subjects as S
from yeto.schemas.errors import WireError
from yeto.schemas.ids import check_run

from .shards import ShardBoard, ShardRow

STEPLOG = "steplog"
EVENT = "event"

# Per-step counters that an island reports per step; the aggregator keeps their running totals.
STEP_COUNTERS = ("pushes", "applies", "bytes_out", "bytes_in", "scatter_bytes", "gather_bytes", "rejected")
DISPOSITIONS = ("accepted", "duplicate", "unexpected_member", "future_base", "stale_base", "out_of_round", "invalid",
                "quarantined")
# Tape kinds worth a line in the "recent" list (merges, commits and dispositions have their own tables).
NOTABLE_KINDS = ("join", "leave", "restart", "error", "final", "session", "settings")


@dataclass(frozen=True)
class Record:
    """One accepted message: which stream it came from, its subject and the validated body."""

    stream: str  # STEPLOG or EVENT
    subject: str
    msg: dict

    @property
    def kind(self) -> str:
        return STEPLOG if self.stream == STEPLOG else self.msg["kind"]


@dataclass
class IslandState:
    island: str
    gen: str = ""
    gens: int = 0  # distinct generations seen (a new one = the island's process restarted)
    step: int = 0
    t: float = 0.0
    boundary_s: float = 0.0
    export_s: float = 0.0
    apply_s: float = 0.0
    pending_pulls: int = 0
    versions: dict[int, int] = field(default_factory=dict)
    loss: float | None = None
    dropped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=lambda: {k: 0 for k in STEP_COUNTERS})  # this step's counters
    totals: dict[str, int] = field(default_factory=lambda: {k: 0 for k in STEP_COUNTERS})  # since the viewer started
    events: int = 0
    out_of_order: int = 0  # events of the current generation whose step went backwards
    dispositions: collections.Counter = field(default_factory=collections.Counter)
    live: bool | None = None  # from join/leave records; None until one is seen
    boundary_sum_s: float = 0.0
    export_sum_s: float = 0.0
    apply_sum_s: float = 0.0

    def take_step(self, m: Mapping[str, Any]) -> None:
        """Fold one step-log record of this island (a new generation: its process restarted)."""
        if m["gen"] != self.gen:
            self.gen = m["gen"]
            self.gens += 1
        elif m["step"] < self.step:
            self.out_of_order += 1
        self.events += 1
        self.step, self.t = m["step"], m["t"]
        self.boundary_s, self.export_s, self.apply_s = m["boundary_s"], m["export_s"], m["apply_s"]
        self.boundary_sum_s += m["boundary_s"]
        self.export_sum_s += m["export_s"]
        self.apply_sum_s += m["apply_s"]
        self.pending_pulls = m["pending_pulls"]
        self.versions = {int(f): v for f, v in m["versions"].items()}
        self.loss = m.get("loss")
        self.dropped = m.get("dropped", self.dropped)
        self.extra = dict(m.get("extra") or {})
        for k in STEP_COUNTERS:
            self.last[k] = m[k]
            self.totals[k] += m[k]

    def presence(self, joined: bool, gen: str) -> None:
        """A join or leave record; a join of a new generation counts it."""
        self.live = joined
        if gen != self.gen and joined:
            self.gen, self.gens = gen, self.gens + 1

    def disposition(self, d: str) -> None:
        self.dispositions[d] += 1

    def lag(self, syncer_versions: Mapping[int, int]) -> dict[int, int]:
        """Fragment -> versions this island is behind the syncer (fragments the island holds)."""
        return {f: max(0, syncer_versions.get(f, v) - v) for f, v in sorted(self.versions.items())}

    def max_lag(self, syncer_versions: Mapping[int, int]) -> int | None:
        lag = self.lag(syncer_versions)
        return max(lag.values()) if lag else None

    def missing(self, syncer_versions: Mapping[int, int]) -> list[int]:
        """Fragments the syncer has a version of that this island holds none of."""
        return sorted(set(syncer_versions) - set(self.versions))


@dataclass
class RoundState:
    step: int
    fragment: int | None = None
    attempt: int = 1
    status: str = "open"  # open -> merged -> committed (records may come in either order)
    base_version: int | None = None
    version: int | None = None
    quorum: int | None = None
    expected: int | None = None
    responded: int | None = None
    quorum_s: float | None = None
    grace_s: float | None = None
    sync_s: float | None = None
    restarts: int = 0
    quorum_timeouts: int = 0
    dispositions: collections.Counter = field(default_factory=collections.Counter)
    staleness: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    t_first: float = 0.0
    t_last: float = 0.0
    reason: str | None = None  # the last restart / error reason

    def touch(self, m: Mapping[str, Any]) -> None:
        """Any tape record naming this round: its time span and fragment."""
        self.t_first = self.t_first or m["t"]
        self.t_last = max(self.t_last, m["t"])
        if "fragment" in m:
            self.fragment = m["fragment"]

    def timed_out(self) -> None:
        self.quorum_timeouts += 1

    def merged(self, m: Mapping[str, Any]) -> None:
        self.attempt, self.version = m["attempt"], m["version"]
        # the syncer writes `commit` (durable, broadcast) before `merge`: never step back from committed
        if self.status != "committed":
            self.status = "merged"
        self.base_version = m.get("base_version", self.base_version)
        self.quorum = m.get("quorum", self.quorum)
        self.expected = len(m["expected"]) if "expected" in m else self.expected
        self.responded = len(m["responded"])
        self.quorum_s, self.grace_s, self.sync_s = m.get("quorum_s"), m.get("grace_s"), m.get("sync_s")
        self.staleness = dict(m.get("staleness") or {})
        self.weights = dict(m["weights"])

    def committed(self, version: int) -> None:
        self.status, self.version = "committed", version

    def restarted(self, m: Mapping[str, Any]) -> None:
        """A restart record (attempt >= 2: a restart; attempt 1: the syncer resumed): the round opens again."""
        if m["attempt"] >= 2:
            self.restarts += 1
        self.attempt, self.reason = m["attempt"], m["reason"]
        self.base_version = m.get("base_version", self.base_version)
        self.quorum = m.get("quorum", self.quorum)
        if "expected" in m:
            self.expected = len(m["expected"])
        self.responded = 0
        self.status = "open"

    def disposition(self, d: str, attempt: int) -> None:
        self.dispositions[d] += 1
        self.attempt = max(self.attempt, attempt)

    def errored(self, reason: str) -> None:
        self.reason = reason


def is_quorum_timeout(msg: Mapping[str, Any]) -> bool:
    """Whether a tape record reports a round that missed its quorum deadline.

    Non-strict mode restarts the round with attempt+1 (`restart`, attempt >= 2); strict mode keeps the
    attempt and records an `error` naming quorum_timeout. A `restart` with attempt 1 is the syncer
    resuming from its checkpoint, not a timeout. `detail.cause == "quorum_timeout"` is honoured too.
    """
    kind = msg.get("kind")
    detail = msg.get("detail") if isinstance(msg.get("detail"), Mapping) else {}
    if detail.get("cause") == "quorum_timeout":
        return True
    if kind == "restart":
        return int(msg.get("attempt", 1)) >= 2
    if kind == "error" and "step" in msg and "attempt" in msg:
        reason = str(msg.get("reason", ""))
        return reason.startswith("quorum_timeout") or "below quorum" in reason
    return False


class Aggregator:
    """Folds a run's step-log events and syncer records into dashboard state (see the module doc)."""

    def __init__(self, run: str, *, island: str | None = None, max_rounds: int = 200, max_recent: int = 50):
        self.run = check_run(run)
        self.island_filter = island
        self.max_rounds = max_rounds
        self.islands: dict[str, IslandState] = {}
        self.rounds: dict[int, RoundState] = {}
        self.syncer_versions: dict[int, int] = {}
        self.kinds: collections.Counter = collections.Counter()  # accepted messages by kind
        self.dispositions: collections.Counter = collections.Counter()
        self.quorum_timeouts = 0
        self.restarts = 0
        self.syncer_resumes = 0
        # `yeto run set`: the runtime settings in force (the syncer's last applied record) and refusals
        self.settings: dict[str, Any] = {}
        self.settings_step: int | None = None
        self.settings_refused = 0
        self.merges = 0
        self.errors = 0
        self.final_step: int | None = None
        self.committed_step: int | None = None
        self.malformed = 0
        self.malformed_by: collections.Counter = collections.Counter()  # (stream, reason) -> count
        self.last_malformed: str | None = None
        self.filtered = 0  # valid events of islands outside --island
        self.recent: collections.deque[dict] = collections.deque(maxlen=max_recent)
        self.last_t = 0.0
        self.shards = ShardBoard()

    # ---- intake -----------------------------------------------------------------------------------

    def feed(self, subject: str, data: bytes | bytearray | memoryview | str) -> Record | None:
        """Decode and fold one message. Returns the Record, or None if it was skipped (malformed or filtered)."""
        try:
            tokens = S.parse(self.run, subject)
        except ValueError:
            return self._bad("?", "foreign_subject", f"subject {subject!r} is not under run {self.run}")
        if len(tokens) == 2 and tokens[0] == "steplog":
            stream = STEPLOG
        elif len(tokens) == 2 and tokens[0] == "events":
            stream = EVENT
        else:
            return self._bad("?", "foreign_subject", f"subject {subject!r} is neither steplog.I nor events.<kind>")
        try:
            msg = codec.decode(stream, data)
        except WireError as exc:
            return self._bad(stream, getattr(exc, "rule", None) or type(exc).__name__, f"{subject}: {exc}")
        if msg["run"] != self.run:
            return self._bad(stream, "run_mismatch", f"{subject}: run {msg['run']!r} on a subject of run {self.run!r}")
        if stream == STEPLOG and msg["island"] != tokens[1]:
            return self._bad(stream, "subject_mismatch", f"{subject}: island {msg['island']!r} on the subject of {tokens[1]!r}")
        if stream == EVENT and msg["kind"] != tokens[1]:
            return self._bad(stream, "subject_mismatch", f"{subject}: kind {msg['kind']!r} on the subject of {tokens[1]!r}")
        rec = Record(stream, subject, msg)
        try:
            return self.apply(rec)
        except Exception as exc:  # a valid message this code did not foresee: skip it, count it, keep going
            return self._bad(stream, "unhandled", f"{subject}: {type(exc).__name__}: {exc}")

    def _bad(self, stream: str, reason: str, text: str) -> None:
        self.malformed += 1
        self.malformed_by[(stream, reason)] += 1
        self.last_malformed = text if len(text) <= 300 else text[:297] + "..."
        return None

    def apply(self, rec: Record) -> Record | None:
        """Fold an already-validated record (feed() calls this)."""
        msg = rec.msg
        self.last_t = max(self.last_t, float(msg["t"]))
        if rec.stream == STEPLOG:
            if self.island_filter is not None and msg["island"] != self.island_filter:
                self.filtered += 1
                return None
            self.kinds[STEPLOG] += 1
            self._steplog(msg)
        else:
            self.kinds[msg["kind"]] += 1
            self._event(msg)
        return rec

    def feed_state(self, key: str, value: bytes | bytearray | None, *, seed: bool = True,
                   seen_at: float | None = None) -> bool:
        """Take one `state` KV entry (None: deleted). Shard status and commit records go to the shard
        board (a malformed one is counted there, never raised); a commit or status record also raises
        the syncer's versions unless `seed` is False (a replay from the start keeps the lag of its time).
        `seen_at`: see shards.ShardBoard.put. True if the key was a shard record."""
        if not self.shards.put(key, value, seen_at=seen_at):
            return False
        if seed:  # both name committed versions only (a status record: its shard's, at its last write)
            base, _, k = key.partition(".")
            table = self.shards.commits if base == "commit" else self.shards.status
            rec = table.get(int(k) if k else None)
            if rec is not None:
                self.seed_versions(rec.versions, rec.committed_step)
        return True

    def shard_rows(self, now: float) -> list[ShardRow]:
        return self.shards.rows(now)

    def seed_versions(self, versions: Mapping[str | int, int], committed_step: int | None = None) -> None:
        """Start from the syncer's durable commit record (state KV key `commit`)."""
        for f, v in versions.items():
            self._syncer_version(int(f), int(v))
        if committed_step is not None:
            self.committed_step = max(self.committed_step or 0, int(committed_step))

    def _syncer_version(self, fragment: int, version: int) -> None:
        if version > self.syncer_versions.get(fragment, -1):
            self.syncer_versions[fragment] = version

    def island(self, island: str) -> IslandState:
        st = self.islands.get(island)
        if st is None:
            st = self.islands[island] = IslandState(island)
        return st

    def _steplog(self, m: dict) -> None:
        st = self.island(m["island"])
        st.take_step(m)
        for f, v in st.versions.items():
            self._syncer_version(f, v)

    def round(self, step: int) -> RoundState:
        r = self.rounds.get(step)
        if r is None:
            r = self.rounds[step] = RoundState(step)
            if len(self.rounds) > self.max_rounds:
                for old in sorted(self.rounds)[: len(self.rounds) - self.max_rounds]:
                    del self.rounds[old]
        return r

    def _event(self, m: dict) -> None:
        kind = m["kind"]
        r: RoundState | None = None
        # merge/restart/disposition always name a round; commit and error only past the version-0 cut
        # (step 0) and, for errors, when they carry an attempt
        if kind in ("merge", "restart", "disposition") or (
                kind in ("commit", "error") and m.get("step", 0) >= 1 and (kind == "commit" or "attempt" in m)):
            r = self.round(m["step"])
            r.touch(m)
        if is_quorum_timeout(m):
            self.quorum_timeouts += 1
            if r is not None:
                r.timed_out()
        if kind == "merge":
            self.merges += 1
            r.merged(m)
            self._syncer_version(m["fragment"], m["version"])
            self.committed_step = max(self.committed_step or 0, m["step"])
        elif kind == "commit":
            self._syncer_version(m["fragment"], m["version"])
            if r is not None:
                r.committed(m["version"])
                self.committed_step = max(self.committed_step or 0, m["step"])
        elif kind == "restart":
            if m["attempt"] >= 2:
                self.restarts += 1
            else:
                self.syncer_resumes += 1
            r.restarted(m)
        elif kind == "disposition":
            d = m["disposition"]
            self.dispositions[d] += 1
            r.disposition(d, m["attempt"])
            if self._wanted(m["island"]):
                self.island(m["island"]).disposition(d)
        elif kind in ("join", "leave"):
            if self._wanted(m["island"]):
                self.island(m["island"]).presence(kind == "join", m["gen"])
        elif kind == "error":
            self.errors += 1
            if r is not None:
                r.errored(m["reason"])
        elif kind == "final":
            self.final_step = m["step"]
        elif kind == "settings":
            detail = m.get("detail") if isinstance(m.get("detail"), dict) else {}
            if isinstance(detail.get("settings"), dict):
                self.settings, self.settings_step = dict(detail["settings"]), m.get("step")
            else:
                self.settings_refused += 1
        if kind in NOTABLE_KINDS:
            self.recent.append(m)

    def _wanted(self, island: str) -> bool:
        return self.island_filter is None or island == self.island_filter

    # ---- views ------------------------------------------------------------------------------------

    def lag(self, island: str) -> dict[int, int]:
        return self.islands[island].lag(self.syncer_versions)

    def summary(self) -> dict:
        """Run-level numbers, JSON-able."""
        return {
            "run": self.run, "islands": len(self.islands), "steplog_events": self.kinds[STEPLOG],
            "syncer_events": sum(v for k, v in self.kinds.items() if k != STEPLOG),
            "merges": self.merges, "restarts": self.restarts, "quorum_timeouts": self.quorum_timeouts,
            "syncer_resumes": self.syncer_resumes, "errors": self.errors, "dispositions": dict(self.dispositions),
            "syncer_versions": {str(f): v for f, v in sorted(self.syncer_versions.items())},
            "committed_step": self.committed_step, "final_step": self.final_step,
            "total_steps": max((st.total_steps for st in self.shards.status.values() if st.total_steps), default=None),
            "malformed": self.malformed, "last_malformed": self.last_malformed, "filtered": self.filtered,
            "shards": self.shards.shards(), "state_malformed": self.shards.malformed,
            "settings": dict(sorted(self.settings.items())), "settings_step": self.settings_step,
            "settings_refused": self.settings_refused,
        }


# ---------------------------------------------------------------------------------------------------- charts

class ChartModel:
    """Bounded time series for the web dashboard, fed with Records (after the Aggregator accepted them).

    Points are lists (compact JSON): island series `[t, step, boundary_s, export_s, apply_s, lag, loss]`,
    rounds `[t, step, attempt, quorum_s, sync_s]`, timeouts `[t, step, cumulative]`. Times are unix
    seconds; the page makes them relative. `max_points` bounds every series (oldest dropped).
    """

    ISLAND_FIELDS = ("t", "step", "boundary_s", "export_s", "apply_s", "lag", "loss")
    ROUND_FIELDS = ("t", "step", "attempt", "quorum_s", "sync_s")
    TIMEOUT_FIELDS = ("t", "step", "count")

    def __init__(self, agg: Aggregator, *, max_points: int = 600, clock: Callable[[], float] | None = None):
        self.agg = agg
        # the shard rows' staleness is judged against the viewer's clock (a shard that went silent
        # sends nothing that would say so); injected so the model stays testable
        self.clock = clock
        self.max_points = max_points
        self.islands: dict[str, collections.deque] = {}
        self.rounds: collections.deque = collections.deque(maxlen=max_points)
        self.timeouts: collections.deque = collections.deque(maxlen=max_points)
        self.seq = 0  # points added so far (all series)
        self._delta: dict[str, Any] = self._empty_delta()

    @staticmethod
    def _empty_delta() -> dict:
        return {"islands": {}, "rounds": [], "timeouts": []}

    def add(self, rec: Record | None) -> bool:
        """Add the record's points; True if it produced any."""
        if rec is None:
            return False
        m = rec.msg
        if rec.stream == STEPLOG:
            lag = self.agg.islands[m["island"]].max_lag(self.agg.syncer_versions)
            pt = [m["t"], m["step"], m["boundary_s"], m["export_s"], m["apply_s"], lag, m.get("loss")]
            self.islands.setdefault(m["island"], collections.deque(maxlen=self.max_points)).append(pt)
            self._delta["islands"].setdefault(m["island"], []).append(pt)
        elif m["kind"] == "merge":
            pt = [m["t"], m["step"], m["attempt"], m.get("quorum_s"), m.get("sync_s")]
            self.rounds.append(pt)
            self._delta["rounds"].append(pt)
        elif is_quorum_timeout(m):
            pt = [m["t"], m.get("step"), self.agg.quorum_timeouts]
            self.timeouts.append(pt)
            self._delta["timeouts"].append(pt)
        else:
            return False
        self.seq += 1
        return True

    def _meta(self) -> dict:
        a = self.agg
        islands = {}
        for name, st in sorted(a.islands.items()):
            islands[name] = {
                "gen": st.gen, "step": st.step, "boundary_s": st.boundary_s, "export_s": st.export_s,
                "apply_s": st.apply_s, "lag": st.max_lag(a.syncer_versions), "pending_pulls": st.pending_pulls,
                "events": st.events, "live": st.live, "loss": st.loss,
                "mean_boundary_s": st.boundary_sum_s / st.events if st.events else 0.0,
                "mean_export_s": st.export_sum_s / st.events if st.events else 0.0,
                "mean_apply_s": st.apply_sum_s / st.events if st.events else 0.0,
            }
        shards = [r.to_json() for r in a.shard_rows(self.clock())] if self.clock is not None else []
        return {"summary": a.summary(), "island_state": islands, "shards": shards, "seq": self.seq}

    def snapshot(self) -> dict:
        return {
            "fields": {"island": self.ISLAND_FIELDS, "round": self.ROUND_FIELDS, "timeout": self.TIMEOUT_FIELDS},
            "max_points": self.max_points,
            "islands": {k: list(v) for k, v in sorted(self.islands.items())},
            "rounds": list(self.rounds), "timeouts": list(self.timeouts), **self._meta(),
        }

    def take_delta(self, force: bool = False) -> dict | None:
        """Points added since the last call, with the current meta; None if no points (unless `force`:
        the meta alone still tells a viewer about, say, a malformed message)."""
        d = self._delta
        if not force and not (d["islands"] or d["rounds"] or d["timeouts"]):
            return None
        self._delta = self._empty_delta()
        return {**d, **self._meta()}

    def discard_delta(self) -> None:
        self._delta = self._empty_delta()


def feed_all(agg: Aggregator, items: Iterable[tuple[str, bytes]]) -> list[Record]:
    """Feed (subject, data) pairs; the accepted Records in order (a convenience for tests and replays)."""
    out = []
    for subject, data in items:
        rec = agg.feed(subject, data)
        if rec is not None:
            out.append(rec)
    return out
