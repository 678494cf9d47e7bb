"""Runnable torch modules for `hetrain profile`: reference models by zoo name, a script's model
factory, or a Hugging Face config. Each comes with `make_input(n)`, a batch of n samples.

Zoo models are built from torch.nn alone (no torchvision or transformers needed): ResNets in
torchvision's bottleneck layout, BERT as a post-norm encoder stack, GPT-2 as a pre-norm causal
stack with a tied vocabulary head, each at the sizes of hetrain/data/models.csv.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetrain.errors import HetrainError
from hetrain.userfiles import read_text
from hetrain.workload.batches import batch_rows

_RESNET_LAYERS = {"resnet50": (3, 4, 6, 3), "resnet152": (3, 8, 36, 3)}
_IMAGE = 224


@dataclass
class RunnableModel:
    """A module, a maker of input batches, and the name and kind its profile is filed under."""

    name: str
    module: Any
    make_input: Callable[[int], Any]
    kind: str | None = None
    source: str | None = None   # where make_input comes from, for errors: "--script 'net.py:make'"

    def batch(self, n: int) -> Any:
        """make_input(n), refused in one line unless it holds n samples (a size the timings are divided by);
        whatever make_input raises is one line naming it, the script and the error."""
        try:
            made = self.make_input(n)
        except Exception as e:  # noqa: BLE001 - whatever the user's make_input raises: one line naming it
            where = f"{self.source}: " if self.source else ""
            raise HetrainError(f"{where}make_input({n}) of {self.name} raised {type(e).__name__}: {_first_line(e)}; "
                               "fix make_input(n) to return a batch of n samples") from None
        rows = batch_rows(made, f"make_input({n}) of {self.name}")
        if rows != n:
            raise HetrainError(f"make_input({n}) of {self.name} gave a batch of {rows} samples, not {n}: its timings "
                               "would be filed under the wrong micro-batch; fix make_input(n) to return n samples "
                               "(the first dimension)")
        return made


def _bottleneck(nn, c_in: int, mid: int, stride: int):
    class Bottleneck(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, 4 * mid, 1, bias=False), nn.BatchNorm2d(4 * mid),
            )
            self.down = None
            if stride != 1 or c_in != 4 * mid:
                self.down = nn.Sequential(nn.Conv2d(c_in, 4 * mid, 1, stride=stride, bias=False), nn.BatchNorm2d(4 * mid))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.body(x) + (x if self.down is None else self.down(x)))

    return Bottleneck()


def resnet(name: str):
    """ResNet-50/152 (v1.5: stride in the 3x3 convolution), 1000 classes, 224x224 inputs."""
    import torch
    from torch import nn

    layers = []
    c_in = 64
    for stage, (count, mid) in enumerate(zip(_RESNET_LAYERS[name], (64, 128, 256, 512))):
        blocks = [_bottleneck(nn, c_in if i == 0 else 4 * mid, mid, (1 if stage == 0 else 2) if i == 0 else 1)
                  for i in range(count)]
        layers.append(nn.Sequential(*blocks))
        c_in = 4 * mid
    model = nn.Sequential()
    model.add_module("stem", nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                           nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)))
    for i, layer in enumerate(layers):
        model.add_module(f"layer{i + 1}", layer)
    model.add_module("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)))
    return model, lambda n: torch.randn(n, 3, _IMAGE, _IMAGE)


def transformer(name: str, layers: int, hidden: int, heads: int, vocab: int, seq_len: int, causal: bool):
    """An embedding, `layers` encoder layers (causal for GPT), and a vocabulary head tied to the embedding."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(seq_len, hidden)

        def forward(self, ids):
            return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu",
                                                    batch_first=True, norm_first=causal)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device) if causal else None
            return self.inner(x, src_mask=mask, is_causal=causal)

    class Head(nn.Module):
        def __init__(self, embed: Embed):
            super().__init__()
            self.norm, self.embed = nn.LayerNorm(hidden), [embed]  # a list: not a second registration

        def forward(self, x):
            return self.norm(x) @ self.embed[0].tokens.weight.T

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embed()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = Head(self.embed)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = Model()
    return model, lambda n: torch.randint(0, vocab, (n, seq_len))


def zoo_module(name: str) -> RunnableModel:
    """A runnable module for a zoo name (resnet50, bert-large-512, gpt2-124m, ...)."""
    from hetrain.workload.zoo import get_profile, model_facts

    get_profile(name)  # a one-line error for an unknown name
    f = model_facts(name)
    if f.model in _RESNET_LAYERS:
        module, make = resnet(f.model)
        return RunnableModel(name, module, make, "cnn")
    if f.model.startswith("llama"):
        raise HetrainError(f"{name!r} has no runnable module built in (gated MLP, rotary positions); "
                           "profile it with --hf-config (its Hugging Face config) or --script")
    causal = f.model.startswith("gpt")
    module, make = transformer(name, f.layers, f.hidden, f.heads, f.vocab, f.seq_len, causal)
    return RunnableModel(name, module, make, "transformer")


def script_file(spec: str) -> tuple[Path, str]:
    """(the file, the factory's name or "") of FILE.py:FACTORY; a one-line error when the file is
    missing, no Python file, or does not compile."""
    file, factory, _ = _script_code(spec)
    return file, factory


def _script_code(spec: str):
    """(the file, the factory's name or "", the file's compiled code) of FILE.py:FACTORY."""
    path, _, factory = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        raise HetrainError(f"--script {spec!r}: {path!r} does not exist; write FILE.py:FACTORY")
    if file.suffix != ".py":
        raise HetrainError(f"--script {spec!r}: {path!r} is not a Python file; write FILE.py:FACTORY, "
                           "a .py file defining FACTORY() that returns (model, make_input)")
    source = read_text(file, "--script file")
    try:
        return file, factory, compile(source, str(file), "exec", dont_inherit=True)
    except SyntaxError as e:
        raise HetrainError(f"--script {spec!r}: {path} line {e.lineno}: {e.msg}; "
                           f"fix the Python in {file.name}") from None


def require_transformers() -> None:
    """A one-line error naming the fix when transformers is not installed."""
    if importlib.util.find_spec("transformers") is None:
        raise HetrainError("--hf-config needs the transformers package; pip install 'transformers>=4.40', "
                           "or profile a zoo model (--model) or your own factory (--script)")


def script_module(spec: str) -> RunnableModel:
    """FILE.py:FACTORY, where FACTORY() returns (model, make_input) and make_input(n) a batch of n."""
    file, factory, code = _script_code(spec)
    folder = str(file.resolve().parent)
    if folder not in sys.path:   # its own modules beside it import, as under `python FILE.py`
        sys.path.insert(0, folder)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(file.stem, file))
    try:
        exec(code, mod.__dict__)  # noqa: S102 - the user's own factory file, as importing it would
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises: one line naming it
        raise HetrainError(f"--script {spec!r}: running {file.name} failed ({type(e).__name__}: {_first_line(e)}); "
                           f"fix {file.name}") from None
    fn = getattr(mod, factory or "make_model", None)
    if not callable(fn):
        raise HetrainError(f"--script {spec!r}: {file.name} defines no function {factory or 'make_model'!r}; "
                           "define FACTORY() returning (model, make_input)")
    try:
        made = fn()
    except Exception as e:  # noqa: BLE001 - whatever the user's factory raises: one line naming it
        raise HetrainError(f"--script {spec!r}: {factory or 'make_model'}() raised {type(e).__name__}: "
                           f"{_first_line(e)}; fix the factory in {file.name}") from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
        raise HetrainError(f"--script {spec!r}: {factory or 'make_model'}() must return (model, make_input), "
                           "make_input(n) giving a batch of n samples")
    return RunnableModel(file.stem if not factory else factory, made[0], made[1], source=f"--script {spec!r}")


def check_seq_len(seq_len: int | None) -> None:
    """Refuse a --seq-len below 1 (0 would silently mean the config's own length)."""
    if seq_len is not None and seq_len < 1:
        raise HetrainError(f"--seq-len {seq_len}: the sequence length must be at least 1; fix: --seq-len 128, "
                           "or leave it out for the config's positions (at most 1024)")


def hf_module(config: str, seq_len: int | None = None) -> RunnableModel:
    """A Hugging Face model from its config (a hub name or a config.json path), random weights."""
    check_seq_len(seq_len)
    require_transformers()
    import torch

    cfg = _hf_config(config)
    vocab = getattr(cfg, "vocab_size", None)
    if not vocab:
        raise HetrainError(f"--hf-config {config!r}: the config has no vocab_size; hetrain builds token inputs "
                           "for --hf-config models; time other models with --script FILE.py:FACTORY")
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False   # a training step keeps no key/value cache (and a block timed alone must not grow one)
    model = _hf_model(cfg, config)
    if getattr(cfg, "model_type", None) == "gpt2" and hasattr(model, "lm_head"):
        # as a pipeline script runs it (docs/pipeline.md): embedding, each layer, head, so the profile's
        # blocks are the layers activation checkpointing recomputes and a pipeline plan's stages cut
        from hetrain.workload.block_models import gpt2_blocks

        model = gpt2_blocks(model)
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 512)
    length = seq_len if seq_len is not None else min(positions, 1024)
    if getattr(cfg, "is_encoder_decoder", False):
        # T5's forward derives no decoder inputs (BART's does): give the decoder its own tokens, as training does
        def make_input(n: int) -> dict:
            return {"input_ids": torch.randint(0, vocab, (n, length)),
                    "decoder_input_ids": torch.randint(0, vocab, (n, length))}

        return RunnableModel(_hf_name(config), model, make_input, "transformer")
    return RunnableModel(_hf_name(config), model, lambda n: torch.randint(0, vocab, (n, length)), "transformer")


_HF_FIX = "give a local config.json or a directory holding one, or a Hugging Face model name reachable from here"


def _hf_config(config: str):
    """The transformers config of a local config.json, a directory holding one, or a hub name."""
    from transformers import AutoConfig

    if not config.strip() or (_looks_local(config) and not Path(config).exists()):
        raise HetrainError(f"--hf-config {config!r}: no such file or directory; fix: {_HF_FIX}")
    if _looks_local(config) and Path(config).is_dir() and not (Path(config) / "config.json").is_file():
        # said here: transformers' own words for it differ from one release to the next
        raise HetrainError(f"--hf-config {config!r} cannot be loaded (the directory holds no config.json); "
                           f"fix: {_HF_FIX}")
    if not _looks_local(config):
        try:   # a hub name already in the local cache needs no network
            return AutoConfig.from_pretrained(config, local_files_only=True)
        except (OSError, ValueError):
            pass
        host = _hub_host()
        if not _reachable(host):   # the hub's client would retry for about 25 s before saying so
            raise HetrainError(f"--hf-config {config!r} is not in the local Hugging Face cache and {host} cannot "
                               f"be reached from here; fix: {_HF_FIX}")
    try:
        return AutoConfig.from_pretrained(config)
    except (OSError, ValueError) as e:  # a missing name, no network, bad JSON, an unknown model type
        raise HetrainError(f"--hf-config {config!r} cannot be loaded ({_first_line(e)}); fix: {_HF_FIX}") from None


def _hub_host() -> str:
    """The Hugging Face hub's host (HF_ENDPOINT where set)."""
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def _reachable(host: str, timeout_s: float = 5.0) -> bool:
    """Whether a TCP connection to `host` on port 443 opens within `timeout_s` (name lookup included)."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hf_model(cfg, config: str):
    """The model the config's `architectures` names; else a causal LM for a decoder (an architecture with a
    causal LM and no masked one: BERT's causal head would make an encoder a decoder); else its base
    model (`AutoModel`). Random weights."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    named = next((getattr(transformers, a) for a in (getattr(cfg, "architectures", None) or [])
                  if hasattr(transformers, a)), None)
    if named is not None:
        return named(cfg)
    decoder = cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and cfg.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if decoder:
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            pass
    try:
        return AutoModel.from_config(cfg)
    except ValueError as e:
        raise HetrainError(f"--hf-config {config!r}: transformers builds no model from it ({_first_line(e)}); "
                           "fix: time the model with --script FILE.py:FACTORY") from None


def _looks_local(config: str) -> bool:
    """A path rather than a hub name (`name` or `namespace/name`)."""
    return (config.endswith(".json") or config.startswith((".", "~", "/"))
            or config.count("/") > 1 or Path(config).exists())


def _hf_name(config: str) -> str:
    """The profile's name: the directory of a local config, or the hub name with '-' for '/'."""
    path = Path(config)
    if path.exists():
        return (path.resolve().parent if path.is_file() else path.resolve()).name or "hf-model"
    return config.replace("/", "-")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
