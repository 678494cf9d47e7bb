"""`hetrain profile`: time a model on this machine's devices and write one profile per device kind.

    hetrain profile (--model NAME | --script FILE.py:FACTORY | --hf-config NAME_OR_PATH) --out DIR
                    [--precision auto|bf16,fp32,...] [--micro-batches 1,2,4,8] [--device auto|cpu|cuda]
                    [--threads N] [--concurrent N] [--repeats 10] [--seconds 5] [--no-blocks] [--json]

DIR gets `workload.json` (the model's FLOPs, parameters and activation bytes) and `<device>.json`
per device kind; `hetrain plan --profiles DIR` plans with them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from hetrain.cli.console import DefaultsShown
from hetrain.cli.console import print_rows, stdout_console
from hetrain.errors import HetrainError
from hetrain.userfiles import ensure_directory


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsShown
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="reference model by zoo name: resnet50, bert-large, gpt2-124m, ...")
    what.add_argument("--script", metavar="FILE.py:FACTORY",
                      help="FACTORY() returns (model, make_input); make_input(n) gives a batch of n samples")
    what.add_argument("--hf-config", metavar="NAME_OR_PATH", help="a Hugging Face config (needs transformers)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length for --hf-config")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the profiles")
    parser.add_argument("--precision", default="auto",
                        help="comma-separated precisions; auto: fp32 on CPU, bf16 (fp16 without bf16) and fp32 on GPUs")
    parser.add_argument("--micro-batches", default="1,2,4,8", help="micro-batch sizes to time, comma-separated")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: one GPU of each kind, or the CPU without GPUs")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: OMP_NUM_THREADS, else torch's default); match what each "
                        "rank will get under hetrain launch")
    parser.add_argument("--concurrent", type=int, default=1,
                        help="CPU only: time this many copies at once, as that many ranks share the CPU")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per point (the median counts)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="time budget per point: timed runs stop once it is spent, after at least 3 (and 2 "
                             "warm-up runs), so a slow model takes longer")
    parser.add_argument("--no-blocks", action="store_true", help="skip the per-block timings")
    parser.add_argument("--json", action="store_true", help="print the profiles as one JSON object")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise HetrainError(f"{flag} {text!r}: write positive integers, e.g. 1,2,4,8")
    return values


def _precision_names(text: str) -> list[str] | None:
    """The precisions --precision names; None for auto."""
    from hetrain.planning.precision_policy import PRECISION_CHOICES

    if text == "auto":
        return None
    values = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in values if p not in PRECISION_CHOICES or p == "auto"]
    if bad or not values:
        raise HetrainError(f"--precision {text!r}: choose from bf16, fp16, tf32, fp32 (comma-separated) or auto")
    return values


def _precisions(text: str, device) -> list[str]:
    values = _precision_names(text)
    if values is None:
        if device.type != "cuda":
            return ["fp32"]
        import torch

        return ["bf16" if torch.cuda.is_bf16_supported() else "fp16", "fp32"]
    if device.type != "cuda" and values != ["fp32"]:
        raise HetrainError(f"--precision {text!r}: the CPU profiles in fp32 only; use --precision fp32")
    return values


def _runnable(args: argparse.Namespace):
    from hetrain.workload.modules import hf_module, script_module, zoo_module

    if args.model:
        return zoo_module(args.model)
    if args.script:
        return script_module(args.script)
    return hf_module(args.hf_config, args.seq_len)


def _workload(args: argparse.Namespace, runnable):
    from hetrain.workload import get_profile, profile

    if args.model:
        return get_profile(args.model)
    # one sample where it is enough (a transformer's figures are per token), two where BatchNorm needs them
    samples = 1 if runnable.kind == "transformer" else 2
    if args.script and not any(p.requires_grad for p in runnable.module.parameters()):
        raise HetrainError(f"--script {args.script!r}: its model ({type(runnable.module).__name__}) has no parameter "
                           "that requires a gradient, so there is no training step to time; return the model you "
                           "train")
    batch = runnable.batch(samples)   # n samples, or one line naming make_input
    try:
        return profile(runnable.module, batch, name=runnable.name, kind=runnable.kind)
    except HetrainError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        if args.model:
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        if args.hf_config:   # a model whose forward takes other inputs than the token ids hetrain builds
            raise HetrainError(f"--hf-config {args.hf_config!r}: the model's forward on token inputs failed "
                               f"({type(e).__name__}: {first}); fix: a --seq-len the model takes, or profile it "
                               "with --script FILE.py:FACTORY, whose make_input(n) gives a batch of n samples the "
                               "model takes") from None
        # a factory's make_input the model cannot take
        raise HetrainError(f"--script {args.script!r}: the model's forward on make_input({samples}) failed "
                           f"({type(e).__name__}: {first}); make_input(n) must give a batch of n samples the "
                           "model takes") from None


def _host_micro_batches(micro_batches: list[int], workload, copies: int) -> list[int]:
    """The CPU's micro-batches that fit the host memory available; a warning for those left out."""
    from hetrain.hardware.catalog import host_available_bytes
    from hetrain.workload.measure import host_micro_batches

    fit = host_micro_batches(micro_batches, workload.activation_bytes(4), workload.params, copies,
                             host_available_bytes())
    if not fit.kept:
        raise HetrainError(f"{fit.shortfall}; fix: smaller --micro-batches, a shorter --seq-len or a smaller model "
                           "(hetrain profile runs fp32 on the CPU)")
    if fit.note:
        print(f"hetrain profile: warning: {fit.note}", file=sys.stderr, flush=True)
    return fit.kept


def _check_flags(args: argparse.Namespace) -> list[int]:
    """What can be checked without torch (so a mistyped flag is refused at once); the micro-batches."""
    from hetrain.workload.modules import check_seq_len, require_transformers, script_file
    from hetrain.workload.zoo import get_profile

    micro_batches = _ints(args.micro_batches, "--micro-batches")
    if args.repeats < 1 or args.seconds <= 0 or args.concurrent < 1:
        raise HetrainError("--repeats, --seconds and --concurrent must be positive")
    if not math.isfinite(args.seconds):
        raise HetrainError(f"--seconds {args.seconds}: give a finite number of seconds per point, e.g. --seconds 5")
    check_seq_len(args.seq_len)
    _precision_names(args.precision)
    if args.seq_len is not None and not args.hf_config:
        raise HetrainError(f"--seq-len {args.seq_len} applies to --hf-config only: a --script's make_input(n) and a "
                           "zoo model set their own length; leave out --seq-len")
    if args.model:
        get_profile(args.model, "time your own model: --script FILE.py:FACTORY or --hf-config NAME_OR_PATH")
    elif args.script:
        script_file(args.script)
    else:
        require_transformers()
    return micro_batches


def run(args: argparse.Namespace) -> int:
    micro_batches = _check_flags(args)
    from hetrain.malloc_cache import apply_here

    apply_here()   # time the steps with the allocator setting hetrain launch gives its ranks
    import torch

    from hetrain.workload.device_profile import WORKLOAD_FILE
    from hetrain.workload.measure import local_devices, measure, measure_cpu_copies, set_cpu_threads

    if args.device == "cuda" and not torch.cuda.is_available():
        raise HetrainError("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    devices = [torch.device("cpu")] if args.device == "cpu" else local_devices()
    if args.threads is not None and args.threads < 1:
        raise HetrainError(f"--threads {args.threads}: give a number of CPU threads >= 1, e.g. --threads 4")
    threads = set_cpu_threads(args.threads)
    if args.concurrent > 1 and any(d.type != "cpu" for d in devices):
        raise HetrainError("--concurrent applies to the CPU only; add --device cpu")
    precisions = {str(d): _precisions(args.precision, d) for d in devices}
    runnable = _runnable(args)   # a bad --script or --hf-config is refused before --out is made
    workload = _workload(args, runnable)
    out = ensure_directory(args.out, "--out")
    workload.save(out / WORKLOAD_FILE)
    written = []
    with _progress() as bar:
        task = bar.add_task("starting", total=None)

        def shown(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)
            if not sys.stderr.isatty() and done < total:   # a log gets one line a point instead of the bar
                print(f"hetrain profile: {what} ({done + 1}/{total})", file=sys.stderr, flush=True)

        for device in devices:
            sizes = _host_micro_batches(micro_batches, workload, args.concurrent) if device.type == "cpu" \
                else micro_batches
            if args.concurrent > 1:
                shown(0, 1, f"{device}: {args.concurrent} copies at once")
                prof = measure_cpu_copies(runnable, args.concurrent, threads, precisions[str(device)], sizes,
                                          repeats=args.repeats, budget_s=args.seconds, blocks=not args.no_blocks,
                                          workload=workload)
            else:
                prof = measure(runnable, device, precisions[str(device)], sizes, repeats=args.repeats,
                               budget_s=args.seconds, blocks=not args.no_blocks, progress=shown, workload=workload)
            written.append((prof.save(out), prof))
    for _, prof in written:
        disturbed = prof.disturbed_note()
        if disturbed:
            print(f"hetrain profile: warning: {disturbed}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"workload": str(out / WORKLOAD_FILE),
                          "profiles": {str(p): prof.model_dump(mode="json") for p, prof in written}}))
        return 0
    _print(written)
    return 0


def _progress():
    """A progress bar on a terminal's stderr, gone once the profiles are written (stdout keeps only
    the tables); nothing into a log."""
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                    disable=not sys.stderr.isatty())


def _print(written) -> None:
    console = stdout_console()
    for path, prof in written:
        s = prof.stamp
        rows = [[t.precision, str(t.micro_batch), f"{t.seconds:.4f}", f"{t.micro_batch / t.seconds:.1f}",
                 f"{t.peak_memory_bytes / 1e9:.2f} GB" if t.peak_memory_bytes is not None else "-"] for t in prof.steps]
        print_rows(console, ["precision", "micro-batch", "seconds", "samples/s", "peak memory"], rows,
                   title=f"{prof.model} on {prof.device} ({s.device_name}; torch {s.torch}"
                   + (f", CUDA {s.cuda}, driver {s.driver}" if s.cuda
                      else f", {s.threads} thread{'' if s.threads == 1 else 's'}") + f"; {s.date})")
        console.print(f"optimizer step {prof.optimizer_seconds * 1e3:.1f} ms; {len(prof.blocks)} blocks timed; "
                      f"written to {path}")
