"""The demo's digits are scikit-learn's, read without importing `sklearn.datasets` in every rank."""

import subprocess
import sys

import numpy as np

from hetrain.bench import digits


def test_the_digits_are_exactly_those_load_digits_gives():
    from sklearn.datasets import load_digits

    features, labels = digits.load_digits_arrays()
    bunch = load_digits()
    assert features.dtype == bunch.data.dtype and labels.dtype == bunch.target.dtype
    np.testing.assert_array_equal(features, bunch.data)
    np.testing.assert_array_equal(labels, bunch.target)


def test_reading_them_leaves_sklearn_datasets_unimported():
    code = ("import sys; from hetrain.bench.digits import digits_datasets; train, test = digits_datasets(); "
            "print(len(train), len(test), 'sklearn.datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1438", "359", "False"]


def test_without_the_file_it_falls_back_to_load_digits(monkeypatch):
    monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)
    features, labels = digits.load_digits_arrays()
    assert features.shape == (1797, 64) and sorted(set(labels.tolist())) == list(range(10))
