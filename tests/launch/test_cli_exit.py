"""A `hetrain` command collects once at exit, then freezes what is left: the interpreter's teardown
does not walk the heap of torch that the verb imported again."""

from hetrain.cli import main as cli
from hetrain import exiting


def test_a_verb_registers_one_collect_then_freeze_per_process(monkeypatch):
    registered, calls = [], []
    monkeypatch.setattr(exiting.atexit, "register", registered.append)
    monkeypatch.setattr(exiting, "_registered", set())
    cli.main(["devices", "--devices", "a100:2", "--json"])
    cli.main(["devices", "--devices", "a100:2", "--json"])
    assert len(registered) == 1
    monkeypatch.setattr(exiting.gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(exiting.gc, "freeze", lambda: calls.append("freeze"))
    registered[0]()
    assert calls == ["collect", "freeze"]


def test_help_and_unknown_verbs_register_nothing(monkeypatch):
    registered = []
    monkeypatch.setattr(exiting.atexit, "register", registered.append)
    monkeypatch.setattr(exiting, "_registered", set())
    assert cli.main(["no-such-verb"]) == 2
    assert registered == []
