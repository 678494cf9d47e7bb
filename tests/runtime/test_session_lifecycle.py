"""A session's edges as a notebook or a new user meets them: a loss that is not one number, a session used
after close(), the same optimizer prepared again by a new session, an error at an interactive prompt, a
device named without an index."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import hetrain
from torch.utils.data import TensorDataset

from hetrain.errors import HetrainError
from tests.runtime.test_refusals import make_data, make_net

ROOT = Path(__file__).resolve().parents[2]


def _session():
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return session, net, model, optimizer, session.loader(make_data(), global_batch_size=8, shuffle=False)


def test_a_loss_that_is_not_one_number_is_refused_naming_the_reduction():
    session, _, model, _, loader = _session()
    x, y = next(iter(loader))
    with pytest.raises(HetrainError, match=r"scalar loss; got a tensor of shape \[8\].*loss.mean\(\)"):
        session.backward(F.cross_entropy(model(x), y, reduction="none"))
    with pytest.raises(HetrainError, match="got a float.*no graph"):
        session.backward(F.cross_entropy(model(x), y).item())
    session.backward(F.cross_entropy(model(x), y))   # the same batch, fixed, goes on
    assert session.step()
    session.close()


@pytest.mark.parametrize("off", ["no_grad", "inference_mode", "set_grad_enabled"])
def test_a_loss_without_a_graph_is_refused_naming_grad_mode_and_the_batch_can_be_retried(off):
    """A forward under torch.no_grad() (or grad mode left off by an evaluation cell): torch's 'element 0 of
    tensors does not require grad', and the fixed retry on the same batch was refused as a second backward."""
    session, _, model, _, loader = _session()
    x, y = next(iter(loader))
    if off == "set_grad_enabled":
        torch.set_grad_enabled(False)
        try:
            with pytest.raises(HetrainError, match=r"no graph.*grad mode is off here.*set_grad_enabled\(False\)"):
                session.backward(F.cross_entropy(model(x), y))
        finally:
            torch.set_grad_enabled(True)
    else:
        with getattr(torch, off)():
            loss = F.cross_entropy(model(x), y)
        with pytest.raises(HetrainError, match=r"no graph.*forward ran with grad mode off.*Nothing was counted"):
            session.backward(loss)
    session.backward(F.cross_entropy(model(x), y))   # the same batch, its forward run again, goes on
    assert session.step()
    session.close()


def test_a_refused_loss_without_a_graph_keeps_the_guards_of_the_step_s_earlier_micro_batches():
    """The refusal ran after the check of what the last micro-batch left, which it cleared: the retry then let a
    zero_grad() between the micro-batches wipe the first one's gradients without a word."""
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8, micro_batch=4)])
    with hetrain.Session(plan) as session:
        net = make_net()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        batches = iter(session.loader(make_data(), global_batch_size=8, shuffle=False))
        x, y = next(batches)
        session.backward(F.cross_entropy(model(x), y))
        assert session.step() is False   # the step's first micro-batch
        x, y = next(batches)
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
        with pytest.raises(HetrainError, match="no graph"):
            session.backward(loss)
        for p in net.parameters():
            p.grad.zero_()
        with pytest.raises(HetrainError, match="earlier micro-batches are gone"):
            session.backward(F.cross_entropy(model(x), y))


def test_a_closed_session_says_so_and_its_optimizer_steps_freely():
    session, net, model, optimizer, loader = _session()
    batches = iter(loader)
    x, y = next(batches)
    session.backward(F.cross_entropy(model(x), y))
    session.step()
    session.close()
    with pytest.raises(HetrainError, match="the session was closed.*new hetrain.Session"):
        next(batches)
    with pytest.raises(HetrainError, match="the session was closed"):
        session.backward(torch.ones((), requires_grad=True))
    F.cross_entropy(net(x), y).backward()
    optimizer.step()   # plain PyTorch after close(): refused before ("called outside session.step()")


def test_a_new_session_prepares_the_optimizer_a_closed_one_had():
    """A notebook re-running its set-up cell with the same model and optimizer: the first step was refused as
    an optimizer.step() outside session.step() (the closed session's guard stayed on the optimizer)."""
    import hetrain

    session, net, model, optimizer, loader = _session()
    session.close()
    with hetrain.Session() as again:
        model, _ = again.prepare(net, optimizer)
        for x, y in again.loader(make_data(), global_batch_size=8, shuffle=False):
            again.backward(F.cross_entropy(model(x), y))
            assert again.step()
            break


ERROR_AFTER_WRITES = """
import atexit
import os
import subprocess
import sys
from pathlib import Path

import torch
import hetrain

if __name__ == "__main__":
    log = open(sys.argv[1], "w")             # the script's own log, written through its buffer
    log.write("run started\\n")
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))
    session = hetrain.Session()
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), global_batch_size=4):
        session.backward(torch.nn.functional.mse_loss(model(x), y))
        session.step()
        log.write(f"step {session.step_count}\\n")
    session.clip_grad_norm_(1.0)            # after the loop: a HetrainError
"""


def test_an_error_of_hetrain_keeps_what_the_script_wrote_and_runs_its_atexit_work(tmp_path):
    """A HetrainError ended the process with os._exit(2): the script's buffered log was lost (0 bytes) and its
    atexit handlers (a run logger's last upload) never ran, where any other error kept both."""
    script, log = tmp_path / "job.py", tmp_path / "train.log"
    script.write_text(ERROR_AFTER_WRITES)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    r = subprocess.run([sys.executable, str(script), str(log)], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "hetrain: error: session.clip_grad_norm_()" in r.stderr, r.stderr[-2000:]
    assert log.read_text() == "run started\nstep 1\nstep 2\n"
    assert (tmp_path / "train.log.atexit").read_text() == "ran"


ERROR_DURING_A_SAVE = """
import sys
import time

import torch
import hetrain
from hetrain.checkpoint import checkpointer

if __name__ == "__main__":
    written = checkpointer.write_torch_file

    def slow(*args, **kwargs):   # a background save that takes a while, as a large model's does
        time.sleep(1.0)
        return written(*args, **kwargs)

    checkpointer.write_torch_file = slow
    session = hetrain.Session(checkpoint_dir=sys.argv[1], checkpoint_interval=2)
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    for x, y in session.loader(data, global_batch_size=4):
        session.backward(torch.nn.functional.mse_loss(model(x), y))
        session.step()
    session.clip_grad_norm_(1.0)            # after the loop, before close(): a HetrainError
"""


def test_an_error_of_hetrain_during_a_background_save_keeps_the_save(tmp_path):
    """The directory's lease was given back before the exit hooks waited for the save in flight, whose commit then
    found the lease gone and threw the checkpoint away (any other error kept it)."""
    from hetrain.checkpoint.checkpointer import Checkpointer

    script = tmp_path / "job.py"
    script.write_text(ERROR_DURING_A_SAVE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "hetrain: error: session.clip_grad_norm_()" in r.stderr, r.stderr[-2000:]
    saved = Checkpointer(tmp_path / "ckpt").latest()
    assert saved is not None and saved.step == 2, sorted(p.name for p in (tmp_path / "ckpt").iterdir())


def test_hetrain_lines_go_to_stderr_as_it_is_at_each_line(capsys, monkeypatch):
    """The log handler kept the sys.stderr of the first session: a test's capture, closed since, made every later
    line a '--- Logging error --- I/O operation on closed file' and lost it."""
    import io
    import logging

    from hetrain.runtime.environment import configure_logging

    monkeypatch.setattr(logging.getLogger("hetrain"), "handlers", [])   # as in a process's first session
    first = io.StringIO()
    old = sys.stderr
    sys.stderr = first
    try:
        configure_logging(None)
        logging.getLogger("hetrain").warning("one")
    finally:
        sys.stderr = old
    first.close()
    logging.getLogger("hetrain").warning("two")
    err = capsys.readouterr().err
    assert "] two\n" in err and "Logging error" not in err, err


def test_an_error_at_an_interactive_prompt_leaves_the_interpreter(monkeypatch, capfd):
    """A HetrainError ends a rank at once (os._exit, peers may wait in collectives), but at a prompt it ended the
    interpreter and everything the user had in it."""
    from hetrain.runtime.environment import print_user_errors_as_one_line

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    print_user_errors_as_one_line()
    hook = sys.excepthook
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    exits = []
    monkeypatch.setattr("os._exit", exits.append)
    hook(HetrainError, HetrainError("session.prepare() was already called"), None)
    assert exits == []
    assert "hetrain: error: session.prepare() was already called" in capfd.readouterr().err


def test_a_device_named_without_an_index_is_this_local_ranks(monkeypatch):
    from hetrain.runtime.environment import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pick_device(5, "cuda") == torch.device("cuda", 1)
    assert pick_device(5, "cuda:3") == torch.device("cuda", 3)
    assert pick_device(5, "cpu") == torch.device("cpu")
    with pytest.raises(HetrainError, match=r"4 CUDA device\(s\), cuda:0..cuda:3; leave device= unset"):
        pick_device(0, "cuda:4")


def test_a_cuda_device_asked_of_a_machine_without_one_names_the_fix(monkeypatch):
    """Session(device="cuda") on a CPU host gave torch's "Torch not compiled with CUDA enabled" deep in set-up."""
    from hetrain.runtime.environment import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(HetrainError, match=r"Session\(device='cuda'\): torch sees no CUDA device.*leave device= unset"):
        pick_device(0, "cuda")
    with pytest.raises(HetrainError, match="torch sees no CUDA device"):
        hetrain.Session(device="cuda:0")
    assert pick_device(0, "cpu") == torch.device("cpu")


@pytest.mark.parametrize("given, env, message", [
    (70000, None, r"Session\(metrics_port=70000\): local ranks serve ports 70000..70000, outside 1..65535"),
    ("9400", None, r"Session\(metrics_port='9400'\): the base port is a whole number"),
    (None, "70000", r"HETRAIN_METRICS_PORT=70000: local ranks serve ports"),
    (None, "ninety", r"HETRAIN_METRICS_PORT='ninety' is not a port"),
])
def test_a_metrics_port_that_is_no_port_is_refused_when_the_session_is_made(monkeypatch, given, env, message):
    """Session(metrics_port=70000) was taken, and refused only at loader(), in the launcher flag's words."""
    if env is not None:
        monkeypatch.setenv("HETRAIN_METRICS_PORT", env)
    with pytest.raises(HetrainError, match=message):
        hetrain.Session(metrics_port=given)
    assert not torch.distributed.is_initialized()   # refused before the process group starts


def test_metrics_port_settings_a_script_or_a_shell_writes_are_taken(monkeypatch):
    """A NumPy integer from a config and an environment value with a space were refused (found in review);
    metrics_port=0 means none, as HETRAIN_METRICS_PORT=0 does."""
    import numpy as np

    from hetrain.runtime.reporting import metrics_port_setting

    assert metrics_port_setting(np.int64(9400)) == 9400 and metrics_port_setting(0) is None
    with pytest.raises(HetrainError, match=r"Session\(metrics_port=True\): the base port is a whole number"):
        metrics_port_setting(True)
    monkeypatch.setenv("HETRAIN_METRICS_PORT", " 9400 ")
    assert metrics_port_setting(None) == 9400


_SESSIONS_ONE_AFTER_ANOTHER = """
import torch, torch.distributed as dist, hetrain
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
for k in range(4):
    if k == 2:   # a trial that fails on every rank, caught by the sweep: its session closes on the error
        try:
            with hetrain.Session() as failed:
                raise RuntimeError("trial failed")
        except RuntimeError:
            pass
    session = hetrain.Session()
    assert session.watch is not None, k   # its own group and progress watch, not the failed trial's group
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=64):
        session.backward(torch.nn.functional.mse_loss(model(x), y))
        session.step()
    session.close()
assert not dist.is_initialized()
print(f"rank {session.rank} ran 4 sessions", flush=True)
"""


def test_sessions_one_after_another_in_a_launched_job_each_get_a_group_of_their_own(tmp_path):
    """A new Session after close() (as the refusal of a closed one advises): each re-joined the job's store
    under the same keys, and a rank could read the closed group's addresses: the job hung in about half
    the runs of two sessions (one rank in init_process_group, the other in the new group's first collective).
    A session that closed on an error left its group, and the next ran on it without a progress watch."""
    from pathlib import Path

    from tests.distributed import run_cli

    script = tmp_path / "sessions.py"
    script.write_text(_SESSIONS_ONE_AFTER_ANOTHER)
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--collective-timeout",
                 "30", str(script)], cwd=Path(__file__).resolve().parents[2], timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("rank 0 ran 4 sessions") == 1 and r.stdout.count("rank 1 ran 4 sessions") == 1, r.stdout


@pytest.mark.parametrize("given, refused", [
    (16.0, r"global_batch_size=16.0\): the samples of one optimizer step over every rank are a whole number; "
           r"pass one, e.g. 16"),
    (16.5, r"global_batch_size=16.5\).*e.g. 256"),
    ("16", r"global_batch_size='16'\)"),
    (True, r"global_batch_size=True\)"),
])
def test_a_global_batch_size_that_is_no_whole_number_is_refused_at_loader(given, refused):
    """16.0 ran until the loop's first batch and ended in torch's TypeError; 16.5 in pydantic's, naming a Plan."""
    import hetrain

    session = hetrain.Session()
    net = make_net()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(HetrainError, match=refused):
        session.loader(make_data(), global_batch_size=given)
    session.close()


def test_a_numpy_integer_global_batch_size_is_a_whole_number():
    import numpy as np

    import hetrain

    with hetrain.Session() as session:
        net = make_net()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for x, y in session.loader(make_data(), global_batch_size=np.int64(8)):
            session.backward(F.cross_entropy(model(x), y))
            assert session.step()
            break


@pytest.mark.parametrize("model", [torch.nn.ReLU(), torch.nn.Linear(2, 2).requires_grad_(False)])
def test_a_model_with_nothing_to_train_is_refused_at_prepare_naming_it(model):
    """It ended in DDP's traceback, or, with an optimizer over another tensor, blamed a model made twice."""
    import hetrain

    session = hetrain.Session()
    with pytest.raises(HetrainError, match=rf"a {type(model).__name__} with no parameter that requires a gradient"):
        session.prepare(model, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    session.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_zero_grad_between_backward_and_step_is_refused_not_a_step_that_applies_nothing(set_to_none):
    """Every step applied nothing, silently: the weights never moved."""
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=8):
        session.backward(F.cross_entropy(model(x), y))
        optimizer.zero_grad(set_to_none=set_to_none)
        with pytest.raises(HetrainError, match=r"gradients are gone between session.backward\(\) and session.step\(\)"):
            session.step()
        break
    session.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataset_returning_none_is_named_with_its_index(workers):
    """Collate said only "found <class 'NoneType'>", or "object of type 'NoneType' has no len()"."""
    import hetrain

    class Holes(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return None if i == 5 else (torch.randn(6), 0)

    session = hetrain.Session()
    net = make_net()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(Exception, match=r"dataset\[5\] returned None: a dataset's __getitem__ returns a sample"):
        for _ in session.loader(Holes(), global_batch_size=16, shuffle=False, num_workers=workers):
            pass
    session.close()


@pytest.mark.parametrize("clip", ["torch", "session", "value"])
def test_a_step_whose_gradients_are_all_zero_is_applied_through_a_clipping(clip):
    """A hinge margin already met leaves every gradient zero; a clipping writes them in place (a factor of 1):
    that is no zero_grad(), and AdamW's weight decay still applies."""
    import hetrain

    session = hetrain.Session()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1))
    data = TensorDataset(torch.randn(8, 4), torch.ones(8))
    for x, y in session.loader(data, global_batch_size=8):
        session.backward(torch.clamp(-1e6 - model(x).squeeze(-1) * y, min=0).mean())   # the margin is met
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif clip == "session":
            session.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
        assert session.step()
        break
    session.close()


def test_a_step_skipped_for_a_non_finite_loss_may_zero_its_gradients_first():
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=8):
        loss = F.cross_entropy(model(x), y) * float("nan")
        session.backward(loss)
        if not torch.isfinite(loss):
            optimizer.zero_grad()   # the script's own guard against the bad step
        assert not session.step()   # skipped, as without the zero_grad()
        break
    session.close()


def test_a_collate_fn_that_drops_the_samples_a_dataset_could_not_read_still_works():
    import hetrain
    from torch.utils.data import default_collate

    class Unreadable(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return None if i % 5 == 3 else (torch.randn(6), 0)

    with hetrain.Session() as session:
        net = make_net()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = session.loader(Unreadable(), global_batch_size=16, shuffle=False,
                                collate_fn=lambda batch: default_collate([s for s in batch if s is not None]))
        x, y = next(iter(loader))
        assert x.shape == (13, 6)
        session.backward(F.cross_entropy(model(x), y))
        assert session.step()


def test_a_global_batch_size_refusal_quotes_a_long_value_short():
    import hetrain

    session = hetrain.Session()
    net = make_net()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(HetrainError) as refused:
        session.loader(make_data(), global_batch_size=list(range(300)))
    assert len(str(refused.value)) < 250, str(refused.value)
    session.close()


def test_a_closed_session_its_model_and_hooks_are_freed_and_sessions_one_after_another_add_nothing():
    """A notebook running session after session: each closed one was kept alive by a cycle through DDP's C++
    reducer (its model, optimizer state and gloo threads: 74 MB and 3 threads a session), its hooks stayed on
    a model prepared again, and torch's "[rank0]: " excepthook prefix was stacked once more per session."""
    import gc
    import weakref

    import hetrain

    net = make_net()
    hooks_before, excepthook_after_first = len(net._forward_pre_hooks), None
    wrapped = []
    for k in range(3):
        session = hetrain.Session()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        wrapped.append(weakref.ref(model))   # the DDP wrapper of this session
        for x, y in session.loader(make_data(), global_batch_size=8):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            break
        session.close()
        if k == 0:
            excepthook_after_first = sys.excepthook
        del session, model
    gc.collect()
    assert [ref() for ref in wrapped] == [None, None, None]
    assert len(net._forward_pre_hooks) == hooks_before
    assert sys.excepthook is excepthook_after_first


def test_a_metrics_port_is_free_after_close_while_persistent_loader_workers_live(tmp_path):
    """The workers, forked while the port was served, held its socket: a second session could not bind it."""
    import socket

    import hetrain
    from tests.ports import free_port

    port = free_port()
    session = hetrain.Session(metrics_port=port)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, num_workers=2, persistent_workers=True)
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        break
    session.close()   # the loader, and its persistent workers, are still referenced here
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
    del loader


def test_a_nan_written_into_the_gradients_before_step_skips_the_step_not_refuses_it():
    """A NaN's inf-norm is NaN, and "not above 0" took it for gradients all zero: the job stopped."""
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=8):
        session.backward(F.cross_entropy(model(x), y))
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("nan")   # a hook's or the script's write
        assert not session.step()   # skipped as non-finite
        break
    session.close()


def _trial(directory, lr):
    import hetrain

    with hetrain.Session(checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False) as session:
        net = make_net()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=lr))
        for x, y in session.loader(make_data(), global_batch_size=8, seed=0):
            session.backward(torch.nn.functional.cross_entropy(model(x), y))
            session.step()
        return session.step_count


def test_a_sweeps_next_trial_in_the_same_checkpoint_directory_is_told_it_continues_the_last_one(tmp_path,
                                                                                                 monkeypatch):
    """A sweep of Sessions in one process under one checkpoint directory (hetrain launch --checkpoint-dir sets
    it for every Session): the second trial resumed the first one's last checkpoint and returned its model,
    trained no step, and said so only at INFO. A directory set both by the launch and by the script is named."""
    from tests.log_lines import hetrain_warnings

    with hetrain_warnings() as lines:
        _trial(tmp_path / "sweep", 0.1)
        assert not any("earlier session of this process" in line for line in lines)
        _trial(tmp_path / "sweep", 0.05)
    assert any("which an earlier session of this process saved: this session continues that one's model" in line
               and "checkpoint_dir of its own" in line for line in lines), lines
    monkeypatch.setenv("HETRAIN_CHECKPOINT_DIR", str(tmp_path / "launched"))
    with hetrain_warnings() as lines:
        _trial(tmp_path / "launched" / "generator", 0.1)   # a folder of the launch's own: as the GAN docs say
        assert not any("checkpoints there, not in" in line for line in lines), lines
        _trial(tmp_path / "elsewhere", 0.1)
    assert any(f"checkpoint_dir={tmp_path / 'elsewhere'}) checkpoints there, not in {tmp_path / 'launched'}" in line
               for line in lines), lines


def test_empty_and_home_relative_path_flags_of_launch(monkeypatch, tmp_path):
    """`--checkpoint-dir ""` checkpointed into the working directory (an empty HETRAIN_CHECKPOINT_DIR means
    none), and `--checkpoint-dir=~/ckpt` (the shell expands no ~ after =) into a folder named ~."""
    import argparse
    import os

    import hetrain.cli.launch as cli

    seen = []
    monkeypatch.setattr(cli, "launch", lambda cfg: seen.append(cfg) or 0)
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    cli.build_parser(parser)
    cli.run(parser.parse_args(["--checkpoint-dir", "", "--run-dir", "", "--plan", "", "train.py"]))
    cli.run(parser.parse_args(["--checkpoint-dir=~/ckpt", "--plan=~/plan.json", "train.py"]))
    assert (seen[0].checkpoint_dir, seen[0].run_dir, seen[0].plan) == (None, None, None)
    assert seen[1].checkpoint_dir == os.path.join(tmp_path, "ckpt")
    assert seen[1].plan == os.path.join(tmp_path, "plan.json")


def test_a_log_level_given_to_one_session_is_not_kept_by_the_next():
    """A sweep's trial with log_level=logging.ERROR left every later trial silent (its INFO lines gone); a level
    the script set on the logger itself stays."""
    import logging

    import hetrain

    logger = logging.getLogger("hetrain")
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        with hetrain.Session(log_level="ERROR"):   # a name, as logging takes it
            assert logger.level == logging.ERROR
        with hetrain.Session():
            assert logger.level == logging.INFO   # rank 0's default
        with hetrain.Session(log_level=logging.DEBUG) as generator, hetrain.Session():   # a GAN's two sessions
            assert logger.level == logging.DEBUG and generator.rank == 0   # the second leaves the first's level
        assert logger.level == logging.INFO
        first, second = hetrain.Session(log_level=logging.DEBUG), hetrain.Session(log_level="error")
        first.close()   # closed out of order: the one still open keeps its level, then the one before them comes back
        assert logger.level == logging.ERROR
        second.close()
        assert logger.level == logging.INFO
        logger.setLevel(logging.WARNING)
        with hetrain.Session():
            assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)


def test_a_group_the_script_started_of_another_size_than_the_launchers_is_refused(monkeypatch):
    """Each process of a 2-rank launch starting a one-rank group of its own trained the whole global batch alone,
    and with a checkpoint directory they resumed each other's checkpoints: exit status 0 (found auditing)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(HetrainError, match=r"the process group the script started has 1 rank\(s\), but the "
                                               r"launcher started 2 \(WORLD_SIZE\)"):
            hetrain.Session()
        monkeypatch.setenv("WORLD_SIZE", "1")
        with pytest.raises(HetrainError, match=r"Session\(backend='nccl'\): the process group the script started "
                                               r"uses gloo"):
            hetrain.Session(backend="nccl")
        with hetrain.Session() as session:   # the launcher's size: the script's group is used
            assert session.world_size == 1 and not session.owns_group
    finally:
        dist.destroy_process_group()


def test_a_group_destroyed_before_close_leaves_the_last_checkpoint_and_says_so(tmp_path):
    """The script's dist.destroy_process_group() before session.close() ended the close in torch's "Group ... is
    not registered" from the final save's broadcast (found auditing); the last checkpoint stands, and it says so."""
    import torch.distributed as dist

    from hetrain.checkpoint.checkpointer import Checkpointer
    from tests.log_lines import hetrain_warnings

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    session = hetrain.Session(checkpoint_dir=tmp_path, checkpoint_interval=2, async_checkpoints=False)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=8):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if session.step_count == 3:
            break
    dist.destroy_process_group()
    with hetrain_warnings() as warnings:
        session.close()
    assert any("no checkpoint of step 3 at close: the process group was destroyed before session.close() (the last "
               "checkpoint is step 2)" in w for w in warnings), warnings
    assert Checkpointer(tmp_path).latest().step == 2
