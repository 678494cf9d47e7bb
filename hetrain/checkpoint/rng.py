"""Every random number generator a rank draws from, as plain data that a checkpoint can hold.

Python's and NumPy's states are stored as int64 tensors and numbers (not their own objects), so
`torch.load(weights_only=True)` reads them back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from hetrain.checkpoint.errors import CheckpointError


def capture_rng() -> dict[str, Any]:
    """The state of python `random`, NumPy's global generator, torch CPU and every CUDA device."""
    version, mt, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what capture_rng() returned (CUDA states only for devices this process has)."""
    try:
        py, npy = state["python"], state["numpy"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        np.random.set_state((
            npy["algorithm"], npy["keys"].numpy().astype(np.uint32), int(npy["pos"]),
            int(npy["has_gauss"]), float(npy["cached_gaussian"]),
        ))
        torch.set_rng_state(state["torch_cpu"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"RNG state is incomplete or malformed ({type(e).__name__}: {e}); pass the dict that "
            f"capture_rng() returned"
        ) from None
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)
