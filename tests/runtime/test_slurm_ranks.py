"""Tasks `srun` started without a launcher: each took RANK 0 of WORLD_SIZE 1 and trained the whole job
on its own, twice over and silently (a scheduler audit)."""

import pytest

from hetrain.errors import HetrainError
from hetrain.runtime.environment import RankEnv

SLURM = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77"}


@pytest.fixture
def slurm_task(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")   # recorded, so what the code under test sets is undone after the test
        monkeypatch.delenv(key)
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_a_task_with_a_rendezvous_address_is_the_rank_slurm_numbers_it(slurm_task):
    import os

    slurm_task.setenv("MASTER_ADDR", "node-0")
    slurm_task.setenv("MASTER_PORT", "29500")
    env = RankEnv.from_environ()
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")


def test_a_task_without_one_is_refused_naming_both_ways_to_start(slurm_task):
    with pytest.raises(HetrainError, match=r"one of 4 tasks srun started .*hetrain launch --nnodes \$SLURM_NNODES"
                                           r".*export MASTER_ADDR .* and MASTER_PORT"):
        RankEnv.from_environ()


def test_a_launcher_set_rank_or_a_single_task_is_left_as_it_is(slurm_task):
    slurm_task.setenv("SLURM_NTASKS", "1")
    assert RankEnv.from_environ().world_size == 1      # one task: a one-rank job
    slurm_task.setenv("SLURM_NTASKS", "4")
    slurm_task.setenv("RANK", "0")
    slurm_task.setenv("WORLD_SIZE", "2")                 # hetrain launch (run by srun) set the rank
    assert (RankEnv.from_environ().rank, RankEnv.from_environ().world_size) == (0, 2)
    slurm_task.delenv("RANK")
    slurm_task.delenv("WORLD_SIZE")
    slurm_task.delenv("SLURM_STEP_ID")                  # the batch script itself, not a task srun started
    assert RankEnv.from_environ().world_size == 1


def test_a_group_the_script_started_in_a_task_keeps_its_own_ranks(slurm_task):
    """One task a node spawning a process per GPU (mp.spawn), each joining the script's own group: the task's
    Slurm numbers became WORLD_SIZE, and the script's group of 4 was refused as not the launcher's 2 (review)."""
    import torch.distributed as dist

    import hetrain

    slurm_task.setenv("SLURM_NTASKS", "2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with hetrain.Session() as session:
            assert session.world_size == 1 and not session.owns_group
    finally:
        dist.destroy_process_group()
