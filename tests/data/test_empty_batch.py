"""A rank with no samples in a step gets an empty batch; a model that cannot take one (a Hugging Face
transformer reshapes it and fails) ends the job with a line that says why and how to avoid it."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, hetrain

    class Picky(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x.reshape(x.shape[0], -1))   # fails on 0 samples, as HF models do

    session = hetrain.Session(balance=False)
    net = Picky(4, 2)
    model, opt = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(13, 4))   # 12 + 1: the last global batch has 1 sample
    for (x,) in session.loader(data, global_batch_size=12, drop_last=False, shuffle=False):
        session.backward(model(x).square().mean())
        session.step()
    session.close()
""")


def test_an_empty_batch_a_model_cannot_take_is_named_with_the_fix(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "3", str(script)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "the epoch's last global batch has 1 sample(s) for 3 ranks" in out.stderr   # said before training
    line = out.stderr.strip().splitlines()[-1]
    assert "cannot reshape" in line and "share 0" in line and "drop_last=True" in line, line


def test_a_dropped_loader_is_not_kept_alive_by_its_hint():
    """The hint was held strongly: every loader, and its persistent workers, lived as long as the process."""
    import gc
    import weakref

    import torch

    from hetrain.runtime.data import make_loader
    from hetrain.runtime.step_state import StepState

    class _Split:
        shares = [8]

    loader = make_loader(torch.utils.data.TensorDataset(torch.arange(16)), 8, rank=0, split=_Split(),
                         step=StepState(1), device=torch.device("cpu"))
    gone = weakref.ref(loader)
    del loader
    gc.collect()
    assert gone() is None
