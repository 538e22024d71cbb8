"""docs/design.md §4.10, §8: the sparse mode's state KV keeps a version as the update from the one before
(services/syncer/state_chain.py): which versions are written full, what a reader needs, what a save may
purge, and the manifest's `chains` object read back strictly. Pure, no I/O."""
from __future__ import annotations

import pytest

from yeto.services.syncer import state_chain as SC

D = [f"{i:064x}" for i in range(40)]   # version i's digest


def _chain(base, top):
    c = SC.full(base, D[base])
    for v in range(base + 1, top + 1):
        c = SC.extend(c, v, D[v], 100 + v)
    return c


def test_full_at_version_0_every_full_every_th_and_without_an_update():
    c = _chain(0, 0)
    assert not SC.writes_update(None, 0, None, has_update=True, full_every=4)
    assert SC.writes_update(c, 1, D[0], has_update=True, full_every=4)
    assert not SC.writes_update(c, 1, D[0], has_update=False, full_every=4)   # a commit without a merge
    assert not SC.writes_update(_chain(0, 3), 4, D[3], has_update=True, full_every=4)   # a full cut
    assert SC.writes_update(_chain(4, 6), 7, D[6], has_update=True, full_every=4)
    assert not SC.writes_update(c, 1, D[0], has_update=True, full_every=1)   # every version full


def test_an_update_needs_the_chain_to_end_on_the_version_before_with_its_digest():
    c = _chain(0, 2)
    assert SC.writes_update(c, 3, D[2], has_update=True, full_every=16)
    assert not SC.writes_update(c, 4, D[3], has_update=True, full_every=16)    # a gap: the store lags
    assert not SC.writes_update(c, 3, D[9], has_update=True, full_every=16)    # other bytes of version 2
    assert not SC.writes_update(c, 3, None, has_update=True, full_every=16)    # no committed version 2
    assert not SC.writes_update(None, 3, D[2], has_update=True, full_every=16)  # nothing held (first save)


def test_a_chain_holds_at_most_full_every_versions():
    every, c = 4, SC.full(0, D[0])
    lengths = []
    for v in range(1, 13):
        c = SC.extend(c, v, D[v], 1) if SC.writes_update(c, v, D[v - 1], has_update=True, full_every=every) \
            else SC.full(v, D[v])
        lengths.append(len(c.versions))
    assert lengths == [2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1] and max(lengths) <= every


def test_what_a_reader_needs_and_what_a_save_may_purge():
    old = _chain(4, 6)
    assert list(old.versions) == [4, 5, 6] and old.digest(5) == D[5] and old.size(6) == 106
    assert SC.needed({0: old}, {0: 6, 1: 9}) == {0: {4, 5, 6}, 1: {9}}
    assert SC.purgeable(old, SC.extend(old, 7, D[7], 1)) == []           # an update keeps the whole chain
    assert SC.purgeable(old, SC.full(8, D[8])) == [4, 5, 6]               # a full version frees it
    assert SC.purgeable(SC.full(3, D[3]), SC.full(4, D[4])) == [3]       # the dense rule: the old version
    assert SC.purgeable(None, SC.full(4, D[4])) == []
    with pytest.raises(ValueError, match="does not follow"):
        SC.extend(old, 8, D[8], 1)


def test_the_manifest_names_only_chains_with_updates_and_reads_them_back_checked():
    chains = {0: _chain(4, 6), 1: SC.full(2, D[2]), 2: _chain(0, 1)}
    doc = {"chains": SC.to_manifest(chains, {0: 6, 1: 2, 2: 5})}   # fragment 2's chain is not the state's
    assert set(doc["chains"]) == {"0"}
    assert SC.to_manifest({1: SC.full(2, D[2])}, {1: 2}) == {}        # dense and bf16: no key at all
    assert SC.from_manifest(doc, {0: 6, 1: 2}, {0: D[6], 1: D[2]}, "ckpt.0.manifest") == {0: chains[0]}
    assert SC.from_manifest({}, {0: 6}, {0: D[6]}, "m") == {}


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(base=-1), r"chains\.0: base -1"),
    (lambda c: c.update(sizes=[]), r"at least one size"),
    (lambda c: c["digests"].pop(), r"digests must be 3 sha256"),
    (lambda c: c.pop("sizes"), r"chains\.0 lacks 'sizes'"),
    (lambda c: c.update(base=3), r"ends at version 5 .* commits version 6"),
    (lambda c: c["digests"].__setitem__(-1, D[30]), r"ends at version 6 digest 0{10}"),
])
def test_a_bad_chain_in_the_manifest_is_refused_naming_the_key_and_field(edit, match):
    c = _chain(4, 6).to_json()
    edit(c)
    with pytest.raises(SC.ChainError, match=r"ckpt\.0\.manifest: .*" + match):
        SC.from_manifest({"chains": {"0": c}}, {0: 6}, {0: D[6]}, "ckpt.0.manifest")
    with pytest.raises(SC.ChainError, match=r"chains\.7: the manifest's state has no fragment '7'"):
        SC.from_manifest({"chains": {"7": _chain(4, 6).to_json()}}, {0: 6}, {0: D[6]}, "ckpt.0.manifest")
