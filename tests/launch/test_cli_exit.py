"""A `hetrain` command collects once at exit, then freezes what is left: the interpreter's teardown
does not walk the heap of torch that the verb imported again."""

from hetrain.cli import main as cli


def test_a_verb_registers_one_collect_then_freeze_per_process(monkeypatch):
    registered, calls = [], []
    monkeypatch.setattr(cli.atexit, "register", registered.append)
    monkeypatch.setattr(cli, "_leaving_quickly", False)
    cli.main(["devices", "--devices", "a100:2", "--json"])
    cli.main(["devices", "--devices", "a100:2", "--json"])
    assert len(registered) == 1
    monkeypatch.setattr(cli.gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    registered[0]()
    assert calls == ["collect", "freeze"]


def test_help_and_unknown_verbs_register_nothing(monkeypatch):
    registered = []
    monkeypatch.setattr(cli.atexit, "register", registered.append)
    monkeypatch.setattr(cli, "_leaving_quickly", False)
    assert cli.main(["no-such-verb"]) == 2
    assert registered == []
