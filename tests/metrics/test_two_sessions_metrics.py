"""Two sessions open side by side in one process (a GAN's generator and discriminator, docs/porting.md) under one
--metrics-port and one run directory: the first serves the job's figures and writes its run log; the second
neither takes the first's port (its serve() was refused as "not closed") nor writes into its log (which mixed
the two models' steps), and says so."""

from __future__ import annotations

import json
import logging
import urllib.request

import torch
import torch.nn.functional as F

import hetrain
from tests.ports import free_ports

STEPS = 4


def _gan(second_port: int | None = None) -> tuple:
    """A GAN's loop, the discriminator's session made first; returns (discriminator's, generator's) sessions."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    sd = hetrain.Session()
    sg = hetrain.Session(metrics_port=second_port)
    disc_m, _ = sd.prepare(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
    gen_m, _ = sg.prepare(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS, 2), torch.randn(8 * STEPS, 4))
    real_batches, noise = sd.loader(data, 8, shuffle=False), iter(sg.loader(data, 8, shuffle=False))
    bce = F.binary_cross_entropy_with_logits
    for real, z in real_batches:
        next(noise)
        fake = gen_m(z)
        real_out, fake_out = disc_m(real), disc_m(fake.detach())
        sd.backward(bce(real_out, torch.ones_like(real_out)) + bce(fake_out, torch.zeros_like(fake_out)))
        sd.step()
        out = disc_m(fake)
        sg.backward(bce(out, torch.ones_like(out)))
        sg.step()
    return sd, sg


def _infos() -> tuple[list[str], logging.Handler]:
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hetrain").addHandler(handler)
    return lines, handler


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_the_first_of_two_sessions_side_by_side_keeps_the_port_and_the_run_log(tmp_path, monkeypatch):
    base = free_ports(1)
    monkeypatch.setenv("HETRAIN_METRICS_PORT", str(base))
    monkeypatch.setenv("HETRAIN_RUN_DIR", str(tmp_path))
    lines, handler = _infos()
    sd = sg = None
    try:
        sd, sg = _gan()
        assert "hetrain_step{" in _scrape(base)
        assert [getattr(o, "port", None) for o in sd.observers] == [base]
        assert sg.observers == []   # the second serves nothing and logs nothing
    finally:
        logging.getLogger("hetrain").removeHandler(handler)
        for session in (sg, sd):
            if session is not None:
                session.close()
    steps = [json.loads(line) for line in (tmp_path / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["kind"] == "step"] == list(range(1, STEPS + 1))   # one model's steps
    said = [line for line in lines if "made beside an earlier one" in line]
    assert len(said) == 1 and f"not on the metrics ports {base}.." in said[0] and str(tmp_path / "metrics") in said[0]


def test_a_second_session_given_a_port_of_its_own_serves_it(tmp_path, monkeypatch):
    base = free_ports(2)
    monkeypatch.setenv("HETRAIN_METRICS_PORT", str(base))
    sd = sg = None
    try:
        sd, sg = _gan(second_port=base + 1)
        assert [getattr(o, "port", None) for o in sg.observers] == [base + 1]
        assert 'hetrain_steps_total{' in _scrape(base + 1) and 'hetrain_steps_total{' in _scrape(base)
    finally:
        for session in (sg, sd):
            if session is not None:
                session.close()
