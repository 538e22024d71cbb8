"""TEST-ONLY STUB (see triton/__init__.py): every attribute is an inert placeholder."""


class _Placeholder:
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return _Placeholder()

    def __call__(self, *a, **k):
        raise RuntimeError("triton is a test-only stub here: kernels cannot run")


constexpr = _Placeholder


def __getattr__(name):
    return _Placeholder()
