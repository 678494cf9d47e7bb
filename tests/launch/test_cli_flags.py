"""A mistyped flag is refused before torch is imported: `hetrain profile` and the benchmarks that
spawn torch ranks answer in a fraction of a second, not after torch's two-second import."""

import subprocess
import sys

REFUSED = [
    ["profile", "--model", "nosuchnet", "--out", "OUT"],
    ["profile", "--model", "resnet50", "--micro-batches", "0", "--out", "OUT"],
    ["profile", "--model", "resnet50", "--precision", "fp8", "--out", "OUT"],
    ["profile", "--script", "missing.py:make", "--out", "OUT"],
    ["bench", "comm", "--steps", "5", "--powersgd-warmup-steps", "10"],
    ["bench", "comm", "--hooks", "int8"],
    ["bench", "memory", "--ranks", "5"],
]


def test_bad_flags_are_refused_without_importing_torch(tmp_path):
    code = (
        "import sys\n"
        "from hetrain.cli.main import main\n"
        f"for argv in {REFUSED!r}:\n"
        f"    argv = [a.replace('OUT', {str(tmp_path / 'out')!r}) for a in argv]\n"
        "    print(main(argv), 'torch' in sys.modules)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.stdout.split("\n")[:-1] == ["2 False"] * len(REFUSED), p.stdout + p.stderr
    assert p.stderr.count("error:") == len(REFUSED) and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()
