"""A state carried from one batch to the next by sample position (word_language_model's batchify columns and
repackaged LSTM hidden state, truncated BPTT) trains as one process does under a split that never changes, uneven
too: each rank reads the same positions of every global batch (docs/porting.md, "Other things DDP scripts do")."""

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.distributed import run_ranks

COLUMNS, BPTT, STEPS, TOKENS = 16, 4, 5, 12


class Chunks(Dataset):
    """Sample j of step i: column j's i-th chunk of BPTT tokens (batchify + get_batch)."""

    def __init__(self):
        data = torch.randint(0, TOKENS, (COLUMNS * BPTT * STEPS + 1,), generator=torch.Generator().manual_seed(0))
        n = (len(data) - 1) // COLUMNS
        self.src, self.tgt = data[:n * COLUMNS].view(COLUMNS, n), data[1:n * COLUMNS + 1].view(COLUMNS, n)

    def __len__(self):
        return COLUMNS * STEPS

    def __getitem__(self, k):
        i, j = divmod(k, COLUMNS)
        return self.src[j, i * BPTT:(i + 1) * BPTT], self.tgt[j, i * BPTT:(i + 1) * BPTT], torch.tensor(j)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.rnn = torch.nn.Embedding(TOKENS, 8), torch.nn.LSTM(8, 8, 1)
        self.decoder = torch.nn.Linear(8, TOKENS)

    def forward(self, x, hidden):   # x: (BPTT, columns)
        out, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(out), hidden


def _loss(net, x, y, hidden):
    out, hidden = net(x.t(), tuple(h.detach() for h in hidden))
    return F.cross_entropy(out.reshape(-1, TOKENS), y.t().reshape(-1)), hidden


def _ranks(rank, world):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=COLUMNS, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=10), RankPlan(rank=1, share=6)])
    session = hetrain.Session(plan)
    net = Net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    loader = session.loader(Chunks(), global_batch_size=COLUMNS, shuffle=False)
    columns = []
    while loader.epoch < 2:
        hidden = (torch.zeros(1, session.shares[session.rank], 8),) * 2
        for x, y, column in loader:
            columns.append(column.tolist())
            loss, hidden = _loss(model, x, y, hidden)
            session.backward(loss)
            session.step()
    params = [p.detach().clone() for p in net.parameters()]
    session.close()
    return {"columns": columns, "params": params}


def test_a_hidden_state_carried_by_column_trains_as_one_process_under_a_fixed_uneven_split():
    net, data = Net(), Chunks()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(2):
        hidden = (torch.zeros(1, COLUMNS, 8),) * 2
        for step in range(STEPS):
            x, y, _ = (torch.stack(t) for t in zip(*(data[step * COLUMNS + j] for j in range(COLUMNS))))
            loss, hidden = _loss(net, x, y, hidden)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    results = run_ranks(_ranks, 2)
    assert results[0]["columns"] == [list(range(10))] * 2 * STEPS      # the same columns at every step
    assert results[1]["columns"] == [list(range(10, 16))] * 2 * STEPS
    for result in results:
        for mine, want in zip(result["params"], net.parameters(), strict=True):
            assert torch.allclose(mine, want.detach(), atol=1e-5), (mine - want).abs().max()
