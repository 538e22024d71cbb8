"""Model adapters: how the sync core reads and writes a model's synced parameters."""
from .base import ModelAdapter, Piece, dtype_name, fragment_names, gather_fragment, scatter_fragment
from .sliced_torch import SlicedTorchAdapter
from .torch_module import TorchModuleAdapter

__all__ = [
    "ModelAdapter",
    "Piece",
    "SlicedTorchAdapter",
    "TorchModuleAdapter",
    "dtype_name",
    "fragment_names",
    "gather_fragment",
    "scatter_fragment",
]
