"""ms-swift plugin with only the hybrid process groups of an island (learner.hybrid, docs/design.md §6).

    YETO_CROSS_NODE_GLOO=1 megatron sft ... --external_plugins /path/to/learner/plugins/yeto_hybrid_plugin.py

For a Megatron job that spans nodes without a device fabric between them but does not (yet) sync
through yeto: groups whose ranks span nodes use gloo with host copies, the rest keep HCCL/NCCL.
`yeto_swift_plugin.py` already does this when `YETO_CROSS_NODE_GLOO=1`; listing both is harmless.

ms-swift imports plugins while parsing its arguments — before torch.distributed and Megatron's groups
exist, which is when hybrid groups must be installed — under a hashed module name, and again in every
dataloader worker (where nothing is done). Importing this file twice changes nothing.
"""
from __future__ import annotations


def _install() -> bool:
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:  # a dataloader worker: no process groups here
        return False
    from yeto.learner import hybrid

    return hybrid.installed() or hybrid.install_from_env()


INSTALLED = _install()
