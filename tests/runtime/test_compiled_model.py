"""A model compiled before `session.prepare()` (`torch.compile(model)`) is saved, exported and resumed under
the plain model's names: its state dict's keys carried `_orig_mod.`, so a run could not resume with compilation
turned off or on, and an export did not load into the plain model (Hugging Face's from_pretrained kept random
weights)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetrain.errors import HetrainError
from tests.distributed import run_ranks, train_steps


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(rank, world, ckpt_dir, compiled, steps, stop_after):
    import hetrain

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=2)
    net = _net()
    model, opt = session.prepare(torch.compile(net, backend="eager") if compiled else net,
                                 torch.optim.Adam(net.parameters(), lr=1e-2))
    loader = session.loader(data, global_batch_size=16, seed=1)
    resumed_at = session.step_count

    def body(batch):
        x, y = batch
        session.backward(F.cross_entropy(model(x), y))

    if not train_steps(session, loader, steps, stop_after, body):
        return None
    state = session.model_state_dict()
    session.close()
    return resumed_at, state


@pytest.mark.parametrize("first, then", [(True, False), (False, True)])
def test_a_run_resumes_with_compilation_turned_off_or_on_and_exports_plain_names(tmp_path, first, then):
    straight = run_ranks(_train, 2, str(tmp_path / "a"), False, 6, None)[0]
    run_ranks(_train, 2, str(tmp_path / "b"), first, 6, 4)
    resumed_at, state = run_ranks(_train, 2, str(tmp_path / "b"), then, 6, None)[0]
    assert resumed_at == 4
    assert list(state) == list(_net().state_dict())
    plain = _net()
    plain.load_state_dict(state)   # strict: the plain model's names
    for name, value in straight[1].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-7, msg=name)


def test_a_pipeline_plan_names_the_fix_for_a_model_compiled_whole():
    from hetrain.planning.plan import PipelinePlan
    from hetrain.runtime.pipeline_stages import model_blocks

    model = torch.compile(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), backend="eager")
    with pytest.raises(HetrainError, match=r"block\.compile\(\)"):
        model_blocks(model, PipelinePlan(stages=[[0, 2], [2, 4]]))
