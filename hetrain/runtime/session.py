"""`Session`: one rank's view of a heterogeneous data-parallel job (the loop in DESIGN.md).

    session = hetrain.Session()
    model, optimizer = session.prepare(model, optimizer)
    loader = session.loader(dataset, global_batch_size=512, shuffle=True, seed=0)
    for batch in loader:
        with session.autocast():
            loss = loss_fn(model(batch[0]), batch[1])    # mean over this rank's samples
        session.backward(loss)
        session.step()
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hetrain.errors import HetrainError
from hetrain.planning.plan import Plan
from hetrain.runtime.balancer import Balancer
from hetrain.runtime.data import GlobalBatchOrder, HeteroLoader
from hetrain.runtime.resume import CHECKPOINT_ENV, INTERVAL_ENV, SessionCheckpoints
from hetrain.runtime.precision import JobLossScaler, autocast, configure_tf32
from hetrain.runtime.timing import StepTimer, TimedHookState, emulated_speed, timed_hook

PLAN_ENV = "HETRAIN_PLAN"
log = logging.getLogger("hetrain")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class Session:
    """Reads rank, world size and plan from the launcher, and runs one rank's part of each step."""

    def __init__(self, plan: Plan | str | os.PathLike | None = None, *, backend: str | None = None,
                 balance: bool | None = None, balance_interval: int | None = None,
                 device: str | torch.device | None = None, log_level: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_interval: int | None = None,
                 keep_checkpoints: int = 3, async_checkpoints: bool = True) -> None:
        self.rank = _env_int("RANK", 0)
        _print_user_errors_as_one_line()
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.restart_count = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
        self._configure_logging(log_level)

        if plan is None and os.environ.get(PLAN_ENV):
            plan = os.environ[PLAN_ENV]
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.load(plan)
        self.plan: Plan | None = plan
        if plan is not None and plan.world_size != self.world_size and self.rank == 0:
            log.warning("the plan has %d ranks but the job has %d; its shares are recomputed for %d ranks",
                        plan.world_size, self.world_size, self.world_size)
        if plan is not None:
            _check_plan_supported(plan, self.rank, self.world_size, self._pick_device(device))
        self.device = self._pick_device(device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            self._init_process_group(backend)
        else:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

        self._balance_override = balance
        self._interval_override = balance_interval

        self.emulated_speed = emulated_speed(self.rank, self.world_size)
        self.emulated = self.emulated_speed is not None
        self.precision = self._rank_plan_field("precision", "fp32")
        configure_tf32(self.precision, self.device)
        any_fp16 = plan is not None and any(r.precision == "fp16" for r in plan.ranks)
        self.scaler = JobLossScaler(enabled=any_fp16, device=self.device)
        self._init_memory()
        self.timer = StepTimer(speed=self.emulated_speed)

        self.model: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.balancer: Balancer | None = None
        self._loader: HeteroLoader | None = None
        self.step_count = 0
        self._local_n: int | None = None
        self._global_n: int | None = None
        self._last_step_end: float | None = None
        self.step_seconds: list[float] = []      # wall time of each step on this rank
        self.compute_seconds: list[float] = []   # compute time of each step on this rank
        self._checkpoint_args = (checkpoint_dir or os.environ.get(CHECKPOINT_ENV) or None,
                                 checkpoint_interval or _env_int(INTERVAL_ENV, 100), keep_checkpoints,
                                 async_checkpoints)
        self.checkpoints: SessionCheckpoints | None = None
        if self.is_main and self.emulated:
            log.info("speeds are emulated on CPU ranks (%s): figures from this run are emulated",
                     os.environ.get("HETRAIN_EMULATE_SPEEDS"))

    # -- set-up ---------------------------------------------------------------------------------

    @staticmethod
    def _configure_logging(level: int | None) -> None:
        logger = logging.getLogger("hetrain")
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[hetrain rank %(rank)s] %(message)s"))
            handler.addFilter(_RankFilter())
            logger.addHandler(handler)
            logger.propagate = False
        if level is not None:
            logger.setLevel(level)
        elif logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO if _env_int("RANK", 0) == 0 else logging.WARNING)

    def _pick_device(self, device: str | torch.device | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def _init_process_group(self, backend: str | None) -> None:
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Workers share the elastic agent's store across restarts; keys written by a failed
            # attempt (a dead rank's address) would be read by the next one. Namespace them.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world_size=self.world_size, is_master=False)
            prefix = f"hetrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{self.restart_count}"
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=self.rank,
                                    world_size=self.world_size)
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        elif self.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            raise HetrainError(
                f"WORLD_SIZE is {self.world_size} but no rendezvous address is set; "
                "start the script with `hetrain launch --nproc-per-node N script.py`"
            )

    def _rank_plan_field(self, name: str, default: Any) -> Any:
        if self.plan is None or self.plan.world_size != self.world_size:
            return default
        return getattr(self.plan.ranks[self.rank], name)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- the user's calls -------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                blocks: list[torch.nn.Module] | None = None
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """Place the model on this rank's device, apply the plan's memory choices (activation checkpointing
        of `blocks`, found when not given; ZeRO-1 or FSDP2) and wrap it in DistributedDataParallel."""
        if self.model is not None:
            raise HetrainError("session.prepare() was already called; a session trains one model")
        self._check_master_weights(model)
        model = model.to(self.device)
        model = self._sync_batchnorm(model)
        self.blocks = self._checkpoint_activations(model, blocks)
        if self.sharding == "fsdp":
            return self._prepare_fsdp(model, optimizer)
        self._check_offload()
        comm = self.plan.comm if self.plan is not None else None
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=comm.bucket_cap_mb if comm else 25.0,
            gradient_as_bucket_view=comm.gradient_as_bucket_view if comm else True,
        )
        inner_state, inner_hook = self._inner_comm_hook()
        ddp.register_comm_hook(TimedHookState(self.timer, inner_state, inner_hook), timed_hook)
        ddp.register_forward_pre_hook(self.timer.forward_pre_hook)
        if optimizer is not None and self.sharding in ("zero1", "zero1-proportional"):
            optimizer = self._zero1(optimizer, model)
        self.model, self.optimizer = ddp, optimizer
        return ddp, optimizer

    def _inner_comm_hook(self):
        comm = self.plan.comm if self.plan is not None else None
        if comm is not None and (comm.compression != "none" or comm.hierarchical):
            from hetrain.runtime.comm_hooks import build_comm_hook

            return build_comm_hook(comm)
        return None, default_hooks.allreduce_hook

    def _sync_batchnorm(self, model: torch.nn.Module) -> torch.nn.Module:
        has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if not has_bn or self.world_size == 1:
            return model
        if self.device.type == "cuda":
            return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if self.is_main:
            warnings.warn(
                "BatchNorm statistics stay local to each CPU rank (SyncBatchNorm needs CUDA); with uneven "
                "shares each rank normalises over its own share. Use GroupNorm/LayerNorm for exact results.",
                stacklevel=3,
            )
        return model

    # -- memory: precision checks, activation checkpointing, micro-batches, ZeRO-1, FSDP2 -----------

    def _init_memory(self) -> None:
        self.sharding: str = self.plan.sharding if self.plan is not None else "none"
        self.micro_batch: int | None = self._rank_plan_field("micro_batch", None)
        self.grad_accum: int = self._rank_plan_field("grad_accum", 1)
        self.activation_checkpointing: bool = self._rank_plan_field("activation_checkpointing", False)
        self.offload_optimizer: bool = self._rank_plan_field("offload_optimizer", False)
        self.blocks: list[torch.nn.Module] = []
        self._micro_n: int | None = None  # samples of the current micro-batch (None: the whole share)
        self._micro_last = True  # the current micro-batch is this rank's last of the step

    @staticmethod
    def _check_master_weights(model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            if p.dtype in (torch.float16, torch.bfloat16):
                raise HetrainError(
                    f"parameter {name} is {str(p.dtype).removeprefix('torch.')}; hetrain keeps master weights and "
                    "optimizer state in fp32 and computes in each rank's precision under session.autocast(); "
                    "pass the model in fp32 (model.float())"
                )

    def _checkpoint_activations(self, model: torch.nn.Module, blocks: list[torch.nn.Module] | None
                                ) -> list[torch.nn.Module]:
        from hetrain.runtime import memory

        if self.activation_checkpointing:
            return memory.apply_activation_checkpointing(model, blocks)
        return memory.resolve_blocks(model, blocks)

    def _check_offload(self) -> None:
        if self.offload_optimizer and self.device.type == "cuda":
            raise HetrainError(
                f"rank {self.rank} asks for offload_optimizer with sharding {self.sharding!r}; optimizer state is "
                "offloaded through FSDP2's CPUOffloadPolicy: set the plan's sharding to 'fsdp'"
            )

    def _zero1(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        from hetrain.runtime import sharding

        weights = None
        if self.sharding == "zero1-proportional":
            caps = [self.plan.ranks[r].memory_capacity_bytes if self.plan is not None
                    and self.plan.world_size == self.world_size else None for r in range(self.world_size)]
            weights = sharding.free_memory_weights(caps, model, self.device)
            if self.is_main:
                log.info("optimizer state sharded by free memory: %s",
                         ", ".join(f"{w / sum(weights):.3f}" for w in weights))
        return sharding.zero1_optimizer(optimizer, weights)

    def _prepare_fsdp(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        from hetrain.runtime import sharding

        names = {id(p): n for n, p in model.named_parameters()}
        offload = self.offload_optimizer and self.device.type == "cuda"  # on a CPU rank state is in host memory
        model = sharding.fully_shard_model(model, self.blocks, offload=offload)
        model.register_forward_pre_hook(self.timer.forward_pre_hook)
        if optimizer is not None:
            optimizer = sharding.rebuild_optimizer(optimizer, names, model)
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def _gradient_sync(self, sync: bool):
        """DDP's no_sync / FSDP2's requires_gradient_sync(False) for all but a step's last micro-batch."""
        import contextlib

        if self.sharding == "fsdp":
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def _micro_batches(self, batch: Any):
        """This step's batch cut into pieces of at most the plan's micro_batch; backward weights each piece."""
        from hetrain.runtime import memory

        n = self._local_n or 0
        sizes = memory.micro_batch_sizes(n, self.micro_batch, self.grad_accum)
        for i, piece in enumerate(memory.split_batch(batch, sizes, n)):
            self._micro_n, self._micro_last = sizes[i], i == len(sizes) - 1
            with self._gradient_sync(self._micro_last):  # DDP reads it in forward: span the user's whole pass
                yield piece

    def loader(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
               drop_last: bool = True, collate_fn=None) -> HeteroLoader:
        """This rank's slices of one sequence of global batches (the same for any world size or split)."""
        if global_batch_size < self.world_size:
            raise HetrainError(
                f"global batch size {global_batch_size} is smaller than the number of ranks "
                f"({self.world_size}); use a global batch of at least {self.world_size}"
            )
        if self._loader is not None:
            raise HetrainError("session.loader() was already called; a session reads one dataset")
        self._setup_split(global_batch_size)
        order = GlobalBatchOrder(len(dataset), global_batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._loader = HeteroLoader(self, dataset, order, collate_fn)
        self._start_checkpoints()
        return self._loader

    def _setup_split(self, global_batch_size: int) -> None:
        plan = self.plan
        if plan is not None and plan.global_batch_size != global_batch_size:
            raise HetrainError(
                f"the plan is for a global batch of {plan.global_batch_size}, the loader asks for "
                f"{global_batch_size}; use the same global_batch_size or re-plan"
            )
        if plan is None or plan.world_size != self.world_size:
            resized = Plan.even(self.world_size, global_batch_size)
            if plan is not None:
                resized = resized.model_copy(update={"balance": plan.balance, "comm": plan.comm})
            plan = resized
        config = plan.balance.model_copy()
        if self._balance_override is not None:
            config.enabled = self._balance_override
        if self._interval_override is not None:
            config.interval = self._interval_override
        self.balancer = Balancer(config=config, shares=list(plan.shares), rank=self.rank)

    @property
    def shares(self) -> list[int]:
        """Samples of each full global batch that each rank takes, by rank."""
        if self.balancer is None:
            raise HetrainError("no split yet: call session.loader(dataset, global_batch_size) first")
        return self.balancer.shares

    @property
    def local_batch_size(self) -> int | None:
        """Samples this rank computes in the current step."""
        return self._local_n

    def _begin_step(self, local_n: int, global_n: int) -> None:
        self._local_n, self._global_n = local_n, global_n

    def autocast(self):
        """This rank's precision for the forward pass (bf16/fp16 autocast, or none)."""
        return autocast(self.precision, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's mean loss, weighted by its share so DDP's average is the global mean."""
        if self.model is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.backward()")
        if self._global_n is None:
            raise HetrainError("session.backward() needs a batch from session.loader(); iterate the loader")
        n = self._local_n if self._micro_n is None else self._micro_n
        if n == 0 and self.sharding == "fsdp":
            # No samples: exact zeros through the forward's graph, which FSDP2's reduce-scatter hangs on.
            loss = torch.nan_to_num(loss) * 0.0
        elif n == 0:
            # No samples this step: contribute exact zeros, still joining every collective.
            loss = sum((p.sum() * 0.0) for p in self.model.parameters() if p.requires_grad)
        else:
            loss = loss * (n * self.world_size / self._global_n)
        self.scaler.scale_loss(loss).backward()

    def step(self) -> bool:
        """Optimizer step (skipped on every rank if any overflowed), then balance; True if applied."""
        if self.optimizer is None:
            raise HetrainError("session.step() needs an optimizer: pass it to session.prepare(model, optimizer)")
        if not self._micro_last:
            return False  # more micro-batches of this step follow on this rank; gradients accumulate
        if self.sharding == "fsdp":
            self.timer.grads_ready()  # FSDP2 has no comm hook: backward (and its reduce-scatter) ended here
        params = [p for group in self.optimizer.param_groups for p in group["params"]]

        def apply() -> bool:
            finite = self.scaler.unscale_and_check(params)
            if finite:
                self.optimizer.step()
            self.scaler.update(finite)
            return finite

        applied = self.timer.time_optimizer(apply)
        self.optimizer.zero_grad(set_to_none=True)
        compute = self.timer.end_step()
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.step_seconds.append(now - self._last_step_end)
            self.compute_seconds.append(compute)
        self._last_step_end = now
        self.balancer.record(self._local_n or 0, compute)
        self.step_count += 1
        if self.balancer.due(self.step_count):
            self.balancer.rebalance(self.step_count, self.balancer.exchange(self.device))
        self._local_n = self._global_n = None
        self._micro_n, self._micro_last = None, True
        if self.checkpoints is not None:
            self.checkpoints.after_step()
        return applied

    # -- helpers for users and tools ---------------------------------------------------------------

    def global_mean(self, value: torch.Tensor | float, weight: float | None = None) -> float:
        """Mean over all ranks of per-rank means, weighted by each rank's samples (default: this step's)."""
        w = float(self._local_n or 0) if weight is None else float(weight)
        v = float(value.detach().float().item() if isinstance(value, torch.Tensor) else value)
        t = torch.tensor([v * w if w else 0.0, w], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    def idle_fraction(self, last: int | None = None) -> float:
        """Fraction of this rank's wall time per step spent not computing (waiting on others)."""
        wall = self.step_seconds[-last:] if last else self.step_seconds
        comp = self.compute_seconds[-last:] if last else self.compute_seconds
        return max(0.0, 1.0 - sum(comp) / sum(wall)) if wall and sum(wall) > 0 else 0.0

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Save a final checkpoint (when checkpointing), then leave the process group if this session started it."""
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None
        if self._owns_group and dist.is_initialized():
            # Every rank reaches this point before the group is torn down: destroying gloo's
            # group while a peer is still in a collective can abort the process at exit.
            dist.barrier()
            dist.destroy_process_group()

    # -- checkpoints (hetrain.runtime.resume decides what and when) ---------------------------------

    def _start_checkpoints(self) -> None:
        directory, interval, keep, async_save = self._checkpoint_args
        if directory is None:
            return
        if self.model is None:
            raise HetrainError("with checkpoints, call session.prepare(model, optimizer) before session.loader() "
                               "so the session can resume them")
        self.checkpoints = SessionCheckpoints(self, directory, interval=interval, keep=keep, async_save=async_save)
        self.checkpoints.resume()

    def _unwrapped_model(self) -> torch.nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def _optimizer_state_for_checkpoint(self) -> dict | None:
        """The whole optimizer state on rank 0 (collective under ZeRO-1: each rank's shard is gathered there)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if self.optimizer is None:
            return None
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            # ZeRO's full state dict is keyed by global parameter index: it loads on any number of ranks
            self.optimizer.consolidate_state_dict(to=0)
            return self.optimizer.state_dict() if self.rank == 0 else None
        return self.optimizer.state_dict()

    def _load_optimizer_state_from_checkpoint(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_plan_supported(plan: Plan, rank: int, world_size: int, device: torch.device) -> None:
    """Refuse what the runtime cannot apply yet; say so for what it applies differently."""
    if plan.pipeline is not None or plan.strategy in ("pipeline", "hybrid") or any(r.stage for r in plan.ranks):
        stages = len(plan.pipeline.stages) if plan.pipeline is not None else 1 + max(r.stage for r in plan.ranks)
        raise HetrainError(
            f"the plan runs a pipeline of {stages} stages (strategy {plan.strategy}); hetrain's runtime does not "
            "run pipeline stages yet. Re-plan with `hetrain plan --strategy balanced` (or zero1, zero3)"
        )
    if plan.world_size == world_size and rank < world_size:
        wanted = plan.ranks[rank].device
        if device.type == "cpu" and wanted != "cpu" and rank == 0:
            log.info("the plan was made for %s devices; this job runs them on CPU ranks (speeds may be emulated "
                     "with --emulate-speeds)", ", ".join(sorted({r.device for r in plan.ranks})))


def _print_user_errors_as_one_line() -> None:
    """In a worker, a HetrainError (bad input) ends the rank with one line and exit code 2."""
    previous = sys.excepthook
    if getattr(previous, "_hetrain", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, HetrainError):
            if _env_int("RANK", 0) == 0:
                print(f"hetrain: error: {value}", file=sys.__stderr__, flush=True)  # torch may redirect sys.stderr
            os._exit(2)  # skip interpreter teardown: peers may be blocked in collectives
        previous(kind, value, tb)

    hook._hetrain = True
    sys.excepthook = hook


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


