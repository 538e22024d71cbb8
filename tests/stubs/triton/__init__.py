"""TEST-ONLY STUB of OpenAI Triton (no CPU wheel is needed by the code under test).

mcore-bridge 1.6.5 imports `triton` unguarded at import time for a vendored CUDA kernel (sparse
attention of one model family) that the tests never run. This stub lets that module import (for
torch and megatron-core, e.g. torch._dynamo, `import triton` keeps failing: ModuleNotFoundError):
`triton.jit` returns the undecorated function, `triton.language` answers any attribute. Calling a
kernel fails. Only tests put tests/stubs on sys.path. Where a real triton is installed (the CUDA torch
wheel depends on it) megatron-core has imported it before mcore-bridge does, and this stub is unused.
"""
from _stub_guard import refuse_for_megatron_and_torch

refuse_for_megatron_and_torch("triton")
__version__ = "0.0.0+yeto.test.stub"
STUB = True


def jit(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


def cdiv(a, b):
    return -(-a // b)
