"""Every bad input found so far: one line naming the value and the fix, a non-zero exit, no traceback.

Each runs the public command in its own process, under a time limit: an input that is only refused
after expanding a huge count fails here by running out of time, not by passing late.
"""

import json
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import run_cli, sigterm_when
from tests.faults.conftest import count

ROOT = Path(__file__).resolve().parents[2]
DIGITS = "examples/train_digits.py"
LIMIT_S = 30


def _cluster(text: str):
    def make(tmp: Path) -> str:
        path = tmp / "cluster.yaml"
        path.write_text(text)
        return str(path)
    return make


def _binary(tmp: Path) -> str:
    path = tmp / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    return str(path)


def _plan_with_device(device: str):
    def make(tmp: Path) -> str:
        from hetrain.planning.plan import Plan

        plan = Plan.even(2, 64)
        doc = json.loads(plan.to_json())
        doc["ranks"][1]["device"] = device
        path = tmp / "plan.json"
        path.write_text(json.dumps(doc))
        return str(path)
    return make


def _large_cluster(tmp: Path) -> str:
    path = tmp / "large.yaml"
    node = "  - name: n{}\n    devices:\n      - model: a100\n        count: 1\n"
    with path.open("w") as f:
        f.write("nodes:\n")
        for i in range(150_000):   # 10 MiB: above the 8 MiB a cluster file may have
            f.write(node.format(i))
    return str(path)


def _a_file(tmp: Path) -> str:
    path = tmp / "a-file"
    path.write_text("not a directory")
    return str(path)


def _under_a_file(tmp: Path) -> str:
    return _a_file(tmp) + "/checkpoints"


ONE_NODE = "nodes:\n  - name: a\n    devices:\n      - model: a100\n        count: {count}\n"
PLAN = ["plan", "--model", "resnet50", "--global-batch", "64"]

# (id, argv with callables filled from tmp_path, text the one line must hold)
CASES = [
    ("plan --out into a missing directory",
     [*PLAN, "--devices", "a100:2", "--out", "/nonexistent-dir/plan.json"], "/nonexistent-dir"),
    ("plan --out where nothing can be written",
     [*PLAN, "--devices", "a100:2", "--out", "/proc/hetrain-plan.json"], "/proc/hetrain-plan.json"),
    ("plan --profile a binary file",
     ["plan", "--profile", _binary, "--devices", "a100:2", "--global-batch", "64"], ("binary", "UTF-8")),
    ("launch --plan a binary file", ["launch", "--plan", _binary, DIGITS], "is a binary file"),
    ("launch a binary file as the script", ["launch", "--nproc-per-node", "2", _binary], "is a binary file, not a Python script"),
    ("devices --topo a binary file", ["devices", "--topo", _binary], "is a binary file"),
    ("simulate --inter-node-gbps nan", ["simulate", "--model", "resnet50", "--inter-node-gbps", "nan"], "finite"),
    ("simulate --out into a missing directory",
     ["simulate", "--model", "resnet50", "--sizes", "1", "--out", "/nonexistent-dir/sim"], "/nonexistent-dir"),
    ("cluster count 100000000000 (devices)",
     ["devices", "--cluster", _cluster(ONE_NODE.format(count=100000000000))], "at most 65,536"),
    ("cluster count 100000000000 (plan)",
     [*PLAN, "--cluster", _cluster(ONE_NODE.format(count=100000000000))], "at most 65,536"),
    ("launch --checkpoint-dir an existing file", ["launch", "--checkpoint-dir", _a_file, DIGITS], "is a file, not a directory"),
    ("launch --checkpoint-dir that cannot be created",
     ["launch", "--checkpoint-dir", _under_a_file, DIGITS], "cannot be created"),
    ("plan --devices a100:99999999999", [*PLAN, "--devices", "a100:99999999999"], "65,536 devices at most"),
    ("plan --devices a100:10000000", [*PLAN, "--devices", "a100:10000000"], "65,536 devices at most"),
    ("plan --devices over 65,536 in all", [*PLAN, "--devices", "a100:40000,v100:40000"], "at most 65,536"),
    ("a 10 MiB cluster file", [*PLAN, "--cluster", _large_cluster], "at most 8 MiB"),
    ("launch --plan with device tpu-v9", ["launch", "--plan", _plan_with_device("tpu-v9"), DIGITS],
     "unknown GPU model 'tpu-v9'; closest catalog names"),
    ("cluster count: true", ["devices", "--cluster", _cluster(ONE_NODE.format(count="true"))], "must be a whole number"),
    ("cluster inter_node_gbps: .inf",
     ["devices", "--cluster", _cluster("inter_node_gbps: .inf\n" + ONE_NODE.format(count=1))], "must be a finite number"),
    ("cluster duplicate keys",
     ["devices", "--cluster", _cluster(ONE_NODE.format(count=1) + "    name: b\n")], "appears twice"),
    ("launch --master-port 99999", ["launch", "--master-port", "99999", DIGITS], "not a TCP port"),
    ("launch --collective-timeout 0", ["launch", "--collective-timeout", "0", DIGITS], "positive number of seconds"),
]


@pytest.mark.parametrize("argv, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_in_one_line(tmp_path, argv, text):
    count("inputs tried")
    args = [a(tmp_path) if callable(a) else a for a in argv]
    start = time.monotonic()
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", *args], cwd=ROOT, timeout=LIMIT_S)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"hetrain {args[0]}: error: "), r.stderr[-2000:]
    texts = text if isinstance(text, tuple) else (text,)
    assert any(t in lines[0] for t in texts), lines[0]
    assert time.monotonic() - start < LIMIT_S
    count("refused cleanly")


def test_sigterm_to_the_launcher_says_so_in_one_line_and_exits_143(tmp_path):
    count("inputs tried")
    # ranks share the pipe and an unbuffered print writes its text and its newline apart, so
    # rank 1's line may follow rank 0's on the same line
    proc = sigterm_when([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "tests/faults/train_faults.py",
                         "--steps", "1000", "--step-sleep", "0.05"], "rank 1 starts", after=2, cwd=ROOT, timeout=60)
    err = proc.stderr
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("hetrain launch: error: the job was stopped by SIGTERM"), err[-2000:]
    assert list((tmp_path / "ckpt").glob("step-*")), "the workers saved no checkpoint on SIGTERM"
    count("refused cleanly")
