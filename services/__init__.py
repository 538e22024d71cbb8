"""The long-running processes and the `yeto` CLI (docs/design.md §2, §7): the syncer (`syncer/`), the
broker, the step-log viewers (`steplog/`), export, replay, auth, and the run harness the demo, tests,
benches and soaks share.

Imports `schemas` (the wire contract), never `learner`: the demo runs islands as processes.
"""
