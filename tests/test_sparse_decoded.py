"""docs/design.md §4.10: the decoded sparse pushes intake keeps for the merge (decoded_pushes.py, the ledger's
keep_decoded / take_decoded): kept within the push budget in place of the raw chunks, handed to the merge
once and only for the very try decoded, dropped with their try (merged, released, restored from an intent),
and the merge's step from them is bit for bit the step from the bytes read back from PUSH."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from yeto.services.syncer import sparse_merge as SM
from yeto.services.syncer.actions import Merge
from yeto.services.syncer.decoded_pushes import DecodedPushes, push_nbytes_decoded
from yeto.services.syncer.intake import PushLedger, PushTry
from yeto.services.syncer.merge import MergeError, Merger
from yeto.schemas.sparse import SparseTensor

from test_sparse_intake import OUTER, chunks, feed, receiver, session, sparse_message

BIG = 1 << 30


def push_of(n: int, seed: int = 0) -> list[SparseTensor]:
    g = torch.Generator().manual_seed(seed)
    return [SparseTensor(torch.arange(n, dtype=torch.int64), torch.randn(n, generator=g))]


def a_try(key=("a", "ab" * 8, 0, 1, 1, 0)) -> PushTry:
    return PushTry(key=key, chunks=1, total=10, dtype="f32", base_version=0, local_step=1, c_steps=1, c_tokens=1)


def test_the_cache_hands_a_decode_once_and_only_to_the_try_object_it_was_decoded_from():
    cache, t = DecodedPushes(), a_try()
    push = push_of(8)
    assert push_nbytes_decoded(push) == 8 * 8 + 8 * 4
    assert not cache.keep(t, push, room=95) and len(cache) == 0   # over the room: not kept
    assert cache.keep(t, push, room=96) and cache.nbytes == 96
    assert cache.take(a_try()) == (None, 0)                        # same key, another object: never
    got, n = cache.take(t)
    assert got[0] is push[0] and n == 96 and cache.nbytes == 0
    assert cache.take(t) == (None, 0)                              # handed over once
    cache.keep(t, push, room=BIG)
    assert cache.drop(t.key) == 96 and cache.drop(t.key) == 0 and cache.nbytes == 0


async def intake(hold_bytes: int):
    sess = session(True)
    rx, broker, tape, queue = receiver(sess)
    rx.ledger.set_budget(hold_bytes)
    msg = sparse_message(sess)
    await feed(rx, broker, chunks(SM.push_spans(sess["fragments"][0], OUTER, 1024), msg, encoding="sparseloco"))
    done = queue.get_nowait()
    assert done.valid
    key = (done.island, done.gen, done.fragment, done.step, done.attempt, done.try_)
    return rx, broker, sess, msg, key


async def test_intake_keeps_the_decode_in_place_of_the_raw_chunks_within_the_budget():
    rx, _, sess, msg, key = await intake(BIG)
    t = rx.ledger.tries[key]
    assert key in rx.ledger.decoded and not t.held          # the raw chunks are no longer needed
    assert rx.ledger.held_bytes == rx.ledger.decoded.nbytes > 0
    assert rx.counters["push.sparse_decoded_kept"] == 1
    got = rx.ledger.take_decoded(t)
    want = SM.decode(sess["fragments"][0], OUTER, msg)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.indices, w.indices) and torch.equal(g.values, w.values)
    assert rx.ledger.held_bytes == 0 and rx.ledger.take_decoded(t) is None


async def test_without_room_the_raw_chunks_stay_and_nothing_decoded_is_kept():
    rx, _, _, _, key = await intake(len(sparse_message(session(True))) + 16)   # the raw chunks fit, not more
    t = rx.ledger.tries[key]
    assert key not in rx.ledger.decoded and len(t.held) == t.chunks
    assert rx.counters["push.sparse_decoded_not_kept"] == 1
    assert rx.ledger.held_bytes == sum(len(d) for d in t.held.values())


def test_a_decode_goes_with_its_try_released_merged_or_restored():
    ledger = PushLedger(hold_bytes=BIG)
    keys = [("a", "ab" * 8, 0, 1, 1, n) for n in range(3)]
    for k in keys:
        ledger.tries[k] = a_try(k)
        assert ledger.keep_decoded(ledger.tries[k], push_of(4))
    assert ledger.held_bytes == 3 * 48
    ledger.pop_try(keys[0])                                 # a try the machine released (a newer try won)
    assert keys[0] not in ledger.decoded and ledger.held_bytes == 2 * 48
    ledger.restore_try(a_try(keys[1]))                      # a merge intent's try: a new object
    assert keys[1] not in ledger.decoded and ledger.take_decoded(ledger.tries[keys[1]]) is None
    ledger.pop_round(0, 1)                                  # the round merged
    assert len(ledger.decoded) == 0 and ledger.held_bytes == 0


def test_a_decode_is_not_kept_for_a_try_forgotten_meanwhile_or_invalid():
    ledger = PushLedger(hold_bytes=BIG)
    t = a_try()
    assert not ledger.keep_decoded(t, push_of(4))           # not the ledger's (popped while it decoded)
    ledger.tries[t.key] = t
    ledger.tries[t.key] = newer = a_try(t.key)              # another object under the key
    assert not ledger.keep_decoded(t, push_of(4))
    newer.invalidate("bad")
    assert not ledger.keep_decoded(newer, push_of(4)) and ledger.held_bytes == 0


class _Publisher:
    def resend_id(self, *a):
        return None


@pytest.mark.parametrize("hold_bytes", [BIG, 0])
async def test_the_merge_takes_the_decode_or_reads_push_again_with_the_same_step_bits(hold_bytes):
    rx, broker, sess, msg, key = await intake(hold_bytes)
    t = rx.ledger.tries[key]
    merger = Merger(broker, "r1", Counter(), rx.model, _Publisher(), rx.ledger, rx.tape, lr=0.7, momentum=0.0,
                    attempts={})
    a = Merge(1, 0, 1, 1, 0, ())
    step, detail = await merger._sparse_step(a, [t])
    want = SM.FragmentStep.of(sess["fragments"][0], [SM.decode(sess["fragments"][0], OUTER, msg)], 0.7)
    assert torch.equal(step.index, want.index) and torch.equal(step.step.view(torch.int32), want.step.view(torch.int32))
    held = hold_bytes == BIG
    assert (detail["sparse_pushes_held"], detail["sparse_pushes_decoded"]) == ((1, 0) if held else (0, 1))
    assert detail["sparse_decode_s"] >= 0 and detail["sparse_aggregate_s"] >= 0
    if not held:   # the fallback reads PUSH: a chunk gone makes the merge fail naming it
        broker.msgs.clear()
        with pytest.raises(MergeError, match="gone"):
            await merger._sparse_step(a, [t])
