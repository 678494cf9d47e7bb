"""Every rank's rows of a tensor, for losses that look across ranks (contrastive, CLIP-style negatives).

Each rank holds its share of the global batch, and shares differ: torch's `all_gather` needs the
same size on every rank (two ranks of 40 and 24 samples stopped with gloo's "collective mismatch",
and a job on an even split stopped at its first re-split). `gather_rows` pads each rank's rows to the
longest share, gathers them with torch's autograd-aware all-gather, and joins the real rows in rank
order, which is the global batch's order (rank r's slice follows rank r-1's). The gradient flows back
to each rank's own rows. A loss that stays exact for any split is each rank's mean over its own rows
against every rank's columns (docs/porting.md, "Losses across ranks").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` joined along the first dimension in rank order (sizes may differ by rank); the
    gradient reaches each rank's own rows (collective: every rank calls it, once per forward)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    world = dist.get_world_size()
    count = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    longest = max(sizes)
    padded = tensor.contiguous()
    if tensor.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros(longest - tensor.shape[0], *tensor.shape[1:])])
    if tensor.requires_grad:
        parts = dist_autograd.all_gather(padded)
    else:
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])
