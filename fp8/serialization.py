"""Loading FP8 checkpoints with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from .tensor import Float8Tensor

__all__ = ["safe_globals"]


def safe_globals() -> list[type]:
    """Classes a checkpoint holding FP8 tensors needs allow-listed for ``torch.load(weights_only=True)``::

        with torch.serialization.safe_globals(fp8.safe_globals()):
            state = torch.load(path)
    """
    return [Float8Tensor]
