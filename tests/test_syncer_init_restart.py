"""A restarted INIT island against a real nats-server and a real `yeto syncer` process.

Generation A of the INIT island sends one fragment whole and part of the other (values X), then dies;
generation B says hello and sends every fragment (values Y). Version 0 must be Y bit for bit: none of
A's bytes may survive, although A already sent the same chunk indexes. A's chunks that arrive after
B's hello are refused as stale and counted; a chunk that names another island is refused.
"""
from __future__ import annotations

import torch
import pytest

from yeto.schemas import subjects as S
from yeto.schemas.dtypes import pack, unpack
from yeto.schemas.chunks import chunk_plan
from tests.scripted import (ScriptedIsland, SyncerProc, close_run, syncer_status, tape, tiny_layout, wait_provisioned,
                            wait_status, wait_tape)

pytestmark = pytest.mark.timeout(90)

LAYOUT = tiny_layout(4, 32)
ARGS = ("--islands", "1", "--fragments", "2", "--sync-every", "2", "--total-steps", "1", "--strict",
        "--chunk-bytes", "1024", "--status-every", "0.3")


def _values(session: dict, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    bulk = session["bulk_dtype"]
    return {f["id"]: unpack(pack(torch.randn(f["numel"], generator=gen), bulk), bulk, f["numel"])
            for f in session["fragments"]}


async def test_v0_comes_from_the_restarted_init_island_only(nats_url, run_id, tmp_path):
    import nats

    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", *ARGS).start()
    isl = ScriptedIsland(await nats.connect(nats_url), run_id, "a", LAYOUT)
    try:
        js = isl.js
        await wait_provisioned(js, run_id)
        await isl.connect_consumer()
        await isl.hello()
        session = await isl.wait_session()
        assert session["init_island"] == "a"
        x, y = _values(session, 1), _values(session, 2)
        assert all(not torch.equal(x[f], y[f]) for f in x)
        n_chunks = {f: len(chunk_plan(x[f].numel(), session["bulk_dtype"], session["chunk_bytes"])) for f in x}
        # the larger fragment is sent in part, the other whole
        part, whole = sorted(n_chunks, key=lambda f: -n_chunks[f])
        assert n_chunks[part] >= 4, n_chunks
        head = set(range(n_chunks[part] // 2))
        tail = set(range(n_chunks[part])) - head

        # ---- generation A: fragment `whole` complete, the first half of fragment `part`
        gen_a = isl.gen
        await isl.send_init({whole: x[whole]})
        await isl.send_init({part: x[part]}, chunks=head)
        await wait_status(js, run_id, lambda st: st["rounds"].get("init.fragment", 0) == 1)

        # ---- generation B says hello; the syncer takes it in before anything else arrives
        await isl.new_generation()
        await isl.hello()
        await wait_tape(js, run_id, lambda r: "INIT restarts" in r.get("reason", ""), kind="session")

        # A's remaining chunks arrive late (a slow publisher of the dead process): stale
        stale = await isl.send_init({part: x[part]}, chunks=tail, gen=gen_a)
        # a chunk that names another island: refused, whatever its generation
        await isl.send_init({whole: y[whole]}, chunks={0}, island="mallory")
        st = await wait_status(js, run_id, lambda st: st["rounds"].get("rejected.stale_gen", 0) == stale
                               and st["rounds"].get("rejected.not_init_island", 0) == 1)
        assert st["phase"] == "init" and not st["versions"]

        # ---- generation B sends everything: version 0 is Y, bit for bit
        await isl.send_init(y)
        for f in sorted(y):
            v0 = await isl.wait_version(f, 0)
            assert torch.equal(v0, y[f]), f"fragment {f}: version 0 is not generation B's bytes"
            assert not torch.equal(v0, x[f])

        st = await wait_status(js, run_id, lambda st: st["phase"] == "running")
        c, r = st["counters"], st["rounds"]
        assert r["rejected.stale_gen"] == stale == len(tail) == c["init.dropped.stale_gen"]
        assert c.get("init.duplicate_chunk", 0) == 0 and r.get("init.duplicate_chunk", 0) == 0
        # B's hello dropped both fragments' A chunks (the whole one and the part); B's filled both
        assert r["init.restart"] == 1 and r["init.fragment"] == 3   # A's whole one, then B's two
        errors = await tape(js, run_id, "error")
        stale_recs = [e for e in errors if e["detail"]["code"] == "stale_gen"]
        assert len(stale_recs) == stale and all(e["gen"] == gen_a and e["island"] == "a" for e in stale_recs)
        (mallory,) = [e for e in errors if e["detail"]["code"] == "not_init_island"]
        assert mallory["island"] == "mallory" and mallory["detail"]["field"] == "island"
        commits = await tape(js, run_id, "commit")
        assert sorted((c["fragment"], c["version"]) for c in commits) == [(0, 0), (1, 0)]
        # the INIT stream is a work queue: every chunk, good or refused, was taken off it
        assert (await js.stream_info(S.stream(run_id, "INIT"))).state.messages == 0
        assert (await syncer_status(js, run_id))["counters"].get("handler_error.INIT", 0) == 0
    finally:
        await close_run([isl], syncer, run_id)
