"""session.loader()'s order arguments as a script passes them on from its own command line or config."""

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import hetrain
from hetrain.errors import HetrainError


def _session() -> hetrain.Session:
    session = hetrain.Session(balance=False)
    net = torch.nn.Linear(1, 1)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return session


@pytest.mark.parametrize("given, message", [
    (dict(drop_last="False"), r"drop_last='False'\): pass True or False \(a command-line flag arrives as a string"),
    (dict(shuffle="False"), r"shuffle='False'\): pass True or False \(a command-line flag"),
    (dict(shuffle=None), r"shuffle=None\): pass True or False$"),
    (dict(seed="1"), r"seed='1'\): the seed of the sample order is a whole number; pass one, e.g. 0"),
    (dict(seed=1.5), r"seed=1.5\): the seed of the sample order is a whole number"),
])
def test_a_flag_or_seed_of_the_wrong_type_is_refused_naming_the_fix(given, message):
    """drop_last="False" kept 16 of 20 samples and shuffle="False" shuffled: a string read as true."""
    session = _session()
    try:
        with pytest.raises(HetrainError, match=message):
            session.loader(TensorDataset(torch.arange(20.0)), 8, **given)
    finally:
        session.close()


def test_numpy_flags_and_seeds_from_a_config_are_taken():
    session = _session()
    try:
        loader = session.loader(TensorDataset(torch.arange(20.0)), 8, shuffle=np.bool_(False), seed=np.int64(3),
                                drop_last=np.bool_(False))
        assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15],
                                                   [16, 17, 18, 19]]
    finally:
        session.close()


@pytest.mark.parametrize("seed", [2**45, 8077939988512092666, np.uint64(2**63), -(2**62)])
def test_any_whole_seed_orders_the_samples(seed):
    """seed=torch.initial_seed() (or any seed past 2**43) failed at the first batch with torch's "Overflow when
    unpacking long long"; the seeds torch took before give the same order as before."""
    session = _session()
    try:
        batches = [b[0].tolist() for b in session.loader(TensorDataset(torch.arange(20.0)), 8, seed=seed)]
        assert len(batches) == 2 and len({x for b in batches for x in b}) == 16, batches
    finally:
        session.close()


def test_a_seed_torch_took_before_keeps_its_order():
    session = _session()
    try:
        batches = [b[0].tolist() for b in session.loader(TensorDataset(torch.arange(20.0)), 8, seed=3)]
    finally:
        session.close()
    assert batches[0] == torch.randperm(20, generator=torch.Generator().manual_seed(3))[:8].float().tolist()
