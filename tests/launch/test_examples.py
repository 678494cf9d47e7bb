"""The examples run as a user would run them: on 2 CPU ranks under `hetrain launch`."""

import re
import sys
from pathlib import Path

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]
HETRAIN = [sys.executable, "-m", "hetrain.cli.main"]


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", text)]


def test_train_gpt2_learns_clips_checkpoints_and_continues(tmp_path):
    cmd = [*HETRAIN, "launch", "--nproc-per-node", "2", "--emulate-speeds", "1,0.5", "--checkpoint-dir",
           str(tmp_path), "examples/train_gpt2.py", "--layers", "1", "--global-batch-size", "16"]
    first = run_cli([*cmd, "--steps", "30"], cwd=ROOT, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = _losses(first.stdout)
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], first.stdout
    assert (tmp_path / "step-000030").is_dir()
    more = run_cli([*cmd, "--steps", "40"], cwd=ROOT, timeout=240)   # a restart continues at step 30
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stderr and re.findall(r"step (\d+) loss", more.stdout) == ["40"]


def test_train_digits_reports_a_finite_loss_when_a_rank_has_no_samples(tmp_path):
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    # rank 1 starts with no samples; the balancer, which has no figure for it, gives it some later
    plan = Plan(global_batch_size=128, balance=BalancePlan(interval=2, min_share=0),
                ranks=[RankPlan(rank=0, share=128), RankPlan(rank=1, share=0)])
    plan.save(tmp_path / "plan.json")
    r = run_cli([*HETRAIN, "launch", "--nproc-per-node", "2", "--plan", str(tmp_path / "plan.json"),
                 "examples/train_digits.py", "--epochs", "2"], cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"epoch \d+ loss ([0-9.a-z]+)", r.stdout)]
    assert len(losses) == 2 and all(0 < x < 3 for x in losses), r.stdout
    assert "split [128, 0] ->" in r.stderr   # the zero share did change within the epoch


def test_train_gpt2_runs_unchanged_under_a_pipeline_plan(tmp_path):
    """The same script under a 2-stage pipeline (embedding + layer | layer + head), stages in their precisions."""
    from hetrain.planning.plan import BalancePlan, PipelinePlan, Plan, RankPlan

    plan = Plan(global_batch_size=16, strategy="pipeline", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=16, stage=0, precision="bf16"),
                       RankPlan(rank=1, share=16, stage=1, precision="fp32")],
                pipeline=PipelinePlan(stages=[[0, 2], [2, 4]], schedule="1f1b", microbatches=4))
    plan.save(tmp_path / "plan.json")
    r = run_cli([*HETRAIN, "launch", "--nproc-per-node", "2", "--plan", str(tmp_path / "plan.json"),
                 "examples/train_gpt2.py", "--layers", "2", "--global-batch-size", "16", "--steps", "30"],
                cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(r.stdout)
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], r.stdout


def test_train_hf_causal_lm_learns_and_saves_a_model_that_reloads(tmp_path):
    """The Hugging Face user's loop (the model's own loss, attention mask, padding collate, warm-up,
    clipping, save_pretrained) on two ranks at speeds 1 and 0.25 (at 0.5, a run beside another launched job once
    kept the even split above the noise of the load)."""
    import torch
    from transformers import GPT2LMHeadModel

    r = run_cli([*HETRAIN, "launch", "--nproc-per-node", "2", "--emulate-speeds", "1,0.25",
                 "examples/train_hf_causal_lm.py", "--out", str(tmp_path / "lm")], cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(r.stdout)
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], r.stdout
    assert "split [16, 16] ->" in r.stderr   # the faster rank took more of the batch
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "lm")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()


def test_train_hf_causal_lm_logs_only_finished_steps_under_a_plan_with_micro_batches(tmp_path):
    """Each rank's share runs in pieces of 8: session.step() returns False after the first piece, and
    the example logs the loss of finished steps only (session.loss is None before the step's last piece)."""
    from hetrain.planning.plan import Plan, RankPlan

    plan = tmp_path / "plan.json"
    plan.write_text(Plan(global_batch_size=32, ranks=[RankPlan(rank=r, share=16, micro_batch=8, grad_accum=2)
                                                     for r in range(2)]).model_dump_json())
    r = run_cli([*HETRAIN, "launch", "--nproc-per-node", "2", "--plan", str(plan),
                 "examples/train_hf_causal_lm.py", "--steps", "40"], cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.findall(r"step (\d+) loss", r.stdout) == ["20", "40"], r.stdout
