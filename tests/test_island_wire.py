"""IslandWire's reading of BCAST against a real nats-server (the syncer side played by hand, with the
helpers of tests/island_support.py): every bad chunk that lands is refused and counted when it
lands, whatever the reading of that fragment is doing (tests/test_island_badinput_e2e.py CI flake:
a corrupted seal landed while a reading waited at an earlier chunk, and was never counted).
"""
from __future__ import annotations

import asyncio
import time

import torch

from tests.island_support import anchor_flat, boundary, net, publish_v, started, steplog_lines, until


async def _notices(island, n: int, what: str) -> None:
    await until(lambda: len(island.client.bcast) >= n, what=what)


async def test_a_bad_chunk_ahead_of_a_waiting_reading_is_refused_when_it_lands(island_env):
    """Fragment 1 (4 chunks): v1's chunks 0-1 landed and were staged; chunk 2 still holds v0 (the
    syncer is between two publishes), so the reading waits there. A corrupted chunk then replaces the
    seal (chunk 3), claiming a version far ahead. It is refused and counted at the next boundary, not
    whenever the reading reaches chunk 3 (if ever: the real seal may overwrite it first), and the
    reading of v1 is kept: once the real chunk 2 and seal land, v1 is installed."""
    island, session, syncer = island_env(net(), fetch_batch_bytes=4096)
    await started(island_env, island, session)
    assert syncer.bcast_chunks(1) == 4
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: syncer.values(1, 2)})
    assert await boundary(island) and island.state.version(1) == 0
    v1 = syncer.values(1, 3)
    await syncer.bcast(1, 1, v1, only={0, 1})
    await _notices(island, 2, "v1 chunks 0-1")
    assert await boundary(island)
    assert island.reader.reading(1) == (1, 2, 4) and island.store.staging(1) == 1
    await syncer.bcast(1, 10**6, syncer.values(1, 9), corrupt=True, only={3},
                       msg_id=lambda f, v, k: f"forged.{f}.{v}.{k}")
    await _notices(island, 1, "the forged seal")
    assert await boundary(island)
    assert steplog_lines(island)[-1]["rejected"] == 1 and island.counters["rejected.digest_mismatch"] == 1
    assert island.reader.reading(1) == (1, 2, 4) and island.store.staging(1) == 1  # v1's reading goes on
    assert await boundary(island) and steplog_lines(island)[-1]["rejected"] == 0  # counted once
    await syncer.bcast(1, 1, v1, only={2, 3})
    await _notices(island, 2, "v1 chunk 2 and seal")
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), v1)
    assert island.counters["rejected.digest_mismatch"] == 1


async def test_every_bad_chunk_of_one_fragment_is_counted_not_only_the_first_a_reading_meets(island_env):
    """Two corrupted chunks land on fragment 1 (4 chunks) together: chunk 1 and chunk 3. The reading
    is refused at chunk 1; chunk 3 is refused and counted at the same boundary (it used to be looked
    at only by a later reading, and never if a real chunk overwrote it first)."""
    island, session, syncer = island_env(net(), fetch_batch_bytes=4096)
    await started(island_env, island, session)
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: syncer.values(1, 2)})
    assert await boundary(island) and island.state.version(1) == 0
    v1 = syncer.values(1, 3)
    await syncer.bcast(1, 1, v1, only={0, 2})
    await syncer.bcast(1, 1, v1, corrupt=True, only={1, 3}, msg_id=lambda f, v, k: f"forged.{f}.{v}.{k}")
    await _notices(island, 4, "v1 with two corrupted chunks")
    assert await boundary(island)
    assert steplog_lines(island)[-1]["rejected"] == 2 and island.counters["rejected.digest_mismatch"] == 2
    assert island.state.version(1) == 0 and island.reader.reading(1) is None
    await syncer.bcast(1, 1, v1, only={1, 3}, msg_id=lambda f, v, k: f"real.{f}.{v}.{k}")
    await _notices(island, 2, "the real chunks 1 and 3")
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), v1)
    assert island.counters["rejected.digest_mismatch"] == 2


def _count_fetches(island, on_first=None) -> dict:
    """Count the island's BCAST fetches (a wrapper around the real client's calls; `on_first` runs in
    the training thread after the first one, e.g. to land more chunks while the reading goes on)."""
    calls = {"now": [], "ahead": []}
    client = island.client
    fetch_last, fetch_last_ahead = client.fetch_last, client.fetch_last_ahead

    def now(kind, subjects, **kw):
        out = fetch_last(kind, subjects, **kw)
        if kind == "BCAST":
            calls["now"].append(len(subjects))
            if on_first is not None and len(calls["now"]) == 1:
                on_first()
        return out

    def ahead(kind, subjects):
        calls["ahead"].append(len(subjects))
        return fetch_last_ahead(kind, subjects)

    client.fetch_last, client.fetch_last_ahead = now, ahead
    return calls


async def test_chunks_landing_while_a_version_is_read_are_fetched_together_not_one_by_one(island_env):
    """Only v1's chunk 0 has landed when the reading starts; chunks 1-3 land during its first fetch
    (the syncer publishing as the island reads). The reading takes the new notices before its next
    batch and fetches the three in one request (it used to see only the notices it started with, and
    fetched a whole 256 MiB version 1 MiB per request, one round trip each)."""
    island, session, syncer = island_env(net(), fetch_batch_bytes=4096)
    await started(island_env, island, session)
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: syncer.values(1, 2)})
    assert await boundary(island) and island.state.version(1) == 0
    v1 = syncer.values(1, 3)
    await syncer.bcast(1, 1, v1, only={0})
    await _notices(island, 1, "v1 chunk 0")
    loop = asyncio.get_running_loop()

    def land_the_rest():
        asyncio.run_coroutine_threadsafe(syncer.bcast(1, 1, v1, only={1, 2, 3}), loop).result(10)
        deadline = time.monotonic() + 10
        while len(island.client.bcast) < 3:
            assert time.monotonic() < deadline, "the notices of chunks 1-3 never came"
            time.sleep(0.01)

    calls = _count_fetches(island, land_the_rest)
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), v1)
    assert calls == {"now": [1, 3], "ahead": []}


async def test_the_next_batch_is_fetched_while_the_one_before_is_checked(island_env):
    """A version that has landed whole, one chunk per batch: the first batch is fetched and waited
    for, each later one was fetched ahead while the batch before it was checked and staged; the
    version installed is the one published, bit for bit. A reading refused at a corrupted chunk
    drops the batch fetched ahead, and reads the real chunk once it lands."""
    island, session, syncer = island_env(net(), fetch_batch_bytes=1024)
    await started(island_env, island, session)
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: syncer.values(1, 2)})
    assert await boundary(island) and island.state.version(1) == 0
    assert [s.nbytes for s in island.reader.spans[1]][:3] == [1024] * 3 and len(island.reader.spans[1]) == 4
    v1 = syncer.values(1, 3)
    await publish_v(syncer, island, 1, {1: v1})
    calls = _count_fetches(island)
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), v1)
    assert calls == {"now": [1], "ahead": [1, 1, 1]}

    v2 = syncer.values(1, 4)
    await syncer.bcast(1, 2, v2, only={0, 1, 3})
    await syncer.bcast(1, 2, v2, corrupt=True, only={2}, msg_id=lambda f, v, k: f"forged.{f}.{v}.{k}")
    await _notices(island, 4, "v2 with chunk 2 corrupted")
    calls = _count_fetches(island)
    assert await boundary(island)
    assert island.state.version(1) == 1 and island.counters["rejected.digest_mismatch"] == 1
    assert calls["now"][0] == 1 and calls["ahead"][:2] == [1, 1]  # chunk 3 was fetched ahead, then dropped
    await syncer.bcast(1, 2, v2, only={2}, msg_id=lambda f, v, k: f"real.{f}.{v}.{k}")
    await _notices(island, 1, "the real chunk 2")
    assert await boundary(island)
    assert island.state.version(1) == 2 and torch.equal(anchor_flat(island, 1), v2)
