"""An evaluation loop over each rank's own part of a set, calling session.gather_rows() once per batch, makes
fewer calls on the rank with fewer batches: that rank closes its session while another waits in the call. The
job ended after the progress limit (300 s) asking whether the call was inside `if rank == 0:`; it is now named
within seconds, with the unequal count of calls as a cause and its fix."""

import json
import sys
from pathlib import Path

from hetrain.runtime.watchdog import CLOSED_KEY, Progress, ProgressWatch, find_stall, stall_message
from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


class Store:   # the c10d store's calls the watch makes, in memory
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def test_a_call_left_waiting_by_a_closed_rank_names_unequal_counts_of_calls():
    after = {0: Progress(9, "in session.gather_rows()", 1.0, 6), 1: Progress(9, "done", 1.0, 7)}
    message = stall_message(find_stall(after, after), after, 4.0, 300.0)
    assert message.startswith("rank 1 closed the session while rank 0 wait(s) in session.gather_rows() for 4 s: a "
                              "collective call every rank makes as many times before close()"), message
    assert "pad every rank's part to one count of batches, or gather once after the loop" in message, message


def test_a_model_state_dict_left_waiting_by_a_closed_rank_is_not_told_to_pad_batches():
    """`if rank == 0: session.model_state_dict()` at the end: a call made once, not in a loop over batches
    (the advice to pad each rank's part was given there too; found in review)."""
    after = {0: Progress(9, "in session.model_state_dict()", 1.0, 6), 1: Progress(9, "done", 1.0, 7)}
    message = stall_message(find_stall(after, after), after, 4.0, 300.0)
    assert "is it inside `if rank == 0:`?" in message and "pad every rank's part" not in message, message


def _watch(store, reports, call):
    watch = ProgressWatch(store, 0, 2, 300.0, on_stall=lambda message, stall: reports.append(message))
    watch.between(9)
    watch._set(9, f"in session.{call}()")
    watch._publish()
    return watch


def _rank1(store, phase, seq):
    store.set("hetrain/progress/1", json.dumps({"step": 9, "phase": phase, "seconds": 1.0, "seq": seq}))


def test_a_rank_in_a_call_that_ends_together_is_told_at_the_second_check_after_the_other_closed():
    store, reports = Store(), []
    watch = _watch(store, reports, "gather_rows")
    _rank1(store, "in the script's own code between steps", 5)   # on its way to the call, or to close()
    store.set(CLOSED_KEY, "1")   # an earlier session of the job closed: not this one's peer
    assert not watch._call_after_close(5.0) and not watch._call_after_close(6.0)
    _rank1(store, "done", 6)
    assert not watch._call_after_close(7.0) and not reports   # a first sight: rank 1 may have just left the call
    assert watch._call_after_close(8.0)
    assert reports[0].startswith("rank 1 closed the session while rank 0 wait(s) in session.gather_rows()"), reports


def test_a_rank_in_model_state_dict_after_the_other_closed_is_left_to_the_progress_limit():
    """rank 0 alone receives the gathered model, and may work on in the call after the others returned."""
    store, reports = Store(), []
    watch = _watch(store, reports, "model_state_dict")
    store.set(CLOSED_KEY, "1")
    _rank1(store, "done", 6)
    assert not any(watch._call_after_close(float(t)) for t in range(5, 10)) and not reports


EVALUATION = '''
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
import hetrain

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    evals = TensorDataset(torch.randn(51, 6, generator=g), torch.randint(0, 3, (51,), generator=g))
    session = hetrain.Session()
    net = torch.nn.Linear(6, 3)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=16, seed=0):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    part = Subset(evals, range(session.rank, len(evals), session.world_size))   # 26 and 25 samples
    preds = []
    with torch.no_grad():
        for x, y in DataLoader(part, batch_size=5):   # 6 batches on rank 0, 5 on rank 1
            preds.append(session.gather_rows(model.module(x).argmax(-1)))
    session.close()
'''


def test_an_evaluation_with_fewer_batches_on_one_rank_is_named_before_the_progress_limit(tmp_path):
    (tmp_path / "job.py").write_text(EVALUATION)
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
                 str(tmp_path / "job.py")], cwd=ROOT, timeout=150)   # the progress limit: 300 s
    assert r.returncode != 0
    assert "rank 1 closed the session while rank 0 wait(s) in session.gather_rows()" in r.stderr, r.stderr[-2000:]
    assert "pad every rank's part to one count of batches, or gather once after the loop" in r.stderr
