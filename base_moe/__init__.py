"""base_moe: batch-aware selection of experts (BASE) for fast batched Mixture-of-Experts decoding.

``import base_moe`` loads the op library (``torch.ops.base_moe.*``); ``base_moe.ops`` holds the typed
Python wrappers, ``base_moe.reference`` a plain-PyTorch version of every op.
"""

import torch

from . import _C  # noqa: F401  (loads the shared library; its static initialisers register the ops)
from . import ops, reference
from .routing import Cost, Fill, Routing, Scoring
from .predictors import Predictors
from .calibrate import calibrate
from . import hf, layouts, policies
from .hf import apply, configure, restore

__version__ = "0.1.0"

__all__ = ["Cost", "Fill", "Routing", "Scoring", "ops", "reference", "__version__", "cuda_available"]
__all__ += ["Predictors", "calibrate"]
__all__ += ["apply", "configure", "restore", "hf", "layouts", "policies"]


def cuda_available() -> bool:
    """True when the op library was built with its CUDA kernels and a GPU is visible."""
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "base_moe::route_select", "CUDA"
    )
