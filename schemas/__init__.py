"""The wire contract both sides import (docs/design.md §2, §3): subjects and names, stream, bucket and
consumer configs, JSON schemas and typed messages, chunks, digests and wire dtypes, layouts, shards,
publishing, connection options and ids.

Imports nothing of `learner` or `services`; everything a message, a subject or a stored byte means is
defined here once.
"""
