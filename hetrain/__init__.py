"""hetrain: train one PyTorch model across GPUs that are not alike, at the sum of their speeds."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Session", "__version__"]


def __getattr__(name: str):
    # Session pulls in torch.distributed; import it only when asked for, so the CLI starts fast.
    if name == "Session":
        from hetrain.runtime.session import Session

        return Session
    raise AttributeError(name)
