"""The words hetrain uses everywhere: Plan JSON, CLI flags, the Python API and the docs.

Each list is written once here; the Plan's types, the CLI's choices and the runtime's checks are
built from it. Nothing here imports torch.
"""

from __future__ import annotations

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")
"""Compute precision of one device: autocast dtype (bf16, fp16) or full-width matmuls (tf32, fp32)."""

SHARDINGS = ("none", "zero1", "zero1-proportional", "fsdp")
"""How parameters and optimizer state are spread over ranks."""

ZERO1_SHARDINGS = ("zero1", "zero1-proportional")

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "int8", "topk")
"""Gradient compression of the data-parallel all-reduce."""

LOSSY_COMPRESSIONS = ("powersgd", "int8", "topk")
"""Those that send part of each gradient and carry the rest to later steps (error feedback)."""

STRATEGIES = ("ddp", "balanced", "zero1", "zero3", "pipeline", "hybrid")
"""What a plan does: plain even DDP, balanced data parallelism, sharded variants, pipeline stages."""

PIPELINE_STRATEGIES = ("pipeline", "hybrid")

OPTIMIZERS = ("adamw", "adam", "adamw-fused", "adam-fused", "sgd", "sgd-fused", "lion", "sgd-nomomentum")
"""The optimizer a plan prices: torch.optim's AdamW, Adam and SGD with momentum as constructed by
default (on GPUs their multi-tensor step), the same with `fused=True`, Lion, and SGD without momentum."""

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Pipeline schedules (torch.distributed.pipelining's); interleaved-1f1b runs several stages per rank."""

CPU_DEVICE = "cpu"
"""The device name of a CPU rank in a plan."""


class Env:
    """Environment variables the launcher sets for every worker (and a user may set by hand)."""

    PLAN = "HETRAIN_PLAN"
    CHECKPOINT_DIR = "HETRAIN_CHECKPOINT_DIR"
    CHECKPOINT_INTERVAL = "HETRAIN_CHECKPOINT_INTERVAL"
    START_FRESH = "HETRAIN_START_FRESH"
    """1: start from step 0 when the checkpoint directory holds checkpoints and none verifies (they are kept
    as damaged-step-*); without it such a job stops and names them."""
    SIGTERM_GRACE = "HETRAIN_SIGTERM_GRACE"
    SIGTERM_MAX_WAIT = "HETRAIN_SIGTERM_MAX_WAIT"
    """Seconds after SIGTERM a rank whose peers all still run waits for its step's end (default 25)."""
    EMULATE_SPEEDS = "HETRAIN_EMULATE_SPEEDS"
    EMULATE_DEVICES = "HETRAIN_EMULATE_DEVICES"
    """Comma-separated catalog names, one per local rank: the device each CPU rank stands in for."""
    METRICS_PORT = "HETRAIN_METRICS_PORT"
    RUN_DIR = "HETRAIN_RUN_DIR"
    COLLECTIVE_TIMEOUT = "HETRAIN_COLLECTIVE_TIMEOUT"
    NNODES = "HETRAIN_NNODES"
    """The launcher's --nnodes, compared across the job's ranks (the rendezvous runs with the first node's)."""
    LAUNCH_ID = "HETRAIN_LAUNCH_ID"
    """Set by `hetrain launch` for its workers: their descendants carry it, so the launcher can end
    any the job leaves behind."""
