"""Reading one key of a run's KV bucket as the syncer's start-up does (services/syncer/run_claim.py,
services/syncer/opening.py): an entry, or its JSON, with an absent key and a deleted one both None."""
from __future__ import annotations

import orjson


async def kv_entry(kv, key: str):
    """The KV entry of `key`, None when absent or deleted (an empty value is a delete marker)."""
    from nats.js.errors import KeyNotFoundError

    try:
        e = await kv.get(key)
    except KeyNotFoundError:
        return None
    return e if e is not None and e.value else None


async def kv_json(kv, key: str):
    """The JSON value of `key`, None when absent or deleted."""
    e = await kv_entry(kv, key)
    return None if e is None else orjson.loads(e.value)
