"""The start method hetrain names where a worker forked from a rank can hang (Python before 3.12,
python/cpython#112275; the progress watch's "reading its batch" line and docs/runtime.md): a launched job whose
session.loader() starts its workers from a fork server reads every sample once, and no rank forks itself."""

import sys
from pathlib import Path

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import os
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain


def forked(*args):
    raise AssertionError("a rank forked a DataLoader worker itself")


def main():
    data = TensorDataset(torch.arange(64.0).view(64, 1), torch.zeros(64, 1))
    with hetrain.Session() as session:
        net = torch.nn.Linear(1, 1)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
        os.fork = forked   # the fork server forks the workers; the rank only asks it to
        seen = []
        for x, y in session.loader(data, global_batch_size=16, shuffle=True, num_workers=2,
                                   multiprocessing_context="forkserver"):
            seen += x.view(-1).long().tolist()
            session.backward(F.mse_loss(model(x), y))
            session.step()
        print("seen", session.rank, session.step_count, " ".join(map(str, seen)), flush=True)


if __name__ == "__main__":   # a fork server's worker imports the script: training stays under this guard
    main()
"""


def test_a_loader_whose_workers_start_from_a_fork_server_reads_every_sample_once_without_forking_a_rank(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", str(tmp_path / "job.py")],
                cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line.split() for line in r.stdout.splitlines() if line.startswith("seen ")]
    assert sorted(int(w[1]) for w in lines) == [0, 1] and all(w[2] == "4" for w in lines), r.stdout
    samples = [int(v) for w in lines for v in w[3:]]
    assert sorted(samples) == list(range(64)), samples
