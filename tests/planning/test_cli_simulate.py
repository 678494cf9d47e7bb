"""`hetrain simulate` over sizes where the model does not fit everywhere: those sizes are left out of
the plot, marked in the CSV and named on one line; only a sweep where nothing fits is an error."""

import csv
import subprocess
import sys


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hetrain.cli.main", "simulate", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_size_that_does_not_fit_is_left_out_not_the_whole_sweep(tmp_path):
    # llama-7b needs about 165 GB even at micro-batch 1: one 32 GB V100 cannot hold it, 8 and 16 can
    p = _run("--model", "llama-7b", "--mix", "v100:1", "--sizes", "1,8,16", "--out", str(tmp_path / "s"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    rows = _rows(tmp_path / "s.csv")
    assert list(rows[0]) == ["devices", "strategy", "compression", "samples_per_s", "ideal_samples_per_s",
                             "scaling_efficiency", "chosen"]   # the columns are the same as before
    skipped = [r for r in rows if r["devices"] == "1"]
    assert skipped == [{"devices": "1", "strategy": "does not fit", "compression": "", "samples_per_s": "",
                        "ideal_samples_per_s": "", "scaling_efficiency": "", "chosen": "False"}]
    chosen = [r["devices"] for r in rows if r["chosen"] == "True"]
    assert chosen == ["8", "16"]   # one chosen strategy per size that fits, as before
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "sizes 1 do not fit llama-7b" in lines[0] and "GB short" in lines[0] and "left out" in lines[0]
    # zero3 and pipeline at 8 and at 16, hybrid at 16: 8 V100s fit no hybrid (its stages sharded over 2
    # replicas hold their weights gathered and gradients unsharded through the step)
    assert p.stdout.strip() == f"wrote {tmp_path / 's'}.csv and {tmp_path / 's'}.png (5 points)"


def test_the_sizes_that_fit_give_the_same_figures_with_or_without_the_ones_that_do_not(tmp_path):
    a = _run("--model", "llama-7b", "--mix", "v100:1", "--sizes", "1,2,8,16", "--out", str(tmp_path / "a"))
    b = _run("--model", "llama-7b", "--mix", "v100:1", "--sizes", "8,16", "--out", str(tmp_path / "b"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert b.stderr == ""   # nothing left out, nothing said
    assert "sizes 1, 2 do not fit" in a.stderr and len(a.stderr.strip().splitlines()) == 1, a.stderr
    fits = [r for r in _rows(tmp_path / "a.csv") if r["strategy"] != "does not fit"]
    assert fits == _rows(tmp_path / "b.csv")
    assert [r["devices"] for r in _rows(tmp_path / "a.csv") if r["strategy"] == "does not fit"] == ["1", "2"]


def test_no_size_fits_is_one_line_naming_the_fix_and_writes_nothing(tmp_path):
    p = _run("--model", "llama-7b", "--mix", "v100:1", "--sizes", "1,2", "--out", str(tmp_path / "s"))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetrain simulate: error: no size in --sizes 1,2 fits llama-7b"), \
        p.stderr
    for fix in ("add 4 more v100-sxm2-32gb", "devices with more memory", "smaller model"):
        assert fix in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_other_bad_input_still_ends_the_sweep(tmp_path):
    """Only the planner's 'does not fit' leaves a size out; an unknown GPU is still one error line."""
    p = _run("--model", "llama-7b", "--mix", "nope:1", "--sizes", "1,8", "--out", str(tmp_path / "s"))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown GPU model 'nope'" in lines[0], p.stderr
    assert list(tmp_path.iterdir()) == []
