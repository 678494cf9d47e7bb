"""The demo's task: scikit-learn's bundled handwritten digits (no download), and a small MLP."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(features, labels) of scikit-learn's 1,797 bundled digits, as `sklearn.datasets.load_digits`
    gives them, read from the file scikit-learn ships. Importing `sklearn.datasets` costs about a
    second in every rank of every job and restart (it loads SciPy); reading its 80 kB file does
    not. Where the file is not found, `load_digits` itself."""
    spec = importlib.util.find_spec("sklearn")   # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target


def digits_datasets(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) of 8x8 digit images as 64 standardised features, with a fixed split."""
    features, labels = load_digits_arrays()
    x = torch.tensor(features, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    mean, std = x[train_idx].mean(0), x[train_idx].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def digits_mlp(hidden: int = 512, depth: int = 2, seed: int = 0) -> torch.nn.Module:
    """An MLP 64 -> hidden (x depth) -> 10, initialised from `seed`."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    model.eval()
    pred = model(x).argmax(1)
    model.train()
    return float((pred == y).float().mean())


def digits_cnn(width: int = 64, seed: int = 0) -> torch.nn.Module:
    """A small CNN on the 8x8 digit images (the 64 features reshaped), initialised from `seed`.

    Convolutions reuse each weight at every pixel, so compute per parameter is high and the
    gradient all-reduce is small next to it, as in most data-parallel training on GPUs.
    """
    torch.manual_seed(seed)
    half = width // 2
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),
        torch.nn.Conv2d(1, half, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(half, width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(width * 16, 10),
    )


def digits_model(kind: str, width: int) -> torch.nn.Module:
    """The demo's model: 'cnn' (default) or 'mlp', of the given width."""
    if kind == "cnn":
        return digits_cnn(width)
    if kind == "mlp":
        return digits_mlp(width)
    raise ValueError(f"unknown model {kind!r}; use cnn or mlp")
