"""A script that never calls session.close() still has its last checkpoint: its background save is finished
at the process's exit. Its daemon thread used to be cut off by the interpreter's teardown: the checkpoint
was lost and about half the runs ended in SIGABRT ("terminate called without an active exception")."""

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import time
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 3, (256,), generator=g))
session = hetrain.Session(checkpoint_interval=4)   # background saves
net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3))
model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))
loader = session.loader(data, global_batch_size=32, seed=0)
for x, y in loader:   # one epoch: 8 steps, the last one saved in the background
    session.backward(F.cross_entropy(model(x), y))
    session.step()
print(f"trained {session.step_count}", flush=True)   # one write: two ranks never run together
"""


def test_a_script_that_never_closes_its_session_keeps_its_last_checkpoint(tmp_path):
    from hetrain.checkpoint.checkpointer import Checkpointer

    script = tmp_path / "no_close.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), str(script)],
                       capture_output=True, text=True, timeout=180, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and "trained 8" in r.stdout, r.stderr[-3000:]
    assert Checkpointer(tmp_path / "ckpt").latest().step == 8
