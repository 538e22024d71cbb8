"""TEST-ONLY STUB of NVIDIA Transformer Engine (not installable on a CPU-only machine).

mcore-bridge (which ms-swift's Megatron trainers import) runs `import transformer_engine` at import
time. This stub makes that import succeed for it (and peft's probe, which then finds no
`transformer_engine.pytorch`); imported from megatron-core or torch it raises ModuleNotFoundError,
so megatron-core keeps seeing Transformer Engine as absent (HAVE_TE = False) and builds its local
(non-TE) modules. Only tests put tests/stubs on sys.path
(tests/megatron_cpu_shim.transformer_engine_stub(), which imports megatron-core's modules first).
"""
from _stub_guard import refuse_for_megatron_and_torch

refuse_for_megatron_and_torch("transformer_engine")

__version__ = "0.0.0+yeto.test.stub"
STUB = True
