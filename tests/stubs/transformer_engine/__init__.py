"""TEST-ONLY STUB of NVIDIA Transformer Engine (not installable on a CPU-only machine).

mcore-bridge (which ms-swift's Megatron trainers import) runs `import transformer_engine` at import
time. This stub makes that import succeed for it (and peft's probe, which then finds no
`transformer_engine.pytorch`); imported from megatron-core or torch it raises ModuleNotFoundError,
so megatron-core keeps seeing Transformer Engine as absent (HAVE_TE = False) and builds its local
(non-TE) modules. Only tests put tests/stubs on sys.path
(tests/megatron_cpu_shim.transformer_engine_stub(), which imports megatron-core's modules first).
"""
import sys


def _importer() -> str:
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        f = f.f_back
    return "" if f is None else str(f.f_globals.get("__name__", ""))


if _importer().startswith(("megatron.", "torch.")):
    raise ModuleNotFoundError("transformer_engine is a test-only stub: megatron-core and torch must see it as absent")

__version__ = "0.0.0+yeto.test.stub"
STUB = True
