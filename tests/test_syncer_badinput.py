"""Bad input from the wire against a real nats-server and a real `yeto syncer` process.

Hellos that do not fit the session get a fatal `error` on ctl.to.I and are not admitted. Malformed or
inconsistent messages and chunks (bad JSON, schema violations, a subject that names another island,
wrong sizes, NaN/Inf INIT values, unknown fragments, digest mismatches, garbage headers) are each
refused with a tape record and a counter (state KV key `syncer`), and a push holding NaN/Inf is
quarantined (docs/design.md §9); none changes anything: the syncer keeps running, later good rounds complete,
and the merged values equal a reference that never saw the bad input.
"""
from __future__ import annotations

import orjson
import pytest
import torch

from yeto.schemas import codec, subjects as S
from yeto.schemas.chunks import digest
from yeto.schemas.dtypes import pack
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.chunks import chunk_plan
from tests.e2e_procs import kv_keys
from tests.scripted import (LR, MU, Reference, ScriptedIsland, close_run, start_run, syncer_status, tape,
                            tiny_layout, wait_status, wait_tape)

pytestmark = pytest.mark.timeout(60)

LAYOUT = tiny_layout(4, 32)  # one fragment of 4544 values: 18 f32 chunks of 1024 bytes
OTHER = tiny_layout(3, 32)
COMMON = ("--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.3",
          "--strict", "--islands", "2", "--fragments", "1", "--sync-every", "1")


async def _finish(isls, syncer, final_step: int, ref: Reference) -> None:
    for isl in isls:
        _, man = await isl.expect(lambda k, m: k == "manifest")
        assert man["final_step"] == final_step
    _, vals, _ = await isls[0].read_cut(0, final=True)
    torch.testing.assert_close(vals, ref.value(0), rtol=1e-6, atol=1e-6)
    for isl in isls:
        await isl.ack(final_step)
    for isl in isls:
        await isl.expect(lambda k, m: k == "shutdown")
    assert syncer.wait(30) == 0, syncer.output()[-4000:]


async def test_hellos_that_do_not_fit_the_session_get_a_fatal_error_and_are_not_admitted(nats_url, run_id, tmp_path):
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], tmp_path / "ckpt", *COMMON,
                                         "--total-steps", "1", layout=LAYOUT)
    a, b = isls
    extra = {name: ScriptedIsland(a.nc, run_id, name, lay) for name, lay in
             [("z", OTHER), ("y", LAYOUT), ("w", LAYOUT), ("liar", OTHER), ("late", LAYOUT)]}
    try:
        js = a.js
        # round 1 is launched (strict: right after version 0) with a and b before anyone else says hello
        pulls = [await isl.expect_pull(1) for isl in (a, b)]
        assert {m["island"] for m in pulls[0]["members"]} == {"a", "b"}
        for isl in extra.values():
            await isl.connect_consumer()
        await extra["z"].hello()                                   # another layout
        await extra["y"].hello(push_dtype="bf16")                   # the session pushes f32
        await extra["w"].hello(bulk_dtype="bf16")                   # the session broadcasts f32
        await extra["liar"].hello(fingerprint=layout_fingerprint(LAYOUT))  # claims the session's fingerprint
        await extra["late"].hello(push_dtype="f32", bulk_dtype="f32")      # fits: asks for what the session uses
        want = {"z": ("layout_mismatch", "layout_fingerprint"), "y": ("dtype_mismatch", "push_dtype"),
                "w": ("dtype_mismatch", "bulk_dtype"), "liar": ("layout_mismatch", "layout_fingerprint")}
        for name, (code, field) in want.items():
            isl = extra[name]
            _, err = await isl.expect(lambda k, m: k == "error")
            assert (err["code"], err["field"], err["fatal"], err["gen"]) == (code, field, True, isl.gen), err
        # every refusal is on the tape; only a, b and late joined
        await wait_tape(js, run_id, lambda r: r.get("island") == "late", kind="join")
        errors = await tape(js, run_id, "error")
        assert {r["island"] for r in errors} == set(want)
        assert {r["island"] for r in await tape(js, run_id, "join")} == {"a", "b", "late"}
        members = await js.key_value(S.kv_bucket(run_id, "members"))
        assert sorted(await kv_keys(members)) == ["a", "b", "late"]

        # the run goes on: round 1 (expected a and b; late joined after it launched), final cut to all three
        ref = Reference(init)
        gen = torch.Generator().manual_seed(4)
        deltas = []
        for isl, pull in zip((a, b), pulls):
            deltas.append(torch.randn(a.frag(0)["numel"], generator=gen) * 0.1)
            await isl.push(pull, deltas[-1], c_tokens=100)
        ref.round(0, deltas, [100, 100])
        await _finish([a, b, extra["late"]], syncer, 1, ref)
        st = await syncer_status(js, run_id)
        assert st["rounds"]["rejected.layout_mismatch"] == 1 and st["rounds"]["rejected.dtype_mismatch"] == 2
        assert st["counters"]["rejected.layout_mismatch"] == 1  # the liar, caught by the shell
    finally:
        await close_run(isls, syncer, run_id)


async def test_bad_wire_input_is_refused_counted_taped_and_changes_nothing(nats_url, run_id, tmp_path):
    async def bad_init(isls):
        # Before the good INIT: a chunk 0 whose digest does not match, and one holding NaN. Other
        # Nats-Msg-Ids than the good chunks' (those carry the INIT island's generation).
        a = isls[0]
        span = chunk_plan(a.frag(0)["numel"], "f32", a.session["chunk_bytes"])[0]
        total = sum(s.nbytes for s in chunk_plan(a.frag(0)["numel"], "f32", a.session["chunk_bytes"]))
        for what, vals in (("digest", torch.full((span.elem_count,), 7.0)), ("nan", torch.full((span.elem_count,), float("nan")))):
            buf = pack(vals, "f32").numpy().tobytes()
            meta = {"v": 1, "run": run_id, "island": a.island, "gen": a.gen, "fragment": 0, "dtype": "f32", "chunk": 0, "chunks": len(chunk_plan(a.frag(0)["numel"], "f32", 1024)),
                    "offset": 0, "nbytes": span.nbytes, "total": total,
                    "digest": digest(b"x" + buf) if what == "digest" else digest(buf)}
            await a.publish_raw(S.init(run_id, 0), buf, {codec.CHUNK_HEADER: codec.encode_header("init_chunk", meta)})

    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], tmp_path / "ckpt", *COMMON,
                                         "--total-steps", "2", layout=LAYOUT, before_init=bad_init)
    a, b = isls
    try:
        js = a.js
        ref = Reference(init)
        n = a.frag(0)["numel"]
        # version 0 is the good INIT, bit for bit
        assert torch.equal(await a.wait_version(0, 0), init[0])
        pa, pb = await a.expect_pull(1), await b.expect_pull(1)
        gen = torch.Generator().manual_seed(5)

        # ---- control messages
        await a.publish_raw(S.hello(run_id, "q"), b"{not json")
        hb = {"type": "heartbeat", "v": 1, "run": run_id, "island": "a", "gen": a.gen, "local_step": -1, "step_time_s": 0.1}
        await a.publish_raw(S.heartbeat(run_id, "a"), orjson.dumps(hb))
        good_hb = codec.encode("heartbeat", codec.make("heartbeat", run=run_id, island="a", gen=a.gen, local_step=1, step_time_s=0.1))
        await a.publish_raw(S.heartbeat(run_id, "b"), good_hb)  # a's heartbeat on b's subject
        # ---- push chunks: wrong size, NaN/Inf, digest mismatch (a's tries 0-2: expected member, slot open)
        for try_, how in enumerate(("size", "nan", "digest")):
            await a.push(pa, torch.randn(n, generator=gen), try_=try_, corrupt=how)
        # unknown fragment, a header that is not JSON, no header at all
        await a.push(pa, torch.randn(10, generator=gen), try_=3, fragment=99)
        await a.publish_raw(S.push(run_id, "a", 0), b"\0" * 64, {codec.CHUNK_HEADER: "{oops"})
        await a.publish_raw(S.push(run_id, "a", 0), b"\0" * 64)

        st = await wait_status(js, run_id, lambda st: st["rounds"].get("disposition.invalid", 0) >= 2
                               and st["rounds"].get("disposition.quarantined", 0) >= 1
                               and st["counters"].get("rejected.unknown_fragment", 0) >= 1
                               and st["counters"].get("rejected.malformed", 0) >= 3)
        c = st["counters"]
        for code in ("digest_mismatch", "non_finite", "wrong_size", "schema", "subject_mismatch"):
            assert c.get(f"rejected.{code}", 0) >= 1, (code, c)
        assert c["rejected.digest_mismatch"] == 2  # INIT + push
        assert c["rejected.non_finite"] == 1       # INIT only: a NaN/Inf push is the round machine's to quarantine
        assert st["rounds"]["quarantine.non_finite"] == 1
        assert st["phase"] == "running" and st["committed_step"] == 0 and st["versions"] == {"0": 0}

        dispositions = await tape(js, run_id, "disposition")
        invalid = sorted((r["try"], r["reason"]) for r in dispositions if r["disposition"] == "invalid")
        assert [t for t, _ in invalid] == [0, 2]
        assert "chunk 0 is" in invalid[0][1] and "nbytes" in invalid[0][1] and "digest" in invalid[1][1]
        (nan,) = [r for r in dispositions if r["disposition"] == "quarantined"]
        assert nan["try"] == 1 and nan["island"] == "a" and "non-finite" in nan["reason"]
        assert nan["detail"]["quarantine"] == {"rule": "non_finite", "non_finite": 2, "limit": 0}  # a NaN and an Inf
        errors = await tape(js, run_id, "error")
        codes = sorted(r["detail"]["code"] for r in errors if "detail" in r)
        assert codes == sorted(["digest_mismatch", "non_finite",                 # INIT
                                "malformed", "schema", "subject_mismatch",      # CTL
                                "unknown_fragment", "malformed", "malformed",   # PUSH
                                # chunk rejects inside push tries, taped when they arrive
                                "wrong_size", "digest_mismatch"])
        chunk_rejects = [r for r in errors if r["detail"].get("where") == "push chunk on " + S.push(run_id, "a", 0)
                         and "try" in r["detail"]]
        assert sorted(r["detail"]["try"] for r in chunk_rejects) == [0, 2]
        assert all(r["island"] == "a" and r["gen"] == a.gen and r["detail"]["step"] == 1 for r in chunk_rejects)
        unknown = next(r for r in errors if r["detail"]["code"] == "unknown_fragment")
        assert unknown["island"] == "a" and unknown["detail"]["field"] == "fragment"

        # ---- the syncer carries on: a's slot is still open, the good pushes make the round
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(pa, da, c_tokens=120, try_=4)
        await b.push(pb, db, c_tokens=80)
        ref.round(0, [da, db], [120, 80])
        torch.testing.assert_close(await a.wait_version(0, 1), ref.value(0), rtol=1e-6, atol=1e-6)
        pa, pb = await a.expect_pull(2), await b.expect_pull(2)
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(pa, da, c_tokens=1)
        await b.push(pb, db, c_tokens=3)
        ref.round(0, [da, db], [1, 3])
        await _finish([a, b], syncer, 2, ref)
        merges = await tape(js, run_id, "merge")
        assert [(m["step"], m["responded"]) for m in merges][0] == (1, [{"island": "a", "gen": a.gen}, {"island": "b", "gen": b.gen}])
        final = await syncer_status(js, run_id)
        assert final["exited"] and final["counters"]["rejected"] >= 10
        assert (await js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 0
    finally:
        await close_run(isls, syncer, run_id)
