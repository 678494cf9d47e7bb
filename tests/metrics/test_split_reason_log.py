"""The run log's step line says why the split changed there: a re-split for speed, a try of a rank at 0 samples,
or the split it came from again."""

import json

import torch

from hetrain.metrics import RankMetrics
from hetrain.metrics.run_log import log_path
from tests.metrics.fake_gpu_rank import step_record


def test_a_step_line_where_the_split_changed_names_the_reason(tmp_path):
    m = RankMetrics(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), device_name="cpu", port=None,
                    run_dir=tmp_path, job="why")
    m.on_step(step_record(1, rank=0))
    m.on_step(step_record(2, rank=0, split_changed=True, split_reason="try"))
    m.close()
    steps = [json.loads(line) for line in open(log_path(tmp_path, 0)) if '"step"' in line]
    assert [(s["split_changed"], s["split_reason"]) for s in steps if s["kind"] == "step"] == [(False, None),
                                                                                               (True, "try")]
