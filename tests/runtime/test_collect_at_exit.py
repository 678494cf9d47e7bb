"""A rank collects its unreachable objects at exit, while the interpreter is whole: a process group
freed in the interpreter's own teardown can end a finished rank with SIGABRT."""

import gc

import pytest

from hetrain.runtime import environment


def test_collect_at_exit_registers_one_collection_per_process(monkeypatch):
    registered = []
    monkeypatch.setattr(environment.atexit, "register", registered.append)
    monkeypatch.setattr(environment, "_collecting_at_exit", False)
    environment.collect_at_exit()
    environment.collect_at_exit()
    assert registered == [gc.collect]


@pytest.fixture
def registered(monkeypatch):
    """What a one-rank session registers at exit, in a process that has registered nothing yet."""
    calls = []
    monkeypatch.setattr(environment.atexit, "register", calls.append)
    monkeypatch.setattr(environment, "_collecting_at_exit", False)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    return calls


def test_a_session_that_starts_the_process_group_collects_at_exit(registered):
    import hetrain

    session = hetrain.Session()
    try:
        assert gc.collect in registered
    finally:
        session.close()


def test_a_session_on_a_group_the_script_started_collects_at_exit(registered):
    """A ported DDP script starts its own process group before the session: its ranks are covered too."""
    import torch.distributed as dist

    import hetrain

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        session = hetrain.Session()
        try:
            assert gc.collect in registered
        finally:
            session.close()
        assert dist.is_initialized()   # the script's group is left to the script
    finally:
        dist.destroy_process_group()
