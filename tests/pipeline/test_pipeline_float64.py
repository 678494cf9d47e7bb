"""A float64 model under pipeline plans trains to one float64 process's model: a stage's hand-off keeps
float64 (it was cast to fp32, and the next stage's double weights refused it: "mixed dtype (CPU)"), its
gradients come back in float64, and the clipping norm and the reported loss stay double."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetrain.planning.plan import PipelinePlan
from hetrain.runtime.data import GlobalBatchOrder

from tests.distributed import run_ranks
from tests.pipeline.common import make_data, make_model, pipeline_plan

STEPS, GLOBAL, CLIP, LR = 3, 12, 0.5, 0.2


def double_data():
    x, y = make_data().tensors
    return torch.utils.data.TensorDataset(x.double(), y)


def reference() -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
    """One process, the whole global batch, float64: states, losses and clipping norms after each step."""
    model, data = make_model().double(), double_data()
    order = GlobalBatchOrder(len(data), GLOBAL, shuffle=True, seed=0, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    states, losses, norms = [], [], []
    for step in range(STEPS):
        x, y = data[order.global_batch(*divmod(step, order.steps_per_epoch))]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states, losses, norms


def train(rank: int, world: int, plan) -> dict:
    import hetrain

    session = hetrain.Session(plan)
    net = make_model().double()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    loader = session.loader(double_data(), global_batch_size=GLOBAL, shuffle=True, seed=0)
    states, losses, norms = [], [], []
    for x, y in loader:
        session.forward_backward(x, y, F.cross_entropy)
        norm = session.clip_grad_norm_(CLIP)
        session.step()
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        states.append({k: v.detach().clone() for k, v in full.items()})
        losses.append(session.loss)
        norms.append((float(norm), norm.dtype))
        if session.step_count == STEPS:
            break
    session.close()
    return {"states": states, "losses": losses, "norms": norms}


def two_by_two_fsdp():
    plan = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[8, 4])
    return plan.model_copy(update={"sharding": "fsdp"})


def interleaved():
    plan = pipeline_plan([[0, 1], [1, 2]], "1f1b", microbatches=2, global_batch=GLOBAL)
    return plan.model_copy(update={"pipeline": PipelinePlan(stages=[[0, 2], [2, 4], [4, 6], [6, 8]],
                                                            schedule="interleaved-1f1b", microbatches=2, chunks=2)})


PLANS = {
    "1f1b": (2, lambda: pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=3, global_batch=GLOBAL)),
    "interleaved": (2, interleaved),
    "hybrid-2x2-fsdp": (4, two_by_two_fsdp),
}


@pytest.mark.parametrize("name", PLANS)
def test_float64_pipeline_matches_one_float64_process(name):
    """Before the fix every plan crashed on its first step; the fp32 clipping norm and loss record (fixed with
    it) left the 1F1B plan 5.2e-9 off in weights and 1.9e-7 in loss on the auditor's model (2.8e-16 now)."""
    world, plan = PLANS[name]
    results = run_ranks(train, world, plan())
    want, losses, norms = reference()
    assert max(norms) > CLIP   # the clipping bites: its norm's dtype matters
    worst = max((value - ref[key]).abs().max().item() for result in results
                for got, ref in zip(result["states"], want, strict=True) for key, value in got.items())
    assert worst < 1e-12
    for result in results:
        assert all(value.dtype == torch.float64 for state in result["states"] for value in state.values())
        assert max(abs(a - b) for a, b in zip(result["losses"], losses, strict=True)) < 1e-12
        assert max(abs(a - b) for (a, _), b in zip(result["norms"], norms, strict=True)) < 1e-12
        assert {dtype for _, dtype in result["norms"]} == {torch.float64}


def test_handoff_dtype_is_fp32_unless_the_stage_computes_in_float64():
    """16-bit stages hand off in fp32, as the planner prices a hand-off (4 bytes an element)."""
    from hetrain.runtime.pipeline_stages import handoff_dtype

    assert handoff_dtype(nn.Linear(2, 2)) == torch.float32
    assert handoff_dtype(nn.Linear(2, 2).bfloat16()) == torch.float32
    assert handoff_dtype(nn.Linear(2, 2).double()) == torch.float64
    assert handoff_dtype(nn.ReLU()) == torch.float32   # no weights: a double output still travels as it is
    scaled = nn.Linear(2, 2)
    scaled.register_buffer("gain", torch.ones(2, dtype=torch.float64))
    assert handoff_dtype(scaled) == torch.float32   # a double buffer: the stage's outputs are its fp32 weights'


class Scaled(nn.Module):
    """A block of an fp32 model keeping a gain in a float64 buffer, used in fp32."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("gain", torch.full((16,), 1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.gain.float()


def _fp32_with_a_double_buffer(rank: int, world: int) -> list[float]:
    import hetrain

    session = hetrain.Session(pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=3, global_batch=GLOBAL))
    net = make_model()
    net[1] = Scaled(net[1])
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    losses = []
    for x, y in session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        losses.append(session.loss)
        if session.step_count == STEPS:
            break
    session.close()
    return losses


def test_an_fp32_model_with_a_double_buffer_hands_off_fp32():
    """Its stage's fp32 outputs were widened to double for the buffer, and the next stage's fp32 weights refused
    them ("mixed dtype (CPU)"); they train as one process does."""
    model, data = make_model(), make_data()
    model[1] = Scaled(model[1])
    order = GlobalBatchOrder(len(data), GLOBAL, shuffle=True, seed=0, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want = []
    for step in range(STEPS):
        x, y = data[order.global_batch(*divmod(step, order.steps_per_epoch))]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    got = run_ranks(_fp32_with_a_double_buffer, 2)
    assert all(max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 1e-5 for losses in got)


class Gained(nn.Module):
    """An fp32 block behind a learnable float64 gain (a parameter, used in fp32)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.ones(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.gain.float())


def _bf16_stage_with_a_double_parameter(rank: int, world: int) -> int:
    import hetrain

    plan = pipeline_plan([[0, 1], [1, 8]], "1f1b", microbatches=3, global_batch=GLOBAL, precisions=["bf16", "fp32"])
    session = hetrain.Session(plan)
    net = make_model()
    net[0] = Gained(net[0])
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    for x, y in session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        if session.step_count == 2:
            break
    session.close()
    return session.step_count


def test_a_bf16_stage_of_an_fp32_model_with_one_double_parameter_hands_off_fp32():
    """Its bf16 outputs were widened to double for that parameter; the next stage's fp32 weights refused them."""
    assert handoff_dtype_of(Gained(nn.Linear(6, 16))) == torch.float32
    assert run_ranks(_bf16_stage_with_a_double_parameter, 2) == [2, 2]


def handoff_dtype_of(module: nn.Module) -> torch.dtype:
    from hetrain.runtime.pipeline_stages import handoff_dtype

    return handoff_dtype(module)
