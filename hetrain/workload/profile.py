"""What one training sample of a model costs: parameters, FLOPs, activation bytes, per block.

`profile(model, sample_input)` measures a real `nn.Module` on CPU: forward+backward FLOPs with
torch's FLOP counter and the bytes of tensors saved for backward with saved-tensor hooks, for the
whole model and for each block around its layer stack (the units a pipeline partition assigns to stages).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetrain.errors import HetrainError, format_validation_error
from hetrain.workload.batches import batch_rows, batch_signature, batch_tensors, call_model

if TYPE_CHECKING:  # torch is imported only when a model is profiled, so planning starts fast
    import torch
    from torch import nn

PROFILE_VERSION = 1
WorkloadKind = Literal["cnn", "transformer", "other"]


class BlockProfile(BaseModel):
    """One contiguous block of the model (a transformer layer, a ResNet stage...)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    params: int = Field(ge=0)
    flops_per_sample: float = Field(ge=0, description="forward + backward FLOPs per sample")
    activation_bytes_per_sample: float = Field(ge=0, description="bytes saved for backward per sample")
    output_bytes_per_sample: float = Field(0.0, ge=0, description="bytes of the block's output per sample")
    tied_params: int = Field(0, ge=0, description="parameters this block shares with block `tied_to` (a tied "
                             "output embedding): counted there, held again by a pipeline stage without it")
    tied_to: int | None = Field(None, ge=0, description="index of the block that holds the tied parameters")
    trainable_params: int | None = Field(None, ge=0, description="of `params`, those that take a gradient (None: "
                                         "all)")
    tied_trainable_params: int | None = Field(None, ge=0, description="of `tied_params`, those that take a "
                                              "gradient (None: all): a frozen tied embedding is held, not trained")

    @model_validator(mode="after")
    def _trained_within_held(self) -> "BlockProfile":
        if self.trainable_params is not None and self.trainable_params > self.params:
            raise ValueError(f"block {self.name!r}: trainable_params {self.trainable_params} is more than its params "
                             f"{self.params}")
        if self.tied_trainable_params is not None and self.tied_trainable_params > self.tied_params:
            raise ValueError(f"block {self.name!r}: tied_trainable_params {self.tied_trainable_params} is more than "
                             f"its tied_params {self.tied_params}")
        return self

    @property
    def trained_params(self) -> int:
        """Parameters of this block that take a gradient (all, where the profile does not say)."""
        return self.params if self.trainable_params is None else min(self.trainable_params, self.params)

    @property
    def tied_trained_params(self) -> int:
        """Of the tied parameters, those that take a gradient (all, where the profile does not say)."""
        return self.tied_params if self.tied_trainable_params is None else min(self.tied_trainable_params,
                                                                               self.tied_params)


class WorkloadProfile(BaseModel):
    """Per-sample costs of training one model; saved to and loaded from JSON."""

    model_config = ConfigDict(extra="forbid")

    version: int = PROFILE_VERSION
    name: str
    kind: WorkloadKind = "other"
    params: int = Field(ge=1)
    trainable_params: int | None = Field(None, ge=0, description="of `params`, those that take a gradient (None: "
                                         "all): gradients, their all-reduce and optimizer state are priced on "
                                         "these, weights on all")
    flops_per_sample: float = Field(gt=0, description="forward + backward FLOPs per sample")
    activation_bytes_per_sample: float = Field(ge=0, description="bytes saved for backward per sample")
    activation_dtype_bytes: int = Field(4, description="bytes per element the activations were counted at")
    seq_len: int | None = None
    inputs: list[str] | None = Field(None, description="every tensor of the sample batch, nested ones too: "
                                     "'path: dtype[shape of one sample]', sorted (None: not recorded, a profile "
                                     "written before hetrain did)")
    matrix_shapes: list[tuple[int, int]] = Field(
        default_factory=list, description="2-D (rows, cols) view of each trained weight with >= 2 dims"
    )
    blocks: list[BlockProfile] = Field(default_factory=list)
    source: str = "measured"

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PROFILE_VERSION:
            raise ValueError(f"workload profile version {v} is not supported; this hetrain reads version "
                             f"{PROFILE_VERSION}: re-run hetrain profile")
        return v

    @model_validator(mode="after")
    def _trained_within_params(self) -> "WorkloadProfile":
        if self.trainable_params is not None and self.trainable_params > self.params:
            raise ValueError(f"trainable_params {self.trainable_params} is more than params {self.params}")
        return self

    def held_params(self, start: int, stop: int) -> int:
        """Parameters a device that runs blocks [start, stop) holds: theirs, and the tied ones whose
        owning block runs elsewhere (a pipeline's last stage keeps its own copy of a tied embedding)."""
        return sum(b.params + (b.tied_params if b.tied_to is not None and not start <= b.tied_to < stop else 0)
                   for b in self.blocks[start:stop])

    @property
    def trained_params(self) -> int:
        """Parameters that take a gradient (all, where the profile does not say: profiles written before it did)."""
        return self.params if self.trainable_params is None else min(self.trainable_params, self.params)

    def held_trained_params(self, start: int, stop: int) -> int:
        """Of `held_params(start, stop)`, those that take a gradient."""
        return sum(b.trained_params + (b.tied_trained_params if b.tied_to is not None and not start <= b.tied_to < stop
                                       else 0)
                   for b in self.blocks[start:stop])

    def identity(self, inputs: bool = True) -> str:
        """A digest of what tells one model from another of the same name: its parameters (all, trained, each
        block's) and its inputs (each tensor's dtype and shape of one sample). A device profile records it, so
        timings of another model are refused. A profile that does not record its inputs, or `inputs=False`:
        the digest before hetrain recorded them, of the parameters and the sequence length."""
        import hashlib

        blocks = [(b.name, b.params) for b in self.blocks]
        if inputs and self.inputs is not None:
            what = [self.params, self.trained_params, blocks, self.inputs]
        else:
            what = [self.params, self.trained_params, self.seq_len, blocks]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

    def activation_bytes(self, element_bytes: int) -> float:
        """Activation bytes per sample when activations are held in `element_bytes`-wide elements."""
        return self.activation_bytes_per_sample * element_bytes / self.activation_dtype_bytes

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (atomically)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "WorkloadProfile":
        """Read a profile written by `save` (or by hand)."""
        path = Path(path)
        if not path.is_file():
            raise HetrainError(
                f"profile file {str(path)!r} does not exist; write one with "
                "hetrain.workload.profile(model, sample_input).save(path)"
            )
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (json.JSONDecodeError, ValidationError) as e:
            if isinstance(e, ValidationError):
                why = format_validation_error(e, cls)
            else:
                why = f"not JSON ({e.msg}, line {e.lineno})"
            raise HetrainError(f"profile file {str(path)!r} is not a workload profile: {why}; write one with "
                               "hetrain profile --out DIR (its workload.json) or hetrain.workload.profile(model, "
                               "sample_input).save(path)") from None


def _kind_of(model: "nn.Module") -> WorkloadKind:
    from torch import nn

    names = {type(m).__name__.lower() for m in model.modules()}
    if any(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for m in model.modules()):
        return "cnn"
    if any("attention" in n or "transformer" in n for n in names):
        return "transformer"
    return "other"


def _matrix_shapes(model: "nn.Module") -> list[tuple[int, int]]:
    return [(p.shape[0], p[0].numel()) for p in model.parameters() if p.dim() >= 2 and p.requires_grad]


def _first_tensor(out) -> "torch.Tensor":
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, Sequence):
        for item in out:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item
    raise HetrainError("the model's output holds no floating-point tensor to take a gradient of")


def profile(model: "nn.Module", sample_input, name: str | None = None, kind: WorkloadKind | None = None) -> WorkloadProfile:
    """Measure per-sample training costs of `model` on `sample_input` (batch first: a tensor, a tuple of
    them, or a dict of them passed as keyword inputs), on CPU.

    Runs one forward and backward (the loss is the sum of the first floating output). FLOPs come
    from torch.utils.flop_counter; activation bytes are the distinct tensors saved for backward,
    parameters excluded, attributed to the block running when they were saved.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from hetrain.workload.layers import profile_blocks

    batch = batch_rows(sample_input)
    blocks = profile_blocks(model)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[tuple[int, int]] = set()
    saved = {bname: 0 for bname, _ in blocks}
    saved_outside = 0
    out_bytes = {bname: 0 for bname, _ in blocks}
    current: list[str | None] = [None]

    def pack(t):
        nonlocal saved_outside
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] not in param_storages and key not in seen:
            seen.add(key)
            if current[0] is None:
                saved_outside += storage.nbytes()
            else:
                saved[current[0]] += storage.nbytes()
        return t

    handles = []
    for bname, block in blocks:
        handles.append(block.register_forward_pre_hook(lambda m, a, bname=bname: current.__setitem__(0, bname)))

        def post(m, a, out, bname=bname):
            current[0] = None
            if isinstance(out, torch.Tensor):
                out_bytes[bname] = out.numel() * out.element_size()

        handles.append(block.register_forward_hook(post))
    was_training = model.training
    model.train()
    try:
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _first_tensor(call_model(model, sample_input)).float().sum()
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    prefix = type(model).__name__
    total_flops = float(counts.get("Global", 0))
    owner: dict[int, int] = {}   # a parameter's id -> the first block that holds it
    block_profiles = []
    for i, (bname, block) in enumerate(blocks):
        tied = [p for p in block.parameters() if id(p) in owner]
        block_profiles.append(BlockProfile(
            name=bname,
            params=sum(p.numel() for p in block.parameters() if id(p) not in owner),
            flops_per_sample=counts.get(f"{prefix}.{bname}", 0) / batch,
            activation_bytes_per_sample=saved[bname] / batch,
            output_bytes_per_sample=out_bytes[bname] / batch,
            tied_params=sum(p.numel() for p in tied),
            tied_trainable_params=sum(p.numel() for p in tied if p.requires_grad),
            trainable_params=sum(p.numel() for p in block.parameters() if id(p) not in owner and p.requires_grad),
            tied_to=owner[id(tied[0])] if tied else None,
        ))
        owner.update({id(p): i for p in block.parameters() if id(p) not in owner})
    total_saved = sum(saved.values()) + saved_outside
    if total_flops <= 0:
        raise HetrainError("the FLOP counter saw no floating-point work; profile a model that computes on its input")
    tokens = [v for v in batch_tensors(sample_input)
              if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() == 2]
    ids = sample_input.get("input_ids") if isinstance(sample_input, dict) else None
    seq_len = int(ids.shape[1]) if any(ids is t for t in tokens) else int(tokens[0].shape[1]) if tokens else None
    return WorkloadProfile(
        name=name or type(model).__name__,
        kind=kind or _kind_of(model),
        params=sum(p.numel() for p in model.parameters()),
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        flops_per_sample=total_flops / batch,
        activation_bytes_per_sample=total_saved / batch,
        activation_dtype_bytes=4,
        seq_len=seq_len,
        inputs=batch_signature(sample_input),
        matrix_shapes=_matrix_shapes(model),
        blocks=block_profiles,
        source="measured",
    )
