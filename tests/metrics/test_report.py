"""`hetrain report` on run logs written by RankMetrics: the figures, restarts, the PNG and its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hetrain.metrics import RankMetrics
from hetrain.metrics.report import load_run, split_change_steps, summary_rows
from hetrain.metrics.events import CheckpointRecord
from tests.distributed import run_cli
from tests.metrics.fake_gpu_rank import step_record

ROOT = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path) -> None:
    """Two ranks, six steps; rank 1 takes a quarter of the batch, then a third from step 4 (decided at step 3);
    rank 1 restarts at step 5."""
    for rank, compute in ((0, 0.2), (1, 0.4)):
        m = RankMetrics(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), device_name="cpu",
                        port=None, run_dir=run_dir, job="report", predicted_step_seconds=0.45)
        for step in range(1, 7):
            shares = (768, 256) if step < 4 else (683, 341)
            m.on_step(step_record(step, rank=rank, world_size=2, device="cpu", share=shares[rank],
                                  samples=shares[rank], shares=shares, split_changed=step == 3, step_seconds=None if step == 1 else 0.5,
                                  compute_seconds=compute, data_wait_seconds=0.05, loss=3.0 - 0.1 * step,
                                  comm_bytes={"intra": 1e6}))
            if step == 3:
                m.on_checkpoint(CheckpointRecord(step=3, blocking_seconds=0.1, total_seconds=0.3, bytes=100))
        m.close()
    # rank 1's workers restarted after step 6 and resumed from step 3's checkpoint: steps 4-5 run again
    m = RankMetrics(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), device_name="cpu", port=None,
                    run_dir=run_dir, job="report")
    m.on_restart(1)
    for step in (4, 5):
        m.on_step(step_record(step, rank=1, world_size=2, device="cpu", share=341, samples=341, shares=(683, 341),
                              step_seconds=None if step == 4 else 1.0, compute_seconds=0.4, data_wait_seconds=0.05,
                              loss=9.0))
    m.close()


def test_summary_figures(tmp_path):
    write_run(tmp_path)
    runs = load_run(tmp_path)
    assert list(runs) == [0, 1]
    assert [s["step"] for s in runs[1].steps] == [1, 2, 3, 4, 5, 6]   # each step once, its last run
    assert runs[1].steps[4]["loss"] == 9.0 and runs[1].restarts == 1
    # a step line keeps the figures the report reads (a long run's lines read whole took 4.5 KB each)
    assert "global_items" not in runs[0].steps[0] and "optimizer_seconds" not in runs[0].steps[0]
    assert split_change_steps(runs) == [3]   # the last step of the old split: step 4 used the new one
    r0, r1 = summary_rows(runs)
    assert r0["step_seconds"] == pytest.approx(0.5) and r0["predicted_step_seconds"] == 0.45
    assert r0["samples_per_second"] == pytest.approx((768 * 2 + 683 * 3) / 2.5)
    assert r0["share"] == pytest.approx(683 / 1024)
    assert r0["items_per_second"] == pytest.approx(512 * 1024 * 5 / 2.5)   # num_items' tokens: the work done
    assert r0["compute"] == pytest.approx(0.4) and r0["waiting for data"] == pytest.approx(0.1)
    assert r0["waiting on ranks"] == pytest.approx(0.5)
    assert r0["checkpoints"] == 1 and r0["restarts"] == 0 and r1["restarts"] == 1
    # after the restart rank 1 re-ran step 4 untimed (a process's first step) and step 5 in 1 s: timed 2, 3, 5, 6
    assert r1["step_seconds"] == pytest.approx((0.5 * 3 + 1.0) / 4)


def test_restarts_count_every_launchs_and_one_that_failed_before_its_first_step(tmp_path):
    """A restarted attempt that failed again before its first step left no line (its restart was held for its
    start line), and a second launch's first restart counts 1 again: 'restarts 0', then 'restarts 1' for 2."""
    def attempt(restart, steps):
        m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), device_name="cpu", port=None,
                        run_dir=tmp_path, job="report")
        m.on_restart(restart)
        for step in steps:
            m.on_step(step_record(step, rank=0, world_size=1, device="cpu", share=8, samples=8, shares=(8,),
                                  step_seconds=0.5, compute_seconds=0.4, data_wait_seconds=0.0, loss=1.0))
        if steps:
            m.close()
        else:   # failed before its first step: no close(), only the process's exit
            from hetrain.metrics.rank_metrics import begin_logs

            begin_logs()

    attempt(0, [1, 2])   # the first launch, failed after step 2
    attempt(1, [])       # its restart, failed again at once
    attempt(0, [1, 2, 3])   # a second launch, from the start (no checkpoint)
    attempt(1, [3, 4])   # its restart
    assert load_run(tmp_path)[0].restarts == 2   # one in each launch


def test_a_rank_that_ran_at_emulated_speeds_then_without_gets_a_row_for_each(tmp_path):
    """A 2-rank job at emulated speeds, resumed on 1 rank without them: one 'cpu' row blended both phases'
    samples/s (381 of 303 and 442) and called the real steps emulated."""
    for emulated, steps, seconds in ((True, range(1, 21), 1.0), (False, range(21, 41), 0.5)):
        m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), device_name="cpu", port=None,
                        run_dir=tmp_path, job="report")
        for step in steps:
            m.on_step(step_record(step, rank=0, world_size=1, device="cpu", share=8, samples=8, shares=(8,),
                                  step_seconds=seconds, compute_seconds=0.4, data_wait_seconds=0.0, loss=1.0,
                                  emulated=emulated))
        m.close()
    rows = summary_rows(load_run(tmp_path))
    assert [(r["device"], r["emulated"], r["first_step"], r["last_step"]) for r in rows] == [
        ("cpu (emulated)", True, 1, 20), ("cpu", False, 21, 40)]
    assert [r["samples_per_second"] for r in rows] == [pytest.approx(8.0), pytest.approx(16.0)]


def test_steps_a_resume_on_fewer_ranks_took_back_are_not_the_departed_ranks(tmp_path):
    """A 2-rank job checkpointed at step 20 and failed after step 24; it resumed on 1 rank. Rank 1's row kept
    steps 21-24, which the job took back (rank 0 ran them again alone): 24 steps, its shares at step 24."""
    import time

    def attempt(rank, world, steps):
        m = RankMetrics(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), device_name="cpu",
                        port=None, run_dir=tmp_path, job="report")
        shares = (40, 24) if world == 2 else (64,)
        for step in steps:
            m.on_step(step_record(step, rank=rank, world_size=world, device="cpu", share=shares[rank],
                                  samples=shares[rank], shares=shares, step_seconds=0.5, compute_seconds=0.4,
                                  data_wait_seconds=0.0, loss=1.0))
        m.close()

    attempt(0, 2, range(1, 25))
    attempt(1, 2, range(1, 25))
    time.sleep(0.01)
    attempt(0, 1, range(21, 41))
    runs = load_run(tmp_path)
    assert [s["step"] for s in runs[1].steps] == list(range(1, 21))
    assert [s["step"] for s in runs[0].steps] == list(range(1, 41)) and runs[0].steps[-1]["shares"] == [64]


def hetrain(*args):
    return run_cli([sys.executable, "-m", "hetrain.cli.main", *args], cwd=ROOT, timeout=120)


def test_cli_draws_the_png_and_prints_the_table(tmp_path):
    write_run(tmp_path)
    r = hetrain("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "samples/s" in r.stdout and "wait ranks" in r.stdout
    assert "items/s" in r.stdout   # the run's items are not its samples (a token count)
    rows = json.loads(hetrain("report", str(tmp_path), "--json", "--out", str(tmp_path / "x.png")).stdout)
    assert [row["rank"] for row in rows] == [0, 1]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: (d / "f").write_text("x") and d / "f", "is a file, not a directory"),
    (lambda d: d, "no run log in"),
])
def test_cli_errors_are_one_line(tmp_path, make, message):
    r = hetrain("report", str(make(tmp_path)))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr


def test_out_into_a_missing_directory_is_refused_not_created(tmp_path):
    write_run(tmp_path)
    r = hetrain("report", str(tmp_path), "--out", str(tmp_path / "missing" / "r.png"))
    assert r.returncode == 2 and "does not exist; fix: create it or choose another path" in r.stderr, r.stderr
    assert not (tmp_path / "missing").exists()


def test_the_out_name_printed_is_the_file_written_and_an_unknown_format_is_one_line(tmp_path):
    """Without a suffix matplotlib wrote NAME.png and the report printed NAME; '.txt' ended in a traceback."""
    write_run(tmp_path)
    r = hetrain("report", str(tmp_path), "--out", str(tmp_path / "plain"))
    assert r.returncode == 0 and f"figure: {tmp_path / 'plain.png'}" in r.stdout.replace("\n", ""), r.stdout
    assert (tmp_path / "plain.png").is_file()
    r = hetrain("report", str(tmp_path), "--out", str(tmp_path / "report.txt"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and ".txt is not an image format" in lines[0], r.stderr


def test_json_with_tensorboard_keeps_stdout_json(tmp_path):
    pytest.importorskip("tensorboard", reason="optional: pip install tensorboard")
    write_run(tmp_path)
    r = hetrain("report", str(tmp_path), "--json", "--tensorboard", str(tmp_path / "tb"))
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 2, r.stdout   # it ended with 'tensorboard scalars: ...'
    assert "tensorboard scalars:" in r.stderr


def test_tensorboard_without_the_package_is_refused_before_the_report_is_made(tmp_path, monkeypatch, capsys):
    from hetrain.cli.main import main

    write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "tensorboard", None)   # as if not installed
    assert main(["report", str(tmp_path), "--tensorboard"]) == 2
    captured = capsys.readouterr()
    assert "pip install 'hetrain[tensorboard]'" in captured.err and captured.out == ""
    assert not (tmp_path / "report.png").exists()


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="optional: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hetrain.metrics.tensorboard import write_scalars

    write_run(tmp_path)
    write_scalars(load_run(tmp_path), tmp_path / "tb")
    write_scalars(load_run(tmp_path), tmp_path / "tb")   # a second export replaces the first, not adds to it
    events = EventAccumulator(str(tmp_path / "tb" / "rank-0")).Reload()
    loss = events.Scalars("hetrain/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    assert loss[-1].value == pytest.approx(2.4)
    assert [e.step for e in events.Scalars("hetrain/samples_per_second")] == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("where", ["checkpoint-dir", "HETRAIN_RUN_DIR"])
def test_a_job_without_a_metrics_port_still_writes_the_run_log_hetrain_report_reads(tmp_path, where):
    """The run log goes to the run directory whether or not Prometheus is served (docs/observe.md)."""
    import os

    run_dir = tmp_path / "run" / "nested"   # not there yet: the job makes it
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETRAIN_")}
    flags = ["--checkpoint-dir", str(run_dir)] if where == "checkpoint-dir" else []
    if where == "HETRAIN_RUN_DIR":
        env["HETRAIN_RUN_DIR"] = str(run_dir)
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--emulate-speeds",
                 "1,0.5", *flags, str(ROOT / "examples/train_digits.py"), "--epochs", "1"],
                cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "metrics").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    rep = hetrain("report", str(run_dir), "--json")
    assert rep.returncode == 0, rep.stderr
    rows = json.loads(rep.stdout[rep.stdout.index("["):])
    assert [row["rank"] for row in rows] == [0, 1] and all(row["steps"] > 5 for row in rows)


def test_traffic_no_step_measured_is_shown_as_unknown_not_as_zero(tmp_path):
    """FSDP2's collectives are not counted: such a run's 'comm sent' is '-', never 0.0 MB."""
    m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), device_name="cpu", port=None,
                    run_dir=tmp_path, job="report")
    for step in range(1, 4):
        m.on_step(step_record(step, rank=0, world_size=1, device="cpu", shares=(512,), comm_bytes={}))
    m.close()
    (row,) = summary_rows(load_run(tmp_path))
    assert row["comm_bytes"] is None
    r = hetrain("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "comm sent" in r.stdout and "MB" not in r.stdout   # the column's one unit


def write_swapped_run(run_dir: Path) -> None:
    """Rank 0 runs steps 1-20 on an A100, then the job resumes from step 10's checkpoint with rank 0 on a V100."""
    for device, steps, compute, predicted in (("a100-sxm4-80gb", range(1, 21), 0.1, 0.16),
                                              ("v100-sxm2-32gb", range(11, 41), 0.3, 0.42)):
        m = RankMetrics(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), device_name=device,
                        port=None, run_dir=run_dir, job="swap", predicted_step_seconds=predicted)
        for step in steps:
            m.on_step(step_record(step, rank=0, world_size=2, device=device, share=64, samples=64, shares=(64, 64),
                                  step_seconds=None if step == steps[0] else compute + 0.1, compute_seconds=compute))
            if step % 10 == 0:
                m.on_checkpoint(CheckpointRecord(step=step, blocking_seconds=0.1, total_seconds=0.3, bytes=100))
        m.close()


def test_a_rank_resumed_on_another_device_gets_a_row_per_device(tmp_path):
    write_swapped_run(tmp_path)
    runs = load_run(tmp_path)
    assert [s["step"] for s in runs[0].steps] == list(range(1, 41))
    a100, v100 = summary_rows(runs)
    assert (a100["device"], a100["first_step"], a100["last_step"], a100["steps"]) == ("a100-sxm4-80gb", 1, 10, 10)
    assert (v100["device"], v100["first_step"], v100["last_step"], v100["steps"]) == ("v100-sxm2-32gb", 11, 40, 30)
    assert a100["predicted_step_seconds"] == 0.16 and v100["predicted_step_seconds"] == 0.42
    assert a100["step_seconds"] == pytest.approx(0.2) and v100["step_seconds"] == pytest.approx(0.4)
    assert a100["compute"] == pytest.approx(0.5) and v100["compute"] == pytest.approx(0.75)
    assert a100["checkpoints"] == 2 and v100["checkpoints"] == 3
    assert runs[0].device == "a100-sxm4-80gb → v100-sxm2-32gb"
    r = hetrain("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "a100-sxm4-80gb" in r.stdout and "v100-sxm2-32gb" in r.stdout and "steps 11-40" in r.stdout, r.stdout


def test_damaged_lines_are_skipped_and_never_replace_a_good_step(tmp_path):
    write_run(tmp_path)
    log = tmp_path / "metrics" / "rank-0.jsonl"
    good = summary_rows(load_run(tmp_path))[0]
    lines = log.read_text().splitlines()
    lines[2:2] = ["[1, 2, 3]", '"text"', '{"kind": "step", "step": null}', '{"kind": "step", "step": 3}',
                  '{"kind": "step", "step": true, "samples": 1}', '{"kind": "restart", "count": "x"}']
    lines.append('{"kind": "step", "step": 2, "samples": "many"}')
    log.write_text("\n".join(lines) + "\n")
    assert summary_rows(load_run(tmp_path))[0] == good
    r = hetrain("report", str(tmp_path), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(r.stdout)[0]["samples_per_second"] == pytest.approx(good["samples_per_second"])
    assert f"{log}: 6 line(s) skipped" in r.stderr, r.stderr   # (a restart without its count is a record)


def test_a_line_that_is_not_utf8_is_skipped_and_counted_naming_the_file(tmp_path):
    write_run(tmp_path)
    log = tmp_path / "metrics" / "rank-0.jsonl"
    good = summary_rows(load_run(tmp_path))[0]
    data = log.read_bytes().split(b"\n")
    data[3:3] = [b'{"kind": "step", "device": "\xff\xfe garbled"}']
    log.write_bytes(b"\n".join(data))
    assert summary_rows(load_run(tmp_path))[0] == good
    r = hetrain("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"hetrain report: note: {log}: 1 line(s) skipped" in r.stderr and "not UTF-8" in r.stderr, r.stderr


def test_a_log_with_no_step_says_so_in_one_line(tmp_path):
    m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), device_name="cpu", port=None,
                    run_dir=tmp_path, job="report")
    m.close()
    r = hetrain("report", str(tmp_path))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "no step was logged" in lines[0], r.stderr
    assert not (tmp_path / "report.png").exists()


def test_a_split_is_marked_where_the_loader_began_using_it():
    """With workers the loader takes a decided split `lag` steps later: decided at step 3, used from 6."""
    from types import SimpleNamespace

    steps = [{"step": s, "shares": (8, 8) if s < 6 else (10, 6), "split_changed": s == 3} for s in range(1, 9)]
    assert split_change_steps({0: SimpleNamespace(steps=steps)}) == [5]
    older = [{"step": s, "split_changed": s == 3} for s in range(1, 9)]   # a log without each step's split
    assert split_change_steps({0: SimpleNamespace(steps=older)}) == [3]


def test_a_checkpoint_committed_just_before_a_crash_is_counted_from_the_resume(tmp_path):
    """A background save that committed just before its rank was killed logged no checkpoint line: the
    report said 3 checkpoints where the job had committed 4 and resumed from the unlogged one."""
    for run_dir, second in ((tmp_path / "same", "cpu"), (tmp_path / "other", "cpu-b")):   # resumed on another device too
        for device, steps, logged in (("cpu", range(1, 11), (4,)), (second, range(9, 17), (12, 16))):   # 8 unlogged
            m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), device_name=device,
                            port=None, run_dir=run_dir, job="crash", predicted_step_seconds=0.1)
            for step in steps:
                m.on_step(step_record(step, rank=0, world_size=1, device=device, share=8, samples=8, shares=(8,),
                                      step_seconds=None if step == steps[0] else 0.2, compute_seconds=0.1))
                if step in logged:
                    m.on_checkpoint(CheckpointRecord(step=step, blocking_seconds=0.1, total_seconds=0.3, bytes=100))
            m.close()
        runs = load_run(run_dir)
        assert runs[0].checkpoint_steps == [4, 8, 12, 16]
        assert sum(row["checkpoints"] for row in summary_rows(runs)) == 4   # step 8 in the row of the device that wrote it


def test_the_png_stays_readable_with_many_ranks(tmp_path):
    """24 ranks: a colour each (matplotlib's cycle repeats after 10, so rank 0 and rank 10 looked alike), the
    time panel's rank labels do not overlap, and the legend names every rank inside the figure."""
    from hetrain.metrics.report_plot import figure

    n = 24
    for rank in range(n):
        m = RankMetrics(rank=rank, local_rank=rank % 8, world_size=n, device=torch.device("cpu"), device_name="cpu",
                        port=None, run_dir=tmp_path, job="report")
        for step in range(1, 5):
            m.on_step(step_record(step, rank=rank, world_size=n, device="cpu", share=8, samples=8, shares=(8,) * n,
                                  step_seconds=None if step == 1 else 0.5 + 0.01 * rank, compute_seconds=0.3,
                                  data_wait_seconds=0.05, loss=3.0 - 0.1 * step))
        m.close()
    fig = figure(load_run(tmp_path), "many ranks")
    ax_rate, _, ax_time, _ = fig.axes[:4]
    colors = [tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color()
              for line in ax_rate.lines if line.get_label().startswith("rank")]
    assert len(colors) == n and len(set(colors)) == n
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    boxes = sorted((t.get_window_extent(renderer) for t in ax_time.get_yticklabels()), key=lambda b: b.y0)
    assert len(boxes) == n
    assert all(lower.y1 <= upper.y0 for lower, upper in zip(boxes, boxes[1:])), "rank labels overlap"
    [legend] = fig.legends
    names = [t.get_text() for t in legend.get_texts()]
    assert [f"rank {r} (cpu)" for r in range(n)] == [x for x in names if x.startswith("rank")]
    box, page = legend.get_window_extent(renderer), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
