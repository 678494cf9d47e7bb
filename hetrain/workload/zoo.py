"""Analytic profiles of reference models, from the published facts in `hetrain/data/models.csv`.

Transformers are cut into embedding, one block per layer, and head; activations per layer follow
s*b*h*(34 + 5*a*s/h) bytes in 16-bit (arXiv:2205.05198). ResNets are cut into stem, four stages
and head; activations count the tensors torchvision's bottleneck saves for backward, in 16-bit.
"""

from __future__ import annotations

import csv
import difflib
import io
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from hetrain.errors import HetrainError
from hetrain.workload.profile import BlockProfile, WorkloadProfile

_RESNET_LAYERS = {"resnet50": (3, 4, 6, 3), "resnet152": (3, 8, 36, 3)}
_CAUSAL_LM = {"gpt2-124m", "gpt2-1.5b", "gpt3-2.7b", "llama-7b"}  # their forward FLOPs include the vocabulary projection
_UNTIED_HEAD = {"llama-7b"}
_GATED_MLP = {"llama-7b"}
_POSITIONS = {"gpt2-124m": 1024, "gpt2-1.5b": 1024, "gpt3-2.7b": 2048, "bert-base": 512, "bert-large": 512}


@dataclass(frozen=True)
class ModelFacts:
    """One row of models.csv."""

    model: str
    params: int
    seq_len: int | None
    forward_flops: float
    layers: int | None
    hidden: int | None
    heads: int | None
    vocab: int | None


@lru_cache(maxsize=1)
def _rows() -> tuple[ModelFacts, ...]:
    text = resources.files("hetrain").joinpath("data/models.csv").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]

    def opt(v: str) -> int | None:
        return int(v) if v.strip() else None

    return tuple(
        ModelFacts(
            model=r["model"],
            params=int(round(float(r["params_m"]) * 1e6)),
            seq_len=opt(r["seq_len"]),
            forward_flops=float(r["forward_gflop"]) * 1e9,
            layers=opt(r["layers"]),
            hidden=opt(r["hidden"]),
            heads=opt(r["heads"]),
            vocab=opt(r["vocab"]),
        )
        for r in csv.DictReader(io.StringIO("\n".join(lines)))
    )


def _facts_by_name() -> dict[str, ModelFacts]:
    table: dict[str, ModelFacts] = {}
    for row in _rows():
        default = row.model not in table
        if row.seq_len is not None:
            table[f"{row.model}-{row.seq_len}"] = row
        if default:  # the first row of a model is its default sequence length
            table[row.model] = row
    return table


def zoo_names() -> list[str]:
    """Names `get_profile` accepts (e.g. resnet152, bert-large, bert-large-512, gpt2-1.5b)."""
    return sorted(_facts_by_name())


def model_facts(name: str) -> ModelFacts:
    """The models.csv row of a zoo name (its default sequence length when none is given)."""
    facts = _facts_by_name().get(name.strip().lower())
    if facts is None:
        get_profile(name)  # raises the one-line error naming the choices
    return facts


def get_profile(name: str, other_ways: str = "") -> WorkloadProfile:
    """The analytic profile of a reference model by name. `other_ways` ends the error for an unknown
    name with what else the caller accepts (a command's flags)."""
    key = name.strip().lower()
    facts = _facts_by_name().get(key)
    if facts is None:
        close = difflib.get_close_matches(key, zoo_names(), n=3, cutoff=0.6)
        raise HetrainError(f"unknown model {name!r}; " + (f"closest: {', '.join(close)}; " if close else "")
                           + f"choose one of: {', '.join(zoo_names())}" + (f", or {other_ways}" if other_ways else ""))
    if facts.model in _RESNET_LAYERS:
        return _resnet(key, facts)
    return transformer_profile(key, facts)


def _resnet(name: str, f: ModelFacts) -> WorkloadProfile:
    elem = 2  # activations counted as 16-bit elements
    blocks: list[BlockProfile] = []
    shapes: list[tuple[int, int]] = [(64, 3 * 49)]
    stem_flops = 2 * 3 * 64 * 49 * 112 * 112
    stem_act = 3 * 224 * 224 + 2 * 64 * 112 * 112 + 64 * 56 * 56
    raw = [("stem", 9408 + 128, stem_flops, stem_act, 64 * 56 * 56)]
    c_in, size = 64, 56
    for stage, (count, mid) in enumerate(zip(_RESNET_LAYERS[f.model], (64, 128, 256, 512))):
        out_size = size if stage == 0 else size // 2
        params = flops = act = 0
        for b in range(count):
            s_in = size if b == 0 else out_size
            cin = c_in if b == 0 else 4 * mid
            params += cin * mid + 9 * mid * mid + 4 * mid * mid + 2 * 6 * mid
            flops += 2 * (cin * mid * s_in**2 + 9 * mid * mid * out_size**2 + 4 * mid * mid * out_size**2)
            act += 2 * mid * s_in**2 + 2 * mid * out_size**2 + 8 * mid * out_size**2
            shapes += [(mid, cin), (mid, 9 * mid), (4 * mid, mid)]
            if b == 0:  # downsample projection
                params += cin * 4 * mid + 8 * mid
                flops += 2 * cin * 4 * mid * out_size**2
                act += 4 * mid * out_size**2
                shapes.append((4 * mid, cin))
        raw.append((f"layer{stage + 1}", params, flops, act, 4 * mid * out_size**2))
        c_in, size = 4 * mid, out_size
    raw.append(("head", 2048 * 1000 + 1000, 2 * 2048 * 1000, 2048 + 1000, 1000))
    shapes.append((1000, 2048))
    scale = f.forward_flops / sum(r[2] for r in raw)  # agree with the published total
    for bname, params, flops, act, out in raw:
        blocks.append(
            BlockProfile(
                name=bname,
                params=params,
                flops_per_sample=3.0 * flops * scale,
                activation_bytes_per_sample=float(act * elem),
                output_bytes_per_sample=float(out * elem),
            )
        )
    return WorkloadProfile(
        name=name,
        kind="cnn",
        params=f.params,
        flops_per_sample=3.0 * f.forward_flops,
        activation_bytes_per_sample=sum(b.activation_bytes_per_sample for b in blocks),
        activation_dtype_bytes=elem,
        matrix_shapes=shapes,
        blocks=blocks,
        source="analytic: models.csv (torchvision layout)",
    )


def transformer_profile(name: str, f: ModelFacts) -> WorkloadProfile:
    assert f.layers and f.hidden and f.heads and f.vocab and f.seq_len
    s, h, a, v, n = f.seq_len, f.hidden, f.heads, f.vocab, f.layers
    elem = 2
    emb_params = v * h + _POSITIONS.get(f.model, 0) * h
    head_params = v * h if f.model in _UNTIED_HEAD else 0
    tied = f.model in _CAUSAL_LM and not head_params   # the output projection is the token embedding
    layer_params = (f.params - emb_params - head_params) // n
    head_fwd = 2.0 * s * h * v if f.model in _CAUSAL_LM else 0.0
    layer_fwd = (f.forward_flops - head_fwd) / n
    layer_act = s * h * (34 + 5 * a * s / h)
    boundary = 2.0 * s * h  # one 16-bit hidden state per token
    head_act = s * v * (2 + 4) if f.model in _CAUSAL_LM else boundary  # 16-bit logits + fp32 log-softmax
    blocks = [BlockProfile(name="embed", params=emb_params, flops_per_sample=0.0,
                           activation_bytes_per_sample=boundary, output_bytes_per_sample=boundary)]
    blocks += [
        BlockProfile(name=f"layer{i}", params=layer_params, flops_per_sample=3.0 * layer_fwd,
                     activation_bytes_per_sample=layer_act, output_bytes_per_sample=boundary)
        for i in range(n)
    ]
    blocks.append(BlockProfile(name="head", params=f.params - emb_params - n * layer_params,
                               flops_per_sample=3.0 * head_fwd, activation_bytes_per_sample=head_act,
                               output_bytes_per_sample=4.0 * s if f.model in _CAUSAL_LM else boundary,
                               tied_params=v * h if tied else 0, tied_to=0 if tied else None))
    mlp_mats = 3 if f.model in _GATED_MLP else 2
    ffn = max(1, (layer_params - 4 * h * h) // (mlp_mats * h))
    shapes = [(v, h)] + ([(v, h)] if head_params else [])
    shapes += n * ([(h, h)] * 4 + [(ffn, h)] * (mlp_mats - 1) + [(h, ffn)])
    return WorkloadProfile(
        name=name,
        kind="transformer",
        params=f.params,
        flops_per_sample=3.0 * f.forward_flops,
        activation_bytes_per_sample=sum(b.activation_bytes_per_sample for b in blocks),
        activation_dtype_bytes=elem,
        seq_len=s,
        matrix_shapes=shapes,
        blocks=blocks,
        source="analytic: models.csv (Megatron FLOPs, Korthikanti activations)",
    )
