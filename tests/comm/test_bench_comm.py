"""`hetrain bench comm --json`, small: bytes per step of a compression against plain all-reduce, on 2 CPU ranks."""

import json
import sys
from pathlib import Path

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_comm_prints_bytes_and_ratios_per_compression():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "comm", "--json", "--steps", "12",
                 "--powersgd-warmup-steps", "2", "--hooks", "none,fp16"], cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    none, fp16 = got["hooks"]["none"], got["hooks"]["fp16"]
    assert none["bytes_per_step"] > 0 and none["bytes_per_step_after_warmup"] > 0, none
    # fp16 sends half of fp32's gradient bytes, before and after the warm-up alike
    assert abs(fp16["ratio_to_none"] - 0.5) < 0.01 and abs(fp16["ratio_after_warmup"] - 0.5) < 0.01, fp16
    assert got["ranks"] == 2 and got["steps"] == 12 and set(got["hooks"]) == {"none", "fp16"}
