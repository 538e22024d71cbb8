"""services/syncer/cut.BulkBytes: the new version packed once (the merge packs and hashes each chunk after
its outer step; the broadcast sends the same bytes). Its bytes and version digest must equal what
schemas.dtypes.pack and ModelStore.bulk_digest give, for any partition of the fragment into `add` ranges."""
from __future__ import annotations

import pytest
import torch

from yeto.schemas.chunks import VersionDigest, chunk_plan
from yeto.schemas.dtypes import pack
from yeto.services.syncer.cut import BulkBytes, CutError, CutPublisher
from yeto.services.syncer.model_store import ModelStore


def _params(n=10_007):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g) * 1e3
    x[:5] = torch.tensor([float("inf"), float("nan"), 3.4e38, -0.0, 1e-40])  # bf16 rounding edge cases
    return x


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("step", [1000, 4096, 10_007])  # push chunks need not match bulk chunks
def test_bytes_and_digest_equal_pack_and_a_sha256_over_the_bulk_chunks(dtype, step):
    x = _params()
    bb = BulkBytes(x, dtype)
    for off in range(0, x.numel(), step):
        bb.add(off, min(step, x.numel() - off))
    want = VersionDigest()
    for s in chunk_plan(x.numel(), dtype, 4096):   # as ModelStore.bulk_digest and the old broadcast packed them
        got, ref = bb.chunk(s.elem_offset, s.elem_count), pack(x[s.elem_offset: s.elem_offset + s.elem_count], dtype)
        assert torch.equal(got, ref), s
        want.update(ref)
    assert bb.hexdigest() == want.hexdigest()
    # the digest the syncer checks a resumed checkpoint against (ModelStore.bulk_digest) and its own packing
    model = ModelStore(None, "r", None, None)
    model.set_session({"fragments": [{"id": 0, "numel": x.numel()}], "bulk_dtype": dtype, "chunk_bytes": 4096})
    model.init_chunk(0, 0, x)
    publisher = CutPublisher(None, "r", None, model, None)
    assert model.bulk_digest(0, dtype) == bb.hexdigest() == publisher.bulk_bytes(0).hexdigest()
    # f32 bytes are the params themselves (no copy); bf16 lives in one buffer of half the size
    assert (bb.buf is None) == (dtype == "f32")
    if dtype == "bf16":
        assert bb.buf.numel() == 2 * x.numel()


def test_out_of_order_partial_and_unpacked_reads_are_refused():
    x = _params(100)
    bb = BulkBytes(x, "bf16")
    bb.add(0, 40)
    with pytest.raises(CutError, match="out of order: elements from 50, expected 40"):
        bb.add(50, 10)
    with pytest.raises(CutError, match="not packed yet"):
        bb.chunk(30, 20)
    with pytest.raises(CutError, match="partly packed fragment \\(40 of 100"):
        bb.hexdigest()
    with pytest.raises(CutError, match="bulk dtype 'q4'"):
        BulkBytes(x, "q4")
