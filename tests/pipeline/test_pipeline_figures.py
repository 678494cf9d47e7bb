"""What a pipeline rank reports per step: its stage ran the replica's whole batch, not the slice its loader
read (a replica's batch is read spread over its ranks)."""

import torch.nn.functional as F

from tests.distributed import run_ranks
from tests.pipeline.common import make_data, make_model, pipeline_plan


def _records(rank, world, plan, fields=("samples", "share", "shares"), sleep=0.0):
    """Each step's record `fields`, over 2 steps (3 with a pause of `sleep` s after each, the script's own)."""
    import time

    import torch

    import hetrain

    session = hetrain.Session(plan)
    records = []

    class Keep:
        def on_step(self, record):
            records.append(tuple(getattr(record, f) for f in fields))

    session.add_observer(Keep())
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=plan.global_batch_size, shuffle=False):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        time.sleep(sleep)
        if session.step_count == (3 if sleep else 2):
            break
    session.close()
    return records


def test_a_stage_reports_its_replicas_samples_and_share():
    """Replica shares [5, 3] over 2 stages: ranks reported 3, 2, 2 and 1 samples (their loader slices),
    shares 37.5/25/25/12.5%, and samples/s in proportion, where each stage computed 5 or 3."""
    plan = pipeline_plan([[0, 4], [4, 8]], "1f1b", 1, 8, replica_shares=[5, 3])
    results = run_ranks(_records, 4, plan)
    for rank, records in enumerate(results):
        want = 5 if rank < 2 else 3   # ranks 0, 1: replica 0's stages; 2, 3: replica 1's
        assert len(records) == 2 and all(samples == want and share == want and sum(shares) == 8
                                         for samples, share, shares in records), (rank, records)


def test_a_stage_counts_the_scripts_own_time_as_the_scripts():
    """No module hook sees a pipeline's step begin: the script's time between steps was reported as 0 and
    counted as waiting on the other ranks. Its 0.4 s pause is large beside a loaded machine's scheduling (at
    0.1 s, waiting was held under 0.09 s a step)."""
    plan = pipeline_plan([[0, 4], [4, 8]], "1f1b", 1, 8)
    for records in run_ranks(_records, 2, plan, ("script_seconds", "waiting_seconds"), 0.4):
        for script, waiting in records[1:]:   # a process's first step has no step before it
            assert script >= 0.36 and waiting < 0.2, records
