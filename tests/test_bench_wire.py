"""bench/wire.py: a smoke run on a tiny size (output contract, stream cleanup) and its chunk plan.

Not a timed assertion: throughput on 2 shared cores is too noisy to gate on; the 512 MiB figures live in
bench/README.md.
"""
from __future__ import annotations

import asyncio
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import nats
import pytest

ROOT = Path(__file__).resolve().parents[1]
WIRE = ROOT / "bench" / "wire.py"
LAST_LINE = re.compile(r"^wire ratio_vs_raw_tcp=(?P<x>[-+0-9.eE]+|nan|inf)$")
RAW_LINE = re.compile(r"^raw tcp: (?P<mbps>\d+) MB/s .*peak RSS recv=\d+MiB send=\d+MiB", re.M)
JS_LINE = re.compile(r"^jetstream file: (?P<mbps>\d+) MB/s e2e .*peak RSS con0=\d+MiB pub0=\d+MiB", re.M)


def _load_wire():
    spec = importlib.util.spec_from_file_location("bench_wire", WIRE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_wire"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


async def _bench_streams(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        return [s.config.name for s in await nc.jetstream().streams_info() if s.config.name.startswith("BENCH_")]
    finally:
        await nc.close()


@pytest.mark.timeout(60)
def test_wire_bench_smoke_prints_both_rates_and_the_ratio_last(nats_url):
    before = asyncio.run(_bench_streams(nats_url))
    proc = subprocess.run(
        [sys.executable, str(WIRE), "--size-mb", "8", "--repeat", "1", "--nats", nats_url],
        capture_output=True, text=True, timeout=55, cwd=ROOT,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    last = LAST_LINE.match(out.strip().splitlines()[-1])
    assert last, f"last line is not `wire ratio_vs_raw_tcp=<x>`:\n{out}"
    ratio = float(last["x"])
    assert math.isfinite(ratio) and ratio > 0

    raw, js = RAW_LINE.search(out), JS_LINE.search(out)
    assert raw and js, f"missing the raw tcp or jetstream MB/s line (with peak RSS per process):\n{out}"
    raw_mbps, js_mbps = float(raw["mbps"]), float(js["mbps"])
    assert raw_mbps > 0 and js_mbps > 0
    # The ratio is the quotient of the two printed (rounded) medians.
    assert ratio == pytest.approx(js_mbps / raw_mbps, rel=0.05, abs=2 / raw_mbps)
    assert "where the time goes" in out and "publisher alone" in out and "consumer alone" in out
    # Each run uses its own stream and deletes it afterwards.
    assert asyncio.run(_bench_streams(nats_url)) == before


def test_chunk_plan_covers_the_fragment_once_and_splits_contiguously():
    wire = _load_wire()
    plan = wire.chunk_plan(5 * wire.MiB + 3, wire.MiB)
    assert [n for _, _, n in plan] == [wire.MiB] * 5 + [3]
    assert [off for _, off, _ in plan] == [i * wire.MiB for i in range(6)]
    parts = wire.split_plan(plan, 2)
    assert [c for part in parts for c in part] == plan and [len(p) for p in parts] == [3, 3]
    with pytest.raises(ValueError, match="chunk=0"):
        wire.chunk_plan(10, 0)
    meta = wire.chunk_meta(2, 6, 2 * wire.MiB, wire.MiB, 5 * wire.MiB + 3, "ab")
    assert list(meta) == ["chunk", "chunks", "offset", "nbytes", "total", "digest"]
    assert wire.msg_id("r1", 7) == "bench.r1.7"


def test_consumer_tally_checks_digest_offset_and_counts_redeliveries():
    import orjson
    import xxhash

    wire = _load_wire()
    plan = wire.chunk_plan(10, 4)  # chunks of 4, 4, 2 bytes
    tally = wire._ChunkTally(plan, 10)
    payloads = [b"abcd", b"efgh", b"ij"]

    def header(i, data, **over):
        _, off, n = plan[i]
        meta = wire.chunk_meta(i, 3, off, n, 10, xxhash.xxh3_64_hexdigest(data)) | over
        return {wire.CHUNK_HEADER: orjson.dumps(meta).decode()}

    tally.add(header(0, payloads[0]), payloads[0], orjson, xxhash)
    tally.add(header(0, payloads[0]), payloads[0], orjson, xxhash)
    assert (tally.duplicates, tally.bytes, tally.done) == (1, 4, False)
    with pytest.raises(ValueError, match="digest="):
        tally.add(header(1, payloads[1]), b"efgX", orjson, xxhash)
    with pytest.raises(ValueError, match="offset/nbytes/total=5/"):
        tally.add(header(1, payloads[1], offset=5), payloads[1], orjson, xxhash)
    with pytest.raises(ValueError, match="chunk=9"):
        tally.add(header(2, payloads[2], chunk=9), payloads[2], orjson, xxhash)
    tally.add(header(1, payloads[1]), payloads[1], orjson, xxhash)
    tally.add(header(2, payloads[2]), payloads[2], orjson, xxhash)
    assert (tally.bytes, tally.done) == (10, True)
