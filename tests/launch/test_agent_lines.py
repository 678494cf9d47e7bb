"""The elastic agent's restarts are said in the launcher's words; its lines the launcher says better are left out."""

import logging

import json
import os
import signal

from hetrain.launch.agent_lines import AGENT, WORKERS, failed_rank, leave_to_the_launcher, restart_line, who_failed
from hetrain.launch.attempt_records import attempt_records
from hetrain.runtime import failure_record
from hetrain.runtime.failure_record import FailureRecord
from hetrain.runtime.watchdog import STALL_EXIT


def _record(msg, *args, level=logging.INFO):
    return logging.LogRecord(AGENT, level, "api.py", 1, msg, args, None)


# the agent's own messages, as torch.distributed.elastic.agent.server.api logs them
FAILED = "[%s] Worker group %s. %s/%s attempts left; will restart worker group"
JOINING = "[%s] Detected %s new nodes from group_rank=%s; will restart worker group"
# the workers' record of the first failure the agent saw, as torch.distributed.elastic.multiprocessing.api logs it
WORKER_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def _failed(exitcode, local_rank):
    return logging.LogRecord(WORKERS, logging.ERROR, "api.py", 1, WORKER_FAILED,
                             (exitcode, local_rank, 4321, "/usr/bin/python"), None)


def test_a_restart_after_a_failure_counts_the_restarts_used():
    assert restart_line(_record(FAILED, "default", "FAILED", 3, 3)) == (
        "hetrain launch: the job failed on this node (its output is above); starting every rank again, restart 1 "
        "of 3 (--max-restarts)")
    assert restart_line(_record(FAILED, "default", "FAILED", 1, 3)).endswith("restart 3 of 3 (--max-restarts)")


def test_a_rank_killed_by_a_signal_is_named_with_how_it_ended_as_it_printed_nothing():
    """A rank the kernel killed for memory printed nothing: "its output is above" would send the user looking."""
    failed = failed_rank(_failed(-int(signal.SIGKILL), 1))
    assert failed == (-int(signal.SIGKILL), 1)
    line = restart_line(_record(FAILED, "default", "FAILED", 2, 2), failed)
    assert line.startswith("hetrain launch: rank 1 was killed by SIGKILL; a SIGKILL no one sent is most often the "
                           "kernel's, when the host runs out of memory")
    assert line.endswith("; starting every rank again, restart 1 of 2 (--max-restarts)")
    assert "output is above" not in line
    several = restart_line(_record(FAILED, "default", "FAILED", 2, 2), (-int(signal.SIGSEGV), 3), one_node=False)
    assert several.startswith("hetrain launch: local rank 3 of this node was killed by SIGSEGV; starting")


def test_a_script_exit_code_is_named_but_a_code_a_peers_echo_also_ends_with_is_not():
    """A Python error's exit code, a stall report's and the agent's SIGTERM are also how ranks that only lost a
    peer end, and the agent reports the first failure by whole seconds: such a rank is not named as the cause."""
    exited = restart_line(_record(FAILED, "default", "FAILED", 1, 1), (3, 1))
    assert exited == ("hetrain launch: rank 1 exited with code 3 (its output is above); starting every rank again, "
                      "restart 1 of 1 (--max-restarts)")
    for code in (1, 2, STALL_EXIT, -int(signal.SIGTERM), 143):   # 2: a launched rank's error; STALL_EXIT: a report
        assert restart_line(_record(FAILED, "default", "FAILED", 1, 1), (code, 0)).startswith(
            "hetrain launch: the job failed on this node (its output is above); starting")


def _write_record(monkeypatch, path, message, **kw):
    """An error file as a rank of a hetrain.Session writes it."""
    monkeypatch.setenv(failure_record.ERROR_FILE_ENV, str(path))
    failure_record.record_failure(message, **kw)


def _attempt(tmp_path, n, ranks=(0, 1)):
    attempt = tmp_path / "run0_abc" / f"attempt_{n}"
    for r in ranks:
        (attempt / str(r)).mkdir(parents=True)
    return attempt


def test_the_records_of_the_attempt_that_failed_name_the_rank_whose_error_came_first(tmp_path, monkeypatch):
    """A rank that raised is named with its error, though the agent saw its peer (which only lost its connection,
    and exits with the same code) first."""
    old = _attempt(tmp_path, 0)
    _write_record(monkeypatch, old / "1" / "error.json", "RuntimeError: an older attempt's")
    new = _attempt(tmp_path, 1)
    os.utime(old, ns=(1, 1))   # made before the attempt that failed now
    _write_record(monkeypatch, new / "0" / "error.json", "RuntimeError: injected fault on rank 0 at step 7")
    _write_record(monkeypatch, new / "1" / "error.json", "RuntimeError: Connection closed by peer", secondary=True)
    records = attempt_records(tmp_path)
    assert records[0] == FailureRecord("RuntimeError: injected fault on rank 0 at step 7", records[0].time)
    assert records[1].secondary
    line = restart_line(_record(FAILED, "default", "FAILED", 1, 1), (2, 1), records)
    assert line == ("hetrain launch: rank 0 failed: RuntimeError: injected fault on rank 0 at step 7 (its output is "
                    "above); starting every rank again, restart 1 of 1 (--max-restarts)")


def test_a_stall_report_is_said_as_the_reporting_rank_wrote_it():
    records = {0: FailureRecord("rank 1 made no progress at step 5 for 20 s", 10.0, blame=1), 1: None}
    assert who_failed((STALL_EXIT, 0), records, True) == (
        "rank 1 made no progress at step 5 for 20 s; rank 0 reported it (its output is above)")
    # the stalled rank's own report (its progress watch found it) names it once
    assert who_failed((STALL_EXIT, 1), {0: None, 1: FailureRecord("rank 1 made no progress", 9.0, blame=1)},
                      True) == "rank 1 made no progress (its output is above)"


def test_the_one_rank_without_a_record_beside_echoes_is_named_when_the_agent_saw_an_echo_first():
    """A rank the kernel SIGKILLed writes nothing; its peer records only a lost connection, and the agent, to the
    second, may report that peer first."""
    records = {0: FailureRecord("RuntimeError: Connection closed by peer", 10.0, secondary=True), 1: None}
    line = who_failed((2, 0), records, True)
    assert line.startswith("rank 1 ended with no error of its own, and every other rank only lost its connection to "
                           "it (a signal, or an exit of the script's own); a SIGKILL no one sent is most often the "
                           "kernel's")
    assert who_failed((-int(signal.SIGKILL), 1), records, True).startswith("rank 1 was killed by SIGKILL; ")
    # a signal is never a peer's echo: it goes before a record a peer wrote of an error that followed from it
    cause_too = {0: FailureRecord("HetrainError: the checkpoint of step 8 was not committed", 10.0), 1: None}
    assert who_failed((-int(signal.SIGKILL), 1), cause_too, True).startswith("rank 1 was killed by SIGKILL; ")
    # two ranks without a record, or several nodes (the cause may be elsewhere): the node's failure, no rank
    assert who_failed((2, 0), {**records, 2: None}, True).startswith("the job failed on this node")
    assert who_failed((2, 0), records, False).startswith("the job failed on this node")
    # on several nodes, a node whose every rank only lost its peers is not where the failure began
    echoes = {0: records[0], 1: FailureRecord("RuntimeError: Connection reset by peer", 10.1, secondary=True)}
    assert who_failed((2, 1), echoes, False) == ("every rank on this node only lost its peers: the failure began on "
                                                 "another node, whose output says which")


def test_no_folder_or_an_unreadable_record_names_no_rank(tmp_path):
    assert attempt_records(None) == {} and attempt_records(tmp_path / "none") == {}
    attempt = _attempt(tmp_path, 0)
    (attempt / "0" / "error.json").write_text("{half a rec")
    (attempt / "1" / "error.json").write_text(json.dumps({"message": "<NONE>"}))
    assert attempt_records(tmp_path) == {0: None, 1: None}


def test_a_failure_record_of_another_shape_names_no_rank():
    assert failed_rank(logging.LogRecord(WORKERS, logging.ERROR, "api.py", 1, WORKER_FAILED, ("?", None, 1, "x"),
                                         None)) is None
    assert failed_rank(logging.LogRecord(WORKERS, logging.ERROR, "api.py", 1, "failed (exitcode: %s)", (9,),
                                         None)) is None
    assert failed_rank(_record("[%s] Stopping worker group", "default")) is None


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
        # the workers' record of the failure comes first; the restart's line names the rank it reported
        assert not workers.filter(_failed(-int(signal.SIGKILL), 1))
        assert not agent.filter(_record(FAILED, "default", "FAILED", 1, 2))
        assert capsys.readouterr().err.startswith("hetrain launch: rank 1 was killed by SIGKILL; ")
        # a later failure the workers did not report with a rank is not given the last one's
        assert not agent.filter(_record(FAILED, "default", "FAILED", 1, 2))
        assert capsys.readouterr().err.startswith("hetrain launch: the job failed on this node")
    finally:
        back()
    assert (agent.level, list(agent.filters), workers.level, list(workers.filters)) == before


def test_a_folder_of_the_launchers_own_is_removed_with_its_filters_and_a_users_is_kept(tmp_path):
    for remove in (False, True):
        (tmp_path / "logs").mkdir(exist_ok=True)
        leave_to_the_launcher(True, str(tmp_path / "logs"), remove=remove)()
        assert (tmp_path / "logs").exists() is not remove

