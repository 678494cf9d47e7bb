"""A MASTER_ADDR left in the shell (a cluster job script exports it) does not make `python train.py` a job of
several ranks: the run read MASTER_PORT (KeyError, a traceback) or waited on the address's host."""

import pytest

import hetrain
from hetrain.errors import HetrainError


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HETRAIN_COLLECTIVE_TIMEOUT", "5")   # before the fix: the wait on another host ends sooner
    return monkeypatch


@pytest.mark.parametrize("variables", [{"MASTER_ADDR": "127.0.0.1"},
                                       {"MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "29555"}])
def test_a_leftover_master_addr_without_a_launchers_ranks_is_a_one_process_job(no_launcher, variables):
    for name, value in variables.items():
        no_launcher.setenv(name, value)
    with hetrain.Session() as session:
        assert session.world_size == 1 and session.rank == 0


def test_a_launchers_ranks_with_master_addr_but_no_port_are_one_line_naming_it(no_launcher):
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("RANK", "0")
    no_launcher.setenv("WORLD_SIZE", "1")
    with pytest.raises(HetrainError, match=r"^MASTER_ADDR is set \(127.0.0.1\) but MASTER_PORT is not; set both"):
        hetrain.Session()
