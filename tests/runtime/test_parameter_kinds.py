"""Parameters prepare() cannot train as one process would are refused there in one line naming the fix:
sparse gradients, a lazy module not yet run, a model on the meta device, mixed dtypes under ZeRO-1/FSDP2.
Each got torch's traceback from inside hetrain's step or torch's wrappers (a sparse embedding's first
backward: 'Could not run aten::_amp_foreach_non_finite_check_and_unscale_ with arguments from the
SparseCPU backend')."""

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan


def _prepare(model, sharding="none"):
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8)])
    with hetrain.Session(plan) as session:
        return session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


class Tokens(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=sparse)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        out = self.head(self.emb(x))
        return out * self.table.sum().float() if hasattr(self, "table") else out


@pytest.mark.parametrize("sharding", ["none", "zero1", "fsdp"])
def test_a_sparse_embedding_is_refused_naming_sparse_false(sharding):
    with pytest.raises(HetrainError, match=r"^emb makes sparse gradients \(sparse=True\).*sparse=False"):
        _prepare(Tokens(sparse=True), sharding)
    with pytest.raises(HetrainError, match=r"^the model makes sparse gradients"):   # the table alone: no name
        _prepare(torch.nn.Embedding(10, 2, sparse=True), sharding)
    _prepare(Tokens(sparse=False), sharding)


def test_a_lazy_module_not_yet_run_is_refused_and_one_run_once_trains():
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    with pytest.raises(HetrainError, match=r"parameter 0.weight is not initialised yet.*run one forward"):
        _prepare(lazy)
    lazy(torch.randn(2, 5))
    _prepare(lazy)


def test_a_model_on_the_meta_device_is_refused_naming_to_empty():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
    with pytest.raises(HetrainError, match=r"parameter weight is on the meta device.*model.to_empty"):
        _prepare(model)


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_parameters_of_two_dtypes_are_refused_under_sharding_that_flattens_them(sharding):
    model = torch.nn.Linear(4, 2)
    model.scale = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(HetrainError, match=r"needs the model's parameters in one dtype, and they are float32 "
                                           r"\(weight\), float64 \(scale\).*sharding 'none'"):
        _prepare(model, sharding)
    _prepare(model, "none")


def test_an_optimizer_over_tensors_that_are_not_the_model_s_is_refused():
    """A model made again after its optimizer trained nothing (every step returned True, the weights never
    moved); a learnable temperature the loss held was stepped on each rank's own gradient."""
    import hetrain

    def prepare(model, params):
        with hetrain.Session() as session:
            return session.prepare(model, torch.optim.SGD(params, lr=0.1))

    stale = torch.nn.Linear(4, 2)
    with pytest.raises(HetrainError, match=r"holds none of the model's parameters.*built on another model object"):
        prepare(torch.nn.Linear(4, 2), stale.parameters())
    model, temperature = torch.nn.Linear(4, 2), torch.nn.Parameter(torch.ones(()))
    with pytest.raises(HetrainError, match=r"holds 1 tensor\(s\) that are not the model's parameters \(shapes \(\)\)"):
        prepare(model, [*model.parameters(), temperature])
    teacher = torch.nn.Linear(4, 2).requires_grad_(False)   # a distillation's teacher, frozen, in the optimizer
    with pytest.raises(HetrainError, match=r"holds 2 frozen tensor\(s\) that are not the model's parameters .*another "
                                           r"model's .*leave them out of the optimizer"):
        prepare(model, [*model.parameters(), *teacher.parameters()])
    both = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(2, 1)})
    prepare(both, [{"params": both["a"].parameters()}, {"params": both["b"].parameters(), "lr": 0.01}])


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_frozen_parameters_of_another_dtype_or_a_frozen_sparse_table_are_not_refused(sharding):
    """A fixed float64 table, or a pretrained sparse embedding, with requires_grad=False trained before the
    refusals of two dtypes and of sparse gradients came in: neither is flattened with the rest nor stepped."""
    model = Tokens(sparse=True)
    model.emb.weight.requires_grad_(False)
    model.table = torch.nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with hetrain.Session(plan) as session:
        net, _ = session.prepare(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
        tokens = torch.arange(8).reshape(8, 1)
        for x, in session.loader(torch.utils.data.TensorDataset(tokens), global_batch_size=8):
            session.backward(net(x).sum())
            session.step()
        after = session.model_state_dict()
    assert torch.equal(after["emb.weight"], before["emb.weight"]) and torch.equal(after["table"], before["table"])
    assert after["table"].dtype == torch.float64
    assert not torch.equal(after["head.weight"], before["head.weight"])   # the head trained


class FunctionalSparse(torch.nn.Module):
    """A table of its own read through F.embedding(sparse=True), or an nn.Embedding(sparse=True) frozen at
    prepare() and made trainable later: neither is an nn.Embedding prepare() can see train sparsely."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.emb = torch.nn.Embedding(10, 4, sparse=how == "unfrozen later")
        self.emb.weight.requires_grad_(how != "unfrozen later")
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        rows = torch.nn.functional.embedding(x, self.emb.weight, sparse=True) if self.how == "functional" else self.emb(x)
        return self.head(rows).sum(1)


def _sparse_steps(rank, world, how):
    import hetrain
    import torch.nn.functional as F

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5), RankPlan(rank=1, share=3)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = FunctionalSparse(how)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randint(0, 10, (32, 3)), torch.randint(0, 2, (32,)))
    try:
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            if session.step_count == 1:
                net.emb.weight.requires_grad_(True)
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    except HetrainError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("how", ["functional", "unfrozen later"])
def test_a_sparse_gradient_prepare_could_not_see_is_refused_naming_sparse_false(how):
    """F.embedding(sparse=True) ended in torch's 'Cannot access storage of SparseTensorImpl' from inside the
    backward; a sparse embedding unfrozen after prepare() in 'reshape is not implemented for sparse tensors'."""
    from tests.distributed import run_ranks

    for said in run_ranks(_sparse_steps, 2, how):
        assert "sparse gradient" in said and "sparse=False" in said, said


class Distiller(torch.nn.Module):
    """A student trained toward a frozen teacher that the model holds, the teacher in bfloat16."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.student = torch.nn.Linear(4, 3)
        self.teacher = torch.nn.Linear(4, 3).to(torch.bfloat16).requires_grad_(False)

    def forward(self, x):
        target = self.teacher(x.to(torch.bfloat16)).float().softmax(-1)
        return torch.nn.functional.kl_div(self.student(x).log_softmax(-1), target, reduction="batchmean")


@pytest.mark.parametrize("sharding", ["none", "zero1", "fsdp"])
def test_a_frozen_half_precision_teacher_inside_the_model_trains_the_student_as_one_process(sharding):
    """Refused before (the teacher had to be kept in fp32, twice its memory): a frozen part has no gradient,
    master weight or optimizer state. Made trainable later it is refused, naming the parameter."""
    import hetrain

    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    reference = Distiller()
    opt = torch.optim.SGD(reference.student.parameters(), lr=0.5)
    for start in (0, 8):
        reference(data.tensors[0][start:start + 8]).backward()
        opt.step()
        opt.zero_grad()
    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8)])
    model = Distiller()
    with hetrain.Session(plan) as session:
        net, _ = session.prepare(model, torch.optim.SGD(model.student.parameters(), lr=0.5))
        for x, in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(net(x))
            session.step()
        after = session.model_state_dict()
    assert after["teacher.weight"].dtype == torch.bfloat16
    assert torch.equal(after["teacher.weight"], reference.teacher.weight)
    torch.testing.assert_close(after["student.weight"], reference.student.weight, rtol=1e-6, atol=1e-6)

    if sharding == "zero1":   # ZeRO-1 flattens what the optimizer holds: a teacher there is refused, named
        whole = Distiller()
        with pytest.raises(HetrainError, match=r"shards every parameter the optimizer holds, frozen ones included.*"
                                               r"bfloat16, float32: build the optimizer on the trainable parameters"):
            _prepare(whole, sharding)
    trainable = Distiller()
    trainable.teacher.requires_grad_(True)
    with pytest.raises(HetrainError, match=r"^parameter teacher.weight is bfloat16 and trainable.*requires_grad_\(False\)"):
        _prepare(trainable, sharding)


def _unfreeze_half(rank, world, sharding):
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5), RankPlan(rank=1, share=3)])
    session = hetrain.Session(plan)
    net = Distiller()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        for x, in session.loader(torch.utils.data.TensorDataset(torch.randn(32, 4)), global_batch_size=8):
            if session.step_count == 1:
                net.teacher.requires_grad_(True)
            session.backward(model(x))
            session.step()
    except HetrainError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_half_precision_part_made_trainable_after_prepare_is_refused_on_every_rank(sharding):
    """Before the backward: under FSDP2 it ended in torch's 'reduce-scatter expects uniform gradient dtype'."""
    from tests.distributed import run_ranks

    for said in run_ranks(_unfreeze_half, 2, sharding):
        assert said.startswith("parameter teacher.weight is bfloat16 and trainable"), said


class SharedAcrossBlocks(torch.nn.Module):
    """ALBERT-style: one weight shared by the layers of two blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
        self.blocks[1][0].weight = self.blocks[0][0].weight
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _fsdp_trains_as_one_process(make, samples, momentum):
    """`make()`'s model trained by one plain process and by a one-rank FSDP2 session on the same batches of 8:
    each weight the same. Returns the session's whole state dict."""
    import hetrain

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 8, generator=g),
                                          torch.randint(0, 3, (samples,), generator=g))
    reference = make()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum)
    for start in range(0, samples, 8):
        torch.nn.functional.cross_entropy(reference(data.tensors[0][start:start + 8]),
                                          data.tensors[1][start:start + 8]).backward()
        opt.step()
        opt.zero_grad()
    model = make()
    plan = Plan(global_batch_size=8, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8)])
    with hetrain.Session(plan) as session:
        net, _ = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum))
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(torch.nn.functional.cross_entropy(net(x), y))
            session.step()
        after = session.model_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-6, msg=name)
    return after


def test_a_weight_shared_by_two_blocks_trains_under_fsdp_as_one_process():
    """prepare() sharded each block as its own FSDP2 group, and the first forward ended in torch's 'shared with a
    parameter already managed by another FSDP group ... use fully_shard([module_a, module_b])', a call a hetrain
    user never makes. Blocks that share a weight are now one group."""
    from hetrain.runtime.sharding import sharing_groups

    assert [len(group) for group in sharing_groups(list(SharedAcrossBlocks().blocks))] == [2, 1]
    after = _fsdp_trains_as_one_process(SharedAcrossBlocks, 24, momentum=0.9)
    assert torch.equal(after["blocks.0.0.weight"], after["blocks.1.0.weight"])


def test_gradient_hooks_on_parameters_fsdp2_never_runs_are_said(tmp_path):
    """A hook on a parameter's gradient (x 0.5) registered before prepare() ran under none and zero1 and silently
    not at all under FSDP2: the update changed without a word."""
    from tests.log_lines import hetrain_warnings

    for sharding in ("fsdp", "none"):
        model = SharedAcrossBlocks()
        model.out.weight.register_hook(lambda g: g * 0.5)
        model.out.bias.register_post_accumulate_grad_hook(lambda p: None)
        with hetrain_warnings() as lines:
            _prepare(model, sharding)
        if sharding == "fsdp":
            said = [line for line in lines if "runs no gradient hook" in line]
        else:
            assert not [line for line in lines if "runs no gradient hook" in line], lines
    assert len(said) == 1 and "which these have: out.weight, out.bias; change p.grad between the step's" in said[0], said


class SharedWithTheRoot(SharedAcrossBlocks):
    """Besides the first two blocks' shared weight, the third block's tied to a layer outside the blocks."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 8)
        self.head.weight = self.blocks[2][0].weight

    def forward(self, x):
        return super().forward(self.head(x))


def test_a_weight_a_block_shares_with_a_layer_outside_the_blocks_trains_under_fsdp_as_one_process():
    """Sharded as its own group, the block held the weight the root's layer also uses: torch refused the first
    forward. Such a block is sharded with the root."""
    after = _fsdp_trains_as_one_process(SharedWithTheRoot, 16, momentum=0.0)
    assert torch.equal(after["head.weight"], after["blocks.2.0.weight"])
