"""Time a model on this machine's devices: the measurements behind `hetrain profile`.

For each device kind (the CPU, or one GPU of each catalog model), each precision and each
micro-batch size: the median seconds of a forward + backward, and the peak memory on CUDA. Then
one AdamW step, and each block's forward + backward (what a pipeline partition needs).
TF32 and autocast are set as hetrain's runtime sets them for the precision, so the profile times
what a rank of that precision will run.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetrain.errors import HetrainError
from hetrain.workload.batches import call_model, to_device
from hetrain.workload.device_profile import BlockTiming, DeviceProfile, Stamp, StepTiming
from hetrain.workload.modules import RunnableModel
from hetrain.workload.profile import WorkloadProfile

_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def _loss(out):
    import torch

    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()), None)
    if not isinstance(out, torch.Tensor):
        raise HetrainError("the model's output holds no floating-point tensor to take a gradient of")
    return out.float().mean()


class _Clock:
    """Wall seconds of a callable on a device (CUDA work synchronised before reading the clock)."""

    def __init__(self, device):
        import torch

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def median(self, fn, repeats: int, budget_s: float, warmup: int = 2) -> float:
        return self.medians(fn, repeats, budget_s, warmup)[0]

    def medians(self, fn, repeats: int, budget_s: float, warmup: int = 2) -> tuple[float, float]:
        """Median wall seconds and median process CPU seconds (all threads) per call."""
        for _ in range(warmup):
            fn()
        self.sync()
        times: list[float] = []
        cpu: list[float] = []
        start = time.perf_counter()
        while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return statistics.median(times), statistics.median(cpu)


def _set_math(precision: str, device) -> None:
    """As hetrain's runtime: TF32 off in fp32, on otherwise (CUDA only)."""
    import torch

    if device.type == "cuda":
        allow = precision != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow


def _autocast(precision: str, device):
    """bf16/fp16 autocast as the runtime's, or nothing for fp32/tf32."""
    import contextlib

    import torch

    dtype = _AUTOCAST.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def _fwd_bwd(runnable: RunnableModel, module, batch, precision: str, device, scaler):
    def run():
        with _autocast(precision, device):
            loss = _loss(call_model(module, batch))
        (scaler.scale(loss) if scaler is not None else loss).backward()

    return run


def _driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - NVML missing or not loadable: try nvidia-smi
        pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def stamp(device) -> Stamp:
    """Device, driver, torch, CUDA and cuDNN versions, threads, host and date of a measurement."""
    import torch

    cuda = device.type == "cuda"
    return Stamp(
        device_name=torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine() or "cpu"),
        driver=_driver_version() if cuda else None,
        torch=torch.__version__,
        cuda=torch.version.cuda if cuda else None,
        cudnn=str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else None,
        threads=torch.get_num_threads(),
        hostname=platform.node() or None,
        date=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    )


def device_kind(device) -> str:
    """The catalog name of a torch device ("cpu", or e.g. "a100-sxm4-80gb"; a slug when unknown)."""
    import torch

    if device.type != "cuda":
        return "cpu"
    from hetrain.hardware.catalog import match_device_name

    name = torch.cuda.get_device_name(device)
    spec = match_device_name(name, torch.cuda.get_device_properties(device).total_memory)
    return spec.name if spec else "-".join(name.lower().replace("nvidia", "").split())


def local_devices() -> list:
    """The CPU when there is no GPU, else the first GPU of each kind."""
    import torch

    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    seen: dict[str, object] = {}
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        seen.setdefault(device_kind(dev), dev)
    return list(seen.values())


HOST_PEAK_FACTOR = 1.5
"""A CPU step's peak over the activations a profile counts (the tensors saved for backward): backward's
own temporaries come on top."""


@dataclass(frozen=True)
class HostFit:
    """Which CPU micro-batches fit the host memory available, and what the largest left out would need."""

    kept: list[int]
    left: list[int]
    need_bytes: float = 0.0        # of the largest left out
    available_bytes: float = 0.0
    copies: int = 1

    @property
    def shortfall(self) -> str:
        """"micro-batch 8 would need about 37.8 GB of host memory, 22.0 GB is available"."""
        return (f"micro-batch {max(self.left)} would need about {self.need_bytes / 1e9:.1f} GB of host memory"
                + (f" ({self.copies} copies)" if self.copies > 1 else "")
                + f", {self.available_bytes / 1e9:.1f} GB is available")

    @property
    def note(self) -> str | None:
        return f"micro-batch {','.join(map(str, self.left))} left out: {self.shortfall}" if self.left else None


def host_micro_batches(micro_batches: Sequence[int], activation_bytes_per_sample: float, params: int,
                       copies: int = 1, available: float | None = None) -> HostFit:
    """The micro-batches whose CPU steps, `copies` at once, fit the host memory available now: their
    activations (HOST_PEAK_FACTOR times those counted) and, in each copy, the state beside the weights
    already loaded (fp32 gradients, AdamW's two moments for the optimizer's timing: 12 bytes a parameter,
    and a copy's own weights, 4 more, in every copy but this one). All of them where it is unknown."""
    if available is None:
        return HostFit(list(micro_batches), [])

    def need(mb: int) -> float:
        return copies * (HOST_PEAK_FACTOR * activation_bytes_per_sample * mb + 16.0 * params) - 4.0 * params

    kept = [mb for mb in micro_batches if need(mb) <= 0.9 * available]
    left = [mb for mb in micro_batches if mb not in kept]
    return HostFit(kept, left, need(max(left)) if left else 0.0, available, copies)


def measure(runnable: RunnableModel, device, precisions: Sequence[str], micro_batches: Sequence[int], *,
            repeats: int = 10, budget_s: float = 5.0, blocks: bool = True,
            progress: Callable[[int, int, str], None] | None = None,
            workload: WorkloadProfile | None = None) -> DeviceProfile:
    """Time `runnable` on `device` in each precision at each micro-batch size (largest that fit).
    `progress(done, total, what)` is called as each point starts, and with done == total at the end.
    `workload` (the model's profile) is recorded as the model measured, so a plan refuses these timings
    for another model of its name; without it, the plan says it cannot check that."""
    import torch

    module = runnable.module.to(device)
    module.train()
    clock = _Clock(device)
    cuda = device.type == "cuda"
    steps: list[StepTiming] = []
    total = len(precisions) * len(micro_batches) + 1 + int(blocks)   # the points, the optimizer, the blocks

    def starting(done: int, what: str) -> None:
        if progress is not None:
            progress(done, total, what)

    for p, precision in enumerate(precisions):
        _set_math(precision, device)
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" and cuda else None
        for i, mb in enumerate(sorted(micro_batches)):
            starting(p * len(micro_batches) + i, f"{device}: {precision} at micro-batch {mb}")
            batch = to_device(runnable.batch(mb), device)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            try:
                seconds, cpu_s = clock.medians(_fwd_bwd(runnable, module, batch, precision, device, scaler),
                                               repeats, budget_s)
            except torch.cuda.OutOfMemoryError:
                module.zero_grad(set_to_none=True)
                break  # larger micro-batches will not fit either
            peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
            steps.append(StepTiming(precision=precision, micro_batch=mb, seconds=seconds, peak_memory_bytes=peak,
                                    cpu_seconds=None if cuda else cpu_s))
            module.zero_grad(set_to_none=True)
    if not steps:
        raise HetrainError(f"no micro-batch of {runnable.name} fits on {device}; try --micro-batches 1")
    starting(total - 1 - int(blocks), f"{device}: an AdamW step")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    first = steps[0]
    _fwd_bwd(runnable, module, to_device(runnable.batch(first.micro_batch), device), "fp32", device, None)()
    opt_s = clock.median(optimizer.step, repeats, budget_s)
    module.zero_grad(set_to_none=True)
    if blocks:
        starting(total - 1, f"{device}: each block's forward and backward")
    timed_blocks = _block_times(runnable, module, device, steps, clock, repeats, budget_s) if blocks else []
    starting(total, f"{device}: done")
    return stamp_workload(DeviceProfile(model=runnable.name, device=device_kind(device), stamp=stamp(device),
                                        steps=steps, optimizer_seconds=opt_s, blocks=timed_blocks), workload)


def stamp_workload(prof: DeviceProfile, workload: WorkloadProfile | None) -> DeviceProfile:
    """`prof` recording the model it measured: `workload`'s name, parameters and identity (as it was, without)."""
    if workload is None:
        return prof
    return prof.model_copy(update={"model": workload.name, "model_params": workload.params,
                                   "workload_id": workload.identity()})


def _detached(value):
    """An input of a block cut from the graph that made it (a tensor, or a tuple or list of them), taking
    a gradient where it is floating-point, as in training; anything else as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v) for v in value)
    return value


def _block_times(runnable, module, device, steps, clock, repeats, budget_s) -> list[BlockTiming]:
    """Each block's forward + backward on the inputs it receives in a real forward."""
    import torch

    from hetrain.workload.layers import profile_blocks

    precision = steps[0].precision
    mb = steps[len(steps) // 2].micro_batch if len(steps) > 1 else steps[0].micro_batch
    blocks = profile_blocks(module)
    captured: dict[str, tuple] = {}
    handles = [b.register_forward_pre_hook(lambda m, args, kwargs, name=name: captured.setdefault(name, (args, kwargs)),
                                           with_kwargs=True)
               for name, b in blocks]
    _set_math(precision, device)
    try:
        with torch.no_grad(), _autocast(precision, device):
            call_model(module, to_device(runnable.batch(mb), device))
    finally:
        for h in handles:
            h.remove()
    out = []
    for name, block in blocks:
        args, kwargs = captured.get(name, ((), {}))
        called = [*args, *kwargs.values()]
        # flags and sizes passed by position (transformers before 4.53 pass a layer's so) are replayed as they are
        if not any(isinstance(a, torch.Tensor) for a in called) or not all(
                isinstance(a, (torch.Tensor, bool, int, float, str)) or a is None for a in args):
            continue   # not called in the forward, or with inputs it cannot be called with again alone
        # positional and keyword inputs (hidden states, a layer's rotary embeddings, its mask) as the model
        # passed them, cut from the graph that made them; floating-point ones take a gradient, as in training
        inputs = tuple(_detached(a) for a in args)
        options = {k: _detached(v) for k, v in kwargs.items()}

        def run(block=block, inputs=inputs, options=options):
            with _autocast(precision, device):
                y = block(*inputs, **options)
            y = y[0] if isinstance(y, (tuple, list)) and y and isinstance(y[0], torch.Tensor) else y
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.float().mean().backward()

        out.append(BlockTiming(name=name, precision=precision, micro_batch=mb,
                               seconds=clock.median(run, max(3, repeats // 2), budget_s / 4, warmup=1)))
    module.zero_grad(set_to_none=True)
    return out


def set_cpu_threads(threads: int | None) -> int:
    """Use `threads` CPU threads (default: what a rank gets under hetrain launch with one rank per core pair)."""
    import torch

    n = threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def _copy_worker(runnable, precisions, micro_batches, threads, repeats, budget_s, blocks, barrier, queue) -> None:
    import torch

    from hetrain.malloc_cache import apply_here

    apply_here()   # the allocator's setting of a rank under hetrain launch, or the step is timed slower
    torch.set_num_threads(threads)
    barrier.wait()
    try:
        prof = measure(runnable, torch.device("cpu"), precisions, micro_batches, repeats=repeats,
                       budget_s=budget_s, blocks=blocks)
        queue.put(prof.model_dump_json())
    except Exception as e:  # noqa: BLE001 - reported by the parent as one line
        queue.put(f"error: {e}")


def measure_cpu_copies(runnable: RunnableModel, copies: int, threads: int, precisions: Sequence[str],
                       micro_batches: Sequence[int], *, repeats: int = 10, budget_s: float = 5.0,
                       blocks: bool = True, workload: WorkloadProfile | None = None) -> DeviceProfile:
    """Time `copies` copies of the model at once on the CPU, `threads` threads each, as the ranks of
    one machine share it under `hetrain launch --nproc-per-node copies`; each point (and each block,
    timed in every copy) is the median over the copies. Each copy runs in a process of its own
    (forked, even when there is one), with the allocator setting those ranks get
    (hetrain.malloc_cache), leaving this process's alone. `workload`: as for `measure`."""
    import multiprocessing

    copies = max(1, copies)
    ctx = multiprocessing.get_context("fork")  # the model and its input maker need not be picklable
    barrier, queue = ctx.Barrier(copies), ctx.Queue()
    procs = [ctx.Process(target=_copy_worker, args=(runnable, list(precisions), list(micro_batches), threads,
                                                    repeats, budget_s, blocks, barrier, queue)) for _ in range(copies)]
    for p in procs:
        p.start()
    results = _collect(procs, queue)
    errors = [r for r in results if r.startswith("error: ")]
    if errors:
        raise HetrainError(f"profiling {copies} copies at once failed: {errors[0].removeprefix('error: ')}")
    return stamp_workload(_median_profile([DeviceProfile.model_validate_json(r) for r in results]), workload)


def _collect(procs, queue) -> list[str]:
    """One result from each copy, however long they take; a one-line error where a copy dies first."""
    import queue as queues

    results: list[str] = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1.0))
            continue
        except queues.Empty:
            pass
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for c in codes) or (None not in codes and queue.empty()):
            for p in procs:
                p.kill()
                p.join()
            code = next((c for c in codes if c), 0)
            raise HetrainError(f"a profiling copy ended (exit code {code}) before reporting its timings, "
                               "perhaps out of memory; fix: fewer --concurrent copies or smaller --micro-batches")
    for p in procs:
        p.join()
    return results


def _median_profile(profs: list[DeviceProfile]) -> DeviceProfile:
    """The first copy's profile with each step, block and the optimizer step at the median over the copies."""
    steps = [
        s.model_copy(update={
            "seconds": statistics.median(q.seconds for q in same),
            "cpu_seconds": statistics.median(q.cpu_seconds for q in same) if all(q.cpu_seconds for q in same) else None,
        })
        for s in profs[0].steps
        for same in [[q for p in profs for q in p.steps if (q.precision, q.micro_batch) == (s.precision, s.micro_batch)]]
    ]
    blocks = [
        b.model_copy(update={"seconds": statistics.median(q.seconds for q in same)})
        for b in profs[0].blocks
        for same in [[q for p in profs for q in p.blocks if (q.name, q.precision, q.micro_batch) ==
                      (b.name, b.precision, b.micro_batch)]]
    ]
    stamp_ = profs[0].stamp.model_copy(update={"concurrent_copies": len(profs)})
    return profs[0].model_copy(update={"steps": steps, "blocks": blocks, "stamp": stamp_,
                                       "optimizer_seconds": statistics.median(p.optimizer_seconds for p in profs)})
