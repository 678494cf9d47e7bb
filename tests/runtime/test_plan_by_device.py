"""A rank finds its plan entry by the device it has, not by its rank number."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.memory import is_checkpointed
from hetrain.runtime.plan_entries import assign_entries
from tests.distributed import run_ranks

A100, V100, L4 = "a100-sxm4-80gb", "v100-sxm2-32gb", "l4"


def mixed_plan() -> Plan:
    """Three devices, listed A100 first: bf16 without micro-batches, V100s in fp16 with micro-batch 2."""
    return Plan(global_batch_size=12, balance=BalancePlan(enabled=False), ranks=[
        RankPlan(rank=0, device=A100, share=6, precision="bf16"),
        RankPlan(rank=1, device=V100, share=3, precision="fp16", micro_batch=2, grad_accum=2),
        RankPlan(rank=2, device=V100, share=3, precision="fp16", micro_batch=2, grad_accum=2,
                 activation_checkpointing=True),
    ])


def test_entries_follow_devices_in_any_rendezvous_order():
    got = assign_entries(mixed_plan(), [V100, A100, V100])
    assert [(e.device, e.precision, e.micro_batch) for e in got.entries] == [
        (V100, "fp16", 2), (A100, "bf16", None), (V100, "fp16", 2)]
    assert [e.rank for e in got.entries] == [0, 1, 2]
    assert got.shares == [3, 6, 3] and not got.resplit


def test_fewer_devices_keep_their_choices_and_shares_are_resplit():
    got = assign_entries(mixed_plan(), [V100, A100])
    assert [(e.device, e.precision, e.micro_batch) for e in got.entries] == [(V100, "fp16", 2), (A100, "bf16", None)]
    assert sum(got.shares) == 12 and got.shares == [4, 8] and got.resplit


def test_more_devices_of_a_known_kind_copy_its_entry():
    got = assign_entries(mixed_plan(), [A100, V100, V100, V100])
    assert [e.precision for e in got.entries] == ["bf16", "fp16", "fp16", "fp16"]
    assert sum(got.shares) == 12 and got.shares[0] > got.shares[1]


def test_the_re_split_note_says_why():
    """Three ranks on three entries whose devices differ from the plan's were told "3 entries for 3 ranks"."""
    assert assign_entries(mixed_plan(), [V100, A100]).notes[-1].startswith("the plan has 3 entries for 2 ranks")
    got = assign_entries(mixed_plan(), [A100, A100, V100])
    assert got.resplit and got.notes[-1].startswith(
        f"the job's devices ({A100}: 2, {V100}: 1) are not the plan's ({A100}: 1, {V100}: 2): shares re-split")


def test_a_device_the_plan_does_not_know_is_refused_with_the_fix():
    with pytest.raises(HetrainError, match=r"runs l4 on rank 1, which the plan has no entry.*a100-sxm4-80gb, "
                                          r"v100-sxm2-32gb.*hetrain plan --devices"):
        assign_entries(mixed_plan(), [A100, L4, V100])


def test_cpu_ranks_stand_in_for_the_plans_devices_in_order():
    got = assign_entries(mixed_plan(), ["cpu", "cpu", "cpu"])
    assert got.stand_in and [e.device for e in got.entries] == [A100, V100, V100]
    assert any("stand in" in n for n in got.notes)


def test_cpu_ranks_named_as_devices_say_so_in_the_plans_order_too():
    got = assign_entries(mixed_plan(), [A100, V100, V100], emulated=[True, True, True])
    assert got.stand_in and not got.resplit
    assert got.notes == [f"CPU ranks stand in for the devices HETRAIN_EMULATE_DEVICES names: rank 0 as {A100}, "
                         f"rank 1 as {V100}, rank 2 as {V100}"]


def make_data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2)])
    return torch.nn.Sequential(torch.nn.Linear(6, 16), blocks, torch.nn.Linear(16, 3))


def _run(rank, world, directory, steps):
    import hetrain

    session = hetrain.Session(mixed_plan(), checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=12, shuffle=True, seed=0)
    start = session.step_count
    pieces = []
    for x, y in loader:
        pieces.append(len(x))
        with session.autocast():
            loss = F.cross_entropy(model(x), y)
        session.backward(loss)
        session.step()
        if session.step_count == steps:
            break
    seen = {"device": session.entry.device, "precision": session.precision, "micro_batch": session.micro_batch,
            "scaler": session.scaler.enabled, "shares": list(session.shares), "start": start, "pieces": pieces,
            "checkpointing": bool(session.blocks) and all(is_checkpointed(b) for b in session.blocks)}
    session.close()
    return seen


def test_plan_listed_in_another_order_then_resumed_on_fewer_ranks(tmp_path):
    # Three ranks whose devices arrive as V100, A100, V100 (the plan lists the A100 first).
    env = {"HETRAIN_EMULATE_DEVICES": f"{V100},{A100},{V100}"}
    first = run_ranks(_run, 3, str(tmp_path), 2, env=env)
    assert [(s["device"], s["precision"], s["micro_batch"]) for s in first] == [
        (V100, "fp16", 2), (A100, "bf16", None), (V100, "fp16", 2)]
    assert first[0]["pieces"] == [2, 1, 2, 1] and first[1]["pieces"] == [6, 6]   # V100s cut 3 into 2 + 1
    assert all(s["scaler"] for s in first) and first[0]["shares"] == [3, 6, 3]
    assert [s["checkpointing"] for s in first] == [False, False, True]   # only the third entry checkpoints
    # The same checkpoint resumed on two ranks (A100 first this time): each keeps its device's choices.
    env = {"HETRAIN_EMULATE_DEVICES": f"{A100},{V100}"}
    second = run_ranks(_run, 2, str(tmp_path), 4, env=env)
    assert [(s["device"], s["precision"], s["micro_batch"]) for s in second] == [(A100, "bf16", None), (V100, "fp16", 2)]
    assert all(s["start"] == 2 for s in second) and all(s["scaler"] for s in second)
    assert second[0]["shares"] == [8, 4] and second[1]["pieces"] == [2, 2, 2, 2]


def test_a_run_without_a_plan_says_how_it_starts():
    """Under plain torchrun (or hetrain launch without --plan) rank 0 says it has no plan and starts even
    (the session logs its assignment's notes on rank 0)."""
    import hetrain

    with hetrain.Session() as session:
        assert session.precision == "fp32"
        assert session.assignment.notes == [
            "no plan (hetrain launch --plan, or HETRAIN_PLAN): 1 rank(s) start from an even split in fp32, "
            "without micro-batches"]


def test_a_plans_islands_give_way_to_a_flat_all_reduce_on_another_number_of_ranks():
    from hetrain.planning.plan import CommPlan
    from hetrain.runtime.plan_entries import comm_for_world

    plan = mixed_plan().model_copy(update={"comm": CommPlan(hierarchical=True, islands=[[0], [1, 2]])})
    same, note = comm_for_world(plan, assign_entries(plan, [A100, V100, V100]))
    assert same is plan.comm and note is None
    flat, note = comm_for_world(plan, assign_entries(plan, [A100, V100]))
    assert not flat.hierarchical and flat.islands is None and flat.compression == plan.comm.compression
    assert note.startswith("the plan's islands [[0], [1, 2]] name its 3 ranks and this job has 2: gradients all-reduce flat")


def test_a_plans_islands_follow_the_ranks_when_the_nodes_arrive_in_another_order():
    """Node B (two V100s) joining first took ranks 0 and 1: the shares and precisions followed the devices,
    but the islands stayed [[0], [1, 2]], joining B's second V100 with A's A100 over the network."""
    from hetrain.planning.plan import CommPlan
    from hetrain.runtime.plan_entries import comm_for_world

    plan = mixed_plan().model_copy(update={"comm": CommPlan(hierarchical=True, islands=[[0], [1, 2]])})
    b_first = assign_entries(plan, [V100, V100, A100], nodes=["1", "1", "0"])
    comm, note = comm_for_world(plan, b_first)
    assert comm.hierarchical and comm.islands == [[2], [0, 1]], comm
    assert "its islands [[0], [1, 2]] are ranks [[2], [0, 1]]" in note
    # entries of one kind on two nodes: following the entries would join nodes, so the islands are the nodes
    two_kinds = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                     comm=CommPlan(hierarchical=True, islands=[[0, 1], [2, 3]]), ranks=[
                         RankPlan(rank=0, device=A100, share=2), RankPlan(rank=1, device=A100, share=2),
                         RankPlan(rank=2, device=V100, share=2), RankPlan(rank=3, device=A100, share=2)])
    mixed_first = assign_entries(two_kinds, [V100, A100, A100, A100], nodes=["1", "1", "0", "0"])
    comm, note = comm_for_world(two_kinds, mixed_first)
    assert comm.islands == [[0, 1], [2, 3]] and "the islands are this job's nodes" in note, (comm, note)
    # one kind on nodes of 4 and 2 ranks, the smaller joining first: every rank keeps its own entry, yet
    # the plan's island [0..3] would span both nodes
    one_kind = Plan(global_batch_size=12, balance=BalancePlan(enabled=False),
                    comm=CommPlan(hierarchical=True, islands=[[0, 1, 2, 3], [4, 5]]),
                    ranks=[RankPlan(rank=r, device=A100, share=2) for r in range(6)])
    small_first = assign_entries(one_kind, [A100] * 6, nodes=["1", "1", "0", "0", "0", "0"])
    comm, note = comm_for_world(one_kind, small_first)
    assert comm.islands == [[0, 1], [2, 3, 4, 5]] and "the islands are this job's nodes" in note, (comm, note)
    same, note = comm_for_world(one_kind, assign_entries(one_kind, [A100] * 6, nodes=["0"] * 4 + ["1"] * 2))
    assert same is one_kind.comm and note is None


def test_a_plan_written_without_devices_runs_on_the_devices_the_ranks_have():
    """porting.md's hand-written plan (RankPlan's device defaults to cpu) stopped every GPU rank with
    'this job runs a100..., which the plan has no entry for (its devices: cpu)'."""
    plan = Plan(global_batch_size=64, ranks=[RankPlan(rank=r, share=32, micro_batch=8) for r in range(2)])
    got = assign_entries(plan, [A100, V100])
    assert [(e.device, e.share, e.micro_batch) for e in got.entries] == [(A100, 32, 8), (V100, 32, 8)]
    assert any("the plan names no device" in n for n in got.notes)
    assert not got.stand_in
