"""TEST-ONLY: shared by the stubs in tests/stubs — refuse the stub to megatron-core and torch."""
import sys

_REFUSED = ("megatron.", "torch.")


def refuse_for_megatron_and_torch(stub: str) -> None:
    """Called from a stub's module body. Raise ModuleNotFoundError when the module whose import
    statement runs that body is megatron-core or torch: for them the real package stays absent
    (megatron-core builds its local, non-TE modules; torch does not use triton)."""
    f = sys._getframe(2)  # 0: here, 1: the stub's module body, 2+: the import machinery, then the importer
    while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        f = f.f_back
    importer = "" if f is None else str(f.f_globals.get("__name__", ""))
    if importer.startswith(_REFUSED):
        raise ModuleNotFoundError(f"{stub} is a test-only stub: megatron-core and torch must see it as absent")
