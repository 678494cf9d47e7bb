"""What a run measured, in the forms other tools read: per-device-kind rates and model FLOPs.

`rates_by_kind` groups the balancer's cost lines by the device kind each rank runs, for
`measured-rates.json` (`hetrain plan --from-run`). `FlopMeter` counts the FLOPs of one forward
pass with torch's FlopCounterMode, for the MFU a rank reports.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

import torch

from hetrain.planning.batch_split import RankCost
from hetrain.planning.measured_rates import DeviceRate, MeasuredRates
from hetrain.planning.plan import RankPlan

log = logging.getLogger("hetrain")


def rates_by_kind(entries: Sequence[RankPlan], costs: Sequence[RankCost], shares: Sequence[int], *, step: int,
                  global_batch_size: int, emulated: bool) -> MeasuredRates:
    """Median cost line of each device kind's ranks."""
    kinds: dict[tuple[str, str], list[int]] = {}
    for r, entry in enumerate(entries):
        kinds.setdefault((entry.device, entry.precision), []).append(r)
    devices = []
    for (device, precision), ranks in kinds.items():
        devices.append(DeviceRate(
            device=device, precision=precision, ranks=len(ranks),
            per_sample_seconds=statistics.median(costs[r].per_sample for r in ranks),
            fixed_seconds=statistics.median(costs[r].fixed for r in ranks),
            share=int(statistics.median(shares[r] for r in ranks)), emulated=emulated))
    return MeasuredRates(step=step, global_batch_size=global_batch_size, devices=devices)


class FlopMeter:
    """Counts the FLOPs of the next forward pass of `module` (then removes itself)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.flops: int | None = None
        self._mode = None
        self._handles = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop)]

    def _start(self, module: torch.nn.Module, args: object) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        try:
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()
        except Exception as e:  # noqa: BLE001 - a model the counter cannot follow reports no MFU
            log.debug("FLOPs not counted: %s", e)
            self._mode = None
            self.remove()

    def _stop(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.flops = int(self._mode.get_total_flops())
            self._mode = None
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
