"""docs/design.md §9: "the quarantine rule ... one e2e run where a scripted island sends a huge push, which
is quarantined while the run converges as without it". A real nats-server, the real `yeto syncer`
process, three scripted islands; island c misbehaves every round: a huge push (over --max-push-norm),
then an outlier (under the absolute limit, far over --outlier-factor x the round's median norm), then
an honest delta with a claim of 2^53-1 tokens. The final cut equals an independent reference that
merges only what an honest run would: a and b in rounds 1-2, and c with its claim capped in round 3.
"""
from __future__ import annotations

import pytest
import torch

from yeto.schemas import subjects as S
from tests.scripted import (LR, MU, Heartbeater, Reference, close_run, start_run, syncer_status, tape,
                            tiny_layout, wait_tape)

pytestmark = pytest.mark.timeout(90)

LAYOUT = tiny_layout(4, 32)  # one fragment of 4544 values: 18 f32 chunks of 1024 bytes
MAX_NORM, OUTLIER = 1000.0, 10.0


async def test_huge_and_outlier_pushes_are_quarantined_and_the_run_converges_as_without_them(nats_url, run_id, tmp_path):
    syncer, isls, init = await start_run(
        nats_url, run_id, ["a", "b", "c"], tmp_path / "ckpt",
        "--islands", "3", "--fragments", "1", "--sync-every", "1", "--total-steps", "3", "--quorum", "2",
        # grace after quorum: min(tau x step time (5 s) - time to quorum, 4 s), long enough for the third push
        "--grace-ms", "4000", "--max-push-norm", str(MAX_NORM), "--outlier-factor", str(OUTLIER),
        "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.3",
        layout=LAYOUT)
    a, b, c = isls
    beats = [Heartbeater(isl, step_time_s=5.0).start() for isl in isls]   # non-strict rounds are paced
    try:
        js = a.js
        ref = Reference(init)
        n = a.frag(0)["numel"]
        gen = torch.Generator().manual_seed(17)

        def honest():
            return torch.randn(n, generator=gen) * 0.1                   # norm about 6.7

        # ---- round 1: c's push is huge -> quarantined on arrival; a and b merge
        p = {isl.island: await isl.expect_pull(1) for isl in isls}
        await c.push(p["c"], honest() * 1e6, c_tokens=2 ** 53 - 1)
        q1 = await wait_tape(js, run_id, lambda r: r["island"] == "c" and r["step"] == 1, kind="disposition")
        assert q1["disposition"] == "quarantined" and q1["gen"] == c.gen and "--max-push-norm" in q1["reason"]
        assert q1["detail"]["quarantine"]["rule"] == "max_push_norm" and q1["detail"]["quarantine"]["limit"] == MAX_NORM
        assert q1["detail"]["quarantine"]["norm"] > 1e6
        da, db = honest(), honest()
        await a.push(p["a"], da, c_tokens=100)
        await b.push(p["b"], db, c_tokens=300)
        ref.round(0, [da, db], [100, 300])
        torch.testing.assert_close(await a.wait_version(0, 1), ref.value(0), rtol=1e-6, atol=1e-6)

        # ---- round 2: c's push is under the absolute limit but an outlier against the round's median
        p = {isl.island: await isl.expect_pull(2) for isl in isls}
        outlier = honest() * 50                                          # norm about 340: < 1000, > 10 x 6.7
        await c.push(p["c"], outlier, c_tokens=100)
        await wait_tape(js, run_id, lambda r: r["island"] == "c" and r["step"] == 2, kind="disposition")  # accepted
        da, db = honest(), honest()
        await a.push(p["a"], da, c_tokens=100)
        await b.push(p["b"], db, c_tokens=300)
        q2 = await wait_tape(js, run_id, lambda r: r["island"] == "c" and r["step"] == 2
                             and r["disposition"] == "quarantined", kind="disposition")
        rule = q2["detail"]["quarantine"]
        assert rule["rule"] == "outlier" and rule["pushes"] == 3 and "--outlier-factor" in q2["reason"]
        assert rule["norm"] == pytest.approx(outlier.norm().item(), rel=1e-4)
        assert rule["median"] == pytest.approx(sorted([da.norm().item(), db.norm().item(), rule["norm"]])[1], rel=1e-4)
        assert MAX_NORM > rule["norm"] > rule["limit"] == pytest.approx(OUTLIER * rule["median"])
        ref.round(0, [da, db], [100, 300])
        torch.testing.assert_close(await a.wait_version(0, 2), ref.value(0), rtol=1e-6, atol=1e-6)

        # ---- round 3: c pushes an honest delta but claims 2^53-1 tokens: capped at 4 x the median claim
        p = {isl.island: await isl.expect_pull(3) for isl in isls}
        da, db, dc = honest(), honest(), honest()
        await c.push(p["c"], dc, c_tokens=2 ** 53 - 1)
        await a.push(p["a"], da, c_tokens=100)
        await b.push(p["b"], db, c_tokens=300)
        ref.round(0, [da, db, dc], [100, 300, 1200])

        for isl in isls:
            _, man = await isl.expect(lambda k, m: k == "manifest")
            assert man["final_step"] == 3
        _, final, _ = await a.read_cut(0, final=True)
        torch.testing.assert_close(final, ref.value(0), rtol=1e-6, atol=1e-6)
        for isl in isls:
            await isl.ack(3)
        for isl in isls:
            await isl.expect(lambda k, m: k == "shutdown")
        assert syncer.wait(30) == 0, syncer.output()[-4000:]

        merges = await tape(js, run_id, "merge")
        assert [sorted(x["island"] for x in m["responded"]) for m in merges] == [["a", "b"], ["a", "b"], ["a", "b", "c"]]
        assert [m["weights"] for m in merges] == [{"a": 100, "b": 300}, {"a": 100, "b": 300},
                                                  {"a": 100, "b": 300, "c": 1200}]
        assert merges[2]["detail"]["token_clamp"] == {"c": {"claimed": 2 ** 53 - 1, "used": 1200, "limit": 1200}}
        st = await syncer_status(js, run_id)
        r = st["rounds"]
        assert (r["disposition.quarantined"], r["quarantine.max_push_norm"], r["quarantine.outlier"]) == (2, 1, 1)
        assert r["tokens.clamped"] == 1 and st["exited"] and st["committed_step"] == 3
        assert (await js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 0   # quarantined pushes deleted
    finally:
        for hb in beats:
            await hb.stop()
        await close_run(isls, syncer, run_id)
