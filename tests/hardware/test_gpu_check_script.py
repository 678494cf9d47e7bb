"""scripts/gpu_check.sh: valid bash, and on a machine without a GPU one line and status 2, nothing run."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run its checks")
def test_without_a_gpu_it_says_so_in_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], r.stdout
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run its checks")
def test_a_relative_out_dir_is_the_callers_and_is_not_made_without_a_gpu(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "myout"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert r.returncode == 2, r.stdout + r.stderr
    assert not (SCRIPT.parents[1] / "myout").exists() and not (tmp_path / "myout").exists()
