"""A job whose ranks saved and stopped on SIGTERM ends `hetrain launch` with 143, however the signal
reached them: a requeue script tells a preemption from a failure by that status. A scheduler that
signals the ranks before their launcher (SLURM signals a job's processes one by one) ended it with 2,
the status of bad input, and when the agent then stopped a rank on its way out, the line blamed it."""

import pytest


def _failure(rank, exitcode, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(tmp_path / "none.json"))


@pytest.mark.parametrize("codes, status, says", [
    ((143, 143), 143, "every rank stopped on a SIGTERM a worker received (not this launcher)"),
    ((143, -15), 143, "every rank stopped on a SIGTERM a worker received (not this launcher)"),
    ((-15, 143), 143, "every rank stopped on a SIGTERM a worker received (not this launcher)"),
    ((143, 1), 2, "rank 1 exited with code 1"),
    ((-15, -15), 2, "ranks 0,1 were killed by SIGTERM, the first of them from outside the job"),
])
def test_ranks_that_saved_on_sigterm_end_the_launcher_with_143(tmp_path, monkeypatch, capsys, codes, status, says):
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hetrain.cli.main import main

    def run(args):
        raise ChildFailedError("train.py", {rank: _failure(rank, code, tmp_path) for rank, code in enumerate(codes)})

    monkeypatch.setattr(torch.distributed.run, "run", run)
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert main(["launch", "--nproc-per-node", "2", str(script)]) == status
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"hetrain launch: error: {says}"), last


def test_a_rank_that_had_returned_beside_one_that_saved_on_sigterm_is_not_blamed(tmp_path):
    """At the very end of training rank 0 returned (exit 0) as rank 1 saved and stopped on SIGTERM: the
    status was 143 and the line blamed rank 0 for returning alone (a review)."""
    from hetrain.launch.launcher import LaunchConfig, failure_line

    line = failure_line({1: _failure(1, 143, tmp_path)}, LaunchConfig(script="t.py", nproc_per_node=2))
    assert line.startswith("every rank stopped on a SIGTERM a worker received (not this launcher)"), line
