#!/usr/bin/env bash
# hetrain's GPU check: one script, under 10 minutes on one GPU.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default OUT_DIR: gpu-check-out, in the current folder)
#
# 1. versions and date (driver, torch, CUDA, cuDNN);
# 2. `hetrain devices --json` (NVML discovery);
# 3. `hetrain profile` of ResNet-50 (bf16, fp16, tf32, fp32) and GPT-2 124M (bf16, tf32, fp32;
#    fp32 with TF32 off, as hetrain runs it);
# 4. a one-rank job under `hetrain launch --plan`: NCCL process group, CUDA autocast in fp16 with
#    loss scaling, the planned step time against the measured one;
# 5. torch's AdamW step (default, fused, per-tensor loop) on BERT-large's tensor shapes, against
#    the bytes a parameter and the step's temporaries the planner prices;
# 6. the measured rows in the format of hetrain/data/published_training.csv, stamped with the date
#    and software versions, ready to add to the calibration data.
# Without a CUDA device it prints one line and exits with status 2; nothing else runs.
set -uo pipefail
OUT="${1:-gpu-check-out}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac   # OUT_DIR is the caller's, before the script moves to the repo
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
HETRAIN=("$PY" -m hetrain.cli.main)
FAILED=()

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to torch on $(hostname); nothing to check (run it on a GPU machine)"
    exit 2
fi
mkdir -p "$OUT"

step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log, remember failures
    local name="$1" limit="$2"; shift 2
    echo "== $name"
    if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
        tail -n 25 "$OUT/$name.log"
    else
        echo "gpu_check: $name FAILED (status $?); see $OUT/$name.log"; tail -n 15 "$OUT/$name.log"
        FAILED+=("$name")
    fi
}

step versions 60 "$PY" - <<'PYEOF'
import datetime, platform, subprocess, torch
print("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print("host", platform.node(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"cc {p.major}.{p.minor}")
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                          "--format=csv"], capture_output=True, text=True, timeout=30).stdout)
except OSError as e:
    print("nvidia-smi not runnable:", e)
PYEOF

step devices 60 "${HETRAIN[@]}" devices --json

step profile-resnet50 180 "${HETRAIN[@]}" profile --model resnet50 --precision bf16,fp16,tf32,fp32 \
    --micro-batches 32,64,128 --repeats 10 --seconds 4 --out "$OUT/profiles-resnet50"
step profile-gpt2 180 "${HETRAIN[@]}" profile --model gpt2-124m --precision bf16,tf32,fp32 \
    --micro-batches 4,8,16 --repeats 10 --seconds 4 --out "$OUT/profiles-gpt2"

KIND="$("$PY" -c "import torch; from hetrain.workload.measure import device_kind; print(device_kind(torch.device('cuda', 0)))")"
cat >"$OUT/train_check.py" <<'PYEOF'
"""One rank on one GPU: Session (NCCL), fp16 autocast with loss scaling, ResNet-50 on random data."""
import json, statistics, sys, time
import torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain
from hetrain.workload.modules import zoo_module

session = hetrain.Session()
assert torch.distributed.get_backend() == "nccl", torch.distributed.get_backend()
net = zoo_module("resnet50")
model, optimizer = session.prepare(net.module, torch.optim.AdamW(net.module.parameters(), lr=1e-4))
gbs, steps = int(sys.argv[1]), 12
data = TensorDataset(net.make_input(gbs * steps), torch.randint(0, 1000, (gbs * steps,)))
ends, losses, applied = [time.perf_counter()], [], 0
for x, y in session.loader(data, global_batch_size=gbs, shuffle=False):
    with session.autocast():
        out = model(x)
        loss = F.cross_entropy(out, y)
    assert out.dtype == torch.float16, out.dtype
    session.backward(loss)
    if session.step():
        applied += 1
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
        losses.append(float(loss))
times = [b - a for a, b in zip(ends, ends[1:])][3:]
ok = all(map(lambda v: v == v, losses)) and applied >= steps - 3
print(json.dumps({"device": str(session.device), "applied_steps": applied, "last_loss": losses[-1],
                  "measured_step_seconds": statistics.median(times), "ok": ok}))
session.close()
sys.exit(0 if ok else 1)
PYEOF
step plan-fp16 60 "${HETRAIN[@]}" plan --devices "$KIND:1" --profiles "$OUT/profiles-resnet50" --model resnet50 \
    --precision fp16 --global-batch-size 128 --json --out "$OUT/plan-fp16.json"
step train-nccl-fp16 180 "${HETRAIN[@]}" launch --nproc-per-node 1 --plan "$OUT/plan-fp16.json" \
    "$OUT/train_check.py" 128

step optimizer-step 120 "$PY" - "$KIND" <<'PYEOF'
"""torch's AdamW step as the planner prices it (cost_model.OPTIMIZER_STEP_BYTES and
OPTIMIZER_STEP_TEMP_BYTES): BERT-large's 391 tensor shapes, default (multi-tensor), fused and
per-tensor loop; bytes a parameter at the catalog bandwidth, and the peak the step adds."""
import statistics, sys, time
import torch
from hetrain.hardware.catalog import get_gpu
from hetrain.planning.cost_model import OPTIMIZER_STEP_BYTES, OPTIMIZER_STEP_TEMP_BYTES

bw = get_gpu(sys.argv[1]).mem_bw_bytes_per_s
shapes = [(30528, 1024), (512, 1024), (2, 1024), (1024,), (1024,)]
for _ in range(24):
    shapes += [(1024, 1024), (1024,)] * 4 + [(4096, 1024), (4096,), (1024, 4096), (1024,)] + [(1024,)] * 4
shapes += [(2, 1024), (2,)]
params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
n = sum(p.numel() for p in params)
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
for name, kwargs in (("adamw", {}), ("adamw-fused", {"fused": True}), ("adamw-loop", {"foreach": False})):
    opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
    opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        extra = torch.cuda.max_memory_allocated() - before
    sec = statistics.median(times)
    priced = OPTIMIZER_STEP_BYTES.get(name)
    print(f"{name}: {len(params)} tensors, {n / 1e6:.0f}M parameters, step {sec * 1e3:.2f} ms = "
          f"{sec * bw / n:.0f} B/param at {bw / 1e9:.0f} GB/s (priced {priced if priced else '-'}), "
          f"step adds {extra / n:.1f} B/param at its peak (priced {OPTIMIZER_STEP_TEMP_BYTES.get(name, 0) if priced else '-'})")
    del opt
PYEOF

echo "== predicted against measured, and calibration rows"
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
from hetrain.workload.device_profile import load_profiles
out = pathlib.Path(sys.argv[1])
try:
    def last_json(name, start):
        lines = [ln for ln in (out / name).read_text().splitlines() if ln.startswith(start)]
        return json.loads(lines[-1])

    plan = last_json("plan-fp16.log", '{"strategy"')
    run = last_json("train-nccl-fp16.log", '{"device"')
    predicted = 128 / plan["predicted_samples_per_s"]
    print(f"resnet50 fp16 x128 on one GPU: predicted {predicted:.4f} s/step, measured "
          f"{run['measured_step_seconds']:.4f}, predicted_over_measured {predicted / run['measured_step_seconds']:.3f}")
except (OSError, ValueError, KeyError, IndexError) as e:
    print("no predicted/measured comparison:", e)
print("# rows for hetrain/data/published_training.csv (source: this check)")
print("workload,seq_len,system,gpu,gpus,precision,fp32_math,batch_per_gpu,samples_per_s,source")
for sub, workload, seq in (("profiles-resnet50", "resnet50", ""), ("profiles-gpt2", "gpt2-124m", "")):
    d = out / sub
    if not d.is_dir():
        continue
    for prof in load_profiles(d).values():
        s = prof.stamp
        source = f"hetrain-gpu-check {s.date} torch {s.torch} CUDA {s.cuda} driver {s.driver}".replace(",", ";")
        for precision in prof.precisions():
            mb, sec = prof.points(precision)[-1]
            rate = mb / (sec + prof.optimizer_seconds)
            print(f"{workload},{seq},{s.hostname},{prof.device},1,{precision},{'fp32' if precision == 'fp32' else ''},"
                  f"{mb},{rate:.1f},{source}")
PYEOF

if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "gpu_check: FAILED: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all steps passed; logs and profiles in $OUT"
