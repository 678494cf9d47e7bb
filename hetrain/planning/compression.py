"""Bytes a gradient-compression hook sends, as a fraction of an uncompressed fp32 all-reduce.

The cost model multiplies gradient bytes by `compression_ratio`. Ratios measured by
`hetrain bench comm` go in MEASURED_RATIOS and are preferred over the analytic ones here.
"""

from __future__ import annotations

from hetrain.errors import HetrainError
from hetrain.workload.profile import WorkloadProfile
from hetrain.vocabulary import COMPRESSIONS

HOOKS = COMPRESSIONS
INT8_CHUNK_ELEMENTS = 1024  # one fp32 scale per chunk of int8 values

# hook name -> bytes sent / bytes an uncompressed all-reduce sends, as measured by
# `hetrain bench comm --json` (bytes_per_step ratio to "none", 2 and 4 CPU ranks, the same
# figure on both). Only hooks whose ratio does not depend on the model are recorded here:
# PowerSGD's ratio follows the layer shapes (the bench measured 0.0139 after warm-up on its MLP,
# exactly what powersgd_ratio() predicts for those shapes), and top-k's grows with the ranks
# (it all-gathers: 0.020 on 2 ranks, 0.040 on 4), so both stay analytic.
MEASURED_RATIOS: dict[str, float] = {"fp16": 0.5, "bf16": 0.5, "int8": 0.252}


def powersgd_ratio(profile: WorkloadProfile, rank: int = 2) -> float:
    """rank*(m+n) per (m x n) matrix sent instead of m*n; vectors (biases, norms) go uncompressed."""
    matrix_params = sum(m * n for m, n in profile.matrix_shapes)
    vector_params = max(0, profile.trained_params - matrix_params)
    sent = vector_params + sum(min(m * n, rank * (m + n)) for m, n in profile.matrix_shapes)
    return sent / max(profile.trained_params, 1)


def analytic_ratio(hook: str, profile: WorkloadProfile | None = None, powersgd_rank: int = 2,
                   topk_ratio: float = 0.01) -> float:
    """The ratio implied by each hook's encoding (fp32 gradients are the reference)."""
    if hook == "none":
        return 1.0
    if hook in ("fp16", "bf16"):
        return 0.5
    if hook == "int8":
        return 0.25 + 1.0 / INT8_CHUNK_ELEMENTS
    if hook == "topk":
        return min(1.0, 2.0 * topk_ratio)  # 32-bit values and 32-bit indices
    if hook == "powersgd":
        if profile is None:
            raise HetrainError("the PowerSGD ratio depends on the layer shapes; pass the workload profile")
        return powersgd_ratio(profile, powersgd_rank)
    raise HetrainError(f"unknown compression {hook!r}; choose one of: {', '.join(HOOKS)}")


def compression_ratio(hook: str, profile: WorkloadProfile | None = None, powersgd_rank: int = 2,
                      topk_ratio: float = 0.01) -> float:
    """Bytes sent relative to no compression: measured where recorded, else analytic."""
    if hook in MEASURED_RATIOS:
        return MEASURED_RATIOS[hook]
    return analytic_ratio(hook, profile, powersgd_rank, topk_ratio)


def lossless_for(specs) -> str:
    """The 16-bit gradient hook every device can reduce in: bf16 if all have it, else fp16."""
    return "bf16" if all(s.bf16 for s in specs) else "fp16"
