"""A real Prometheus scrapes a 2-rank `hetrain launch --metrics-port` job and a fake-GPU rank.

Checks every series of hetrain.metrics.names for both ranks with their labels, every panel of the
shipped Grafana dashboard against the same server, and that a stopped rank leaves the other's
endpoint answering. The GPU series come from tests/metrics/fake_gpu_rank.py (fake NVML and CUDA
allocator figures), which is the only target that has them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetrain.metrics.names import CUDA_LABELS, METRICS, RANK_LABELS
from hetrain.metrics.report import load_run, summary_rows
from tests.metrics.fake_gpu_rank import TENSOR_ACTIVE
from tests.metrics.prometheus_server import SCRAPE_INTERVAL, Prometheus
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
# rank 0's compute a step (rank 1's twice that): rank 0 waits about COMPUTE_S a step on rank 1, 2.9 s in all, far
# above what a loaded machine's hiccups add to rank 1's waits (at the driver's 0.02 s, 0.58 s against them)
COMPUTE_S = 0.1
DIGITS_EPOCHS = 8   # 44 steps of 32 digits an epoch: about 2 s of steps, several scrapes of each rank
GPU_ONLY = ("nvml", "nvlink", "mfu")   # MFU divides by a datasheet peak: a CPU rank has none
DASHBOARD = ROOT / "hetrain" / "data" / "dashboard.json"


def _wait(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _popen(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _end(proc: subprocess.Popen, timeout: float = 20) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("scrape")
    # base, base+1: the driver's ranks; base+2: the fake GPU rank; base+3: its fake DCGM exporter;
    # base+4, base+5: the ranks of examples/train_digits.py under the Session
    base = free_ports(6)
    prom = Prometheus(work, [f"127.0.0.1:{p}" for p in range(base, base + 6)])
    stop = work / "stop"
    started = time.time()
    gpu = _popen([sys.executable, "-m", "tests.metrics.fake_gpu_rank", "--port", str(base + 2),
                  "--stop-file", str(stop), "--dcgm-port", str(base + 3)], work / "gpu.log")
    job = _popen([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
                  "--metrics-port", str(base), "tests/metrics/rank_driver.py", "--steps", str(STEPS),
                  "--compute-seconds", str(COMPUTE_S),
                  "--run-dir", str(work / "run"), "--stop-file", str(stop)], work / "job.log")
    digits = _popen([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
                     "--emulate-speeds", "1,0.5", "--metrics-port", str(base + 4), "--checkpoint-dir",
                     str(work / "digits"), "examples/train_digits.py", "--epochs", str(DIGITS_EPOCHS),
                     "--global-batch", "32"], work / "digits.log")
    driver = f'instance=~"127.0.0.1:({base}|{base + 1})"'
    try:
        # both ranks' last step scraped (the ranks keep serving after it until `stop` appears)
        def both_done() -> bool:
            if job.poll() is not None:
                raise AssertionError("the job ended early:\n" + (work / "job.log").read_text()[-3000:])
            return len(prom.query(f'hetrain_step{{{driver}}} == {STEPS}')) == 2

        _wait(both_done, 60, f"both ranks at step {STEPS} in Prometheus")
        _wait(lambda: digits.poll() is not None, 60, "train_digits.py to finish")
        assert digits.returncode == 0, (work / "digits.log").read_text()[-3000:]
        time.sleep(3 * SCRAPE_INTERVAL)  # a few more scrapes of the driver's final figures
        yield SimpleNamespace(prom=prom, started=started, base=base, work=work, job=job, driver=driver,
                              digits=f'instance=~"127.0.0.1:({base + 4}|{base + 5})"')
    finally:
        stop.touch()
        for proc in (job, gpu, digits):
            _end(proc)
        prom.close()


def _by_rank(results: list[dict]) -> dict[str, dict]:
    return {r["metric"]["rank"]: r for r in results}


def _query_name(name: str, kind: str) -> str:
    return f"{name}_count" if kind == "summary" else name


def test_every_metric_for_both_ranks_with_their_labels(run):
    for m in METRICS:
        if m.source in GPU_ONLY:
            continue
        results = run.prom.query(f'{_query_name(m.name, m.kind)}{{{run.driver}}}')
        ranks = _by_rank(results)
        assert set(ranks) == {"0", "1"}, (m.name, results)
        for r in results:
            labels = r["metric"]
            assert set(RANK_LABELS) | set(m.labels) <= set(labels), (m.name, labels)
            assert labels["device"] == "cpu" and labels["node"] and labels["job"] != "hetrain", labels
            assert not set(CUDA_LABELS) & set(labels), labels   # CPU ranks have no GPU to join on
    for name in ("hetrain_mfu_ratio", "hetrain_peak_flops"):   # no peak, so no ratio above 100%
        assert not run.prom.query(f"{name}{{{run.driver}}}"), name


def _value(prom: Prometheus, name: str, selector: str) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(f"{name}{{{selector}}}")}


def test_the_figures_are_the_job_s_own(run):
    p, d = run.prom, run.driver
    half = STEPS // 2
    # rank 0 computes 48 samples a step, then 40 from the step the split changes
    assert _value(p, "hetrain_samples_total", d) == {"0": (half - 1) * 48 + (STEPS - half + 1) * 40,
                                                     "1": (half - 1) * 16 + (STEPS - half + 1) * 24}
    assert _value(p, "hetrain_share_ratio", d) == {"0": 40 / 64, "1": 24 / 64}
    assert _value(p, "hetrain_split_changes_total", d) == {"0": 1, "1": 1}
    assert _value(p, "hetrain_checkpoints_written_total", d) == {"0": STEPS // 5, "1": STEPS // 5}
    assert _value(p, "hetrain_step_seconds_count", d) == {"0": STEPS - 1, "1": STEPS - 1}
    # rank 1 computes twice as long, so rank 0 waits on it and rank 1 hardly waits
    waits = _value(p, "hetrain_wait_seconds_total", d + ', cause="ranks"')
    assert waits["0"] > 2 * waits["1"], waits
    kinds = {r["metric"]["kind"] for r in p.query(f'hetrain_memory_bytes{{{d}, rank="0"}}')}
    assert kinds == {"rss", "peak_rss"}   # a CPU rank says which memory it reports


# What a Session's step record fills for examples/train_digits.py on CPU ranks. The script does not
# clip (no grad norm), runs without a plan (no prediction) and its Session passes no model cost (no MFU).
SESSION_SERIES = ("hetrain_rank_info", "hetrain_step", "hetrain_steps_total", "hetrain_step_seconds_count",
                  "hetrain_compute_seconds_total", "hetrain_wait_seconds_total", "hetrain_samples_total",
                  "hetrain_items_total", "hetrain_share_samples", "hetrain_share_ratio", "hetrain_split_changes_total",
                  "hetrain_loss", "hetrain_loss_scale", "hetrain_skipped_steps_total", "hetrain_memory_bytes",
                  "hetrain_restarts_total")


def test_a_session_run_under_launch_metrics_port(run):
    """examples/train_digits.py, unchanged, under `hetrain launch --metrics-port`: the Session serves both ranks."""
    for name in SESSION_SERIES:
        # the job has ended: its last scraped samples, not the staleness markers after them
        results = run.prom.query(f"last_over_time({name}{{{run.digits}}}[10m])")
        assert {r["metric"]["rank"] for r in results} == {"0", "1"}, (name, results)
        assert all(set(RANK_LABELS) <= set(r["metric"]) for r in results), results
    # Prometheus saw some of the steps; the run log has them all
    rows = summary_rows(load_run(run.work / "digits"))
    assert [r["steps"] for r in rows] == [44 * DIGITS_EPOCHS] * 2   # 1438 training digits, 44 full batches of 32
    assert rows[0]["share"] > rows[1]["share"], rows   # the balancer gave the full-speed rank more
    logs = sorted((run.work / "digits" / "metrics").glob("rank-*.jsonl"))
    assert [p.name for p in logs] == ["rank-0.jsonl", "rank-1.jsonl"]   # the run log beside the checkpoints


def test_gpu_series_carry_dcgm_labels(run):
    for m in METRICS:
        if m.source not in GPU_ONLY:
            continue
        results = run.prom.query(f'{m.name}{{job="fake-gpu"}}')
        assert len(results) == 1, (m.name, results)
        labels = results[0]["metric"]
        assert labels["UUID"].startswith("GPU-") and labels["gpu"] == "3" and labels["Hostname"], labels
    kinds = {r["metric"]["kind"] for r in run.prom.query('hetrain_memory_bytes{job="fake-gpu"}')}
    assert kinds == {"allocated", "reserved", "peak_allocated", "peak_reserved"}


def test_the_documented_dcgm_joins(run):
    docs = (ROOT / "docs" / "observe.md").read_text()
    [by_rank] = [ln for ln in docs.splitlines() if ln.startswith("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE * on (UUID)")]
    [(joined)] = run.prom.query(by_rank)
    assert joined["metric"]["rank"] == "2" and joined["metric"]["device"] == "a100-sxm4-80gb", joined
    assert float(joined["value"][1]) == TENSOR_ACTIVE
    [per_activity] = [ln for ln in docs.splitlines() if ln.startswith("hetrain_mfu_ratio{UUID!=\"\"} / on (UUID)")]
    [(ratio)] = run.prom.query(per_activity)
    [(mfu)] = run.prom.query('hetrain_mfu_ratio{job="fake-gpu"}')
    assert float(ratio["value"][1]) == pytest.approx(float(mfu["value"][1]) / TENSOR_ACTIVE)


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def test_every_dashboard_panel_returns_data(run):
    queries = dashboard_queries()
    assert len(queries) >= 20
    empty = []
    for title, expr in queries:
        promql = (expr.replace("$__rate_interval", "2s").replace("$job", ".*").replace("$rank", ".*")
                  .replace("$device", ".*"))
        if not run.prom.query_range(promql, run.started, time.time(), step=0.5):
            empty.append(f"{title}: {promql}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_a_stopped_rank_does_not_hang_the_others(run):
    pid1 = int((run.work / "run" / "pid-1").read_text())
    os.kill(pid1, signal.SIGSTOP)   # rank 1 hangs; rank 0 blocks in its next all-reduce
    try:
        time.sleep(0.5)
        t = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{run.base}/metrics", timeout=5) as r:
            assert b"hetrain_step{" in r.read()
        assert time.monotonic() - t < 3.0   # answered while its rank waits in an all-reduce for rank 1
        up = lambda: {r["metric"]["instance"]: r["value"][1] for r in run.prom.query('up{job="hetrain"}')}
        _wait(lambda: up().get(f"127.0.0.1:{run.base + 1}") == "0", 5, "rank 1's target down")
        assert up()[f"127.0.0.1:{run.base}"] == "1"
        assert up()[f"127.0.0.1:{run.base + 2}"] == "1" and up()[f"127.0.0.1:{run.base + 3}"] == "1"
    finally:
        os.kill(pid1, signal.SIGCONT)
