"""The hostile messages of soak/hostile.py: the categories of forgery (`CATS`: what each breaks, on which
subject, and where its refusal is counted) and the mutator (`Hostile`) that makes each message from what the
run really publishes, seeded, so a failing seed replays.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import orjson
import torch

from yeto.schemas import codec, subjects as S
from yeto.schemas.chunks import chunk_header, chunk_plan, digest, push_digest
from yeto.schemas.dtypes import pack
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.messages import BcastChunk, InitChunk, PushChunk

ISLANDS = ("a", "b")


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
    # server permissions (docs/design.md §13); they stall or stop the run (soak/README.md).
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
            meta = PushChunk(run=self.run, island=island, gen=gen, fragment=frag, step=step, attempt=attempt,
                             try_=try_, base_version=base if base is not None else 0,
                             local_step=rnd.randrange(1, 10**5), c_steps=4, c_tokens=256, dtype=dtype,
                             **chunk_header(spans, s.index, buf)).to_wire()
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
        framing = dict(chunk_header(spans, min(chunk, len(spans) - 1), b""), chunk=chunk, digest="0" * 16)
        # BCAST carries the version digest on the last chunk only (the seal), FINAL (`every`) on every
        # chunk: a forgery that broke that rule would be refused for it, not for what its category tests.
        seal = version_digest if every or chunk >= len(spans) - 1 else None
        meta = BcastChunk(run=self.run, fragment=frag, version=version, dtype=self.bulk_dtype, **framing,
                          version_digest=seal).to_wire()
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
        if cat in ("init_bad_digest", "init_unknown_gen"):
            # a well-formed first INIT chunk from the INIT island; bad_digest then lies about its digest
            f = rnd.randrange(len(self.frags))
            span = chunk_plan(self.frags[f], self.bulk_dtype, self.cb)[0]
            buf = pack(torch.randn(span.elem_count), self.bulk_dtype).numpy().tobytes()
            meta = self.init_meta(self.init_island, gen, f, 0, buf, span=span)
            if cat == "init_bad_digest":
                meta["digest"] = "%016x" % rnd.getrandbits(64)
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
        return InitChunk(run=self.run, island=island, gen=gen, fragment=f, dtype=self.bulk_dtype,
                         **dict(chunk_header(spans, s.index, buf), nbytes=len(buf))).to_wire()

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
