"""docs/design.md §4.10: the syncer's intake of sparse pushes (services/syncer/receive.py with a stand-in broker):
a complete sparse try is decoded whole (its chunks read back from PUSH when not kept) and judged by its
decoded norm; a push of the other mode, or one the decoder refuses, is counted and taped naming the field,
its try completes invalid, and intake goes on."""
from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from yeto.learner.sparse_push import SparsePushes
from yeto.schemas import codec
from yeto.schemas import outer_mode as OM
from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan
from yeto.schemas.dtypes import pack
from yeto.schemas.layout import build_session
from yeto.schemas.messages import PushStream
from yeto.services.syncer import sparse_merge as SM
from yeto.services.syncer.intake import PushLedger
from yeto.services.syncer.receive import Receiver

RUN, GEN = "r1", "ab" * 8
LAYOUT = [{"name": "w", "shape": [40, 30], "dtype": "float32"}, {"name": "b", "shape": [40], "dtype": "float32"}]
OUTER = OM.parse_pin(OM.check_outer("sparseloco", tile=8, k=32, chunk_1d=16, k_1d=16, beta=0.9))


def session(sparse: bool) -> dict:
    s = build_session(LAYOUT, 1, run=RUN, push_dtype="f32", bulk_dtype="f32", chunk_bytes=1024, init_island="a",
                      sync_every=2, created=1.0)
    return OM.pin(s, OUTER.to_pin()) if sparse else s


class Broker:
    """PUSH as a dict of sequences: what the receiver reads back (get_msg) and deletes."""

    def __init__(self):
        self.msgs: dict[int, bytes] = {}
        self.deleted: list[int] = []

    async def get_msg(self, stream, seq, direct=False):
        from nats.js.errors import NotFoundError

        if seq not in self.msgs:
            raise NotFoundError()
        return SimpleNamespace(data=self.msgs[seq])

    async def delete_msg(self, stream, seq):
        self.deleted.append(seq)


class Tape:
    def __init__(self):
        self.records: list[dict] = []

    async def write(self, rec, kind=None):
        self.records.append(rec)


def receiver(sess: dict):
    frag = sess["fragments"][0]
    model = SimpleNamespace(session=sess, frags={0: SimpleNamespace(numel=frag["numel"])}, owns=lambda f: True,
                            shard=0, shards=1)
    broker, tape, queue = Broker(), Tape(), asyncio.Queue()
    rx = Receiver(broker, RUN, Counter(), model, PushLedger(), tape, queue, send_error=None)
    return rx, broker, tape, queue


def chunks(spans, payload: bytes, *, step=1, encoding=None):
    stream = PushStream(spans, run=RUN, island="a", gen=GEN, fragment=0, step=step, attempt=1, try_=0,
                        base_version=0, local_step=2, c_steps=2, c_tokens=4, dtype="f32", encoding=encoding)
    for s in spans:
        part = payload[s.byte_offset: s.byte_offset + s.nbytes]
        yield part, {codec.CHUNK_HEADER: stream.chunk(s.index, part).header()}


async def feed(rx, broker, items, seq0=1):
    for n, (data, headers) in enumerate(items):
        seq = seq0 + n
        broker.msgs[seq] = bytes(data)
        await rx.on_push(SimpleNamespace(subject=S.push(RUN, "a", 0), headers=headers, data=bytes(data),
                                         metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq),
                                                                  num_delivered=1)))


def sparse_message(sess: dict) -> bytes:
    return SparsePushes(sess, OUTER).encode(0, torch.randn(sess["fragments"][0]["numel"],
                                                         generator=torch.Generator().manual_seed(1)))


async def test_a_sparse_push_is_decoded_whole_read_back_from_push_and_judged_by_its_decoded_norm():
    sess = session(True)
    rx, broker, tape, queue = receiver(sess)
    msg = sparse_message(sess)
    spans = SM.push_spans(sess["fragments"][0], OUTER, 1024)
    assert len(spans) > 1
    await feed(rx, broker, chunks(spans, msg, encoding="sparseloco"))
    done = queue.get_nowait()
    assert done.valid and done.reason is None
    assert done.norm == pytest.approx(SM.norm(SM.decode(sess["fragments"][0], OUTER, msg)), rel=0, abs=0)
    assert rx.counters["rejected"] == 0 and not tape.records


@pytest.mark.parametrize("sparse_run", [True, False])
async def test_a_push_of_the_other_mode_is_refused_naming_encoding_counted_and_intake_goes_on(sparse_run):
    sess = session(sparse_run)
    rx, broker, tape, queue = receiver(sess)
    if sparse_run:   # a dense push (d in f32, no encoding) to a sparse run
        values = torch.randn(sess["fragments"][0]["numel"])
        payload = bytes(pack(values, "f32").numpy())
        items = chunks(chunk_plan(values.numel(), "f32", 1024), payload)
    else:            # a sparse push to a dense run
        items = chunks(SM.push_spans(sess["fragments"][0], OUTER, 1024), sparse_message(session(True)),
                       encoding="sparseloco")
    await feed(rx, broker, items)
    done = queue.get_nowait()
    assert not done.valid and "encoding" in done.reason
    assert rx.counters["rejected.wrong_encoding"] >= 1
    assert tape.records and tape.records[0]["detail"]["field"] == "encoding"
    if sparse_run:   # the next, right, push of the same island is taken as usual
        msg = sparse_message(sess)
        await feed(rx, broker, chunks(SM.push_spans(sess["fragments"][0], OUTER, 1024), msg, step=3,
                                      encoding="sparseloco"), seq0=100)
        assert queue.get_nowait().valid


async def test_a_message_the_decoder_refuses_makes_its_try_invalid_counted_and_taped():
    sess = session(True)
    rx, broker, tape, queue = receiver(sess)
    msg = bytearray(sparse_message(sess))
    msg[4] = 7   # the format byte: every chunk's framing and digest still check
    await feed(rx, broker, chunks(SM.push_spans(sess["fragments"][0], OUTER, 1024), bytes(msg),
                                  encoding="sparseloco"))
    done = queue.get_nowait()
    assert not done.valid and "sparse push refused" in done.reason and "format" in done.reason
    assert rx.counters["rejected.malformed"] == 1
    assert tape.records[-1]["detail"]["field"] == "header.format"


async def test_a_sparse_push_whose_chunk_is_gone_from_push_completes_invalid_not_never():
    sess = session(True)
    rx, broker, tape, queue = receiver(sess)
    items = list(chunks(SM.push_spans(sess["fragments"][0], OUTER, 1024), sparse_message(sess), encoding="sparseloco"))
    await feed(rx, broker, items[:-1])
    del broker.msgs[1]   # purged before the try completed (max_age, an operator)
    await feed(rx, broker, items[-1:], seq0=len(items))
    done = queue.get_nowait()
    assert not done.valid and "gone from the stream" in done.reason
    assert rx.counters["rejected"] == 1
