"""bench/hostile.py — a real run under a flood of malformed and hostile messages (docs/design.md §14).

    .venv/bin/python bench/hostile.py                      # 1000 hostile messages, seed 0, embedded broker
    .venv/bin/python bench/hostile.py --quick              # ~250 messages, a shorter run (the suite's test)
    .venv/bin/python bench/hostile.py --count 5000 --seed 7 --nats nats://host:4222
    .venv/bin/python bench/hostile.py --poison all         # a compromised island (docs/design.md §9), default syncer flags

`--poison KIND[,KIND...]|all` runs no flood: it starts a clean 2-island run and, side by side on the same broker,
one run per KIND whose island a is compromised by learner/demo.py's test-only fault injector (YETO_DEMO_POISON:
plus50, nan, norm5x, tokens), the syncer on its default flags, and prints per kind
`poison kind=K clean=X poisoned=Y ratio=Y/X quarantined=.. clamped=.. ...` (X, Y: the final cut's held-out eval
loss), the clean run's `max_norm_ratio` (how near an honest push came to --push-norm-factor) and last
`poison ok=<true|false> ...`.

Starts the embedded broker (unless --nats), the real syncer (`python -m yeto.services.cli syncer`) and two real islands
(`python -m yeto.learner.demo`, islands a and b), and once version 0 is committed sends --count malformed or hostile
messages on every subject a client can reach, towards the syncer (CTL hello/heartbeat/ack, PUSH, INIT) and towards
the islands (CTL pull and to-island, BCAST, FINAL) and on STEPLOG, while the run goes on. They are built with the
`schemas` package (subjects, codec, chunk framing) and mutated by a seeded random mutator: bad JSON, schema
violations, forged island ids, generations and runs, truncated / oversize / overlapping chunks, bad chunk and push
digests, NaN/Inf values, wrong dtypes and totals, unknown fragments, stale and future steps and attempts, duplicate
Nats-Msg-Ids, INIT from an island that is not the INIT island, forged pulls, manifests, errors, shutdowns, broadcast
and final chunks.

Every message has a category. Deterministic categories say how many rejections they must cause: one record on the
syncer's tape (EVENTS: an `error` record, or a push disposition other than `accepted`, for a complete push try), or
one rejection per island that reads it (the islands' logs: "rejected CTL message on ..." / "rejected bcast_chunk
notice on ..."). Those are attributed to their category by the forged generation (its first 4 hex digits are the
category number) or the subject's island token (`h<NN>...`), and compared. Other categories (payload forgeries on
real broadcast chunk subjects, which the islands meet only if they read that chunk before the syncer overwrites it;
FINAL garbage; step-log garbage nobody consumes here; duplicates JetStream drops) are reported as observed.

Checked at the end: the run finishes (syncer and islands exit 0), every island's parameters equal the exported
final cut bitwise, the syncer's peak RSS during the flood, the longest gap between two commits (no stall longer than
one quorum timeout), and crashes = processes that exited non-zero or never finished, plus handler errors (an
exception the syncer's intake caught instead of a rejection). Last line:

    hostile sent=<n> rejected=<r> crashes=<c> final_equal=<true|false>

where `rejected` counts the observed rejections of the deterministic categories; `must=<m>` on the line before
is what they must add up to.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import torch  # noqa: E402

from yeto.schemas import codec, subjects as S  # noqa: E402
from yeto.schemas.chunks import digest, push_digest  # noqa: E402
from yeto.schemas.dtypes import pack  # noqa: E402
from yeto.schemas.layout import layout_fingerprint  # noqa: E402
from yeto.schemas.chunks import chunk_header, chunk_plan  # noqa: E402

ISLANDS = ("a", "b")
ISLAND_ENV = {"YETO_SESSION_TIMEOUT": "90", "YETO_FINAL_TIMEOUT": "90", "YETO_SHUTDOWN_TIMEOUT": "30",
              "YETO_INIT_V0_TIMEOUT": "90", "YETO_PUSH_TIMEOUT": "30", "YETO_PROGRESS": "0"}
# what pull_inconsistent makes the pull book refuse (other pull refusals belong to observed categories)
RX_CTL = re.compile(r"rejected CTL message on |rejected pull \d+/\d+: (fragment must be below|round \d+ targets fragment)")
# notice garbage goes to chunk subjects 50..99 (past every real chunk); payload forgeries to real ones
RX_NOTICE = re.compile(r"rejected bcast_chunk notice on \S+\.bcast\.\d+\.(\d+)")
RX_CUT = re.compile(r"rejected (bcast_chunk|final_chunk) \d+/\d+|rejected bcast notice")


# ---- categories --------------------------------------------------------------------------------------

@dataclass
class Cat:
    name: str
    target: str            # "syncer", "islands", "observed"
    weight: int            # relative share of the messages
    per_unit: int = 0      # syncer: tape records one unit must cause (islands: Unit.islands says)
    record: str = "error"  # the tape record kind that counts ("disposition" for a complete push try)
    sent: int = 0
    units: int = 0
    observed: int = 0
    extra: int = 0         # other records of the category (e.g. one error per bad chunk of a push try)
    deduped: int = 0
    island_must: int = 0

    @property
    def must(self) -> int:
        return self.units * self.per_unit


CATS = [
    # towards the syncer: one tape record per unit
    Cat("ctl_bad_json", "syncer", 6, 1), Cat("ctl_schema", "syncer", 8, 1), Cat("ctl_forged_island", "syncer", 5, 1),
    Cat("ctl_wrong_run", "syncer", 3, 1), Cat("ctl_deep_json", "syncer", 1, 1), Cat("hello_bad_fingerprint", "syncer", 2, 1),
    Cat("hello_other_layout", "syncer", 2, 1), Cat("hello_dtype", "syncer", 2, 1), Cat("ack_forged", "syncer", 3, 1),
    Cat("push_bad_header", "syncer", 5, 1), Cat("push_schema", "syncer", 6, 1), Cat("push_subject_mismatch", "syncer", 4, 1),
    Cat("push_unknown_fragment", "syncer", 3, 1), Cat("push_bad_digest", "syncer", 4, 1, "disposition"),
    Cat("push_truncated", "syncer", 4, 1, "disposition"), Cat("push_oversize", "syncer", 3, 1, "disposition"), Cat("push_overlap", "syncer", 3, 1, "disposition"),
    Cat("push_nan_inf", "syncer", 4, 1, "disposition"), Cat("push_wrong_dtype", "syncer", 2, 1, "disposition"), Cat("push_bad_push_digest", "syncer", 3, 1, "disposition"),
    Cat("push_stale_step", "syncer", 3, 1, "disposition"), Cat("push_future_step", "syncer", 3, 1, "disposition"),
    # pushes for the round in flight: observed (see Hostile.push_try)
    Cat("push_stale_attempt", "observed", 2, 0, "disposition"), Cat("push_future_attempt", "observed", 2, 0, "disposition"),
    Cat("push_forged_gen", "observed", 3, 0, "disposition"), Cat("push_future_base", "observed", 2, 0, "disposition"),
    Cat("init_malformed", "syncer", 3, 1), Cat("init_not_init_island", "syncer", 3, 1), Cat("init_bad_digest", "syncer", 2, 1),
    # towards the islands: one rejection per island
    Cat("pull_bad_json", "islands", 3, 1), Cat("pull_deep_json", "islands", 1, 1), Cat("pull_schema", "islands", 4, 1), Cat("pull_wrong_run", "islands", 2, 1),
    Cat("ctl_wrong_subject", "islands", 2, 1), Cat("to_island_garbage", "islands", 3, 1),
    Cat("bcast_notice_garbage", "islands", 5, 1), Cat("pull_inconsistent", "islands", 2, 1),
    # observed only (no fixed count: see the module doc)
    Cat("pull_forged_stale", "observed", 3),
    Cat("to_island_forged_gen", "observed", 3),
    Cat("bcast_payload_forgery", "observed", 5), Cat("final_garbage", "observed", 2), Cat("steplog_garbage", "observed", 2),
    Cat("duplicate_msg_id", "observed", 3), Cat("heartbeat_forged_gen", "observed", 3),
    Cat("init_unknown_gen", "observed", 0),
    # opt-in (--impersonate): forged pulls for rounds not committed yet, and fatal errors / manifests / shutdowns
    # naming the islands' real generations. Nothing on the wire tells them from the syncer's own until
    # server permissions (docs/design.md §13); they stall or stop the run (see bench/README.md).
    Cat("pull_forged_future", "observed", 0), Cat("to_island_real_gen", "observed", 0),
]
CAT_NO = {c.name: i + 1 for i, c in enumerate(CATS)}


def hgen(cat: str, rnd: random.Random) -> str:
    """A forged generation that names its category (first 4 hex digits)."""
    return f"{CAT_NO[cat]:04x}" + "".join(rnd.choice("0123456789abcdef") for _ in range(12))


def hisland(cat: str, rnd: random.Random) -> str:
    return f"h{CAT_NO[cat]:02d}x{rnd.randrange(1000)}"


@dataclass
class Msg:
    subject: str
    data: bytes
    headers: dict | None = None
    msg_id: str | None = None


@dataclass
class Unit:
    cat: str
    msgs: list[Msg]
    islands: int = 0        # islands-target: how many islands must reject it


# ---- the mutator ---------------------------------------------------------------------------------------

class Hostile:
    def __init__(self, run: str, session: dict, gens: dict[str, str], seed: int):
        self.run, self.session, self.gens = run, session, gens
        self.rnd = random.Random(seed)
        self.n = 0
        self.init_island = session["init_island"]
        self.push_dtype, self.bulk_dtype, self.cb = session["push_dtype"], session["bulk_dtype"], session["chunk_bytes"]
        self.frags = {f["id"]: f["numel"] for f in session["fragments"]}
        self.layout = [{"name": t["name"], "shape": t["shape"], "dtype": "float32"}
                       for f in session["fragments"] for t in f["tensors"]]
        self.committed = 0
        self.attempts: dict[int, int] = {}
        self.versions_hint: dict[int, int] = {}

    def mid(self) -> str:
        self.n += 1
        return f"hostile.{self.n}.{self.rnd.getrandbits(32):x}"

    # -- near-valid messages and their mutation --------------------------------------------------
    def invalid(self, kind: str, msg: dict) -> dict:
        """`msg` with a random field broken (re-drawn until the codec refuses it)."""
        for _ in range(50):
            m = json.loads(json.dumps(msg))
            key = self.rnd.choice(sorted(m))
            op = self.rnd.randrange(6)
            if op == 0:
                del m[key]
            elif op == 1:
                m[key] = self.rnd.choice([None, -1, 2**60, "", "x" * 300, [], {}, 1.5, True, "a.b", "*"])
            elif op == 2:
                m["unexpected_" + str(self.rnd.randrange(100))] = 1
            elif op == 3 and isinstance(m.get(key), int) and not isinstance(m.get(key), bool):
                m[key] = float(m[key]) + 0.5
            elif op == 4:
                m[key] = {"nested": [m.get(key)]}
            else:
                m[key] = str(m.get(key)) + "\u0000"
            try:
                codec.validate(kind, m)
            except Exception:
                return m
        m = dict(msg)
        m["v"] = 99
        return m

    def bad_json(self) -> bytes:
        return self.rnd.choice([b"", b"{", b"{not json", b"\xff\xfe\x00", b"null", b"[]", b"42", b'"hello"',
                                b'{"type": "hello"', b"[" * 1010 + b"]" * 1010, os.urandom(self.rnd.randrange(1, 64))])

    def deep_json(self, typ: str) -> bytes:
        """A typed message nesting 990-1020 levels deep: orjson parses up to 1024, and a recursive walk of it
        raised RecursionError in the codec before (an island's CTL pump died of it)."""
        n = self.rnd.randrange(990, 1020)
        return b'{"type":"%s","v":1,"x":' % typ.encode() + b'{"a":' * n + b"1" + b"}" * (n + 1)

    def hello(self, island: str, gen: str, **kw) -> dict:
        lay = kw.pop("layout", self.layout)
        return codec.make("hello", run=self.run, island=island, gen=gen, layout=lay,
                          layout_fingerprint=kw.pop("layout_fingerprint", layout_fingerprint(lay)),
                          push_dtype=kw.pop("push_dtype", "auto"), bulk_dtype=kw.pop("bulk_dtype", "auto"),
                          world={"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1}, host="hostile", **kw)

    def heartbeat(self, island: str, gen: str, run: str | None = None) -> dict:
        return codec.make("heartbeat", run=run or self.run, island=island, gen=gen, local_step=self.rnd.randrange(1000),
                          step_time_s=0.05)

    def ack(self, island: str, gen: str, run: str | None = None) -> dict:
        return codec.make("ack", run=run or self.run, island=island, gen=gen, final_step=self.rnd.randrange(1, 10**6))

    def push_try(self, cat: str, *, island: str | None = None, gen: str | None = None, frag: int | None = None,
                 step: int | None = None, attempt: int | None = None, base: int | None = None,
                 values: torch.Tensor | None = None, spoil=None, spoil_header=None, subject_island: str | None = None,
                 total_delta: int = 0, dtype: str | None = None) -> list[Msg]:
        """Every chunk of one push try (so the syncer's ledger completes it and tapes one disposition)."""
        rnd = self.rnd
        island = island or rnd.choice(ISLANDS)
        gen = gen or hgen(cat, rnd)
        # Default: a round that will not be in flight for a while. The syncer forgets a round's tries at
        # its commit (PushLedger.pop_round), so a try straddling that commit would never complete and
        # never be taped: a count that depends on timing (reported as a finding).
        step = step if step is not None else self.committed + 3 + rnd.randrange(3)
        frag = frag if frag is not None else (step - 1) % len(self.frags)
        attempt = attempt if attempt is not None else self.attempts.get(step, 1)
        dtype = dtype or self.push_dtype
        numel = self.frags.get(frag, 16)
        vals = values if values is not None else torch.randn(numel) * 0.01
        spans = chunk_plan(numel, dtype, self.cb)
        total = sum(s.nbytes for s in spans) + total_delta
        try_ = rnd.randrange(8)
        digests, out = [], []
        for s in spans:
            buf = bytearray(pack(vals[s.elem_offset: s.elem_offset + s.elem_count].contiguous(), dtype).numpy().tobytes())
            # A normal chunk's header, as an island builds it; the categories spoil it below.
            meta = {"v": 1, "run": self.run, "island": island, "gen": gen, "fragment": frag, "step": step,
                    "attempt": attempt, "try": try_, "base_version": base if base is not None else 0,
                    "local_step": rnd.randrange(1, 10**5), "c_steps": 4, "c_tokens": 256, "dtype": dtype,
                    **chunk_header(spans, s.index, buf)}
            meta["total"] = total
            if spoil is not None:
                buf, meta = spoil(s.index, len(spans), buf, meta)
            digests.append(meta["digest"])
            if s.index == len(spans) - 1:
                meta["push_digest"] = push_digest(digests)
            if spoil_header is not None:
                meta = spoil_header(s.index, len(spans), meta)
            hdr = orjson.dumps(meta).decode()
            out.append(Msg(S.push(self.run, subject_island or island, frag), bytes(buf), {codec.CHUNK_HEADER: hdr},
                           S.push_msg_id(island, gen, frag, step, attempt, try_, s.index)))
        return out

    def bcast_meta(self, frag: int, chunk: int, version: int, *, version_digest: str = "ab" * 32,
                   every: bool = False, **kw) -> dict:
        spans = chunk_plan(self.frags[frag], self.bulk_dtype, self.cb)
        # The framing of the nearest real chunk (`chunk` may lie past the plan); the caller sets the digest.
        meta = {"v": 1, "run": self.run, "fragment": frag, "version": version, "dtype": self.bulk_dtype,
                **chunk_header(spans, min(chunk, len(spans) - 1), b""), "chunk": chunk, "digest": "0" * 16}
        # BCAST carries the version digest on the last chunk only (the seal), FINAL (`every`) on every
        # chunk: a forgery that broke that rule would be refused for it, not for what its category tests.
        if every or chunk >= len(spans) - 1:
            meta["version_digest"] = version_digest
        meta.update(kw)
        return meta

    # -- one unit of a category ---------------------------------------------------------------------
    def unit(self, cat: str) -> Unit:
        r, run, rnd = self, self.run, self.rnd
        gen = hgen(cat, rnd)
        isl = hisland(cat, rnd)
        real = rnd.choice(ISLANDS)
        step = self.committed + 1
        if cat == "ctl_bad_json":
            subj = rnd.choice([S.hello, S.heartbeat, S.ack])(run, isl)
            return Unit(cat, [Msg(subj, r.bad_json())])
        if cat == "ctl_deep_json":
            subj, typ = rnd.choice([(S.hello, "hello"), (S.heartbeat, "heartbeat"), (S.ack, "ack")])
            return Unit(cat, [Msg(subj(run, isl), r.deep_json(typ))])
        if cat == "ctl_schema":
            kind = rnd.choice(["hello", "heartbeat", "ack"])
            msg = {"hello": lambda: r.hello(isl, gen), "heartbeat": lambda: r.heartbeat(isl, gen),
                   "ack": lambda: r.ack(isl, gen)}[kind]()
            subj = {"hello": S.hello, "heartbeat": S.heartbeat, "ack": S.ack}[kind](run, isl)
            return Unit(cat, [Msg(subj, orjson.dumps(r.invalid(kind, msg)))])
        if cat == "ctl_forged_island":   # the message claims a real island, the subject is another's
            kind = rnd.choice(["hello", "heartbeat", "ack"])
            msg = {"hello": lambda: r.hello(real, gen), "heartbeat": lambda: r.heartbeat(real, gen),
                   "ack": lambda: r.ack(real, gen)}[kind]()
            subj = {"hello": S.hello, "heartbeat": S.heartbeat, "ack": S.ack}[kind](run, isl)
            return Unit(cat, [Msg(subj, codec.encode(kind, msg))])
        if cat == "ctl_wrong_run":
            kind = rnd.choice(["heartbeat", "ack"])
            msg = (r.heartbeat if kind == "heartbeat" else r.ack)(isl, gen, run="other-run")
            return Unit(cat, [Msg((S.heartbeat if kind == "heartbeat" else S.ack)(run, isl), codec.encode(kind, msg))])
        if cat == "hello_bad_fingerprint":
            return Unit(cat, [Msg(S.hello(run, isl), codec.encode("hello", r.hello(isl, gen, layout_fingerprint="c" * 64)))])
        if cat == "hello_other_layout":
            lay = [dict(t) for t in self.layout]
            lay[rnd.randrange(len(lay))]["shape"] = [rnd.randrange(2, 9), 3]
            return Unit(cat, [Msg(S.hello(run, isl), codec.encode("hello", r.hello(isl, gen, layout=lay)))])
        if cat == "hello_dtype":
            other = "bf16" if self.push_dtype != "bf16" else "f32"
            return Unit(cat, [Msg(S.hello(run, isl), codec.encode("hello", r.hello(isl, gen, push_dtype=other)))])
        if cat == "ack_forged":
            return Unit(cat, [Msg(S.ack(run, isl), codec.encode("ack", r.ack(isl, gen)))])
        if cat == "push_bad_header":
            hdr = rnd.choice([None, "{oops", "", "[]", "null", "{\"chunk\": 1", "\u00ff" * 10])
            return Unit(cat, [Msg(S.push(run, isl, rnd.randrange(2)), os.urandom(64),
                                  None if hdr is None else {codec.CHUNK_HEADER: hdr})])
        if cat == "push_schema":
            meta = json.loads(r.push_try(cat, island=isl, gen=gen)[0].headers[codec.CHUNK_HEADER])
            bad = r.invalid("push_chunk", meta)
            return Unit(cat, [Msg(S.push(run, isl, meta["fragment"]), os.urandom(32), {codec.CHUNK_HEADER: orjson.dumps(bad).decode()})])
        if cat == "push_subject_mismatch":   # header claims a real island (or another fragment), subject is ours
            msgs = r.push_try(cat, island=real, gen=gen, subject_island=isl)
            return Unit(cat, msgs[:1])
        if cat == "push_unknown_fragment":
            f = rnd.choice([len(self.frags), len(self.frags) + 3, 999])
            meta = json.loads(r.push_try(cat, island=isl, gen=gen)[0].headers[codec.CHUNK_HEADER])
            meta.update(fragment=f)
            return Unit(cat, [Msg(S.push(run, isl, f), os.urandom(meta["nbytes"]), {codec.CHUNK_HEADER: orjson.dumps(meta).decode()})])
        if cat == "push_bad_digest":
            k = [0]

            def spoil(i, n, buf, meta):
                if i == k[0]:
                    buf[rnd.randrange(len(buf))] ^= 0x40
                return buf, meta
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen, spoil=spoil))
        if cat == "push_truncated":
            def spoil(i, n, buf, meta):
                if i == n - 1:
                    buf = buf[: max(1, len(buf) - 4 * rnd.randrange(1, 4))]
                    meta["digest"] = digest(bytes(buf))
                return buf, meta
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen, spoil=spoil))
        if cat == "push_oversize":
            def spoil(i, n, buf, meta):
                if i == 0:
                    buf = buf + bytes(rnd.randrange(4, 4096))
                    meta["digest"] = digest(bytes(buf))
                return buf, meta
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen, spoil=spoil))
        if cat == "push_overlap":   # a chunk claims bytes the previous chunk holds
            def spoil(i, n, buf, meta):
                if i == n - 1 and n > 1:
                    meta["offset"] = max(0, meta["offset"] - 4 * rnd.randrange(1, 64))
                    meta["nbytes"] = meta["total"] - meta["offset"]
                    buf = bytearray(os.urandom(meta["nbytes"]))
                    meta["digest"] = digest(bytes(buf))
                return buf, meta
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen, spoil=spoil))
        if cat == "push_nan_inf":
            v = torch.randn(max(self.frags.values())) * 0.01
            for _ in range(rnd.randrange(1, 5)):
                v[rnd.randrange(v.numel())] = rnd.choice([float("nan"), float("inf"), float("-inf")])
            f = (step - 1) % len(self.frags)
            idx = torch.nonzero(~torch.isfinite(v[: self.frags[f]]))
            if idx.numel() == 0:
                v[0] = float("nan")
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen, values=v[: self.frags[f]]))
        if cat == "push_wrong_dtype":
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen,
                                        dtype="bf16" if self.push_dtype != "bf16" else "f32"))
        if cat == "push_bad_push_digest":
            def sh(i, n, meta):
                if i == n - 1:
                    meta["push_digest"] = "%064x" % rnd.getrandbits(256)
                return meta
            return Unit(cat, r.push_try(cat, island=rnd.choice([isl, real]), gen=gen, spoil_header=sh))
        if cat == "push_stale_step":
            if self.committed < 2:
                return self.unit("push_future_step")
            return Unit(cat, r.push_try(cat, island=real, gen=gen, step=rnd.randrange(max(1, self.committed - 3), self.committed)))
        if cat == "push_future_step":
            return Unit(cat, r.push_try(cat, island=real, gen=gen, step=self.committed + rnd.randrange(3, 10**6)))
        # the round in flight (observed: a try that straddles the round's commit is never completed)
        if cat == "push_stale_attempt":
            return Unit(cat, r.push_try(cat, island=real, gen=gen, step=step,
                                        attempt=max(1, self.attempts.get(step, 1) - 1)))
        if cat == "push_future_attempt":
            return Unit(cat, r.push_try(cat, island=real, gen=gen, step=step,
                                        attempt=self.attempts.get(step, 1) + rnd.randrange(1, 100)))
        if cat == "push_forged_gen":   # a real island's id with a generation it never had
            return Unit(cat, r.push_try(cat, island=real, gen=gen, step=step))
        if cat == "push_future_base":
            return Unit(cat, r.push_try(cat, island=real, gen=gen, step=step, base=10**6 + rnd.randrange(100)))
        if cat == "init_malformed":
            hdr = rnd.choice([None, "{", "[]", orjson.dumps(r.invalid("init_chunk", self.init_meta(isl, gen, 0, 0, b"x"))).decode()])
            return Unit(cat, [Msg(S.init(run, rnd.randrange(len(self.frags))), os.urandom(32),
                                  None if hdr is None else {codec.CHUNK_HEADER: hdr})])
        if cat == "init_not_init_island":
            f = rnd.randrange(len(self.frags))
            buf = os.urandom(16)
            meta = self.init_meta(rnd.choice([isl] + [i for i in ISLANDS if i != self.init_island]), gen, f, 0, buf)
            return Unit(cat, [Msg(S.init(run, f), buf, {codec.CHUNK_HEADER: orjson.dumps(meta).decode()})])
        if cat == "init_bad_digest":
            f = rnd.randrange(len(self.frags))
            span = chunk_plan(self.frags[f], self.bulk_dtype, self.cb)[0]
            buf = pack(torch.randn(span.elem_count), self.bulk_dtype).numpy().tobytes()
            meta = self.init_meta(self.init_island, gen, f, 0, buf, span=span)
            meta["digest"] = "%016x" % rnd.getrandbits(64)
            return Unit(cat, [Msg(S.init(run, f), buf, {codec.CHUNK_HEADER: orjson.dumps(meta).decode()})])
        if cat == "init_unknown_gen":
            f = rnd.randrange(len(self.frags))
            span = chunk_plan(self.frags[f], self.bulk_dtype, self.cb)[0]
            buf = pack(torch.randn(span.elem_count), self.bulk_dtype).numpy().tobytes()
            meta = self.init_meta(self.init_island, gen, f, 0, buf, span=span)
            return Unit(cat, [Msg(S.init(run, f), buf, {codec.CHUNK_HEADER: orjson.dumps(meta).decode()})])
        # ---- towards the islands
        if cat == "pull_bad_json":
            return Unit(cat, [Msg(S.pull(run), r.bad_json())], islands=2)
        if cat == "pull_deep_json":
            return Unit(cat, [Msg(S.pull(run), r.deep_json("pull"))], islands=2)
        if cat == "pull_schema":
            return Unit(cat, [Msg(S.pull(run), orjson.dumps(r.invalid("pull", self.pull_msg(gen))))], islands=2)
        if cat == "pull_wrong_run":
            m = self.pull_msg(gen)
            m["run"] = "other-run"
            return Unit(cat, [Msg(S.pull(run), codec.encode("pull", m))], islands=2)
        if cat == "ctl_wrong_subject":   # a manifest or shutdown on the pull subject
            kind = rnd.choice(["manifest", "shutdown", "error"])
            return Unit(cat, [Msg(S.pull(run), codec.encode(kind, self.to_island_msg(kind, gen)))], islands=2)
        if cat == "to_island_garbage":
            target = rnd.choice(ISLANDS)
            kind = rnd.choice(["manifest", "shutdown", "error"])
            data = rnd.choice([r.bad_json(), orjson.dumps(r.invalid(kind, self.to_island_msg(kind, gen)))])
            return Unit(cat, [Msg(S.to_island(run, target), data)], islands=1)
        if cat == "bcast_notice_garbage":   # on chunk subjects past the real ones: never replaces real data
            f = rnd.randrange(len(self.frags))
            k = 50 + rnd.randrange(50)
            how = rnd.randrange(4)
            if how == 0:
                hdrs = None
            elif how == 1:
                hdrs = {codec.CHUNK_HEADER: rnd.choice(["{", "[]", "null"])}
            elif how == 2:
                hdrs = {codec.CHUNK_HEADER: orjson.dumps(self.bcast_meta(f, k, 10**6)).decode()}  # chunk >= chunks
            else:
                hdrs = {codec.CHUNK_HEADER: orjson.dumps(dict(self.bcast_meta(f, 0, 10**6), run="other-run")).decode()}
            return Unit(cat, [Msg(S.bcast(run, f, k), os.urandom(16), hdrs)], islands=2)
        if cat == "pull_forged_stale":   # a round already committed: the islands drop it
            if self.committed < 1:
                return self.unit("pull_bad_json")
            m = self.pull_msg(gen, step=rnd.randrange(1, self.committed + 1))
            m["base_version"] = (m["step"] - 1) // len(self.frags)   # what that round's launch carried
            return Unit(cat, [Msg(S.pull(run), codec.encode("pull", m))])
        if cat == "pull_inconsistent":   # a fragment the round does not target, or one the session lacks
            m = self.pull_msg(gen)
            m["fragment"] = rnd.choice([(m["fragment"] + 1) % len(self.frags) if len(self.frags) > 1 else 7, len(self.frags) + 2])
            m["members"] = [{"island": i, "gen": self.gens[i]} for i in ISLANDS]
            return Unit(cat, [Msg(S.pull(run), codec.encode("pull", m))], islands=2)
        if cat == "pull_forged_future":
            m = self.pull_msg(gen, step=self.committed + rnd.randrange(1, 5))
            m["base_version"] = self.versions_hint.get(m["fragment"], 0) + rnd.randrange(0, 50)
            m["attempt"] = rnd.randrange(1, 50)
            return Unit(cat, [Msg(S.pull(run), codec.encode("pull", m))])
        if cat == "to_island_real_gen":
            target = rnd.choice(ISLANDS)
            kind = rnd.choice(["manifest", "shutdown", "error"])
            return Unit(cat, [Msg(S.to_island(run, target), codec.encode(kind, self.to_island_msg(kind, self.gens[target])))])
        if cat == "to_island_forged_gen":   # a fatal error, a manifest, a shutdown for a generation that is not the island's
            kind = rnd.choice(["manifest", "shutdown", "error"])
            return Unit(cat, [Msg(S.to_island(run, rnd.choice(ISLANDS)), codec.encode(kind, self.to_island_msg(kind, gen)))])
        if cat == "bcast_payload_forgery":
            return Unit(cat, [self.bcast_forgery()])
        if cat == "final_garbage":
            f = rnd.randrange(len(self.frags))
            meta = dict(self.bcast_meta(f, 0, rnd.randrange(1, 10**6), every=True), dtype="f32",
                        final_step=rnd.randrange(1, 10**6))
            return Unit(cat, [Msg(S.final(run, f, 60 + rnd.randrange(40)), os.urandom(32),
                                  {codec.CHUNK_HEADER: orjson.dumps(meta).decode()})])
        if cat == "steplog_garbage":
            return Unit(cat, [Msg(S.steplog(run, rnd.choice(ISLANDS)), r.bad_json())])
        if cat == "heartbeat_forged_gen":
            return Unit(cat, [Msg(S.heartbeat(run, real), codec.encode("heartbeat", r.heartbeat(real, gen)))])
        if cat == "duplicate_msg_id":   # the same hostile hello twice under one Nats-Msg-Id: JetStream keeps one
            data = codec.encode("hello", r.hello(isl, gen, layout_fingerprint="c" * 64))
            mid = self.mid()
            return Unit(cat, [Msg(S.hello(run, isl), data, msg_id=mid), Msg(S.hello(run, isl), data, msg_id=mid)])
        raise ValueError(cat)

    def init_meta(self, island, gen, f, k, buf, span=None) -> dict:
        spans = chunk_plan(self.frags[f], self.bulk_dtype, self.cb)
        s = span or spans[k]
        # The header an INIT island builds, except `nbytes`, which says what `buf` holds (forged sizes).
        return {"v": 1, "run": self.run, "island": island, "gen": gen, "fragment": f, "dtype": self.bulk_dtype,
                **chunk_header(spans, s.index, buf), "nbytes": len(buf)}

    def pull_msg(self, gen: str, step: int | None = None) -> dict:
        step = step if step is not None else self.committed + self.rnd.randrange(1, 5)
        frag = (step - 1) % len(self.frags)
        # a base below the fragment's current version: never raises what the islands believe is committed
        base = max(0, self.versions_hint.get(frag, 0) - 1 - self.rnd.randrange(0, 3))
        return codec.make("pull", run=self.run, fragment=frag, step=step, attempt=self.rnd.randrange(1, 5), seq=0,
                          base_version=base, members=[{"island": i, "gen": gen} for i in ISLANDS])

    def to_island_msg(self, kind: str, gen: str) -> dict:
        if kind == "manifest":
            return codec.make("manifest", run=self.run, final_step=self.committed + 1,
                              versions={str(f): 10**5 for f in self.frags},
                              version_digests={str(f): "cd" * 32 for f in self.frags}, gen=gen)
        if kind == "shutdown":
            return codec.make("shutdown", run=self.run, reason="hostile", gen=gen)
        return codec.make("error", run=self.run, code="hostile", message="forged fatal error", fatal=True, gen=gen)

    def bcast_forgery(self) -> Msg:
        """A chunk on a real BCAST chunk subject: it replaces the real one in the stream (one message per
        subject; closed by server permissions, docs/design.md §13). The islands must refuse it and recover."""
        rnd = self.rnd
        f = rnd.randrange(len(self.frags))
        spans = chunk_plan(self.frags[f], self.bulk_dtype, self.cb)
        s = rnd.choice(spans)
        version = rnd.choice([self.versions_hint.get(f, 0), self.versions_hint.get(f, 0) + 1,
                              self.versions_hint.get(f, 0) + rnd.randrange(2, 10**4)])
        buf = bytearray(pack(torch.randn(s.elem_count), self.bulk_dtype).numpy().tobytes())
        meta = self.bcast_meta(f, s.index, version, digest=digest(bytes(buf)), version_digest="%064x" % rnd.getrandbits(256))
        how = rnd.randrange(5)
        if how == 0:                           # bad digest
            buf[0] ^= 0x10
        elif how == 1 and len(buf) > 4:        # truncated payload
            buf = buf[:-4]
            meta["digest"] = digest(bytes(buf))
        elif how == 2:                         # NaN / Inf values (right digest)
            v = torch.randn(s.elem_count)
            v[0] = float("nan")
            v[-1] = float("inf")
            buf = bytearray(pack(v, self.bulk_dtype).numpy().tobytes())
            meta["digest"] = digest(bytes(buf))
        elif how == 3:                         # wrong shape: total and nbytes of another fragment size
            meta["total"] = meta["total"] + 4 * rnd.randrange(1, 100)
        # how == 4: a consistent chunk of a version whose version digest can never match (on the seal; on
        # another chunk: bytes the seal's digest can never match once they are read into a version)
        return Msg(S.bcast(self.run, f, s.index), bytes(buf), {codec.CHUNK_HEADER: orjson.dumps(meta).decode()})



# ---- processes ----------------------------------------------------------------------------------------

def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Procs:
    def __init__(self, url: str, run: str, work: Path, args, island_env: dict[str, dict] | None = None):
        self.url, self.run, self.work, self.args = url, run, work, args
        self.island_env = island_env or {}   # island -> extra environment (--poison: the fault injector)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self) -> None:
        a = self.args
        env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
        env.update(PYTHONUNBUFFERED="1", YETO_NATS=self.url, YETO_RUN=self.run)
        syncer = [sys.executable, "-m", "yeto.services.cli", "syncer", "--nats", self.url, "--run", self.run,
                  "--islands", "2", "--fragments", "2", "--sync-every", "8", "--total-steps", str(a.rounds),
                  "--chunk-bytes", str(a.chunk_bytes), "--checkpoint-dir", str(self.work / "syncer"), "--small-limits",
                  "--quorum-timeout", str(a.quorum_timeout), "--member-timeout", "20", "--final-timeout", "90",
                  "--status-every", "0.5"]
        self._spawn("syncer", syncer, env)
        for isl in ISLANDS:
            cmd = [sys.executable, "-m", "yeto.learner.demo", "--run", self.run, "--island", isl,
                   "--step-delay", str(a.step_delay), "--out", str(self.work / f"island-{isl}.safetensors")]
            self._spawn(isl, cmd, dict(env, YETO_ISLAND=isl, **ISLAND_ENV,
                                       YETO_DILOCO_STEP_LOG=str(self.work / f"steplog-{isl}.jsonl"),
                                       **self.island_env.get(isl, {})))

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        self.logs[name] = self.work / f"{name}.log"
        f = open(self.logs[name], "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                            start_new_session=True)

    def log(self, name: str) -> str:
        p = self.logs.get(name)
        return p.read_text(errors="replace") if p and p.exists() else ""

    def stop(self) -> None:
        import signal

        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if p.poll() is None:
                p.wait()


# ---- the attack --------------------------------------------------------------------------------------

async def kv_json(js, run: str, key: str) -> dict | None:
    from nats.js.errors import KeyNotFoundError, NotFoundError

    try:
        kv = await js.key_value(S.kv_bucket(run, "state"))
        e = await kv.get(key)
    except (KeyNotFoundError, NotFoundError, Exception):
        return None
    return orjson.loads(e.value) if e is not None and e.value else None


async def tape(js, run: str) -> list[dict]:
    info = await js.stream_info(S.stream(run, "EVENTS"))
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(S.stream(run, "EVENTS"), seq=seq)
        except Exception:
            continue
        out.append(orjson.loads(m.data))
    return out


def attribute(rec: dict, real_gens: set[str]) -> str | None:
    """The category a tape rejection record belongs to (None: not caused by a hostile message)."""
    gen = rec.get("gen")
    if gen in real_gens:
        return None
    if isinstance(gen, str) and len(gen) == 16:
        n = int(gen[:4], 16)
        if 1 <= n <= len(CATS):
            return CATS[n - 1].name
    isl = rec.get("island") or ""
    m = re.match(r"^h(\d\d)x", isl)
    if m and 1 <= int(m.group(1)) <= len(CATS):
        return CATS[int(m.group(1)) - 1].name
    if gen is None and not isl and str(rec.get("reason", "")).startswith("INIT chunk"):
        return "init_malformed"
    return None


def is_rejection(rec: dict) -> bool:
    return rec.get("kind") == "error" or (rec.get("kind") == "disposition" and rec.get("disposition") != "accepted")


async def attack(url: str, run: str, procs: Procs, args, report: dict) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream(timeout=20)
    try:
        t0 = time.monotonic()
        while True:   # version 0 committed and both islands admitted
            commit = await kv_json(js, run, "commit")
            st = await kv_json(js, run, "syncer")
            if commit is not None and st is not None and st.get("phase") == "running" and set(st.get("live", [])) >= set(ISLANDS):
                break
            if time.monotonic() - t0 > args.timeout / 2:
                raise RuntimeError("the run never got to version 0")
            if any(p.poll() is not None for p in procs.procs.values()):
                raise RuntimeError("a process exited before version 0")
            await asyncio.sleep(0.2)
        session = codec.decode("session", (await (await js.key_value(S.kv_bucket(run, "state"))).get("session")).value)
        members = await js.key_value(S.kv_bucket(run, "members"))
        gens = {i: orjson.loads((await members.get(i)).value)["gen"] for i in ISLANDS}
        report["real_gens"] = gens
        h = Hostile(run, session, gens, args.seed)
        rnd = h.rnd
        weights = [c.weight for c in CATS]
        by_name = {c.name: c for c in CATS}
        if args.impersonate:
            weights = [c.weight or (4 if c.name in ("pull_forged_future", "to_island_real_gen") else 0) for c in CATS]
        plan = [c.name for c in rnd.choices(CATS, weights=weights, k=args.count * 2)]
        plan[0:0] = ["pull_deep_json", "ctl_deep_json"]   # every run carries the codec's regression once
        skip = set(filter(None, (args.skip or "").split(",")))
        plan = [c for c in plan if c not in skip]   # the same draws otherwise: for bisecting a failure
        pid = procs.procs["syncer"].pid
        rss = report["rss_kib"] = [_rss_kib(pid) or 0]
        sent = 0
        t_start = time.monotonic()
        batch = max(5, args.count // 40)
        journal = open(procs.work / "sent.jsonl", "ab")   # every hostile message, for post-mortems
        i = 0
        while sent < args.count:
            st = await kv_json(js, run, "syncer") or {}
            h.committed = int(st.get("committed_step", h.committed))
            h.versions_hint = {int(k): v for k, v in (st.get("versions") or {}).items()}
            for r in st.get("rounds_in_flight", []):
                h.attempts[r["step"]] = r["attempt"]
            if st.get("phase") not in (None, "running") or h.committed >= args.rounds - 3:
                report["stopped_early"] = f"run at step {h.committed}, phase {st.get('phase')}"
                break
            rss.append(_rss_kib(pid) or 0)
            for _ in range(batch):
                if sent >= args.count or i >= len(plan):
                    break
                u = h.unit(plan[i])
                i += 1
                cat = by_name[u.cat]   # a unit may fall back to another category (e.g. nothing committed yet)
                for m in u.msgs:
                    hdrs = dict(m.headers or {})
                    hdrs[S.MSG_ID] = m.msg_id or h.mid()
                    journal.write(orjson.dumps({"t": time.time(), "cat": cat.name, "subject": m.subject,
                                                "header": (m.headers or {}).get(codec.CHUNK_HEADER), "bytes": len(m.data),
                                                "data": m.data[:200].decode("utf-8", "replace") if not m.headers else None})
                                  + b"\n")
                    try:
                        ack = await js.publish(m.subject, m.data, headers=hdrs)
                        if ack.duplicate:
                            cat.deduped += 1
                    except Exception as exc:  # a publish the server refuses is a rejection too, but not ours to count
                        report.setdefault("publish_errors", []).append(f"{cat.name}: {exc!r}")
                    sent += 1
                    cat.sent += 1
                cat.units += 1
                cat.island_must += u.islands
            await asyncio.sleep(args.pace)
        # Last: an INIT chunk of a generation the syncer never saw holds its INIT intake for a while,
        # so nothing else may queue behind it.
        for _ in range(args.init_gens if "stopped_early" not in report else 0):
            u = h.unit("init_unknown_gen")
            cat = by_name[u.cat]
            for m in u.msgs:
                await js.publish(m.subject, m.data, headers=dict(m.headers or {}, **{S.MSG_ID: h.mid()}))
                sent += 1
                cat.sent += 1
            cat.units += 1
        report["send_s"] = time.monotonic() - t_start
        report["sent"] = sent
        # keep sampling the syncer's RSS until it exits
        while procs.procs["syncer"].poll() is None and time.monotonic() - t0 < args.timeout:
            rss.append(_rss_kib(pid) or rss[-1])
            await asyncio.sleep(0.5)
    finally:
        report["_nc"] = nc


async def collect(nc, run: str, report: dict) -> None:
    js = nc.jetstream(timeout=20)
    real = set(report.get("real_gens", {}).values())
    recs = await tape(js, run)
    for c in CATS:
        c.observed = 0
    collateral = []
    for rec in recs:
        if not is_rejection(rec):
            continue
        cat = attribute(rec, real)
        if cat is None:
            collateral.append(rec)
            continue
        c = next(c for c in CATS if c.name == cat)
        if rec["kind"] == c.record:
            c.observed += 1
        else:
            c.extra += 1
    report["collateral"] = collateral
    merges = sorted(r["t"] for r in recs if r.get("kind") == "merge")
    report["merges"] = len(merges)
    report["max_commit_gap_s"] = max((b - a for a, b in zip(merges, merges[1:])), default=0.0)
    report["status"] = await kv_json(js, run, "syncer") or {}


def island_rejections(procs: Procs) -> dict[str, dict[str, int]]:
    out = {}
    for isl in ISLANDS:
        text = procs.log(isl)
        notices = [int(k) for k in RX_NOTICE.findall(text)]
        out[isl] = {"ctl": len(RX_CTL.findall(text)), "notice": sum(1 for k in notices if k >= 50),
                    "cut": len(RX_CUT.findall(text)) + sum(1 for k in notices if k < 50)}
    return out


def final_equal(work: Path, run: str) -> tuple[bool, str]:
    from safetensors.torch import load_file

    from yeto.services.cmd_export import export

    path = work / "final-cut.safetensors"
    try:
        export(work / "syncer", path, run)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the bench must print its last line
        return False, f"export failed: {exc!r}"
    final = load_file(str(path))
    for isl in ISLANDS:
        p = work / f"island-{isl}.safetensors"
        if not p.exists():
            return False, f"island {isl} saved no parameters"
        mine = load_file(str(p))
        if sorted(mine) != sorted(final):
            return False, f"island {isl} has other tensors than the final cut"
        for k, v in final.items():
            if not torch.equal(mine[k], v):
                return False, f"island {isl} differs from the final cut at {k}"
    return True, "every island equals the final cut bitwise"


# ---- --poison: a compromised island against the syncer's default defences ---------------------------

POISON_KINDS = ("plus50", "nan", "norm5x", "tokens")   # learner/demo.py's fault injector (YETO_DEMO_POISON)


def final_eval_loss(work: Path, run: str) -> float:
    """The held-out loss (learner.demo.eval_loss) of the run's final cut, exported from the syncer's checkpoint."""
    from safetensors.torch import load_file

    from yeto.learner import demo
    from yeto.services.cmd_export import export

    path = work / "final-cut.safetensors"
    export(work / "syncer", path, run)
    weights = load_file(str(path))
    model = demo.build_model(hidden=weights["0.weight"].shape[0])
    model.load_state_dict(weights)
    return demo.eval_loss(model)


def norm_headroom(merges: list[dict]) -> float:
    """The largest ratio, over a run's merged pushes, of a push's norm to the reference norm the syncer's
    default norm bound judged it against (services/syncer/pushes.py, replayed from the merge records'
    `detail.norms`): how close an honest run came to --push-norm-factor."""
    from yeto.services.syncer.config import NORM_HISTORY, NORM_MIN_ISLANDS
    from yeto.services.syncer.state import lower_median

    hist: dict[int, dict[str, list[float]]] = {}
    worst = 0.0
    for m in sorted(merges, key=lambda r: r.get("step", 0)):
        norms = (m.get("detail") or {}).get("norms") or {}
        h = hist.setdefault(m["fragment"], {})
        values = []
        for isl in sorted(e["island"] for e in m.get("expected", [])):
            own = [v for v in h.get(isl, []) if v > 0] + ([norms[isl]] if norms.get(isl, 0) > 0 else [])
            if own:
                values.append(lower_median(own))
        if len(values) >= NORM_MIN_ISLANDS:
            ref = lower_median(values)
            worst = max([worst] + [n / ref for n in norms.values()])
        for isl, n in norms.items():
            h.setdefault(isl, []).append(n)
            del h[isl][:-NORM_HISTORY]
    return worst


def poison_runs(url: str, work: Path, a) -> dict[str, dict]:
    """One clean run and one run per poison kind, side by side on one broker: the real syncer with its
    default defence flags (none given) and islands a and b (`python -m yeto.learner.demo`); island a of a
    poisoned run carries YETO_DEMO_POISON=<kind>. Returns {kind or "clean": {eval_loss, exit_codes, rounds}}."""
    import nats

    kinds = ["clean", *a.poison]
    stamp = int(time.time())
    runs = {k: (f"poison-{k}-{a.seed}-{stamp}", work / k) for k in kinds}
    procs = {}
    for k, (run, wd) in runs.items():
        wd.mkdir(parents=True, exist_ok=True)
        procs[k] = Procs(url, run, wd, a, {"a": {"YETO_DEMO_POISON": k}} if k != "clean" else None)
    out: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        for pr in procs.values():
            pr.start()
        for k, pr in procs.items():
            rcs = {}
            for name, proc in pr.procs.items():
                try:
                    rcs[name] = proc.wait(max(1.0, t0 + a.timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rcs[name] = None
            out[k] = {"exit_codes": rcs}

        async def status():
            nc = await nats.connect(url)
            try:
                js = nc.jetstream(timeout=20)
                for k, (run, _) in runs.items():
                    st = await kv_json(js, run, "syncer") or {}
                    out[k]["rounds"] = st.get("rounds", {})
                    out[k]["committed_step"] = st.get("committed_step")
                    out[k]["headroom"] = norm_headroom([r for r in await tape(js, run) if r.get("kind") == "merge"])
            finally:
                await nc.close()
        asyncio.run(status())
        for k, (run, wd) in runs.items():
            try:
                out[k]["eval_loss"] = final_eval_loss(wd, run)
            except Exception as exc:  # noqa: BLE001 - reported: the bench must print its lines
                out[k]["eval_loss"] = float("nan")
                out[k]["error"] = repr(exc)
    finally:
        for pr in procs.values():
            pr.stop()
    out["_wall_s"] = {"s": time.monotonic() - t0}
    return out


def poison_main(a, url: str, work: Path) -> int:
    print(f"hostile --poison: {','.join(a.poison)} against a clean run, {a.rounds} rounds, NATS {url}, files in {work}",
          flush=True)
    res = poison_runs(url, work, a)
    wall = res.pop("_wall_s")["s"]
    clean = res["clean"]
    ok = all(rc == 0 for rc in clean["exit_codes"].values()) and clean.get("committed_step") == a.rounds
    # an honest run is never touched by the defences: nothing quarantined, no claim cut
    honest = clean.get("rounds", {}).get("disposition.quarantined", 0) + clean.get("rounds", {}).get("tokens.clamped", 0)
    ok = ok and honest == 0
    print(f"poison kind=clean eval_loss={clean['eval_loss']:.6g} quarantined={clean.get('rounds', {}).get('disposition.quarantined', 0)} "
          f"clamped={clean.get('rounds', {}).get('tokens.clamped', 0)} committed={clean.get('committed_step')} "
          f"max_norm_ratio={clean.get('headroom', 0.0):.3g} "
          f"exit_codes={clean['exit_codes']}" + (f" error={clean['error']}" if "error" in clean else ""))
    for k in a.poison:
        r = res[k]
        rounds = r.get("rounds", {})
        quarantined = {q.split(".", 1)[1]: v for q, v in rounds.items() if q.startswith("quarantine.")}
        ratio = r["eval_loss"] / clean["eval_loss"] if clean["eval_loss"] > 0 else float("inf")
        fine = all(rc == 0 for rc in r["exit_codes"].values()) and r.get("committed_step") == a.rounds
        ok = ok and fine and ratio <= a.max_ratio
        print(f"poison kind={k} clean={clean['eval_loss']:.6g} poisoned={r['eval_loss']:.6g} ratio={ratio:.4g} "
              f"quarantined={rounds.get('disposition.quarantined', 0)} clamped={rounds.get('tokens.clamped', 0)} "
              f"merges={rounds.get('merge', 0)} committed={r.get('committed_step')} rules={json.dumps(quarantined)} "
              f"exit_codes={json.dumps(r['exit_codes'])}" + (f" error={r['error']}" if "error" in r else ""), flush=True)
    print(f"poison ok={'true' if ok else 'false'} kinds={len(a.poison)} max_ratio={a.max_ratio:g} wall_s={wall:.0f}",
          flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/hostile.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", default=None, help="use this NATS server instead of the embedded one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=None, help="hostile messages to send (default 1000; --quick 250)")
    p.add_argument("--quick", action="store_true", help="a shorter run and fewer messages (the suite's test)")
    p.add_argument("--rounds", type=int, default=None, help="global rounds of the run (default 80; --quick 30)")
    p.add_argument("--step-delay", type=float, default=None, help="islands' simulated compute per step (s)")
    p.add_argument("--chunk-bytes", type=int, default=4096, help="session chunk size: several chunks per fragment")
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--init-gens", type=int, default=2, help="INIT chunks of unknown generations to send")
    p.add_argument("--pace", type=float, default=0.05, help="pause between two batches of messages (s)")
    p.add_argument("--impersonate", action="store_true",
                   help="also forge pulls for rounds not committed yet and messages naming the islands' real "
                        "generations (syncer impersonation: only server permissions stop it; expect stalls)")
    p.add_argument("--skip", default="", help="categories (comma separated) left out of the seeded plan, the "
                   "other messages staying the same: for bisecting a failure")
    p.add_argument("--poison", default=None, metavar="KIND[,KIND...]",
                   help="instead of the flood: a clean run and, side by side, one run per KIND (plus50, nan, norm5x, "
                        "tokens, or all) whose island a is compromised (learner/demo.py's YETO_DEMO_POISON), the "
                        "syncer on its default flags; prints per kind `poison kind=K clean=X poisoned=Y ratio=R ...` "
                        "and last `poison ok=<true|false> ...` (ok: every run finished and every ratio <= --max-ratio)")
    p.add_argument("--max-ratio", type=float, default=10.0, help="--poison: the largest poisoned/clean eval loss ratio "
                   "that passes")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--workdir", default=None)
    p.add_argument("--run", default=None)
    a = p.parse_args(argv)
    import signal

    # a SIGTERM (a CI timeout) still runs the `finally` below: no syncer, island or broker left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.poison is not None:
        kinds = list(POISON_KINDS) if a.poison.strip() == "all" else [k.strip() for k in a.poison.split(",") if k.strip()]
        bad = [k for k in kinds if k not in POISON_KINDS]
        if bad or not kinds:
            p.error(f"--poison: {bad or a.poison!r} not among {', '.join(POISON_KINDS)} (or all)")
        a.poison = kinds
        a.rounds = a.rounds if a.rounds is not None else 16
    a.count = a.count if a.count is not None else (250 if a.quick else 1000)
    a.rounds = a.rounds if a.rounds is not None else (30 if a.quick else 80)
    a.step_delay = a.step_delay if a.step_delay is not None else (0.04 if a.quick else 0.05)
    a.timeout = a.timeout if a.timeout is not None else (150.0 if a.quick else 400.0)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="yeto-hostile-"))
    work.mkdir(parents=True, exist_ok=True)
    run = a.run or f"hostile-{a.seed}-{int(time.time())}"
    broker = None
    url = a.nats
    if not url:
        from yeto.services.broker import Broker

        broker = Broker(store_dir=work / "jetstream", log_file=work / "nats-server.log").start()
        url = broker.url
    if a.poison is not None:
        try:
            return poison_main(a, url, work)
        finally:
            if broker is not None:
                broker.stop()
    print(f"hostile: run {run}, NATS {url}, seed {a.seed}, {a.count} messages, files in {work}", flush=True)
    procs = Procs(url, run, work, a)
    report: dict = {}
    crashes = 0
    t0 = time.monotonic()
    try:
        procs.start()
        try:
            asyncio.run(asyncio.wait_for(attack(url, run, procs, a, report), a.timeout))
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            report["attack_error"] = repr(exc)
        deadline = t0 + a.timeout
        rcs = {}
        for name, proc in procs.procs.items():
            try:
                rcs[name] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rcs[name] = None
        report["exit_codes"] = rcs
        crashes += sum(1 for rc in rcs.values() if rc != 0)

        async def _collect():
            import nats

            nc = await nats.connect(url)
            try:
                await collect(nc, run, report)
            finally:
                await nc.close()
        old = report.pop("_nc", None)
        if old is not None:
            try:
                asyncio.run(old.close())
            except Exception:
                pass
        asyncio.run(_collect())
        st = report.get("status", {})
        handler_errors = {k: v for k, v in st.get("counters", {}).items() if k.startswith("handler_error")}
        report["handler_errors"] = handler_errors
        crashes += sum(handler_errors.values())
        isl_rej = island_rejections(procs)
        report["island_rejections"] = isl_rej
        eq, why = final_equal(work, run) if all(rc == 0 for rc in rcs.values()) else (False, "a process failed")
        report["final_equal_why"] = why
    finally:
        procs.stop()
        if broker is not None:
            broker.stop()

    # ---- report
    sent = report.get("sent", 0)
    print(f"\n{'category':26s} {'target':8s} {'sent':>6s} {'units':>6s} {'must':>6s} {'seen':>6s} {'other':>6s}")
    must = seen = 0
    isl_rej = report.get("island_rejections", {})
    for c in CATS:
        if c.target == "syncer":
            m, o = c.must, c.observed
        elif c.target == "islands":
            m, o = c.island_must, None
        else:
            m, o = None, c.observed or None
        if c.sent == 0:
            continue
        print(f"{c.name:26s} {c.target:8s} {c.sent:6d} {c.units:6d} {'' if m is None else m:>6} {'' if o is None else o:>6}"
              f" {c.extra or '':>6}" + (f"  (JetStream dropped {c.deduped} duplicates)" if c.deduped else ""))
        if c.target == "syncer":
            must += m
            seen += o
    syncer_must, syncer_seen = must, seen
    isl_must = sum(c.island_must for c in CATS if c.target == "islands")
    isl_seen = sum(v["ctl"] + v["notice"] for v in isl_rej.values())
    must += isl_must
    seen += isl_seen
    rss = report.get("rss_kib") or [0]
    print(f"\nsyncer: tape rejections {syncer_seen} of {syncer_must} that must be; collateral (real islands' "
          f"rejections) {len(report.get('collateral', []))}; handler errors {report.get('handler_errors', {})}")
    print(f"islands: CTL + notice rejections {isl_seen} of {isl_must} that must be; cut rejections "
          f"{sum(v['cut'] for v in isl_rej.values())} (payload forgeries read before being overwritten); per island {isl_rej}")
    print(f"run: {report.get('merges', 0)} merges of {a.rounds}; longest gap between two commits "
          f"{report.get('max_commit_gap_s', 0.0):.1f} s (quorum timeout {a.quorum_timeout:.0f} s); exit codes {report.get('exit_codes')}")
    print(f"syncer RSS: {rss[0] / 1024:.1f} MiB when the flood began, peak {max(rss) / 1024:.1f} MiB, "
          f"last {rss[-1] / 1024:.1f} MiB; flood sent in {report.get('send_s', 0.0):.1f} s; whole bench {time.monotonic() - t0:.0f} s")
    for key in ("stopped_early", "attack_error", "publish_errors"):
        if report.get(key):
            print(f"{key}: {report[key] if key != 'publish_errors' else report[key][:5]}")
    for rec in report.get("collateral", [])[:5]:
        print(f"collateral: {json.dumps(rec)[:300]}")
    print(f"final: {report.get('final_equal_why')}")
    eq = report.get("final_equal_why") == "every island equals the final cut bitwise"
    print(f"hostile must={must} stall_s={report.get('max_commit_gap_s', 0.0):.1f} rss_growth_mib="
          f"{(max(rss) - rss[0]) / 1024:.1f}")
    print(f"hostile sent={sent} rejected={seen} crashes={crashes} final_equal={'true' if eq else 'false'}", flush=True)
    return 0 if crashes == 0 and eq and seen == must else 1


if __name__ == "__main__":
    sys.exit(main())
