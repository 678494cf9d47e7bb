"""User model sources for `hetrain profile`: --script FILE.py:FACTORY and --hf-config, and their one-line errors."""

import subprocess
import sys

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.workload.modules import hf_module, script_file, script_module


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_script_that_is_no_python_file_is_one_line(tmp_path):
    text = tmp_path / "notpy.txt"
    text.write_text("hello\n")
    for spec in (f"{text}:make", "/bin/ls:make"):
        for reader in (script_file, script_module):
            with pytest.raises(HetrainError, match=r"is not a Python file; write FILE\.py:FACTORY"):
                reader(spec)


def test_a_binary_script_is_one_line(tmp_path):
    binary = tmp_path / "model.py"
    binary.write_bytes(b"x = 1\x00\n")
    with pytest.raises(HetrainError, match="is a binary file"):
        script_module(f"{binary}:make")


def test_a_script_with_a_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\n\ndef make(:\n    pass\n")
    for reader in (script_file, script_module):
        with pytest.raises(HetrainError, match=rf"{bad} line 3: .*fix the Python in broken\.py") as e:
            reader(f"{bad}:make")
        assert "\n" not in str(e.value)


def test_a_good_script_still_builds_its_model(tmp_path):
    good = tmp_path / "net.py"
    good.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4)\n")
    runnable = script_module(f"{good}:make")
    assert runnable.name == "make" and tuple(runnable.module(runnable.make_input(3)).shape) == (3, 2)


def test_profile_cli_refuses_a_non_python_script_in_one_line(tmp_path):
    p = _cli("--script", "/bin/ls:make", "--device", "cpu", "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("hetrain profile: error: --script '/bin/ls:make'") and "FILE.py:FACTORY" in p.stderr


def test_a_factory_whose_batch_the_model_cannot_take_is_one_line(tmp_path):
    """It printed torch's 41-line traceback from the first forward (found auditing the CLI)."""
    script = tmp_path / "bad.py"
    script.write_text("import torch\n\ndef make_model():\n    return torch.nn.Linear(64, 10), lambda n: torch.randn(n, 32)\n")
    p = _cli("--script", str(script), "--device", "cpu", "--out", str(tmp_path / "out"), "--micro-batches", "2",
             "--seconds", "1", "--no-blocks")
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "the model's forward on make_input(2) failed (RuntimeError: mat1 and mat2" in p.stderr
    assert "make_input(n) must give a batch of n samples the model takes" in p.stderr


def test_a_factory_whose_model_has_nothing_to_train_says_so_not_blame_its_input(tmp_path):
    script = tmp_path / "relu.py"
    script.write_text("import torch\n\ndef make_model():\n    return torch.nn.ReLU(), lambda n: torch.randn(n, 5)\n")
    p = _cli("--script", str(script), "--device", "cpu", "--out", str(tmp_path / "out"), "--micro-batches", "2",
             "--seconds", "1", "--no-blocks")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "its model (ReLU) has no parameter that requires a gradient" in p.stderr and "make_input" not in p.stderr


def test_a_missing_hf_config_path_names_the_path_and_the_fix(tmp_path):
    missing = str(tmp_path / "nonexist" / "config.json")
    with pytest.raises(HetrainError, match="no such file or directory; fix: give a local config.json") as e:
        hf_module(missing)
    assert missing in str(e.value) and "Hugging Face model name" in str(e.value)


@pytest.mark.parametrize("content,reason", [(None, "the directory holds no config.json"), ("{not json", "not a valid JSON file"),
                                            ('{"model_type": "nosuchtype"}', "nosuchtype")])
def test_a_bad_hf_config_is_one_line(tmp_path, content, reason):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(HetrainError, match=f"cannot be loaded .*{reason}.*; fix: give a local config.json") as e:
        hf_module(str(tmp_path))
    assert "\n" not in str(e.value)


def test_an_hf_config_directory_still_builds_and_is_named_after_it(tmp_path):
    from transformers import GPT2Config

    directory = tmp_path / "tiny-gpt2"
    GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2).save_pretrained(directory)
    for config in (str(directory), str(directory / "config.json")):
        runnable = hf_module(config)
        assert runnable.name == "tiny-gpt2"
        assert runnable.module(runnable.make_input(2)).shape == (2, 16, 64)   # logits


def test_a_gpt2_hf_config_is_profiled_as_embedding_layers_and_head(tmp_path):
    """As one `transformer` block, checkpointing was priced as saving nothing (a 3060 refused plain DDP
    for GPT-2 medium) and pipeline plans cut 2 blocks where the script's model has 26."""
    from transformers import GPT2Config

    from hetrain.runtime.memory import find_blocks
    from hetrain.workload.layers import profile_blocks

    GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2).save_pretrained(tmp_path)
    model = hf_module(str(tmp_path)).module
    blocks = [b for _, b in profile_blocks(model)]
    assert len(blocks) == 3 + 2 and all(any(b is layer for layer in find_blocks(model)) for b in blocks[1:-1])


def test_profile_cli_with_a_missing_hf_config_is_one_line(tmp_path):
    missing = str(tmp_path / "nonexist" / "config.json")
    p = _cli("--hf-config", missing, "--device", "cpu", "--micro-batches", "1", "--seconds", "1",
             "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"hetrain profile: error: --hf-config '{missing}': no such file or directory")


def test_a_hub_name_neither_cached_nor_reachable_is_refused_at_once(tmp_path, monkeypatch):
    """The hub's client retried for about 25 s on a machine without the network before its error."""
    import time

    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))   # nothing cached
    start = time.monotonic()
    with pytest.raises(HetrainError, match="not in the local Hugging Face cache and hub.invalid cannot be reached"):
        hf_module("some-org/some-model")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_an_hf_config_of_another_architecture_is_profiled_layer_by_layer(tmp_path, arch):
    """The layers sit inside the model (model.layers, bert.encoder.layer): the profile counts and times
    them one by one, the blocks activation checkpointing recomputes, where it counted two or three."""
    from transformers import BertConfig, LlamaConfig

    from hetrain.runtime.memory import find_blocks
    from hetrain.workload import profile
    from hetrain.workload.measure import measure
    from hetrain.workload.layers import profile_blocks

    if arch == "llama":
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=32).save_pretrained(tmp_path)
    else:
        BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=32).save_pretrained(tmp_path)
    runnable = hf_module(str(tmp_path), seq_len=16)
    blocks = profile_blocks(runnable.module)
    layers = find_blocks(runnable.module)
    assert [b for _, b in blocks if any(b is layer for layer in layers)] == layers and len(layers) == 3
    workload = profile(runnable.module, runnable.make_input(2))
    assert [b.flops_per_sample > 0 for b in workload.blocks if "layer" in b.name] == [True] * 3
    timed = measure(runnable, torch.device("cpu"), ["fp32"], [1], repeats=2, budget_s=0.5)
    assert [t.name for t in timed.blocks if "layer" in t.name] == [n for n, b in blocks if any(b is x for x in layers)]


def test_a_t5_hf_config_is_profiled_with_decoder_inputs(tmp_path):
    """T5 through --hf-config ended in a traceback ('You must specify exactly one of input_ids or inputs_embeds'):
    only the encoder's tokens were built, and T5 derives no decoder inputs from them."""
    from transformers import T5Config

    from hetrain.workload import profile
    from hetrain.workload.measure import measure

    T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
             n_positions=8).save_pretrained(tmp_path)
    runnable = hf_module(str(tmp_path), seq_len=8)
    workload = profile(runnable.module, runnable.batch(1), name=runnable.name, kind=runnable.kind)
    assert workload.flops_per_sample > 0 and workload.seq_len == 8
    timed = measure(runnable, torch.device("cpu"), ["fp32"], [1], repeats=2, budget_s=0.05, blocks=False)
    assert [s.micro_batch for s in timed.steps] == [1]


def test_an_hf_config_whose_forward_fails_is_one_line_naming_the_fix(tmp_path):
    """A failed forward was one line for --script only; --hf-config printed torch's traceback."""
    from transformers import BertConfig

    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               max_position_embeddings=8).save_pretrained(tmp_path / "bert")
    p = _cli("--hf-config", str(tmp_path / "bert"), "--seq-len", "32", "--device", "cpu", "--micro-batches", "1",
             "--seconds", "0.1", "--no-blocks", "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "the model's forward on token inputs failed" in p.stderr and "fix: a --seq-len the model takes" in p.stderr


def test_a_script_imports_the_modules_beside_it_from_any_folder(tmp_path, monkeypatch):
    """Run from another folder, `from helper import Block` ended in ModuleNotFoundError, though
    `python FILE.py` finds its neighbours."""
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the script's folder joins it: not beyond this test
    (tmp_path / "hetrain_test_sibling_layers.py").write_text(
        "import torch\n\nclass Block(torch.nn.Linear):\n    pass\n")
    (tmp_path / "net.py").write_text("import torch\nfrom hetrain_test_sibling_layers import Block\n\n"
                                     "def make_model():\n    return Block(4, 2), lambda n: torch.randn(n, 4)\n")
    runnable = script_module(str(tmp_path / "net.py"))
    assert tuple(runnable.module(runnable.batch(3)).shape) == (3, 2)


def test_a_factory_that_raises_is_one_line_naming_the_script_and_the_error(tmp_path):
    script = tmp_path / "raising.py"
    script.write_text("def make_model():\n    raise RuntimeError('dataset path /data/x not found')\n")
    with pytest.raises(HetrainError, match=r"raising\.py': make_model\(\) raised RuntimeError: dataset path /data/x "
                                           r"not found; fix the factory in raising\.py") as e:
        script_module(str(script))
    assert "\n" not in str(e.value)


def test_a_make_input_that_raises_is_one_line_naming_make_input_the_script_and_the_error(tmp_path):
    """It ended in a traceback (exit 1) once the first batch was taken outside the profile's guard."""
    script = tmp_path / "noisy.py"
    script.write_text("import torch\n\ndef make_model():\n    def make_input(n):\n"
                      "        raise KeyError('tokenizer missing')\n    return torch.nn.Linear(4, 2), make_input\n")
    with pytest.raises(HetrainError, match=r"--script '.*noisy\.py': make_input\(3\) of noisy raised KeyError: "
                                           r"'tokenizer missing'; fix make_input\(n\)") as e:
        script_module(str(script)).batch(3)
    assert "\n" not in str(e.value)
    p = _cli("--script", str(script), "--device", "cpu", "--out", str(tmp_path / "out"), "--micro-batches", "2",
             "--seconds", "1", "--no-blocks")
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "make_input(2) of noisy raised KeyError" in p.stderr
