"""`session.forward_backward` calls the model as a script would: a tokenizer's dict as keywords (a Hugging
Face model gets its attention_mask), a tuple or list as positional inputs."""

import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, Plan, RankPlan


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 3)
        self.calls = []

    def forward(self, input_ids, attention_mask=None):
        self.calls.append(sorted(k for k, v in (("attention_mask", attention_mask),) if v is not None))
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.head(h.mean(1))


def test_a_dict_of_inputs_is_passed_as_keywords_and_a_list_as_positional_inputs():
    import hetrain

    plan = Plan(global_batch_size=4, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=4)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = Masked()
    reference = Masked()
    reference.load_state_dict(net.state_dict())
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ids, mask = torch.randint(0, 10, (8, 5)), torch.tensor([[1, 1, 1, 0, 0]] * 8)
    data = torch.utils.data.StackDataset(input_ids=ids, attention_mask=mask)
    for inputs, how in zip(session.loader(data, global_batch_size=4, shuffle=False), ("dict", "list")):
        y = torch.tensor([0, 1, 2, 0])
        args = inputs if how == "dict" else [inputs["input_ids"], inputs["attention_mask"]]
        loss = session.forward_backward(args, y, F.cross_entropy)
        expected = F.cross_entropy(reference(**inputs), y)
        assert torch.allclose(loss, expected), (how, loss, expected)
        assert net.calls[-1] == ["attention_mask"]
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        expected.backward()
        for n, p in reference.named_parameters():
            assert torch.allclose(grads[n], p.grad, atol=1e-7), n
        reference.zero_grad()
        session.step()
        reference.load_state_dict(net.state_dict())
    assert session.step_count == 2
    session.close()
