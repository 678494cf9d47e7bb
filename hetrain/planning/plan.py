"""The Plan: everything that differs per rank, as a versioned JSON document.

The planner writes it, the runtime reads it, a user can read and edit it
(`hetrain launch --plan plan.json`), and a checkpoint stores it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetrain.errors import HetrainError, format_validation_error
from hetrain.vocabulary import COMPRESSIONS, PRECISIONS, SCHEDULES, SHARDINGS, STRATEGIES, ZERO1_SHARDINGS

PLAN_VERSION = 1

Precision = Literal[PRECISIONS]
Compression = Literal[COMPRESSIONS]
Sharding = Literal[SHARDINGS]
Strategy = Literal[STRATEGIES]
Schedule = Literal[SCHEDULES]

STRATEGY_SHARDINGS: dict[str, tuple[str, ...]] = {
    "ddp": ("none",), "balanced": ("none",), "zero1": ZERO1_SHARDINGS, "zero3": ("fsdp",),
}
"""The shardings each data-parallel strategy runs (the pipeline strategies take none or fsdp inside their stages)."""


def strategy_of(sharding: str) -> str:
    """The data-parallel strategy that runs `sharding` with balanced shares (none: balanced, fsdp: zero3)."""
    return next(s for s, shardings in STRATEGY_SHARDINGS.items() if sharding in shardings and s != "ddp")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)   # 1e400 reads as inf: refused, not run


class RankPlan(_Strict):
    """What one rank does."""

    rank: int = Field(ge=0, description="global rank")
    device: str = Field("cpu", description="catalog name of the device (e.g. a100-sxm4-80gb) or 'cpu'")
    share: int = Field(ge=0, description="samples of each global batch this rank computes")
    precision: Precision = Field("fp32", description="autocast precision of this rank")
    micro_batch: int | None = Field(None, ge=1, description="samples per forward; None = the whole share")
    grad_accum: int = Field(1, ge=1, description="micro-batches per step (share / micro_batch, rounded up); with "
                                                 "micro_batch set the runtime cuts the share (which re-splits change) "
                                                 "into pieces of at most micro_batch, and this is informative")
    activation_checkpointing: bool = Field(False, description="recompute block activations in backward")
    stage: int = Field(0, ge=0, description="pipeline stage this rank runs")
    offload_optimizer: bool = Field(False, description="keep optimizer state in host memory")
    memory_bytes: int | None = Field(None, ge=0, description="predicted peak memory on this device")
    memory_capacity_bytes: int | None = Field(None, gt=0, description="usable memory of this device")
    predicted_step_seconds: float | None = Field(None, ge=0, description="predicted compute time per step")

    @field_validator("device")
    @classmethod
    def _catalog_name(cls, device: str) -> str:
        """A catalog alias ("v100", as `hetrain plan --devices` takes it) becomes the catalog's name, the one a
        rank's device is found by; a name the catalog lacks stays as written (the launcher refuses it)."""
        from hetrain.hardware.catalog import get_gpu

        try:
            return get_gpu(device).name
        except HetrainError:
            return device

    @model_validator(mode="after")
    def _chip_has_precision(self) -> "RankPlan":
        if self.precision == "bf16" and self.device != "cpu":
            from hetrain.hardware.catalog import load_catalog

            spec = load_catalog().get(self.device)   # an unknown device is refused where the ranks meet
            if spec is not None and not spec.bf16:
                raise ValueError(f"precision bf16 on {self.device}, which has no bf16: use fp16 (the job scales its "
                                 "loss) or fp32, or re-plan with hetrain plan")
        return self


class BalancePlan(_Strict):
    """How the balancer re-splits the global batch while the job runs."""

    enabled: bool = True
    interval: int = Field(10, ge=1, description="steps between re-splits")
    min_share: int = Field(1, ge=0, description="fewest samples a rank takes per step")
    max_share: int | None = Field(None, ge=1, description="most samples a rank takes per step")
    hysteresis: float = Field(0.01, ge=0, lt=1, description="re-split only if faster by this fraction")
    history: int = Field(8, ge=1, description="intervals each rank's fixed and per-sample cost is fitted on")


class CommPlan(_Strict):
    """How gradients travel."""

    compression: Compression = "none"
    powersgd_rank: int = Field(2, ge=1)
    powersgd_warmup_steps: int = Field(10, ge=0)
    topk_ratio: float = Field(0.01, gt=0, le=1)
    hierarchical: bool = Field(False, description="reduce inside islands, then across island leaders")
    islands: list[list[int]] | None = Field(None, description="groups of ranks sharing a fast link")
    bucket_cap_mb: float = Field(25.0, gt=0)
    gradient_as_bucket_view: bool = True


class PipelinePlan(_Strict):
    """Layer partition for models that fit on no single device."""

    stages: list[list[int]] = Field(description="per stage in pipeline order, the [first, last) block indices it holds")
    schedule: Schedule = "1f1b"
    microbatches: int = Field(4, ge=1)
    chunks: int = Field(1, ge=1, description="stages per rank (interleaved-1f1b): with p = len(stages) / chunks "
                                             "ranks per pipeline, the rank of stage j holds stages j, j + p, j + 2p, ...")

    @model_validator(mode="after")
    def _chunked(self) -> "PipelinePlan":
        if self.chunks > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(f"chunks {self.chunks}: only the interleaved-1f1b schedule runs several stages per rank; "
                             "set \"schedule\": \"interleaved-1f1b\" or \"chunks\": 1")
        if len(self.stages) % self.chunks:
            raise ValueError(f"{len(self.stages)} stages are not {self.chunks} chunks per rank; list chunks x ranks "
                             "stages (rank j holds stages j, j + p, ...)")
        return self

    @property
    def ranks_per_pipeline(self) -> int:
        """p: the ranks one pipeline replica spans (stages over chunks)."""
        return len(self.stages) // self.chunks


class Plan(_Strict):
    """One job's plan: a rank entry per process, and the job-wide choices."""

    version: int = PLAN_VERSION
    global_batch_size: int = Field(ge=1)
    strategy: Strategy = "balanced"
    sharding: Sharding = "none"
    ranks: list[RankPlan]
    balance: BalancePlan = Field(default_factory=BalancePlan)
    comm: CommPlan = Field(default_factory=CommPlan)
    pipeline: PipelinePlan | None = None
    predicted_samples_per_s: float | None = None
    notes: list[str] = Field(default_factory=list, description="why the planner chose this plan")

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan version {self.version} is not supported; this hetrain reads version {PLAN_VERSION}")
        if self.pipeline is None:
            if "strategy" not in self.model_fields_set:   # Plan(sharding="fsdp"): the strategy of that sharding
                self.strategy = strategy_of(self.sharding)
            runs = STRATEGY_SHARDINGS.get(self.strategy, (self.sharding,))   # pipeline strategies: checked at launch
            if self.sharding not in runs:
                fits = " or ".join(repr(s) for s in runs)
                raise ValueError(f"strategy {self.strategy!r} runs sharding {fits}, not {self.sharding!r}: set "
                                 f"\"sharding\" to {fits}, or \"strategy\" to {strategy_of(self.sharding)!r}")
        if not self.ranks:
            raise ValueError("a plan needs at least one rank")
        if [r.rank for r in self.ranks] != list(range(len(self.ranks))):
            raise ValueError(f"ranks must be listed as 0..{len(self.ranks) - 1} in order")
        if self.sharding == "fsdp" and (self.comm.compression != "none" or self.comm.hierarchical):
            what = f"compression {self.comm.compression!r}" if self.comm.compression != "none" else "hierarchical"
            raise ValueError(f"comm {what} runs as a DDP communication hook, and sharding 'fsdp' (FSDP2) has none: "
                             "set compression 'none' and hierarchical false, or sharding 'zero1' or 'none'")
        if self.pipeline is None:
            total = sum(r.share for r in self.ranks)
            if total != self.global_batch_size:
                raise ValueError(
                    f"rank shares add up to {total}, not the global batch {self.global_batch_size}; "
                    "make the shares sum to global_batch_size"
                )
        return self

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def shares(self) -> list[int]:
        return [r.share for r in self.ranks]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: unique_keys(pairs, source))
            if isinstance(data, dict) and "candidates" in data and isinstance(data.get("plan"), dict):
                if data.get("plan_sha256") == plan_digest(data["plan"]):   # its plan as printed: an edit, if
                    _check_summary(data, source)                          # any, is in the summary alone
                data = data["plan"]   # `hetrain plan --json` output: its plan
            return cls.model_validate(data)
        except json.JSONDecodeError as e:
            raise HetrainError(f"{source}: not valid JSON ({e})") from None
        except ValidationError as e:
            raise HetrainError(f"{source}: {format_validation_error(e, cls, 'a plan: hetrain plan --out FILE writes one')}"
                               ) from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if path.is_dir():
            raise HetrainError(f"plan file {str(path)!r} is a directory; fix: give the plan's JSON file, e.g. the "
                               "plan.json that `hetrain plan --out plan.json` wrote")
        if not path.is_file():
            raise HetrainError(f"plan file {str(path)!r} does not exist; write one with `hetrain plan --out {path}`")
        from hetrain.userfiles import read_text

        return cls.from_json(read_text(path, "plan file"), source=str(path))

    @classmethod
    def even(cls, world_size: int, global_batch_size: int, **fields) -> "Plan":
        """A plan that splits evenly, as plain DDP would (remainder to the first ranks)."""
        from hetrain.planning.batch_split import split_even

        ranks = [RankPlan(rank=r, share=n) for r, n in enumerate(split_even(global_batch_size, world_size))]
        return cls(global_batch_size=global_batch_size, ranks=ranks, **fields)


def unique_keys(pairs: list[tuple[str, Any]], source: str) -> dict[str, Any]:
    """A JSON object, refused where one key is written twice (json keeps the last one silently)."""
    keys = [k for k, _ in pairs]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        where = f" (rank {dict(pairs)['rank']})" if "rank" in keys and "rank" != twice else ""
        raise HetrainError(f"{source}: key {twice!r} appears twice in one object{where}; fix: keep one")
    return dict(pairs)


def plan_digest(plan: dict[str, Any]) -> str:
    """sha256 of a plan's JSON object as the Plan reads it (keys sorted, numbers as its fields hold them, so a tool
    that rewrote 25.0 as 25 changes nothing): `hetrain plan --json` prints it beside the plan, so that an edit to
    the summary alone can be told from an edit to the plan."""
    import hashlib

    try:
        plan = Plan.model_validate(plan).model_dump(mode="json")
    except ValidationError:   # a plan edited wrong: the raw text's digest, which differs; the plan's errors follow
        pass
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


_SUMMARY_FIELDS = ("device", "precision", "share", "micro_batch", "grad_accum", "activation_checkpointing", "stage")


def _check_summary(data: dict[str, Any], source: str) -> None:
    """`hetrain plan --json` prints a summary (strategy, ranks) above the plan launch runs: an edit to the summary
    alone (the plan as printed) would be ignored, so it is refused."""
    plan, changed = data["plan"], []
    if "strategy" in data and data["strategy"] != plan.get("strategy", data["strategy"]):
        changed.append(f"strategy {data['strategy']!r} against {plan.get('strategy')!r}")
    ranks = {r.get("rank"): r for r in plan.get("ranks", []) if isinstance(r, dict)}
    for row in data.get("ranks", []) if isinstance(data.get("ranks"), list) else []:
        theirs = ranks.get(row.get("rank")) if isinstance(row, dict) else None
        if theirs is None:
            changed.append(f"rank {row.get('rank') if isinstance(row, dict) else row!r} missing from its plan")
            continue
        changed += [f"rank {row['rank']} {k} {row[k]!r} against {theirs[k]!r}" for k in _SUMMARY_FIELDS
                    if k in row and k in theirs and row[k] != theirs[k]]
    if changed:
        raise HetrainError(f"{source}: its summary at the top differs from the `plan` below it, which is what runs "
                           f"({'; '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}); make the edit under "
                           "\"plan\" (hetrain plan --out FILE writes the plan alone)")
