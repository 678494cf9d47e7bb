"""The elastic agent's restarts are said in the launcher's words; its lines the launcher says better are left out."""

import logging

from hetrain.launch.agent_lines import AGENT, WORKERS, leave_to_the_launcher, restart_line


def _record(msg, *args, level=logging.INFO):
    return logging.LogRecord(AGENT, level, "api.py", 1, msg, args, None)


# the agent's own messages, as torch.distributed.elastic.agent.server.api logs them
FAILED = "[%s] Worker group %s. %s/%s attempts left; will restart worker group"
JOINING = "[%s] Detected %s new nodes from group_rank=%s; will restart worker group"


def test_a_restart_after_a_failure_counts_the_restarts_used():
    assert restart_line(_record(FAILED, "default", "FAILED", 3, 3)) == (
        "hetrain launch: the job failed on this node (its output is above); starting every rank again, restart 1 "
        "of 3 (--max-restarts)")
    assert restart_line(_record(FAILED, "default", "FAILED", 1, 3)).endswith("restart 3 of 3 (--max-restarts)")


def test_a_node_waiting_to_join_is_said_without_calling_it_new():
    """A node that restarted after its own failure waits as a new one does: the line names neither as a failure."""
    line = restart_line(_record(JOINING, "default", 1, 0))
    assert line == ("hetrain launch: 1 node(s) wait to join the job (one that restarted, or a new one); starting "
                    "every rank again with them")


def test_a_restart_record_of_another_shape_is_left_to_the_agent():
    """A filter that raised would stop the agent in the middle of its restart: such a record gets no line."""
    assert restart_line(_record(FAILED, "default", "FAILED", "many", None)) is None


def test_other_records_are_not_restarts():
    assert restart_line(_record("[%s] Stopping worker group", "default")) is None
    assert restart_line(_record("[%s] worker group successfully finished. Waiting %s seconds for other agents to "
                                "finish.", "default", 300)) is None


def test_the_agents_info_lines_stay_hidden_and_its_logs_are_given_back(capsys):
    agent, workers = logging.getLogger(AGENT), logging.getLogger(WORKERS)
    before = (agent.level, list(agent.filters), workers.level, list(workers.filters))
    back = leave_to_the_launcher()
    try:
        assert agent.isEnabledFor(logging.INFO)   # the restart records are made
        assert not agent.filter(_record("[%s] Stopping worker group", "default"))
        assert not agent.filter(_record("Received %s death signal, shutting down workers", 2, level=logging.WARNING))
        assert not workers.filter(logging.LogRecord(WORKERS, logging.WARNING, "api.py", 1,
                                                    "Sending process %s closing signal %s", (1234, "SIGINT"), None))
        assert agent.filter(_record("a warning of its own", level=logging.WARNING))
        assert not agent.filter(_record(FAILED, "default", "FAILED", 2, 2))
        assert capsys.readouterr().err == ("hetrain launch: the job failed on this node (its output is above); "
                                           "starting every rank again, restart 1 of 2 (--max-restarts)\n")
    finally:
        back()
    assert (agent.level, list(agent.filters), workers.level, list(workers.filters)) == before
