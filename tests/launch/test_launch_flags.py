"""`hetrain launch`'s torchrun flags and their PET_* defaults are checked before any worker starts: one line naming
the fix (torch's agent raised a traceback, or a bare AssertionError, and exited 1), and a value from the
environment is named by its variable."""

import argparse
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from hetrain.cli.launch import build_parser, launch_config, run
from hetrain.errors import HetrainError
from hetrain.launch.launcher import LaunchConfig, validate
from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples/train_digits.py")


@pytest.mark.parametrize("flags, message", [
    ({"rdzv_conf": "foo"}, "--rdzv-conf 'foo': 'foo' is not KEY=VALUE; fix:"),
    ({"rdzv_conf": "join_timeout=120,read_timeout"}, "'read_timeout' is not KEY=VALUE"),
    ({"rdzv_conf": "join_timeout=abc"}, "join_timeout must be a whole number above 0, e.g. join_timeout=600"),
    ({"rdzv_conf": "read_timeout=-5"}, "read_timeout must be a whole number above 0, e.g. read_timeout=60"),
    ({"rdzv_conf": "last_call_timeout=0"}, "last_call_timeout must be a whole number above 0"),
    ({"rdzv_conf": "is_host=maybe"}, "is_host must be one of 1, true"),
    ({"rdzv_conf": "store_type=redis"}, "store_type must be one of tcp, file"),
    ({"redirects": "9"}, "--redirects '9' must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
    ({"tee": "7"}, "--tee '7' must be 0 (none)"),
    ({"redirects": "0:3,1"}, "--redirects '0:3,1' must be"),
    ({"local_ranks_filter": "x"}, "--local-ranks-filter 'x' must be local ranks, e.g. 0 or 0,1"),
    ({"local_ranks_filter": "0,"}, "--local-ranks-filter '0,' must be local ranks"),
    ({"rdzv_backend": "c10"}, "--rdzv-backend 'c10' is not a rendezvous torch has; fix: use c10d"),
    ({"rdzv_backend": "etcd"}, "--rdzv-backend etcd needs the python-etcd package"),
    ({"monitor_interval": 0.0}, "--monitor-interval 0 must be a positive number of seconds"),
    ({"monitor_interval": -1.0}, "--monitor-interval -1 must be a positive number of seconds"),
    ({"monitor_interval": float("nan")}, "--monitor-interval nan must be"),
    ({"log_dir": SCRIPT}, "--log-dir"),
])
def test_a_bad_torchrun_flag_is_refused_naming_the_fix(flags, message):
    if flags.get("rdzv_backend") == "etcd" and find_spec("etcd") is not None:
        pytest.skip("python-etcd is installed here")
    with pytest.raises(HetrainError) as e:
        validate(LaunchConfig(script=SCRIPT, **flags))
    assert message in str(e.value)
    if "log_dir" in flags:
        assert "is a file, not a directory" in str(e.value)


def test_what_torch_accepts_passes(tmp_path):
    validate(LaunchConfig(script=SCRIPT, rdzv_backend="c10d", log_dir=str(tmp_path / "logs"), monitor_interval=0.5,
                          redirects="0:3,1:1", tee="3", local_ranks_filter="0, 1",
                          rdzv_conf="join_timeout=120, read_timeout=10,is_host=TRUE,store_type=file,use_libuv=0,"
                                    "keep_alive_interval=5,keep_alive_max_attempt=3,close_timeout=30,timeout=60,"))
    assert (tmp_path / "logs").is_dir()   # made, as torch's agent would
    validate(LaunchConfig(script=SCRIPT, rdzv_backend="static", rdzv_conf="store_type=anything"))


def _args(*argv):
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args([*argv, SCRIPT])


def test_a_bad_pet_value_names_its_variable(monkeypatch):
    """PET_MASTER_PORT=abc was told as `argument --master-port/--master_port: invalid int value`, a flag the user
    never typed; PET_MAX_RESTARTS=-3 as `--max-restarts must be >= 0`."""
    monkeypatch.setenv("PET_MASTER_PORT", "abc")
    with pytest.raises(HetrainError, match=r"^PET_MASTER_PORT='abc', torchrun's default of --master-port: not a whole "
                                           r"number; fix: set PET_MASTER_PORT"):
        launch_config(_args())
    assert launch_config(_args("--master-port", "29400"))[0].master_port == 29400   # the line wins
    monkeypatch.delenv("PET_MASTER_PORT")
    for name, value, message in [("MAX_RESTARTS", "-3", "--max-restarts (from PET_MAX_RESTARTS) must be >= 0, got -3"),
                                 ("MONITOR_INTERVAL", "0", "--monitor-interval (from PET_MONITOR_INTERVAL) 0 must be"),
                                 ("REDIRECTS", "9", "--redirects (from PET_REDIRECTS) '9' must be")]:
        monkeypatch.setenv(f"PET_{name}", value)
        with pytest.raises(HetrainError) as e:
            run(_args())
        assert str(e.value).startswith(message), e.value
        monkeypatch.delenv(f"PET_{name}")
    with pytest.raises(HetrainError, match=r"^--max-restarts must be >= 0, got -2"):
        run(_args("--max-restarts", "-2"))


def test_help_gives_the_defaults_and_every_flag_says_what_it_does():
    parser = argparse.ArgumentParser()
    build_parser(parser)
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    assert "(default: 1)" in helps["--nproc-per-node"] and "(default: 0)" in helps["--max-restarts"]
    assert "(default: 300)" in helps["--collective-timeout"] and "(default: 0.1)" in helps["--monitor-interval"]
    for flag in ("--node-rank", "--monitor-interval", "--master-addr", "--master-port"):
        assert helps[flag], flag


@pytest.mark.parametrize("argv, env, message", [
    (["--monitor-interval", "0"], {}, "--monitor-interval 0 must be a positive number of seconds"),
    (["--rdzv-conf", "foo"], {}, "'foo' is not KEY=VALUE"),
    ([], {"PET_MASTER_PORT": "abc"}, "PET_MASTER_PORT='abc'"),
])
def test_the_cli_prints_one_line_and_exits_2(argv, env, message):
    import os

    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", *argv, SCRIPT], cwd=ROOT, timeout=120,
                env={**os.environ, **env})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
