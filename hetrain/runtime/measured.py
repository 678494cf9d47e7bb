"""What a run measured, in the forms other tools read: per-device-kind rates and model FLOPs.

`rates_by_kind` groups the balancer's cost lines by the device kind each rank runs, for
`measured-rates.json` (`hetrain plan --from-run`). `FlopMeter` counts the FLOPs of one forward
pass (of each of a pipeline rank's chunks) with torch's FlopCounterMode and each step's input elements, for
the MFU a rank reports.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

import torch

from hetrain.planning.batch_split import RankCost
from hetrain.planning.measured_rates import DeviceRate, MeasuredRates
from hetrain.planning.plan import RankPlan
from hetrain.runtime.batch_tree import tensors

log = logging.getLogger("hetrain")


def rates_by_kind(entries: Sequence[RankPlan], costs: Sequence[RankCost | None], shares: Sequence[int], *, step: int,
                  global_batch_size: int, emulated: bool, model_params: int | None = None) -> MeasuredRates:
    """Median cost line of each device kind's ranks (those measured: a rank the plan gave no samples has
    no cost line, and a kind with none of its ranks measured is left out)."""
    kinds: dict[tuple[str, str], list[int]] = {}
    for r, entry in enumerate(entries):
        if costs[r] is not None:
            kinds.setdefault((entry.device, entry.precision), []).append(r)
    devices = []
    for (device, precision), ranks in kinds.items():
        devices.append(DeviceRate(
            device=device, precision=precision, ranks=len(ranks),
            per_sample_seconds=statistics.median(costs[r].per_sample for r in ranks),
            fixed_seconds=statistics.median(costs[r].fixed for r in ranks),
            share=int(statistics.median(shares[r] for r in ranks)), emulated=emulated))
    return MeasuredRates(step=step, global_batch_size=global_batch_size, devices=devices, model_params=model_params)


class FlopMeter:
    """Counts the FLOPs of the first forward pass of each of `modules` (the model, or a pipeline rank's chunks,
    which torch's schedule calls one by one), and the input elements (the numbers in the tensors passed to it)
    of every forward: a step's FLOPs are each module's first forward's per input element times its elements in
    the step. Padded tokens count as the model computes them; a batch twice as long costs twice the FLOPs
    whatever `num_items` says. `carries_samples` says whether the forward now running computes samples: a
    stand-in piece (rows run so that FSDP2's collectives meet, which carry no samples) or a pipeline's shape
    inference (a forward of torch's own on placeholder data) is not the model's work."""

    def __init__(self, modules: torch.nn.Module | Sequence[torch.nn.Module],
                 carries_samples: Callable[[], bool] = lambda: True) -> None:
        modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        self._parts = [_ModuleFlops(m, carries_samples) for m in modules]

    def take_step_flops(self) -> float | None:
        """Forward and backward FLOPs (3x the forwards') of the forwards since the last call; None before
        every module's first forward was counted, when one could not be, or when they count none."""
        taken = [part.take_step_flops() for part in self._parts]
        if any(flops is None for flops in taken) or not any(taken):
            return None
        return sum(taken)

    def remove(self) -> None:
        for part in self._parts:
            part.remove()


class _ModuleFlops:
    """One module's FLOPs per input element (its first forward of samples) and its input elements since the
    last `take_step_flops`."""

    def __init__(self, module: torch.nn.Module, carries_samples: Callable[[], bool]) -> None:
        self.carries_samples = carries_samples
        self.flops: int | None = None
        self.first_elements = 0
        self.step_elements = 0     # input elements of the forwards since `take_step_flops` last ran
        self.failed = False
        self._mode = None
        self._counting = [module.register_forward_pre_hook(self._start, with_kwargs=True),
                          module.register_forward_hook(self._stop)]
        self._elements = module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # a training forward of samples; an evaluation under no_grad, or a stand-in, is not the step's work
        if torch.is_grad_enabled() and self.carries_samples():
            self.step_elements += _elements(args, kwargs)

    def _start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.first_elements = _elements(args, kwargs)
        if not self.first_elements or not self.carries_samples():   # a rank without samples yet (its share 0)
            self.first_elements = 0   # counts the FLOPs of the first forward that has some
            return
        try:
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()
        except Exception as e:  # noqa: BLE001 - a model the counter cannot follow reports no MFU
            log.debug("FLOPs not counted: %s", e)
            self._mode, self.failed = None, True
            self.remove()

    def _stop(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._mode is None and not self.first_elements:   # a forward without samples: the next one is counted
            return
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.flops = int(self._mode.get_total_flops())
            self._mode = None
        for handle in self._counting:
            handle.remove()
        self._counting = []
        if not self.flops or not self.first_elements:
            self.remove()

    def take_step_flops(self) -> float | None:
        """Forward and backward FLOPs of the forwards since the last call: 0 for a module whose forward counts
        none (an activation), None before its first forward was counted, or when it could not be."""
        elements, self.step_elements = self.step_elements, 0
        if self.failed or self.flops is None:
            return None
        if not self.flops or not self.first_elements:
            return 0.0
        return 3.0 * self.flops * elements / self.first_elements

    def remove(self) -> None:
        for handle in self._counting:
            handle.remove()
        self._counting = []
        if self._elements is not None:
            self._elements.remove()
            self._elements = None


def _elements(args: tuple, kwargs: dict) -> int:
    """The numbers in the tensors a forward is given."""
    return sum(t.numel() for t in tensors((args, kwargs)))
