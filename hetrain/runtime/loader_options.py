"""What a script passes session.loader() from its DataLoader: the options hetrain decides itself are refused in
one line naming what decides them, DataLoader's own defaults (None) are let through, and a name that is not
DataLoader's is named with the closest one."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from hetrain.errors import HetrainError

OWNED = {"batch_size": "global_batch_size", "shuffle": "shuffle", "sampler": "seed and shuffle",
         "batch_sampler": "the balancer's split", "generator": "the workers' seeds, from seed"}
NONE_BY_DEFAULT = ("sampler", "batch_sampler", "generator")


def checked_options(dataset: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader options to pass on, less DataLoader's own defaults a script passes through
    (`sampler=sampler if ddp else None`); one-line errors for what a user coming from a DataLoader passes first."""
    options = {k: v for k, v in options.items() if not (v is None and k in NONE_BY_DEFAULT)}
    if isinstance(dataset, DataLoader):
        raise HetrainError(
            "session.loader() was given a DataLoader; it reads the dataset itself: pass loader.dataset and the "
            "loader's options, e.g. session.loader(dl.dataset, global_batch_size, num_workers=dl.num_workers, "
            "collate_fn=dl.collate_fn)"
        )
    if options.get("in_order") is False:
        raise HetrainError("session.loader(..., in_order=False) would hand out steps out of order, and each step's "
                           "batch must be that step's slice; drop in_order=False")
    if isinstance(options.get("sampler"), DistributedSampler):
        raise HetrainError(
            "session.loader(..., sampler=DistributedSampler(...)): a DistributedSampler gives each rank an even "
            "part of the dataset, and hetrain splits each global batch by the ranks' shares itself; drop it and "
            "pass its shuffle and seed: session.loader(dataset, global_batch_size, shuffle=..., seed=...)")
    for name, owner in OWNED.items():
        if name in options:
            sampled = ("; a sampler's own order or weights cannot be kept: draw the epoch's indices yourself "
                       "(e.g. torch.multinomial over the weights) and pass Subset(dataset, indices) with "
                       "shuffle=False") if name in ("sampler", "batch_sampler") else ""
            raise HetrainError(
                f"session.loader(..., {name}=) is decided by hetrain ({owner}): every rank takes its share of "
                f"one global batch; drop it and pass global_batch_size, shuffle and seed{sampled}"
            )
    known = set(inspect.signature(DataLoader.__init__).parameters) - {"self", "dataset"}
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise HetrainError(f"session.loader(..., {name}=): not an option of torch's DataLoader"
                               + (f"; did you mean {close[0]}=?" if close else
                                  f"; its options: {', '.join(sorted(known - set(OWNED)))}"))
    return options
