"""Plan files and a run's measured-rates.json are read strictly: an infinite number, another version, a
key written twice, an unknown device or precision is refused in one line, not run or crashed on."""

import json

import pytest

from hetrain.errors import HetrainError
from hetrain.planning.measured_rates import RATES_FILE, MeasuredRates
from hetrain.planning.plan import Plan


def _plan() -> dict:
    return json.loads(Plan.even(2, 8).to_json())


@pytest.mark.parametrize("text", ['"bucket_cap_mb": 1e400', '"bucket_cap_mb": Infinity', '"bucket_cap_mb": NaN'])
def test_a_plan_with_an_infinite_number_is_refused(tmp_path, text):
    """1e400 passed load and crashed in prepare() with OverflowError."""
    data = json.dumps(_plan()).replace('"bucket_cap_mb": 25.0', text)
    assert text in data
    path = tmp_path / "plan.json"
    path.write_text(data)
    with pytest.raises(HetrainError, match=r"bucket_cap_mb") as e:
        Plan.load(path)
    assert "\n" not in str(e.value)


def _rates(**device) -> dict:
    return {"version": 1, "step": 100, "global_batch_size": 64, "model_params": None,
            "devices": [{"device": "a100-sxm4-80gb", "precision": "bf16", "ranks": 2, "per_sample_seconds": 0.001,
                         "fixed_seconds": 0.01, "share": 32, "emulated": False, **device}]}


@pytest.mark.parametrize("text,why", [
    (json.dumps(_rates(per_sample_seconds=float("inf"))), "per_sample_seconds"),
    (json.dumps(_rates(fixed_seconds=float("nan"))), "fixed_seconds"),
    (json.dumps({**_rates(), "version": 9}), "measured rates version 9 is not supported"),
    (json.dumps(_rates(precision="int4")), "precision"),
    (json.dumps(_rates(device="a100-sxm9")), "device 'a100-sxm9' is neither a catalog device nor 'cpu'"),
    (json.dumps(_rates()).replace('"step": 100', '"step": 100, "step": 5'), "key 'step' appears twice"),
])
def test_a_measured_rates_file_that_no_run_writes_is_refused_in_one_line(tmp_path, text, why):
    """Infinity made plan --from-run crash with ZeroDivisionError; the rest were read silently."""
    (tmp_path / RATES_FILE).write_text(text)
    with pytest.raises(HetrainError, match=why) as e:
        MeasuredRates.load(tmp_path)
    assert "\n" not in str(e.value)


def test_a_measured_rates_file_a_run_writes_still_loads(tmp_path):
    (tmp_path / RATES_FILE).write_text(json.dumps(_rates()))
    assert MeasuredRates.load(tmp_path).devices[0].per_sample_seconds == 0.001
    (tmp_path / RATES_FILE).write_text(json.dumps(_rates(device="cpu", precision="fp32")))
    assert MeasuredRates.load(tmp_path).devices[0].device == "cpu"
