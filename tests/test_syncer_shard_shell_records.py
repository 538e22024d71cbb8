"""Syncer shards: the coordinator's check of another shard's `final.<K>` record (services/syncer/
shard_watch.parse_shard_final), pure. A record that passes fills the manifest's digests, so each way
a record can be wrong is refused with a message naming it."""
from __future__ import annotations

import orjson
import pytest

from yeto.services.syncer.shard_watch import ShardRecordError, parse_shard_final

D = "ab" * 32


def rec(**kw) -> bytes:
    base = {"shard": 1, "final_step": 8, "versions": {"1": 2, "3": 2}, "version_digests": {"1": D, "3": D}}
    base.update(kw)
    return orjson.dumps(base)


def test_a_good_record_gives_step_versions_and_digests():
    assert parse_shard_final(1, rec(), fragments=4, shards=2) == (8, {1: 2, 3: 2}, {1: D, 3: D})


@pytest.mark.parametrize("value, why", [
    (b"not json", "not JSON"),
    (b"[1]", "not an object"),
    (rec(shard=2), "shard 2, the key names shard 1"),
    (rec(final_step=-1), "final_step -1"),
    (rec(final_step=True), "final_step True"),
    (rec(versions={"1": 2}), "shard 1 owns ['1', '3']"),
    (rec(versions={"1": 2, "2": 2}), "shard 1 owns"),
    (rec(version_digests={"1": D}), "shard 1 owns"),
    (rec(versions={"1": -1, "3": 2}), "version -1 of fragment 1"),
    (rec(versions={"1": "2", "3": 2}), "version '2' of fragment 1"),
    (rec(version_digests={"1": D, "3": "XYZ"}), "digest 'XYZ' of fragment 3"),
    (rec(versions=[2, 2]), "not objects"),
])
def test_a_bad_record_is_refused_naming_what_is_wrong(value, why):
    with pytest.raises(ShardRecordError, match=None) as exc:
        parse_shard_final(1, value, fragments=4, shards=2)
    assert why in str(exc.value)

