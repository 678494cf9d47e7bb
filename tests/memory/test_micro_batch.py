"""Gradient accumulation over micro-batches gives the update of the whole share at once."""

import torch

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.data import GlobalBatchOrder
from hetrain.runtime.memory import micro_batch_sizes, split_batch
from tests.distributed import run_ranks
from tests.memory.models import make_data, make_model

SHARES = [7, 4, 1]
MICRO = [2, 3, None]
STEPS = 2
LR = 0.5


def test_micro_batch_sizes():
    assert micro_batch_sizes(7, 2) == [2, 2, 2, 1]
    assert micro_batch_sizes(4, 3) == [2, 2]
    assert micro_batch_sizes(5, None) == [5]
    assert micro_batch_sizes(5, None, grad_accum=2) == [3, 2]
    assert micro_batch_sizes(0, 2) == [0]
    x, y = torch.arange(7.0), torch.arange(7)
    pieces = list(split_batch([x, y], [3, 4], 7))
    assert [p[0].tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5, 6]] and torch.equal(pieces[1][1], y[3:])


def _session(shares, micro, **options):
    """A session on a plan of these shares and micro-batches, SGD at LR, and its loader."""
    import hetrain

    plan = Plan(global_batch_size=sum(shares), balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, micro_batch=m) for r, (s, m) in enumerate(zip(shares, micro))])
    session = hetrain.Session(plan)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    loader = session.loader(make_data(), global_batch_size=sum(shares), shuffle=True, seed=5, **options)
    return session, net, model, loader


def _train(rank, world):

    session, net, model, loader = _session(SHARES, MICRO)
    params, returned, sizes = [], [], []
    for x, y in loader:                          # the plain loop: the loader yields micro-batches
        sizes.append(len(x))
        session.backward(torch.nn.functional.cross_entropy(model(x), y))
        returned.append(session.step())
        if returned[-1]:
            params.append([p.detach().clone() for p in net.parameters()])
        if session.step_count == STEPS:
            break
    return {"params": params, "returned": returned, "sizes": sizes, "steps": session.step_count}


def test_accumulated_update_equals_the_whole_batch_update():
    results = run_ranks(_train, 3)
    assert results[0]["sizes"] == [2, 2, 2, 1] * STEPS
    assert results[0]["returned"] == [False, False, False, True] * STEPS
    assert results[1]["sizes"] == [2, 2] * STEPS and results[2]["sizes"] == [1] * STEPS
    assert [r["steps"] for r in results] == [STEPS] * 3

    _assert_single_process_updates(results, sum(SHARES))


def _assert_single_process_updates(results, global_batch):
    """Each rank's parameters after each step equal SGD on the whole global batch in one process."""
    model = make_model()
    order = GlobalBatchOrder(len(make_data()), global_batch, shuffle=True, seed=5)
    for step in range(STEPS):
        grads = _global_grads_at(model, order.global_batch(0, step))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= LR * g
        for rank in range(len(results)):
            for got, want in zip(results[rank]["params"][step], model.parameters()):
                assert (got - want).abs().max().item() < 1e-5, (step, rank)


def _global_grads_at(model, indices):
    x, y = make_data()[indices]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.autograd.grad(loss, list(model.parameters()))


BE_SHARES = [6, 2, 0]
BE_MICRO = [2, None, None]


def _collate_encoding(samples):
    """What a tokenizer's collator returns: a BatchEncoding (a UserDict, not a dict)."""
    from transformers import BatchEncoding

    return BatchEncoding({"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])})


def _train_encoding(rank, world):
    session, net, model, loader = _session(BE_SHARES, BE_MICRO, collate_fn=_collate_encoding)
    params, sizes, kinds = [], [], set()
    for batch in loader:
        kinds.add(type(batch).__name__)
        sizes.append(len(batch["x"]))
        session.backward(torch.nn.functional.cross_entropy(model(batch.x), batch["y"]))
        if session.step():
            params.append([p.detach().clone() for p in net.parameters()])
        if session.step_count == STEPS:
            break
    return {"params": params, "sizes": sizes, "kinds": kinds}


def test_a_batch_encoding_is_cut_into_micro_batches_and_emptied_on_a_rank_without_samples():
    """Hugging Face collators return a BatchEncoding: it is cut into the plan's micro-batches like a
    dict (it was handed whole to every piece, counting a rank's samples once per piece), and a rank
    with no samples gets it empty; the update is the single process's on the global batch."""
    results = run_ranks(_train_encoding, 3)
    assert results[0]["sizes"] == [2, 2, 2] * STEPS and results[1]["sizes"] == [2] * STEPS
    assert results[2]["sizes"] == [0] * STEPS
    assert all(r["kinds"] == {"BatchEncoding"} for r in results)
    _assert_single_process_updates(results, sum(BE_SHARES))


class _WithText(torch.utils.data.Dataset):
    """make_data's samples with their label as text too, as a collate leaves raw strings: a list per batch."""

    def __init__(self):
        self.data = make_data()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, y, str(int(y))


def _train_text(rank, world):
    import hetrain

    plan = Plan(global_batch_size=sum(BE_SHARES), balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, micro_batch=m) for r, (s, m) in enumerate(zip(BE_SHARES, BE_MICRO))])
    session = hetrain.Session(plan)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    loader = session.loader(_WithText(), global_batch_size=sum(BE_SHARES), shuffle=True, seed=5)
    params, texts = [], []
    for x, y, text in loader:
        texts.append(list(text))
        labels = torch.tensor([int(t) for t in text], dtype=torch.long)   # the loop reads the strings
        assert len(labels) == len(x) and torch.equal(labels, y)
        session.backward(torch.nn.functional.cross_entropy(model(x), labels))
        if session.step():
            params.append([p.detach().clone() for p in net.parameters()])
        if session.step_count == STEPS:
            break
    return {"params": params, "texts": texts}


def test_per_sample_strings_are_cut_with_their_samples_and_emptied_on_a_rank_without_samples():
    results = run_ranks(_train_text, 3)
    assert [len(t) for t in results[0]["texts"]] == [2, 2, 2] * STEPS
    assert results[2]["texts"] == [[]] * STEPS
    _assert_single_process_updates(results, sum(BE_SHARES))


def _collate_ragged(samples):
    """A collate that leaves each sample's token ids a list of its own length, beside the batch tensors,
    and a tensor that belongs to the whole batch (a class weight)."""
    return {"x": torch.stack([s[0] for s in samples]), "ids": [[int(s[1])] * (1 + int(s[1]) % 3) for s in samples],
            "weight": torch.ones(4)}


def _train_ragged(rank, world):
    session, net, model, loader = _session(BE_SHARES, BE_MICRO, collate_fn=_collate_ragged)
    params, sizes = [], []
    for batch in loader:
        labels = torch.tensor([ids[0] for ids in batch["ids"]], dtype=torch.long)   # the loop reads the lists
        assert len(labels) == len(batch["x"]) and batch["weight"].shape == (4,)
        sizes.append(len(labels))
        session.backward(torch.nn.functional.cross_entropy(model(batch["x"]), labels))
        if session.step():
            params.append([p.detach().clone() for p in net.parameters()])
        if session.step_count == STEPS:
            break
    return {"params": params, "sizes": sizes}


def test_per_sample_lists_are_cut_with_their_samples_and_a_rank_without_samples_keeps_whole_batch_tensors():
    """Token ids as one list per sample were handed whole to every micro-batch (0.30 from the single
    process's parameters after one step); a rank without samples had its whole-batch tensors cut to 0."""
    results = run_ranks(_train_ragged, 3)
    assert results[0]["sizes"] == [2, 2, 2] * STEPS and results[2]["sizes"] == [0] * STEPS
    _assert_single_process_updates(results, sum(BE_SHARES))


def test_a_list_of_lists_is_cut_by_sample_below_the_top_level_only():
    from hetrain.runtime.memory import empty_batch

    pieces = list(split_batch({"x": torch.zeros(4, 1), "ids": [[1, 2], [3], [4, 5, 6], [0]]}, [3, 1], 4))
    assert [p["ids"] for p in pieces] == [[[1, 2], [3], [4, 5, 6]], [[0]]]
    offsets = [[(0, 1), (1, 3)], [(0, 2)], [(0, 1)], []]   # a tokenizer's unpadded offsets: pairs per token
    pieces = list(split_batch({"x": torch.zeros(4, 1), "offsets": offsets}, [1, 3], 4))
    assert [p["offsets"] for p in pieces] == [offsets[:1], offsets[1:]]
    assert empty_batch({"x": torch.zeros(1, 2), "ids": [[0]], "n": torch.ones(3)})["ids"] == []
    assert empty_batch({"x": torch.zeros(1, 2), "ids": [[0]], "n": torch.ones(3)})["n"].shape == (3,)
    fields = (["a", "b"], ["c", "d"])   # the top level: two fields of one string per sample, not two samples
    assert list(split_batch(fields, [1, 1], 2))[1] == (["b"], ["d"])


def test_a_sequence_first_tensor_is_refused_where_the_batch_is_cut_not_handed_whole():
    import pytest

    from hetrain.errors import HetrainError

    tokens, lengths = torch.zeros(5, 8), torch.arange(8)          # [T, B]: the samples along dimension 1
    with pytest.raises(HetrainError, match=r"shape \(5, 8\) .* its 8 samples lie along dimension 1"):
        list(split_batch((tokens, lengths), [4, 4], 8))
    assert list(split_batch((tokens, lengths), [8], 8))[0][0] is tokens        # one piece: nothing to cut
    position_ids = torch.arange(8)[None]                            # [1, T]: broadcast over the samples
    assert list(split_batch((tokens.T, position_ids), [4, 4], 8))[1][1] is position_ids
    shared = torch.ones(5)                                          # no dimension of 8: shared by the pieces
    pieces = list(split_batch({"x": torch.zeros(8, 3), "bias": shared, "ids": ("a",) * 8}, [3, 5], 8))
    assert [p["x"].shape[0] for p in pieces] == [3, 5] and pieces[1]["bias"] is shared
    assert pieces[0]["ids"] == ("a",) * 3
    scale = torch.tensor(2.0)                                       # a 0-d tensor: shared
    assert all(p[1] is scale for p in split_batch((torch.zeros(8, 3), scale), [4, 4], 8))


def test_a_batch_of_rows_that_are_not_samples_is_refused_where_it_would_be_cut():
    """A tokenizer's overflowing windows (9 rows for 6 samples) and sequences packed into one row went whole
    to every micro-batch (0.020 off the single process in 3 steps); 12 windows of 6 tokens for 6 samples were
    called sequence-first."""
    import pytest

    from hetrain.errors import HetrainError

    overflow = {"input_ids": torch.zeros(9, 7), "overflow_to_sample_mapping": torch.arange(9)}
    windows = {"input_ids": torch.zeros(12, 6), "attention_mask": torch.ones(12, 6)}
    packed = {"input_ids": torch.zeros(1, 40), "position_ids": torch.zeros(1, 40)}
    for batch in (overflow, windows, packed):
        with pytest.raises(HetrainError, match="nothing in this rank's batch of 6 samples has one entry per sample"):
            list(split_batch(batch, [2, 2, 2], 6))
        assert list(split_batch(batch, [6], 6))[0] is batch   # one piece: nothing to cut
    import numpy as np

    arrays = list(split_batch({"x": np.zeros((6, 5)), "y": np.zeros(6)}, [2, 4], 6))   # NumPy fields are samples
    assert [p["x"].shape for p in arrays] == [(2, 5), (4, 5)]


def test_a_batch_encoding_s_per_sample_encodings_follow_their_piece():
    """word_ids() and tokens() of a piece answered for the rank's first samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hetrain.runtime.memory import empty_batch

    words = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]")
    batch = tokenizer(["a b", "c", "b c a", "a"], padding=True, return_tensors="pt")
    pieces = list(split_batch(batch, [2, 2], 4))
    assert [pieces[1].tokens(i) for i in range(2)] == [batch.tokens(2), batch.tokens(3)]
    assert pieces[0].word_ids(1) == batch.word_ids(1) and len(batch.encodings) == 4   # the batch kept whole
    assert empty_batch(tokenizer(["a b"], return_tensors="pt")).encodings == []
