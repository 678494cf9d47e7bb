"""RankMetrics driven directly with StepRecords: what it serves, what it leaves out, what it costs."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import sys
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hetrain.errors import HetrainError
from hetrain.metrics import RankMetrics
from hetrain.metrics.names import METRICS
from hetrain.metrics.serve import check_port_range, check_ports_free
from hetrain.metrics.events import CheckpointRecord
from tests.metrics.fake_gpu_rank import fake_gpu_metrics, patch_cuda, step_record
from tests.metrics.fake_nvml import FakeNvml
from tests.ports import free_ports
from tests.distributed import run_cli


def cpu_metrics(**kw) -> RankMetrics:
    args = dict(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), device_name="cpu", port=None,
                run_dir=None, job="unit")
    args.update(kw)
    return RankMetrics(**args)


def samples(metrics: RankMetrics) -> dict[str, list]:
    """name -> [(labels, value)] as a scrape would read them."""
    out: dict[str, list] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(metrics: RankMetrics, name: str) -> float:
    [(_, value)] = samples(metrics)[name]
    return value


def test_before_any_step_only_what_exists_is_exported():
    m = cpu_metrics(predicted_step_seconds=0.2)
    names = set(samples(m))
    assert {"hetrain_rank_info", "hetrain_memory_bytes", "hetrain_restarts_total", "hetrain_predicted_step_seconds"} <= names
    assert not names & {"hetrain_loss", "hetrain_step", "hetrain_grad_norm", "hetrain_mfu_ratio", "hetrain_share_ratio"}


def test_steps_fold_into_counters_and_gauges():
    m = cpu_metrics(flops_per_item=1e6, peak_flops=1e9)
    m.on_step(step_record(1, rank=1, step_seconds=None, grad_norm=None))
    m.on_step(step_record(2, rank=1, step_seconds=0.5, compute_seconds=0.3, data_wait_seconds=0.05, split_changed=True,
                          share=256, shares=(512, 256, 256), grad_norm=None, items=1000))
    m.on_step(step_record(3, rank=1, step_seconds=0.5, compute_seconds=0.3, data_wait_seconds=0.05, grad_norm=2.5, share=256,
                          skipped=True, skipped_total=1, items=1000))
    s = samples(m)
    assert one(m, "hetrain_step") == 3 and one(m, "hetrain_steps_total") == 3
    assert one(m, "hetrain_step_seconds_count") == 2 and one(m, "hetrain_step_seconds_sum") == pytest.approx(1.0)
    waits = {labels["cause"]: v for labels, v in s["hetrain_wait_seconds_total"]}
    # compute + waiting adds up to the step time over the timed steps (the first has no step time)
    assert one(m, "hetrain_compute_seconds_total") + waits["ranks"] + waits["data"] == pytest.approx(1.0)
    assert waits == pytest.approx({"ranks": 0.3, "data": 0.1})   # no checkpoint held the loop: no series
    assert one(m, "hetrain_share_ratio") == pytest.approx(0.25)
    assert one(m, "hetrain_split_changes_total") == 1
    assert {labels["level"]: v for labels, v in s["hetrain_comm_sent_bytes_total"]} == {"intra": 12e8, "inter": 3e8}
    assert one(m, "hetrain_grad_norm") == 2.5 and one(m, "hetrain_skipped_steps_total") == 1
    assert one(m, "hetrain_mfu_ratio") == pytest.approx(1e6 * 1000 / 0.5 / 1e9)
    m.on_checkpoint(CheckpointRecord(step=3, blocking_seconds=0.25, total_seconds=1.5, bytes=4096))
    m.on_restart(2)
    assert one(m, "hetrain_checkpoints_written_total") == 1 and one(m, "hetrain_checkpoint_save_seconds_sum") == 1.5
    assert one(m, "hetrain_restarts_total") == 2


def test_a_resumed_process_counts_only_its_own_skipped_steps():
    # A restart resumes with 2 skips in its checkpoint: Prometheus reads the new process's counter from
    # zero, so a reloaded count would be counted twice by increase().
    m = cpu_metrics()
    m.on_step(step_record(21, rank=1, skipped_total=2))
    assert one(m, "hetrain_skipped_steps_total") == 0
    m.on_step(step_record(22, rank=1, skipped=True, skipped_total=3))
    assert one(m, "hetrain_skipped_steps_total") == 1


def test_rank_info_carries_the_ranks_precision_and_emulation_before_its_first_step():
    m = cpu_metrics(precision="fp16", emulated=True)
    [(labels, _)] = samples(m)["hetrain_rank_info"]
    assert labels["precision"] == "fp16" and labels["emulated"] == "true"
    m.on_step(step_record(1, rank=1, precision="fp16", emulated=True))
    assert [labels for labels, _ in samples(m)["hetrain_rank_info"]] == [labels]   # one series, not a second


def test_rank_info_names_a_pipeline_ranks_stage_and_replica_and_no_other_rank_has_them():
    [(labels, _)] = samples(cpu_metrics(place={"stage": 1, "stages": 3, "replica": 0, "replicas": 2}))["hetrain_rank_info"]
    assert (labels["stage"], labels["stages"], labels["replica"], labels["replicas"]) == ("1", "3", "0", "2"), labels
    [(labels, _)] = samples(cpu_metrics())["hetrain_rank_info"]
    assert not {"stage", "stages", "replica", "replicas"} & set(labels), labels


def test_mfu_uses_the_catalog_peak_of_the_device_in_its_precision(monkeypatch):
    patch_cuda(monkeypatch.setattr)
    m = cpu_metrics(device=torch.device("cuda:0"), device_name="a100-sxm4-80gb", flops_per_item=1e9, nvml=FakeNvml())
    m.on_step(step_record(2, step_seconds=1.0, items=156, precision="bf16"))
    assert one(m, "hetrain_peak_flops") == 312e12
    assert one(m, "hetrain_mfu_ratio") == pytest.approx(156e9 / 312e12)
    unknown = cpu_metrics(device_name="not-a-gpu", flops_per_item=1e9)
    unknown.on_step(step_record(2))
    assert "hetrain_mfu_ratio" not in samples(unknown)   # no peak known: absent, not zero
    cpu = cpu_metrics(device_name="cpu", flops_per_item=1e9)   # the catalog's CPU figure is no peak (MFU of 230%)
    cpu.on_step(step_record(2, step_seconds=1.0, items=156))
    assert "hetrain_mfu_ratio" not in samples(cpu) and "hetrain_peak_flops" not in samples(cpu)


def test_a_cpu_rank_standing_in_for_a_gpu_has_no_peak_and_no_mfu(tmp_path):
    """HETRAIN_EMULATE_DEVICES, or a plan's GPU entry run on a CPU rank: the GPU's peak is no peak of a CPU (the
    A100's 3.12e14 gave an MFU of 3.6e-8)."""
    m = cpu_metrics(device_name="a100-sxm4-80gb", flops_per_item=1e9, run_dir=tmp_path, emulated=True)
    m.on_step(step_record(2, step_seconds=1.0, items=156, precision="bf16", emulated=True))
    m.close()
    assert "hetrain_mfu_ratio" not in samples(m) and "hetrain_peak_flops" not in samples(m)
    start = json.loads((tmp_path / "metrics" / "rank-1.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["peak_flops"] is None


def test_cuda_rank_labels_and_nvml_readings(monkeypatch):
    patch_cuda(monkeypatch.setattr)
    m_nvml = FakeNvml()
    m = fake_gpu_metrics(port=None, nvml=m_nvml)
    m.on_step(step_record(1))
    s = samples(m)
    labels = s["hetrain_gpu_power_watts"][0][0]
    assert labels["UUID"] == "GPU-8f3a5c2e-1111-2222-3333-444455556666" and labels["gpu"] == "3"
    assert labels["Hostname"] == socket.gethostname() and labels["device"] == "a100-sxm4-80gb"
    assert one(m, "hetrain_gpu_power_watts") == 312.5 and one(m, "hetrain_gpu_utilization_ratio") == 0.87
    assert one(m, "hetrain_gpu_temperature_celsius") == 64
    # NVLink counters: NVML's all-links total in KiB, read at each scrape
    before = m_nvml.kib_sent   # the fake's counter grows 1000 KiB a reading; received is twice sent
    scrape = samples(m)
    assert scrape["hetrain_gpu_nvlink_sent_bytes_total"][0][1] == (before + 1000) * 1024
    assert scrape["hetrain_gpu_nvlink_received_bytes_total"][0][1] == 2 * (before + 2000) * 1024
    assert {lab["kind"] for lab, _ in s["hetrain_memory_bytes"]} == {"allocated", "reserved", "peak_allocated",
                                                                    "peak_reserved"}


def test_readings_a_device_lacks_are_absent(monkeypatch):
    patch_cuda(monkeypatch.setattr)
    nvml = FakeNvml(unsupported=("nvmlDeviceGetPowerUsage", "nvmlDeviceGetNvLinkState"))
    names = set(samples(fake_gpu_metrics(port=None, nvml=nvml)))
    assert "hetrain_gpu_temperature_celsius" in names
    assert not names & {"hetrain_gpu_power_watts", "hetrain_gpu_nvlink_sent_bytes_total",
                        "hetrain_gpu_nvlink_received_bytes_total"}


def test_serves_on_base_port_plus_local_rank_and_every_name_is_documented():
    base = free_ports(2)
    m = cpu_metrics(port=base, local_rank=1)
    try:
        m.on_step(step_record(1, rank=1))
        text = urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    documented = {m.name for m in METRICS} | {f"{m.name}{suffix}" for m in METRICS if m.kind == "summary"
                                              for suffix in ("_count", "_sum")}
    assert served and served <= documented, served - documented


def test_port_in_use_is_one_line_naming_the_flag():
    base = free_ports(2)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", base + 1))
        busy.listen()
        with pytest.raises(HetrainError, match=rf"--metrics-port {base}: port {base + 1} is already in use") as e:
            cpu_metrics(port=base, local_rank=1)
        assert "\n" not in str(e.value)
        with pytest.raises(HetrainError, match="already in use"):
            check_ports_free(base, 2)
        r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--metrics-port",
                     str(base), "examples/train_digits.py"], timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--metrics-port" in lines[0], r.stderr


def test_the_port_the_error_suggests_is_free(monkeypatch):
    base = free_ports(2)
    with socket.socket() as busy, socket.socket() as next_busy:
        busy.bind(("0.0.0.0", base))
        busy.listen()
        try:   # the node's second port at the first base a guess would offer is taken too
            next_busy.bind(("0.0.0.0", base + 101))
            next_busy.listen()
        except OSError:
            pass
        with pytest.raises(HetrainError) as e:
            check_ports_free(base, 2)
        suggested = int(re.search(r"e\.g\. --metrics-port (\d+)$", str(e.value)).group(1))
        assert suggested != base + 100
        check_ports_free(suggested, 2)   # free now: no error
        # a worker (local rank 0 of 2) finding its port taken suggests room for the node's 2 ranks too
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        with pytest.raises(HetrainError) as e:
            cpu_metrics(port=base, local_rank=0)
        suggested = int(re.search(r"e\.g\. --metrics-port (\d+)$", str(e.value)).group(1))
        assert suggested != base + 100
        check_ports_free(suggested, 2)


def test_port_range_must_fit_the_local_ranks():
    check_port_range(65534, 2)
    with pytest.raises(HetrainError, match=r"ports 65535\.\.65536"):
        check_port_range(65535, 2)
    with pytest.raises(HetrainError, match="outside 1..65535"):
        check_port_range(0, 1)


def test_run_log_has_a_line_per_step_and_checkpoint(tmp_path):
    m = cpu_metrics(run_dir=tmp_path, flops_per_item=1.0)
    m.on_step(step_record(1, rank=1))
    m.on_checkpoint(CheckpointRecord(step=1, blocking_seconds=0.1, total_seconds=0.2, bytes=10))
    m.on_step(step_record(2, rank=1))
    m.close()
    m.close()  # twice is fine
    lines = [json.loads(x) for x in (tmp_path / "metrics" / "rank-1.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["start", "step", "checkpoint", "step"]
    assert lines[0]["device"] == "cpu" and lines[0]["world_size"] == 2
    assert lines[3]["waiting_seconds"] == pytest.approx(0.5 - 0.4 - 0.02)


def test_a_step_costs_microseconds(tmp_path):
    """The step path: numbers added under a lock and one JSON line handed to the OS (one write call)."""
    m = cpu_metrics(run_dir=tmp_path, flops_per_item=1.0)
    record = step_record(2, rank=1)
    m.on_step(record)
    n = 2000
    t = time.perf_counter()
    for i in range(n):
        m.on_step(dataclasses.replace(record, step=i))
    per_step = (time.perf_counter() - t) / n
    m.close()
    assert per_step < 200e-6, per_step   # about 25 us measured; a training step takes milliseconds


def test_without_pynvml_or_a_driver_a_cuda_rank_has_no_gpu_series(monkeypatch):
    from types import SimpleNamespace

    from hetrain.metrics.nvml import load_nvml

    monkeypatch.setitem(sys.modules, "pynvml", None)          # not installed
    assert load_nvml() is None

    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=no_driver))
    assert load_nvml() is None
    patch_cuda(monkeypatch.setattr)
    m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cuda:0"), device_name="h100-sxm5-80gb",
                    port=None, run_dir=None, job="unit")
    names = set(samples(m))
    assert "hetrain_memory_bytes" in names and not any(n.startswith("hetrain_gpu_") for n in names)
    assert "UUID" not in samples(m)["hetrain_rank_info"][0][0]


def test_a_cpu_ranks_peak_memory_is_never_below_its_current_memory():
    """Linux updates ru_maxrss lazily; read just after the resident set grew, it trailed it."""
    from hetrain.metrics.memory import process_memory

    grown = bytearray(64 * 2**20)   # resident now, maybe not yet in the kernel's peak
    grown[::4096] = b"x" * len(grown[::4096])
    m = process_memory()
    assert m["peak_rss"] >= m["rss"] > 64 * 2**20


def test_a_port_held_by_an_unclosed_session_of_this_process_says_so():
    """A sweep's trial that raised without closing its session kept serving the port; the next trial's error
    suggested another base port, not the close() that frees it."""
    import hetrain

    base = free_ports(1)
    sessions = []

    def trial():
        session = hetrain.Session(metrics_port=base)
        sessions.append(session)
        net = torch.nn.Linear(4, 1)
        session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        for _ in session.loader(data, global_batch_size=8):
            raise RuntimeError("trial failed")

    try:
        with pytest.raises(RuntimeError, match="trial failed"):
            trial()
        with pytest.raises(HetrainError, match=rf"port {base} is served by an earlier hetrain.Session of this process "
                                               r"that was not closed.*session.close\(\)"):
            trial()
    finally:
        sessions[0].close()   # the process group and the port go with it (the second never got them)
    assert not torch.distributed.is_initialized()
