"""A version number re-issued after a failed redo (services/syncer/cut.CutPublisher.reissue): a syncer killed in the
middle of version v's broadcast whose redo then failed (a push gone from PUSH) restarts the round, and v
comes back with other bytes. Those chunks need Nats-Msg-Ids of their own — under the killed syncer's ids
JetStream drops them as duplicates within its window and BCAST keeps the partial version's neighbours
(the whole path runs in tests/test_syncer_cut_through.py) — and the restarted round's merge intent keeps
that resend id, so a second redo of it sends under the same ids again."""
from __future__ import annotations

from collections import Counter

import torch

from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan
from yeto.services.syncer.actions import Merge, MergeInput
from yeto.services.syncer.cut import CutPublisher
from yeto.services.syncer.intake import PushLedger
from yeto.services.syncer.merge import Merger
from yeto.services.syncer.model_store import ModelStore


def _cut(n=3000):
    model = ModelStore(None, "r", Counter(), None)
    model.set_session({"fragments": [{"id": 0, "numel": n}, {"id": 1, "numel": n}], "bulk_dtype": "f32",
                       "chunk_bytes": 4096})
    return CutPublisher(None, "r", Counter(), model, None)


def _ids(publisher, fid, version, n=3000):
    spans = chunk_plan(n, "f32", 4096)
    buf = torch.zeros(n)
    return [publisher.chunk_message(fid, version, "f32", spans, s, buf[s.elem_offset: s.elem_offset + s.elem_count], "0" * 64)[1]
            for s in spans]


def test_a_reissued_version_gets_its_own_message_ids_and_no_other_version_does():
    publisher = _cut()
    plain = _ids(publisher, 1, 4)
    assert plain == [S.bcast_msg_id(1, 4, k) for k in range(len(plain))]
    publisher.reissue_version(1, 4, 1733300000123)
    again = _ids(publisher, 1, 4)
    assert again == [S.bcast_msg_id(1, 4, k, 1733300000123) for k in range(len(plain))]
    assert not set(again) & set(plain)
    assert _ids(publisher, 1, 5) == [S.bcast_msg_id(1, 5, k) for k in range(len(plain))]   # the next version: plain ids
    assert _ids(publisher, 0, 4) == [S.bcast_msg_id(0, 4, k) for k in range(len(plain))]   # another fragment: plain ids


def test_the_merge_intent_keeps_the_resend_id_of_a_reissued_version():
    publisher = _cut()
    merger = Merger(None, "r", Counter(), publisher.model, publisher, PushLedger(), None, lr=0.7, momentum=0.9, attempts={4: 2})
    member = MergeInput(island="a", gen="g", weight=1.0, try_=0, c_tokens=10, c_steps=1, base_version=3,
                          local_step=8)
    merge = Merge(step=8, fragment=1, attempt=2, version=4, base_version=3, members=(member,))
    assert merger.intent(merge, [])["reissue"] is None
    publisher.reissue_version(1, 4, 1733300000123)
    intent = merger.intent(merge, [])
    assert intent["reissue"] == 1733300000123
    later = Merge(step=10, fragment=1, attempt=1, version=5, base_version=4, members=(member,))
    assert merger.intent(later, [])["reissue"] is None     # only the re-issued version number
