"""A small stack of residual MLP blocks and data, shared by the memory tests."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_model(width: int = 16, depth: int = 6) -> Stack:
    torch.manual_seed(0)
    return Stack(width, depth)


def make_data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))

