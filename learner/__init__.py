"""The island side (docs/design.md §2, §5, §6): what a training loop links to sync with the syncer.

Imports `schemas` (the wire contract), never `services`. Decisions are pure (`boundary`, `pulls`,
`sync_state`, `cut_reader`, `layout_map`); I/O lives in thin shells around them (`island`, `island_wire`,
`client`, `piece_io`); model access goes through an adapter (`adapters`).
"""
