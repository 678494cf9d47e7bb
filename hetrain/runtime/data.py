"""The per-rank loader: this rank's slice of each global batch, read by torch's DataLoader.

The order of global batches is `GlobalBatchOrder` (one permutation per epoch; data_order.py).
A map-style dataset is read through `torch.utils.data.DataLoader` with a `RankBatchSampler`
(batch_sampler.py), so workers, prefetching, pinned memory and collate functions keep their
DataLoader meaning. A stream (`IterableDataset`) is cut into global batches in stream order
(stream.py). Each step's batch is handed out with the step state set and moved to the device.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate

from hetrain.checkpoint.errors import START_FROM_WEIGHTS
from hetrain.errors import HetrainError, ranks_by_value, ranks_text
from hetrain.runtime.batch_tree import check_cuttable
from hetrain.runtime.batch_sampler import RankBatchSampler, ShareSchedule, check_order_arguments, step_shares
from hetrain.runtime.batch_transfer import to_device
from hetrain.runtime.environment import add_error_hint
from hetrain.runtime.loader_options import checked_options
from hetrain.runtime.loader_position import StepPosition
from hetrain.runtime.loader_workers import with_sigterm_left_to_rank
from hetrain.runtime.data_order import GlobalBatchOrder, generator_seed, rank_slice
from hetrain.runtime.sample_seeds import KeyedBatches, SeededSamples
from hetrain.runtime.memory import empty_batch, equal_pieces, job_piece_count, micro_batch_sizes, split_batch
from hetrain.runtime.step_state import StepState
from hetrain.runtime.tensor_gather import TensorGather, as_is, reads_as_tensor_dataset
from hetrain.runtime.stream import PassCount, check_workers, unpack
from hetrain.planning.batch_split import split_partial

__all__ = ["GlobalBatchOrder", "HeteroLoader", "make_loader", "rank_slice"]

log = logging.getLogger("hetrain")

_END = object()


class HeteroLoader:
    """Iterates one epoch of this rank's slices; `len()` is the steps per epoch, equal on all ranks.

    Each batch is on the rank's device. A rank whose share of a step is 0 receives an empty batch
    and still takes the step. Handing out a batch moves the data position (what a checkpoint
    saves): a batch drawn and dropped is a step of data skipped. Batches prefetched by workers
    and not handed out are not part of the position: a resumed run reads them again.
    """

    def __init__(self, dataset: Any, order: GlobalBatchOrder | None, *, rank: int, split: Any, step: StepState,
                 device: torch.device, micro_batch: int | None = None, grad_accum: int = 1,
                 gradient_sync: Callable[[bool], ContextManager] | None = None,
                 same_piece_count: Sequence[tuple[int | None, int]] | None = None,
                 collate_fn: Callable | None = None, lag: int = 0, global_batch_size: int | None = None,
                 seed: int = 0, drop_last: bool = True, **dataloader_options: Any) -> None:
        self.dataset = dataset
        self.order = order
        self.stream = order is None
        self.rank = rank
        self.split = split              # anything with a `shares` list (the balancer)
        self.step = step
        self.device = device
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        # every rank's (micro_batch, grad_accum), when every rank must run as many micro-batches (FSDP2)
        self.same_piece_count = list(same_piece_count) if same_piece_count is not None else None
        self.gradient_sync = gradient_sync or (lambda sync: contextlib.nullcontext())
        # whether the model holds gradients no step used (the session tells; a loop that zeroed them
        # after backward, to read them, mixes nothing)
        self.gradients_pending: Callable[[], bool] = lambda: True
        # told (epoch, batches) when the stream ends a pass, None once every rank began the next (the session's watch)
        self.on_stream_end: Callable[[tuple[int, int] | None], None] = lambda ended: None
        self.on_phase: Callable[[str], None] = lambda phase: None   # "reading" its batch, "computing" its step, or
        # "between": the loop left it with a batch drawn
        self._warned_no_step = False
        self.collate_fn = collate_fn or default_collate
        self.global_batch_size = order.global_batch_size if order is not None else int(global_batch_size)
        self.seed = order.seed if order is not None else seed
        self._epoch = 0
        self._in_epoch = 0   # steps of `epoch` already handed out
        self._end_pending = False   # resumed from a checkpoint the epoch's last step took inside session.step()
        self.run_step = 0        # steps handed out since the run began (all epochs)
        self._position = StepPosition()   # as of the last step taken: what a checkpoint saves
        self.schedule = ShareSchedule(split.shares, lag=0 if self.stream else lag)
        # how long the training loop blocked for the last step's batch: the loading that workers did not
        # hide (all of it without workers), collating and moving it to the device included
        self.data_wait_seconds = 0.0
        self._generator = torch.Generator()   # workers' base seed, apart from the global RNG
        add_error_hint(self._empty_batch_hint)
        if self.stream:
            self._source = _GlobalBatchSource(dataset, self.global_batch_size, drop_last)
            self.sampler = None
            self.dataloader = DataLoader(self._source.stream, batch_size=None, collate_fn=as_is,
                                         generator=self._generator, **dataloader_options)
        else:
            self.sampler = RankBatchSampler(order, self.schedule, rank)
            if reads_as_tensor_dataset(dataset) and collate_fn in (None, default_collate):   # nothing random
                self.dataloader = DataLoader(TensorGather(dataset), batch_sampler=self.sampler, collate_fn=as_is,
                                             generator=self._generator, **dataloader_options)
            else:   # each sample read with the generators seeded from (seed, epoch, index): sample_seeds.py
                self.dataloader = DataLoader(SeededSamples(dataset, self.seed, self.collate_fn is default_collate),
                                             batch_sampler=KeyedBatches(self.sampler), collate_fn=self.collate_fn,
                                             generator=self._generator, **dataloader_options)

    @property
    def epoch(self) -> int:
        """The epoch the loop is in; once the step of its last batch has ended (`session.step()`) the next, so
        `while loader.epoch < epochs` stops after the run's last step. Resumed from a checkpoint that step took,
        the epoch's own until a pass with no batch: the loop's code after the epoch's batches runs again."""
        return self._epoch + 1 if self._finished() else self._epoch

    @property
    def step_in_epoch(self) -> int:
        """Steps of `epoch` handed out (0 once an epoch's last step has ended)."""
        return 0 if self._finished() else self._in_epoch

    def _finished(self) -> bool:   # the epoch's last step has ended (a resumed one's end code has run too)
        return self._epoch_done() and not self.step.active and not self._end_pending

    @property
    def piece_samples(self) -> int | None:
        """Samples of the batch or micro-batch the loop holds that count: 0 for a stand-in piece (FSDP2 runs the
        job's piece count; a rank short of pieces repeats its first samples, counted as 0 items)."""
        return self.step.current_samples() if self.step.active else None

    @property
    def lag(self) -> int:
        """Steps between a split change seen by the loader and the first step it applies to."""
        return self.schedule.lag

    @property
    def current_shares(self) -> list[int]:
        """The split of the step last handed out (a split the balancer decides arrives `lag` steps later)."""
        return list(self.schedule.at(max(self.run_step - 1, 0)))

    def __len__(self) -> int:
        if self.order is None:
            raise TypeError("a loader over a stream (IterableDataset) has no length: the stream decides when "
                            "the epoch ends")
        return self.order.steps_per_epoch

    def _empty_batch_hint(self, error: BaseException) -> str | None:
        """A note for an error that ends the rank while its batch of the step is empty (share 0)."""
        if not (self.step.active and self.step.local_samples == 0):
            return None
        return ("hetrain: this rank has no samples in this step (share 0) and its batch is empty; if the error came "
                "from the model, some models cannot take one (Hugging Face transformers): give every rank a sample: "
                "drop_last=True in session.loader() where the epoch's last global batch has fewer samples than "
                "there are ranks, min_share >= 1 in the plan's balance settings, or a plan that gives every device samples")

    def _epoch_done(self) -> bool:
        return self.order is not None and self._in_epoch >= self.order.steps_per_epoch

    def _check_last_step_ended(self) -> None:
        """A new step's batch is about to be handed out: the last one must have ended in session.step()."""
        if not self.step.active:
            return
        if self.step.backwards and not self.step.last_micro:
            raise HetrainError(
                "a new step's batch was drawn while the last step had micro-batches left: a new iter(loader) "
                "(next(iter(loader)) each iteration) leaves the plan's other micro-batches of that step unread, "
                "and session.step() returned False on the one it ran; keep one iterator, or loop with "
                "'for batch in loader'")
        if self.step.backwards and self.gradients_pending():
            raise HetrainError(
                "session.backward() ran on the last batch but no session.step() followed before the next one: "
                "the two steps' gradients would be mixed and divided by one step's items; call session.step() "
                "after every batch (accumulating over several batches is the plan's micro-batches: set "
                "global_batch_size to the whole batch)")
        if not self._warned_no_step:   # once an iteration: an evaluation pass over the loader is one mistake
            self._warned_no_step = True
            log.warning("a batch was drawn from the loader and no session.step() followed; iterating the loader "
                        "moves the data position, so that batch's step of data is skipped (docs/porting.md)")

    def __iter__(self) -> Iterator[Any]:
        self._warned_no_step = False
        if self._end_pending:   # resumed from an epoch's last step: a pass with no batch, then the epoch's end code
            self._end_pending, self._epoch, self._in_epoch = False, self._epoch + 1, 0
            return
        if self._epoch_done():
            self._epoch, self._in_epoch = self._epoch + 1, 0
        self.schedule.observe(self.run_step, self.split.shares)
        self._generator.manual_seed(generator_seed(self.seed * 1_000_003 + self._epoch))
        if self.stream:
            self._source.new_pass(self._in_epoch, self._epoch)
        else:
            self.sampler.start(self._epoch, self._in_epoch, self.run_step)
        batches = map(unpack, iter(self.dataloader)) if self.stream else iter(self.dataloader)
        counted = None
        if self.stream and self.dataloader.num_workers > 1:   # every worker's first batch, before any step
            counted = PassCount(batches)
            batches = iter(counted)
            head = list(itertools.islice(batches, self.dataloader.num_workers))
            check_workers(head, self.dataloader.num_workers)
            batches = itertools.chain(head, batches)
        started_at = self._in_epoch
        while not self._epoch_done():
            self.step.check_open()
            self.schedule.observe(self.run_step, self.split.shares)
            shares = self.schedule.at(self.run_step)
            started = time.perf_counter()
            self.on_phase("reading")
            batch = next(batches, _END)   # _END: the stream ended (a map-style epoch ends by its length above)
            if self.stream and self._in_epoch == started_at:   # floats too at a fresh start, before generators part
                self._source.check_ranks(None if batch is _END else batch, floats=self.run_step == 0)
                self.on_stream_end(None)
            if batch is _END:
                if counted is not None:   # every global batch of the pass came (no worker stopped by the stream)
                    counted.check(self._in_epoch - started_at, started_at, self.dataloader.num_workers)
                if self.stream:
                    self.on_stream_end((self._epoch, self._in_epoch))
                break
            if self.stream:
                batch, local, total = self._source.take(batch, shares, self.rank, self.collate_fn)
                used = list(shares) if total == sum(shares) else split_partial(total, shares)
            else:
                used = step_shares(self.order, self._in_epoch, shares)
                local, total = used[self.rank], sum(used)
                if local == 0:
                    batch = empty_batch(batch)
            if self._in_epoch == started_at and local and self._may_cut(shares):
                check_cuttable(batch, local)   # what a later step may need to cut, refused at the first
            batch = to_device(batch, self.device)
            self.data_wait_seconds = time.perf_counter() - started
            self._check_last_step_ended()
            self._position.drawing((self._epoch, self._in_epoch, self.run_step), self.step.finished)
            self.step.begin_step(local, total, used)
            self.on_phase("computing")
            self._in_epoch += 1
            self.run_step += 1
            try:
                yield from self._pieces(batch, local, shares)
            except GeneratorExit:   # the loop left with this batch drawn (a break, zip's last draw): its own code
                self.on_phase("between")
                raise
        del batches
        if self.stream and started_at == 0 and self._in_epoch == 0:   # a whole pass without a global batch
            if self.run_step > 0:
                raise HetrainError(
                    f"the stream yielded no global batch in epoch {self._epoch} after earlier epochs did: its "
                    "__iter__ must start the stream again each time it is called (an iterator or generator "
                    "object stored in the dataset is read once); or loop over one epoch of it")
            raise HetrainError(
                f"the stream ended before one global batch of {self.global_batch_size} samples"
                + (" (drop_last=True drops a last, partial batch)" if self._source.drop_last else "")
                + "; lower global_batch_size, pass drop_last=False, or check the stream yields samples")
        # the epoch is complete: the next iteration starts the next one
        self._epoch += 1
        self._in_epoch = 0

    def _may_cut(self, shares: Sequence[int]) -> bool:
        """Whether a step may cut a batch: micro-batches, or a rank given no samples (a share of 0, a last
        partial global batch smaller than the ranks, a balancer allowed to give none)."""
        pieces = self.micro_batch or self.same_piece_count or self.grad_accum > 1
        drop_last = self._source.drop_last if self.stream else self.order.drop_last
        min_share = getattr(getattr(self.split, "config", None), "min_share", 1)
        return bool(pieces) or (len(shares) > 1 and (0 in shares or not drop_last or min_share == 0))

    def set_epoch(self, epoch: int) -> None:
        """What a loop written for Accelerate or a DistributedSampler calls each epoch."""
        raise HetrainError(
            f"loader.set_epoch({epoch}): the loader orders each epoch itself and resumes mid-epoch; remove the "
            "call and loop with 'while loader.epoch < epochs: for batch in loader' (docs/porting.md)")

    @property
    def batch_sampler(self) -> Any:
        """DataLoader's name for it (`loader.batch_sampler.set_epoch(epoch)`, an Accelerate loop's call): the
        sampler of this rank's batches (a stream's: the loader), whose set_epoch says what to do instead."""
        return self.sampler if self.sampler is not None else self

    def _pieces(self, batch: Any, n: int, shares: Sequence[int]) -> Iterator[Any]:
        """The step's batch, or its micro-batches when the plan caps this rank's micro_batch below its share
        (under FSDP2, as many as the rank that needs the most, some maybe empty)."""
        if self.same_piece_count is not None:
            sizes = equal_pieces(n, job_piece_count(shares, self.same_piece_count), self.micro_batch, self.grad_accum)
        else:
            sizes = micro_batch_sizes(n, self.micro_batch, self.grad_accum)
        for i, piece in enumerate(split_batch(batch, sizes, n)):
            last = i == len(sizes) - 1
            self.step.begin_micro(sizes[i], last)
            with self.gradient_sync(last):  # DDP reads it in forward: span the user's whole pass
                yield piece

    def state_dict(self, in_step: bool = False) -> dict:
        epoch, in_epoch, run_step = self._position.saved((self._epoch, self._in_epoch, self.run_step),
                                                         self.step.finished)   # a draw given no step is not in it
        state = {"epoch": epoch, "step_in_epoch": in_epoch, "run_step": run_step, "seed": self.seed,
                 "epoch_end_pending": (in_step and self._epoch_done()) or self._end_pending,
                 "global_batch_size": self.global_batch_size, "schedule": self.schedule.state_dict()}
        if self.order is not None:
            state["order"] = self._order_settings()
        return state

    def _order_settings(self) -> dict:
        return {"samples": self.order.dataset_len, "shuffle": self.order.shuffle, "drop_last": self.order.drop_last}

    def load_state_dict(self, state: dict) -> None:
        if state["global_batch_size"] != self.global_batch_size or state["seed"] != self.seed:
            raise HetrainError(
                f"the checkpoint's data order (global batch {state['global_batch_size']}, seed {state['seed']}) "
                f"differs from this loader's ({self.global_batch_size}, {self.seed}); "
                f"resume with the same global_batch_size and seed, or {START_FROM_WEIGHTS}")
        epoch, in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        saved = state.get("order")
        if saved is not None and self.order is not None and saved != self._order_settings():
            if in_epoch >= GlobalBatchOrder(saved["samples"], self.global_batch_size,
                                            drop_last=saved["drop_last"]).steps_per_epoch:
                epoch, in_epoch = epoch + 1, 0   # the saved epoch was complete: the next starts in this order
            elif in_epoch:
                changed = ", ".join(f"{k} {saved[k]} -> {v}" for k, v in self._order_settings().items()
                                    if saved.get(k) != v)
                raise HetrainError(
                    f"the checkpoint stopped in the middle of epoch {epoch}, and this loader orders that epoch "
                    f"differently ({changed}): the rest of the epoch would repeat some samples and skip others; "
                    "resume with the checkpoint's dataset and loader settings, or change them at an epoch's end")
        self._epoch, self._in_epoch = epoch, in_epoch
        self._end_pending = bool(state.get("epoch_end_pending")) and self._epoch_done()
        self.run_step = int(state.get("run_step", 0))
        saved = state.get("schedule")
        if saved is not None and all(len(s) == len(self.split.shares) for _, s in saved["changes"]):
            self.schedule.load_state_dict(saved)
        else:   # another world size: the split starts from this run's
            self.start_split_anew()

    def start_split_anew(self) -> None:
        """Every step from now takes the split's current shares (a resume whose saved split is not this run's)."""
        self.schedule.changes = [(0, list(self.split.shares))]


class _GlobalBatchSource:
    """A stream's global batches and this rank's slice of each."""

    def __init__(self, dataset: IterableDataset, global_batch_size: int, drop_last: bool) -> None:
        from hetrain.runtime.stream import GlobalBatchStream

        self.stream = GlobalBatchStream(dataset, global_batch_size, drop_last=drop_last)
        self.drop_last = drop_last

    def new_pass(self, skip: int, epoch: int) -> None:
        self.stream.new_pass(skip, epoch)

    @staticmethod
    def check_ranks(item: tuple[str | None, list[Any]] | None, floats: bool) -> None:
        """Every rank reads the same stream: the digests of a pass's first global batch (None for a stream
        that ended) must agree (collective, once a pass). Float values count only with `floats` (a run's
        first pass): later, dropout on unequal shares has moved the ranks' generators apart, and a float
        augmentation drawn from them differs while every sample is still read once."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        from hetrain.runtime.stream import fingerprint

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, None if item is None else fingerprint(item[1], floats=floats))
        if len(set(gathered)) > 1:
            read = "; ".join(ranks_text(ranks) + (" read none" if digest is None else "")
                             for digest, ranks in ranks_by_value(gathered).items())
            raise HetrainError(
                f"the ranks' streams gave different first global batches ({read}): hetrain has every rank read "
                "the whole stream and keep its slice of each global batch, so a stream split by rank "
                "(split_dataset_by_node, split_by_node, range(rank, n, world_size)) loses the other ranks' "
                "samples, and a shuffle buffer seeded differently on each rank repeats some and loses others; "
                "give every rank the whole stream in one order (seed any shuffle the same on every rank); "
                "values drawn at random (a token window, a mask; noise in samples of floats only) must come "
                "from the sample's position in the stream (docs/data.md, Streams)")

    @staticmethod
    def take(item: tuple[str | None, list[Any]], shares: list[int], rank: int,
             collate_fn: Callable) -> tuple[Any, int, int]:
        """(this rank's collated slice, its samples, the global batch's samples)."""
        _, samples = item
        if len(samples) != sum(shares):
            shares = split_partial(len(samples), shares)
        mine = rank_slice(samples, shares, rank)
        if not mine:
            return empty_batch(collate_fn(samples[:1])), 0, len(samples)
        return collate_fn(mine), len(mine), len(samples)


def prefetch_depth(options: dict[str, Any]) -> int:
    """Steps a DataLoader with these options reads ahead of the loop (0 without workers)."""
    workers = int(options.get("num_workers", 0) or 0)
    if workers <= 0:
        return 0
    factor = options.get("prefetch_factor")
    return workers * (2 if factor is None else int(factor))


def agreed_lag(depth: int, device: torch.device, settings: dict[str, Any] | None = None) -> int:
    """The largest prefetch depth of any rank: every rank schedules split changes the same steps ahead.
    `settings` (what orders the global batches) must be the same on every rank: a difference is refused,
    naming it, before any batch is read."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return depth
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (depth, settings))
    differ = [key for key in (settings or {}) if len({repr(g[1].get(key)) for g in gathered}) > 1]
    if differ:
        by_rank = "; ".join(f"{key}: " + ", ".join(f"rank {r} {g[1].get(key)}" for r, g in enumerate(gathered))
                            for key in differ)
        raise HetrainError(
            f"the ranks' session.loader() settings differ ({by_rank}): every rank must read one sequence of global "
            "batches, or samples are lost and repeated; give every node the same dataset, global_batch_size, seed, "
            "shuffle and drop_last")
    return max(g[0] for g in gathered)


def _length(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise HetrainError(
            f"the dataset ({type(dataset).__name__}) has no len() and is not an IterableDataset; give it __len__ "
            "and __getitem__, or make it a torch.utils.data.IterableDataset to read it as a stream"
        ) from None


def make_loader(dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                rank: int, split: Any, step: StepState, device: torch.device, micro_batch: int | None = None,
                grad_accum: int = 1, gradient_sync: Callable[[bool], ContextManager] | None = None,
                same_piece_count: Sequence[tuple[int | None, int]] | None = None,
                collate_fn: Callable | None = None, **dataloader_options: Any) -> HeteroLoader:
    """The loader `session.loader()` returns: this rank's part of one global-batch order.

    `dataloader_options` are `torch.utils.data.DataLoader`'s (num_workers, pin_memory,
    prefetch_factor, persistent_workers, worker_init_fn, timeout, multiprocessing_context, ...),
    with DataLoader's meaning. Collective when ranks are initialised (they agree on the lag).
    """
    shuffle, seed, drop_last = check_order_arguments(shuffle, seed, drop_last)
    dataloader_options = checked_options(dataset, dataloader_options)
    stream = isinstance(dataset, IterableDataset)
    settings = {"global_batch_size": global_batch_size, "seed": seed, "shuffle": shuffle if not stream else None,
                "drop_last": drop_last, "samples": "a stream" if stream else _length(dataset)}
    lag = agreed_lag(prefetch_depth(dataloader_options), device, settings)
    common = dict(rank=rank, split=split, step=step, device=device, micro_batch=micro_batch, grad_accum=grad_accum,
                  gradient_sync=gradient_sync, same_piece_count=same_piece_count, collate_fn=collate_fn, lag=lag,
                  **with_sigterm_left_to_rank(dataloader_options))
    if isinstance(dataset, IterableDataset):
        if dataloader_options.get("persistent_workers"):
            raise HetrainError(
                "persistent_workers=True with a stream (IterableDataset): persistent workers keep the stream "
                "position they started with, so a resumed or later pass would read the wrong batches; drop it"
            )
        if global_batch_size < 1:
            raise HetrainError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if shuffle:
            log.debug("a stream is read in its own order; shuffle it in the stream (e.g. a shuffle buffer)")
        return HeteroLoader(dataset, None, global_batch_size=global_batch_size, seed=seed, drop_last=drop_last,
                            **common)
    order = GlobalBatchOrder(settings["samples"], global_batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    tail, ranks = settings["samples"] % global_batch_size, len(split.shares)
    if not drop_last and 0 < tail < ranks and rank == 0:
        log.warning("the epoch's last global batch has %d sample(s) for %d ranks: %d rank(s) get an empty batch in "
                    "that step, which some models cannot take (Hugging Face transformers); %s",
                    tail, ranks, ranks - tail,
                    "drop_last=True avoids it" if settings["samples"] >= global_batch_size else
                    "the dataset is that batch, so only more samples avoid it")
    return HeteroLoader(dataset, order, **common)
