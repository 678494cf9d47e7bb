"""What every test gets: a session a test left open (one that checks a refusal before close()) is closed after
it, so that no later test of the same pytest process takes it for a session made beside its own (a companion
whose split it would follow, or to which its process group would pass at close)."""

import contextlib

import pytest


@pytest.fixture(autouse=True)
def _close_the_sessions_a_test_left_open():
    from hetrain.runtime.companions import open_sessions

    before = {id(s) for s in open_sessions()}
    yield
    for session in open_sessions():
        if id(session) not in before:
            with contextlib.suppress(Exception):   # (a session an error left half made closes as far as it can)
                session.close()
