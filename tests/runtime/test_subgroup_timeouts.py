"""The groups hetrain makes beside the job's (islands and their leaders for a two-level all-reduce, a pipeline's
stages and replicas) wait as long as the job's collectives, max(2S, S+30) for a progress timeout of S seconds:
made without a timeout they took gloo's 30 minutes, so ranks waiting on a frozen node held on for half an hour."""

import datetime

import torch

from tests.distributed import run_ranks


def _timeouts(rank, world):
    import torch.distributed as dist

    from hetrain.runtime.environment import collective_timeout
    from hetrain.runtime.hierarchical import island_groups
    from hetrain.runtime.pipeline_schedule import make_groups
    from hetrain.runtime.pipeline_stages import PipelineLayout

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=collective_timeout())
    islands = island_groups([[0], [1]])
    pipe, stage = make_groups(PipelineLayout(grid=[[0], [1]], replica=rank, stage=0))
    groups = [islands.island_group, islands.leaders_group, pipe, stage]
    return collective_timeout(), [g._get_backend(torch.device("cpu")).options._timeout for g in groups]


def test_islands_and_pipeline_groups_wait_as_long_as_the_job():
    for want, got in run_ranks(_timeouts, 2, env={"HETRAIN_COLLECTIVE_TIMEOUT": "20"}):
        assert want == datetime.timedelta(seconds=50)
        assert got == [want] * 4, got
