"""An observer whose close() raises: the session still closes everything else (every other observer, the metrics
port, the run log and the run directory's hold, the process group), then raises that error; the next session
takes the same port and run directory (it was refused as an unclosed session's)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch
import torch.nn.functional as F

import hetrain
from tests.ports import free_ports


class _Observer:
    def __init__(self, fails: bool) -> None:
        self.fails, self.closed = fails, False

    def on_step(self, record) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        if self.fails:
            raise RuntimeError("the observer's own close failed")


def _train(base: int, *observers) -> hetrain.Session:
    session = hetrain.Session(metrics_port=base)
    net = torch.nn.Linear(8, 3)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for observer in observers:
        session.add_observer(observer)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    for x, y in session.loader(data, 16):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    return session


def test_an_observer_whose_close_raises_leaves_nothing_open(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_RUN_DIR", str(tmp_path))
    base = free_ports(1)
    failing, after = _Observer(fails=True), _Observer(fails=False)
    session = _train(base, failing, after)
    with pytest.raises(RuntimeError, match="the observer's own close failed"):
        session.close()
    assert after.closed
    assert not torch.distributed.is_initialized()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=5)
    again = _train(base)   # the same port and run directory
    try:
        assert [getattr(o, "port", None) for o in again.observers] == [base]
    finally:
        again.close()
    assert (tmp_path / "metrics" / "rank-0.jsonl").read_text().count('"kind": "start"') == 2
