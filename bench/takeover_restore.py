"""What a standby's warm copy saves a takeover: the committed state of one syncer (P fragments of S MiB,
params and momentum) restored from the run's `ckpt` KV into an empty directory, cold (everything fetched)
against warm (the standby's passes fetched every committed version, then the owner committed one more
fragment and died: the takeover fetches that one and moves the rest into place), against a real
nats-server on this machine. The limit is reading the same bytes from a local file (page cache).

  python bench/takeover_restore.py [--size-mib 256] [--fragments 4] [--chunk-mib 1]   (chunks: at most the server's max)

Last line: `takeover restore cold_s=<a> warm_s=<b> speedup=<a/b> file_read_s=<c> rss_mib=<peak>`.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path


import nats  # noqa: E402
import torch  # noqa: E402

from yeto.schemas.chunks import max_chunk_bytes  # noqa: E402
from yeto.schemas.conn import server_max_payload  # noqa: E402
from yeto.schemas.provision import RunLimits, kv as kv_handle, provision_run  # noqa: E402
from yeto.services.broker import Broker  # noqa: E402
from yeto.services.run_harness import peak_rss_self  # noqa: E402  (peak RSS as every bench reads it)
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState  # noqa: E402
from yeto.services.syncer.state_store import WARM_DIR, StateStore  # noqa: E402


def _state(run: str, versions: dict[int, int], step: int) -> CheckpointState:
    return CheckpointState(run=run, session_fingerprint="s" * 64, layout_fingerprint="l" * 64, committed_step=step,
                           versions=dict(versions), version_digests={})


async def main(args) -> None:
    numel = int(args.size_mib * 2**20) // 4
    numels = {f: numel for f in range(args.fragments)}
    session = {"fragments": [{"id": f, "numel": numel} for f in numels], "session_fingerprint": "s" * 64,
               "layout_fingerprint": "l" * 64}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with Broker(store_dir=work / "js", log_file=work / "nats.log") as broker:
            nc = await nats.connect(broker.url, max_reconnect_attempts=-1)
            js = nc.jetstream(timeout=30)
            run = f"bench_{uuid.uuid4().hex[:8]}"
            await provision_run(js, run, RunLimits())
            counters: Counter = Counter()
            store = StateStore(js, run, await kv_handle(js, run, "ckpt"), counters, shard=0,
                               chunk_bytes=min(int(args.chunk_mib * 2**20), max_chunk_bytes(server_max_payload(nc))))
            frag = torch.randn(numel)
            v0 = {f: (frag, frag) for f in numels}
            await store.save(_state(run, {f: 0 for f in numels}, 0), v0, {})

            t0 = time.perf_counter()
            await store.restore_into(CheckpointDir(work / "cold"), session, numels)
            cold = time.perf_counter() - t0

            standby = CheckpointDir(work / "warm")
            await store.warm(CheckpointDir(standby.path / WARM_DIR), numels)
            await store.save(_state(run, {**{f: 0 for f in numels}, 0: 1}, 1), {0: (frag + 1, frag)}, {0: 0})
            t0 = time.perf_counter()
            await store.restore_into(standby, session, numels, warm=CheckpointDir(standby.path / WARM_DIR))
            warm = time.perf_counter() - t0
            assert counters["state_store.restored_warm"] == args.fragments - 1, counters

            t0 = time.perf_counter()
            for f in numels:   # the same bytes from local files: what a restore from a local disk costs
                for p in (work / "cold").glob(f"frag-{f}-v0.*"):
                    with open(p, "rb") as r:
                        while r.read(1 << 24):
                            pass
            file_read = time.perf_counter() - t0
            await nc.close()
    rss = peak_rss_self() / (1 << 20)
    print(f"takeover restore cold_s={cold:.2f} warm_s={warm:.2f} speedup={cold / warm:.1f} "
          f"file_read_s={file_read:.2f} rss_mib={rss:.0f} (P={args.fragments} x {args.size_mib} MiB, "
          f"params + momentum)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=256)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--chunk-mib", type=float, default=1)
    asyncio.run(main(ap.parse_args()))
