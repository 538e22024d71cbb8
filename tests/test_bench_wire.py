"""bench/wire.py: a smoke run on a tiny size (output contract, stream cleanup), its use of the production
chunk plan, and its consumer's checks (the production header and check_chunk).

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
        capture_output=True, text=True, timeout=55,
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


def test_the_bench_cuts_fragments_with_the_production_plan():
    from yeto.schemas.chunks import chunk_plan

    wire = _load_wire()
    cfg = wire.Config(size_mb=5, chunk_mb=1)
    assert cfg.plan() == chunk_plan(5 * wire.MiB // 4, "f32", wire.MiB)
    assert wire.split_numel(10, 3) == [3, 4, 3] and sum(wire.split_numel(5 * wire.MiB // 4, 2)) == 5 * wire.MiB // 4
    two = wire.Config(size_mb=5, chunk_mb=1, procs=2)  # one fragment per publisher process
    assert [sum(s.nbytes for s in two.plan(k)) for k in (0, 1)] == [int(2.5 * wire.MiB)] * 2


def test_consumer_tally_checks_each_chunk_as_an_island_would_and_counts_redeliveries():
    """The consumer decodes the real bcast_chunk header and checks the chunk against its own plan: a bad
    digest, offset, version or header is refused naming the field; a redelivery is counted once."""
    from yeto.schemas import codec
    from yeto.schemas.chunks import DigestMismatch, chunk_plan
    from yeto.schemas.errors import DecodeError, WireError

    wire = _load_wire()
    spans = chunk_plan(3, "f32", 4)  # three chunks of one f32 value
    payloads = [b"abcd", b"efgh", b"ijkl"]

    def header(i, data=None, **over):
        meta = wire._bcast_meta("r1", 0, spans, i, data if data is not None else payloads[i], "0" * 64) | over
        return {codec.CHUNK_HEADER: codec.encode_header("bcast_chunk", meta)}

    tally = wire._ChunkTally(spans, "r1", 0)
    tally.add(header(0), payloads[0])
    tally.add(header(0), payloads[0])
    assert (tally.duplicates, tally.bytes, tally.done) == (1, 4, False)
    with pytest.raises(DigestMismatch) as ei:
        tally.add(header(1), b"efgX")
    assert ei.value.field == "digest"
    with pytest.raises(WireError) as ei:
        tally.add(header(1, offset=8), payloads[1])
    assert ei.value.field == "offset"
    with pytest.raises(WireError) as ei:
        tally.add(header(1, version=2), payloads[1])
    assert ei.value.field == "version"
    with pytest.raises(DecodeError):
        tally.add({codec.CHUNK_HEADER: "{not json"}, payloads[1])
    tally.add(header(1), payloads[1])
    tally.add(header(2), payloads[2])
    assert (tally.bytes, tally.done) == (12, True)
