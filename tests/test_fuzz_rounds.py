"""Fuzzing the syncer's pure round machine (services/syncer/rounds.py) with hypothesis.

Random event sequences — hellos (known and unknown islands, new and replayed generations, other layouts and
dtypes), heartbeats, pushes with random fields (steps, fragments, attempts, tries, bases, validity, members and
generations that are not expected), INIT completions from any island, ticks and time jumps, final acks — are fed
through a driver that plays the shell honestly: it answers `CommitV0` with `V0Done`, `Merge` with `MergeDone` (after
a random delay) and the final cut with its completion. Whatever the sequence:

- `handle` never raises;
- a fragment's versions go up by exactly one per merge, steps commit in order, at most one merge is outstanding;
- never two rounds in flight on one fragment, never more than `pipeline`;
- no `Merge` has fewer inputs than the round's quorum, and every input is an accepted, valid push of a member the
  round's pull named;
- every action is well-formed: pulls, errors and tape records validate against the wire schemas, and no push the
  outstanding merge reads is released;
- no merge input is a push that was quarantined (NaN/Inf, over --max-push-norm, an outlier, over the default
  --push-norm-factor bound), and no input's c_tokens exceeds --max-token-factor x the lower median of the merged
  pushes' positive claims (every push here covers the same c_steps, where the cap by tokens per step is the same);
- a merge has at least the round's quorum of inputs, less the members excused by a quarantine.
"""
from __future__ import annotations

import math
import zlib

from hypothesis import HealthCheck, given, settings, strategies as st

from yeto.schemas import codec
from yeto.schemas.layout import layout_fingerprint
from yeto.services.syncer.actions import (
    Action, CommitV0, Merge, PublishPull, Release, SendError, Tape, WriteMember, WriteSession,
)
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import (
    Event, FinalAck, FinalPublished, Heartbeat, Hello, InitComplete, MergeDone, PushComplete, Tick, V0Done,
)
from yeto.services.syncer.rounds import RoundMachine

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

RUN = "fz"
LAYOUT = [{"name": "embed.weight", "shape": [8, 4], "dtype": "float32"}] + [
    {"name": f"layers.{i}.w", "shape": [4, 4], "dtype": "float32"} for i in range(4)]
FP = layout_fingerprint(LAYOUT)
ISLANDS = ("a", "b", "c", "zz")          # zz never says hello with the right layout
GENS = ("0000000000000001", "0000000000000002", "0000000000000003")


CONFIGS = st.builds(
    lambda frags, per, total, pipeline, quorum, strict, lag, eq, max_norm, outlier, token_factor: SyncerConfig(
        run=RUN, islands=2, fragments=frags, sync_every=frags * per, total_steps=total, pipeline=pipeline,
        quorum=quorum, quorum_timeout_s=5.0, grace_ms=500.0, strict=strict, max_base_lag=lag, equal_weights=eq,
        member_timeout_s=8.0, final_timeout_s=20.0, max_push_norm=max_norm, outlier_factor=outlier,
        max_token_factor=token_factor),
    st.integers(1, 3), st.integers(1, 2), st.integers(1, 6), st.integers(1, 3), st.one_of(st.none(), st.integers(1, 3)),
    st.booleans(), st.integers(0, 2), st.booleans(), st.sampled_from((None, 5.0, 50.0)),
    st.sampled_from((None, 1.5, 3.0)), st.sampled_from((None, 1.0, 4.0)))

ISLAND = st.sampled_from(ISLANDS)
GEN = st.sampled_from(GENS)
SMALL = st.integers(0, 8)
EVENTS = st.one_of(
    st.tuples(st.just("hello"), ISLAND, GEN, st.sampled_from((FP, "e" * 64)), st.sampled_from(("auto", "f32", "bf16")),
              st.sampled_from(("auto", "f32", "bf16"))),
    st.tuples(st.just("hb"), ISLAND, GEN, SMALL, st.one_of(st.none(), st.floats(0.001, 2.0))),
    st.tuples(st.just("init"), ISLAND, GEN, st.integers(0, 3)),
    st.tuples(st.just("push"), ISLAND, GEN, st.one_of(st.just(None), st.integers(0, 4)), st.one_of(st.just(None), SMALL),
              st.one_of(st.just(None), st.integers(1, 4)), st.integers(0, 2), st.one_of(st.just(None), st.integers(0, 6)),
              st.booleans(), st.integers(0, 1000)),
    st.tuples(st.just("good_push"), ISLAND, st.integers(0, 1000)),
    st.tuples(st.just("tick"), st.floats(0.0, 12.0)),
    st.tuples(st.just("ack"), ISLAND, GEN, st.one_of(st.just(None), SMALL)),
    st.tuples(st.just("answer"),),
    # weight towards what moves rounds along (one_of picks its branches uniformly)
    st.tuples(st.just("good_push"), st.sampled_from(("a", "b")), st.integers(0, 1000)),
    st.tuples(st.just("good_push"), st.sampled_from(("a", "b")), st.integers(0, 1000)),
    st.tuples(st.just("hb"), st.sampled_from(("a", "b")), st.just(GENS[0]), SMALL, st.just(0.05)),
    st.tuples(st.just("answer"),),
    st.tuples(st.just("tick"), st.floats(0.0, 1.0)),
    # a third member makes rounds the outlier rule judges (it needs three pushes)
    st.tuples(st.just("hello"), st.just("c"), st.just(GENS[0]), st.just(FP), st.just("auto"), st.just("auto")),
    st.tuples(st.just("good_push"), st.just("c"), st.integers(0, 10**6)),
)


class Shell:
    """Plays the I/O shell's part and checks every action against the invariants."""

    def __init__(self, cfg: SyncerConfig):
        self.cfg = cfg
        self.m = RoundMachine(cfg)   # the real session builder
        self.now = 1000.0
        self.versions: dict[int, int] = {}
        self.committed = 0
        self.inflight: dict[int, int] = {}                     # step -> fragment (pull published, not merged)
        self.pulls: dict[tuple[int, int], list[dict]] = {}     # (step, attempt) -> every seq's pull
        self.accepted_ok: set[tuple] = set()                   # valid pushes fed (island, gen, step, attempt, try)
        self.figures: dict[tuple, tuple] = {}                   # same key -> (norm, non_finite, c_tokens)
        self.quarantined: set[tuple] = set()                   # same key, taped quarantined
        self.gens: dict[str, str] = {}                          # island -> gen of its last hello
        self.owed: list[Event] = []                           # the shell's answers not fed yet
        self.merging: Merge | None = None
        self.final_published = False
        self.wild = False                                       # good pushes get any norm, NaN/Inf included

    # -- feeding ---------------------------------------------------------------------------------
    def feed(self, ev: Event) -> None:
        for a in self.m.handle(ev):   # must never raise
            self.check(a)

    def answer(self) -> None:
        if self.owed:
            self.feed(self.owed.pop(0))

    def step(self, e: tuple) -> None:
        kind = e[0]
        self.now += 0.05
        if kind == "hello":
            _, isl, gen, fp, pd, bd = e
            if isl == "zz":
                fp = "e" * 64
            self.gens.setdefault(isl, gen)
            self.feed(Hello(isl, gen, LAYOUT, fp, pd, bd, self.now))
            if fp == FP and pd == "auto" and bd == "auto":
                self.gens[isl] = gen
        elif kind == "hb":
            _, isl, gen, local, st_s = e
            self.feed(Heartbeat(isl, gen, local, st_s, self.now))
        elif kind == "init":
            _, isl, gen, frag = e
            self.feed(InitComplete(isl, gen, frag, self.now))
        elif kind == "push":
            _, isl, gen, step, frag, attempt, try_, base, valid, tokens = e
            step = step if step is not None else (min(self.inflight) if self.inflight else 1)
            frag = frag if frag is not None else self.cfg.fragment_of(step)
            attempt = attempt if attempt is not None else self._attempt(step)
            base = base if base is not None else self.versions.get(frag, 0)
            self._push(isl, gen, step, frag, attempt, try_, base, valid, tokens)
        elif kind == "good_push":
            # the push an honest member would send for the oldest round naming it (a wild shell: any norm)
            _, isl, tokens, *more = e
            try_ = more[0] if more else 0
            for step in sorted(self.inflight):
                att = self._attempt(step)
                for p in self.pulls.get((step, att), [])[-1:]:
                    for mem in p["members"]:
                        if mem["island"] == isl:
                            self._push(isl, mem["gen"], step, p["fragment"], att, try_, p["base_version"], True,
                                       tokens, honest=not self.wild)
                            return
        elif kind == "tick":
            self.now += e[1]
            self.feed(Tick(self.now))
        elif kind == "ack":
            _, isl, gen, fs = e
            self.feed(FinalAck(isl, self.gens.get(isl, gen) if gen == GENS[0] else gen,
                                 self.committed if fs is None else fs, self.now))
        elif kind == "answer":
            self.answer()

    def _attempt(self, step: int) -> int:
        atts = [a for (s, a) in self.pulls if s == step]
        return max(atts) if atts else 1

    def _push(self, isl, gen, step, frag, attempt, try_, base, valid, tokens, honest=False):
        key = (isl, gen, step, attempt, try_)
        # The shell's figures are a function of the push's bytes, so of its identity: derived from it here.
        # Honest pushes of a and b stay sane (norm 1-4: never over --max-push-norm 5, an outlier only
        # beside a third member); anything else may be NaN/Inf or up to 100.
        h = zlib.crc32(repr(key).encode())
        if honest and isl in ("a", "b"):
            norm, nf = 1.0 + h % 4, 0
        else:
            norm, nf = 0.5 + h % 1000 / 10.0, int(h % 11 == 0)
        norm, tokens = self.figures.setdefault(key, (norm, nf, tokens))[0::2]
        nf = self.figures[key][1]
        ev = PushComplete(isl, gen, frag, step, attempt, try_, base, 10, 5, tokens, valid,
                            None if valid else "digest_mismatch: fuzz", self.now, norm=math.nan if nf else norm,
                            non_finite=nf)
        if valid:
            self.accepted_ok.add(key)
        self.feed(ev)

    # -- checking every action -------------------------------------------------------------------
    def check(self, a: Action) -> None:
        cfg = self.cfg
        if isinstance(a, PublishPull):
            p = a.pull
            codec.make("pull", run=RUN, **p)       # well-formed on the wire
            assert p["fragment"] == cfg.fragment_of(p["step"])
            assert p["base_version"] == self.versions[p["fragment"]], (p, self.versions)
            if p["step"] not in self.inflight:
                assert p["step"] == max([self.committed, *self.inflight]) + 1, "rounds launch in step order"
                assert p["fragment"] not in self.inflight.values(), "two rounds on one fragment"
                assert len(self.inflight) < cfg.pipeline, "more rounds in flight than --pipeline"
                assert p["step"] <= cfg.total_steps
                self.inflight[p["step"]] = p["fragment"]
            self.pulls.setdefault((p["step"], p["attempt"]), []).append(p)
        elif isinstance(a, Merge):
            assert self.merging is None, "a second merge while one is outstanding"
            assert a.step == self.committed + 1, "steps commit in order"
            assert self.inflight.get(a.step) == a.fragment
            assert a.version == self.versions[a.fragment] + 1, "a version skipped or repeated"
            pulls = self.pulls[(a.step, a.attempt)]
            named = {(m["island"], m["gen"]) for p in pulls for m in p["members"]}
            expected = len(pulls[-1]["members"])
            quorum = expected if cfg.strict or cfg.quorum is None else max(1, min(cfg.quorum, expected))
            if not cfg.strict:
                # a member whose push of this attempt was quarantined is excused from its quorum (pushes.py),
                # for the rest of the attempt (a later try of it that is accepted merges, but is not waited for)
                excused = {k[0] for k in self.quarantined if k[2:4] == (a.step, a.attempt)}
                quorum = max(1, min(quorum, expected - len(excused)))
            assert len(a.members) >= quorum, f"merge with {len(a.members)} inputs, quorum {quorum}"
            assert len({m.island for m in a.members}) == len(a.members)
            for mi in a.members:
                assert (mi.island, mi.gen) in named, f"{mi} was not named by the round's pull"
                assert (mi.island, mi.gen, a.step, a.attempt, mi.try_) in self.accepted_ok
                assert self.versions[a.fragment] - mi.base_version <= cfg.max_base_lag
                assert mi.base_version <= self.versions[a.fragment]
                assert math.isfinite(mi.weight) and mi.weight >= 0
                key = (mi.island, mi.gen, a.step, a.attempt, mi.try_)
                assert key not in self.quarantined, f"merged a quarantined push {key}"
                norm, nf, claimed = self.figures[key]
                assert nf == 0 and (cfg.max_push_norm is None or norm <= cfg.max_push_norm)
                assert mi.c_tokens <= claimed
            assert math.isclose(sum(m.weight for m in a.members), 1.0, rel_tol=1e-9)
            claims = sorted(c for c in (self.figures[(m.island, m.gen, a.step, a.attempt, m.try_)][2]
                                        for m in a.members) if c > 0)
            if cfg.max_token_factor is not None and not cfg.equal_weights and claims:
                cap = cfg.max_token_factor * claims[(len(claims) - 1) // 2]
                assert all(m.c_tokens <= cap for m in a.members), "a claim above the token cap weighs in full"
            self.merging = a
            self.owed.append(MergeDone(a.step, a.fragment, a.version, 0.01, self.now))
        elif isinstance(a, Release):
            mg = self.merging
            if mg is not None and (a.step, a.fragment, a.attempt) == (mg.step, mg.fragment, mg.attempt):
                assert (a.island, a.gen, a.try_) not in {(m.island, m.gen, m.try_) for m in mg.members}, \
                    "released a push the outstanding merge still reads"
        elif isinstance(a, CommitV0):
            assert not self.versions, "version 0 twice"
            assert tuple(a.fragments) == tuple(range(cfg.fragments))
            self.owed.append(V0Done(self.now))
        elif isinstance(a, Tape):
            codec.validate("event", {"v": 1, "run": RUN, **a.event})
            ev = a.event
            if ev["kind"] == "disposition" and ev["disposition"] == "quarantined":
                self.quarantined.add((ev["island"], ev["gen"], ev["step"], ev["attempt"], ev["try"]))
        elif isinstance(a, SendError):
            fields = {"run": RUN, "code": a.code, "message": a.message, "fatal": a.fatal, "gen": a.gen}
            if a.field is not None:
                fields["field"] = a.field
            codec.make("error", **fields)
        elif isinstance(a, WriteMember):
            assert a.record["gen"] in GENS
        elif isinstance(a, WriteSession):
            codec.validate("session", a.session)
        elif type(a).__name__ == "PublishFinal":
            assert not self.final_published, "a second final cut"
            assert self.committed == cfg.total_steps and not self.inflight
            assert {int(k): v for k, v in a.versions.items()} == self.versions
            self.final_published = True
            self.owed.append(FinalPublished(self.now))
        elif type(a).__name__ in ("SendManifest", "Finalize"):
            assert {int(k): v for k, v in a.versions.items()} == self.versions
            assert a.final_step == self.committed == cfg.total_steps
        assert isinstance(a, Action)

    def merged(self, ev: MergeDone) -> None:
        pass


def _feed_answers(shell: Shell) -> None:
    """Book-keeping for the answers as the machine sees them: wrap `feed` so MergeDone/V0Done update the shell."""
    orig = shell.feed

    def feed(ev):
        if isinstance(ev, MergeDone):
            shell.versions[ev.fragment] = ev.version
            shell.committed = ev.step
            shell.inflight.pop(ev.step, None)
            shell.merging = None
        elif isinstance(ev, V0Done):
            shell.versions = {f: 0 for f in range(shell.cfg.fragments)}
        orig(ev)

    shell.feed = feed


def _boot(shell: Shell) -> None:
    """Islands a and b say hello, a (the INIT island) completes INIT, version 0 is committed."""
    for isl in ("a", "b"):
        shell.feed(Hello(isl, GENS[0], LAYOUT, FP, "auto", "auto", shell.now))
        shell.gens[isl] = GENS[0]
    for f in range(shell.cfg.fragments):
        shell.feed(InitComplete("a", GENS[0], f, shell.now))
    shell.answer()
    assert shell.m.phase == "running"


@FUZZ
@given(CONFIGS, st.booleans(), st.lists(EVENTS, max_size=80))
def test_random_event_sequences_never_raise_and_keep_the_invariants(cfg, boot, events):
    shell = Shell(cfg)
    _feed_answers(shell)
    if boot:   # most interesting sequences need a running machine; reaching it at random is rare
        _boot(shell)
    for e in events:
        shell.step(e)


@FUZZ
@given(CONFIGS, st.lists(EVENTS, max_size=40), st.randoms(use_true_random=False))
def test_a_run_with_noise_still_commits_every_step_once_in_order(cfg, noise, rnd):
    """Honest islands a and b drive the run to the end while random noise is interleaved: every step is merged
    exactly once, each fragment reaches total/P versions, and the final cut is published once."""
    shell = Shell(cfg)
    _feed_answers(shell)
    _boot(shell)
    noise = list(noise)
    for _ in range(400):
        if shell.final_published or (shell.m.phase in ("finalizing", "done") and not shell.inflight):
            break
        if noise and rnd.random() < 0.4:
            e = noise.pop(0)
            if e[0] == "hello" or (e[0] in ("hb", "init", "push", "ack") and e[1] in ("a", "b")):
                e = ("tick", 0.1)   # the honest islands keep one generation; noise comes from c and zz
            shell.step(e)
            continue
        for isl in ("a", "b"):
            shell.feed(Heartbeat(isl, GENS[0], 1, 0.01, shell.now))
            shell.step(("good_push", isl, 100))
        shell.answer()
        shell.now += 0.3
        shell.feed(Tick(shell.now))
    while shell.owed:
        shell.answer()
    assert shell.committed == cfg.total_steps, (shell.committed, shell.m.phase, shell.m.counters)
    per = {f: sum(1 for t in range(1, cfg.total_steps + 1) if cfg.fragment_of(t) == f) for f in range(cfg.fragments)}
    assert shell.versions == per
    assert shell.m.phase in ("finalizing", "done")


THREE = st.builds(
    lambda total, quorum, strict, max_norm, outlier, token_factor: SyncerConfig(
        run=RUN, islands=3, fragments=1, sync_every=1, total_steps=total, quorum=quorum, quorum_timeout_s=5.0,
        grace_ms=500.0, strict=strict, member_timeout_s=8.0, final_timeout_s=20.0, max_push_norm=max_norm,
        outlier_factor=outlier, max_token_factor=token_factor),
    st.integers(1, 4), st.one_of(st.none(), st.integers(1, 3)), st.booleans(), st.sampled_from((None, 20.0, 80.0)),
    st.sampled_from((1.5, 3.0, 10.0)), st.sampled_from((None, 1.0, 4.0)))
MEMBER = st.sampled_from(("a", "b", "c"))
GOOD = st.tuples(st.just("good_push"), MEMBER, st.integers(0, 10**6), st.integers(0, 2))
THREE_EVENTS = st.one_of(   # weighted towards pushes: the outlier rule needs three in one attempt
    GOOD, GOOD, GOOD,
    st.tuples(st.just("hb"), MEMBER, st.just(GENS[0]), SMALL, st.just(0.05)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    st.tuples(st.just("answer"),),
)


@FUZZ
@given(THREE, st.lists(THREE_EVENTS, min_size=30, max_size=120))
def test_three_members_with_wild_pushes_never_merge_a_quarantined_one(cfg, events):
    """Members a, b and c push any norm (NaN/Inf included), several tries each: the quarantine rules (the
    outlier one needs three pushes) act on real rounds, and the invariants hold (no quarantined push is
    merged or read after its release; quorum, weights and the token cap hold)."""
    shell = Shell(cfg)
    shell.wild = True
    _feed_answers(shell)
    for isl in ("a", "b", "c"):
        shell.feed(Hello(isl, GENS[0], LAYOUT, FP, "auto", "auto", shell.now))
        shell.gens[isl] = GENS[0]
    shell.feed(InitComplete("a", GENS[0], 0, shell.now))
    shell.answer()
    assert shell.m.phase == "running"
    for e in events:
        shell.step(e)
