#!/usr/bin/env bash
# GPU check, self-contained, sized for a short window on one GPU: runs a spes binary built
# elsewhere against that machine's own PyTorch (no network needed) and checks every CUDA path
# once, writing each figure as it goes, so a section that times out still leaves the others.
#
#   scripts/gpu-check.sh OUT_DIR [path/to/spes]           every section (<= 5 min on one H200)
#   scripts/gpu-check.sh --quick OUT_DIR [path/to/spes]   the short subset (<= 2 min)
#   scripts/gpu-check.sh --cpu OUT_DIR [path/to/spes]     the CPU twin: every section with
#                                                          --device cpu on tiny shapes
#   PYTHON=... picks the interpreter that has torch (default python3).
#
# OUT_DIR/results.md gets one line per figure and OUT_DIR/results.jsonl one JSON object per
# section (name, seconds, status). A wrong result stops the script at once with a non-zero
# exit; a section over its time budget is recorded and the script goes on (and exits non-zero
# at the end). The budgets (seconds, at each `section` line below) add up to 360 for the whole
# check and 115 for --quick.
set -euo pipefail
mode=full
case "${1:-}" in
  --quick) mode=quick; shift ;;
  --cpu) mode=cpu; shift ;;
esac
[ $# -ge 1 ] || { echo "usage: $0 [--quick|--cpu] OUT_DIR [path/to/spes]" >&2; exit 2; }
out=$(mkdir -p "$1" && realpath "$1")
bin=$(realpath "${2:-target/release/spes}")
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
md="$out/results.md"
jl="$out/results.jsonl"
: >"$md"
: >"$jl"
work="$out/work"
rm -rf "$work"
mkdir -p "$work"

# The binary links libtorch from the machine's PyTorch: torch/lib, and the CUDA runtime
# libraries that install brought (site-packages/nvidia/*/lib).
torch_lib=$("$py" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
nvidia_libs=$("$py" - <<'PY'
import glob, os, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
print(":".join(sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))))
PY
)
export LD_LIBRARY_PATH="$torch_lib${nvidia_libs:+:$nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

say() { echo "$*" | tee -a "$md"; }
fail() { say "FAILED: $*"; exit 1; }

timed_out=0
# The CPU twin runs the same sections on a 2-core machine: four times the GPU's budgets.
budget_scale=1
[ "$mode" = cpu ] && budget_scale=4
# section NAME BUDGET_S FUNCTION: runs FUNCTION under a time budget, records how it went.
section() {
  local name=$1 budget=$(($2 * budget_scale)) fn=$3 start rc secs
  say ""
  say "## $name (budget ${budget} s)"
  start=$(date +%s.%N)
  set +e
  timeout --kill-after=5 "$budget" bash -c "set -euo pipefail; $(declare -f); $fn" 2>&1 | tee -a "$out/log.txt"
  rc=${PIPESTATUS[0]}
  set -e
  secs=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  python3 -c "import json, sys; print(json.dumps({'section': sys.argv[1], 'seconds': float(sys.argv[2]), 'status': int(sys.argv[3])}))" "$name" "$secs" "$rc" >>"$jl"
  case "$rc" in
    0) say "ok in $secs s" ;;
    124|137) say "TIMEOUT after $secs s (its figures so far are above)"; timed_out=1 ;;
    *) fail "section '$name' exited $rc after $secs s" ;;
  esac
}

if [ "$mode" = cpu ]; then
  dev=cpu; prec=fp32; big=tiny; big_tokens=(--batch-size 2 --seq-len 64); steps=(--steps 2 --warmup 1)
  own=(--own-experts 4); demo_steps=20; demo_sync=5; demo_batch=4; int4_steps=10; repeats=1
else
  dev=cuda; prec=bf16; big=1b; big_tokens=(--batch-size 4 --seq-len 2048); steps=(--steps 5 --warmup 2)
  own=(--own-experts 4); demo_steps=300; demo_sync=50; demo_batch=32; int4_steps=100; repeats=1
fi
export bin py here md out work dev prec big mode
export big_tokens_s="${big_tokens[*]}" steps_s="${steps[*]}" own_s="${own[*]}"
export demo_steps demo_sync demo_batch int4_steps repeats

env_info() {
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' | tee -a "$md"
  if [ "$dev" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$md"
  fi
  "$bin" --version | tee -a "$md"
}

# tokens/s, step time and memory of one `spes bench --json` run, as a results line.
bench_line() {
  local label=$1; shift
  local r
  r=$("$bin" bench "$@" --json | tail -n 1)
  python3 - "$label" "$r" <<'PY' | tee -a "$md"
import json, sys
label, r = sys.argv[1], json.loads(sys.argv[2])
mem = r.get("gpu_memory_mb") or r.get("peak_rss_mb")
print(f"- {label}: {r['tokens_per_s']:.0f} tokens/s, step {r['step_ms']:.0f} ms, memory {mem:.0f} MiB")
PY
}

device_and_precision() {
  # --device cuda must pick the GPU and fail loudly otherwise; both precisions run.
  bench_line "tiny $dev bf16" --preset tiny --device "$dev" --precision bf16 --steps 3 --warmup 1
  bench_line "tiny $dev fp32" --preset tiny --device "$dev" --precision fp32 --steps 3 --warmup 1
}

node_step() {
  # A SPES node's step on the big preset: all experts trained, then the node's share, then
  # with activation checkpointing.
  bench_line "$big all experts trained" --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $steps_s
  bench_line "$big SPES node (4 experts per layer)" --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $steps_s $own_s
  bench_line "$big SPES node, activation checkpointing" --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $steps_s $own_s --activation-checkpointing
}

vs_pytorch() {
  # spes against the same model in plain PyTorch: tokens/s and MFU from the FLOPs a SPES node
  # does (frozen experts compute no weight gradients).
  local variants=eager,fused,compile
  [ "$dev" = cpu ] && variants=eager
  "$bin" bench-vs-pytorch --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $own_s \
    $steps_s --repeats "$repeats" --variants "$variants" --python "$py" | tee -a "$md"
}

moe_kernels() {
  # The grouped kernel (_grouped_mm, CUDA's default) must match the loop within rounding.
  local d
  d=$("$bin" bench --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $own_s --steps 1 --warmup 0 --compare-moe-kernels --json | tail -n 1)
  python3 - "$d" <<'PY' | tee -a "$md"
import json, sys
d = json.loads(sys.argv[1])["moe_kernels"]
loss, grad = d["loss_rel"], d["grad_rel"]
print(f"- grouped vs loop: loss {loss:.2e}, gradients {grad:.2e} apart (relative)")
assert loss < 2e-2 and grad < 5e-2, "the grouped kernel must match the loop within bf16 rounding"
PY
  for kernel in loop grouped; do
    bench_line "moe kernel $kernel" --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $own_s $steps_s --moe-kernel $kernel
  done
}

step_paths() {
  # The step's two CUDA paths made once per optimizer step (bf16 compute copies of the trained
  # weights, fused q/k/v and gate/up) against the per-micro-batch casts they replace.
  local d
  d=$("$bin" bench --preset "$big" --device "$dev" --precision bf16 $big_tokens_s $own_s --steps 1 --warmup 0 --compare-step-paths --json | tail -n 1)
  python3 - "$d" <<'PY' | tee -a "$md"
import json, sys
d = json.loads(sys.argv[1])["step_paths"]
print(f"- compute copies + fused projections vs per-micro-batch casts: loss {d['loss_rel']:.2e}, gradients {d['grad_rel']:.2e} apart (relative)")
assert d["loss_rel"] < 1e-2 and d["grad_rel"] < 5e-2, "the once-per-step compute copies must match the casts"
PY
}

frozen_memory() {
  # Frozen experts resident in bf16 (CUDA's default) against fp32, and the planner against both.
  for frozen in bf16 fp32; do
    local m p
    m=$("$bin" bench --preset "$big" --device "$dev" --precision "$prec" $big_tokens_s $own_s --steps 2 --warmup 1 --frozen-experts $frozen --json | tail -n 1)
    p=$("$bin" plan-memory --preset "$big" --nodes 4 --micro-batch 4 --seq-len 2048 --gpu-mem 140 \
      --frozen-experts $frozen --slack 0 --json)
    python3 - "$m" "$p" $frozen <<'PY' | tee -a "$md"
import json, sys
m = json.loads(sys.argv[1])
measured = m.get("gpu_memory_mb") or m.get("peak_rss_mb")
p = json.loads(sys.argv[2])[0]["total"] / 2**20
print(f"- frozen experts {sys.argv[3]}: measured {measured:.0f} MiB, planned {p:.0f} MiB (no headroom), planned / measured {p / measured:.3f}")
PY
  done
}

demo_identity() {
  # Server + 4 nodes over deltas of one wire form ($1: a directory under $work; then --set
  # overrides): every node applies the published deltas to its fp32 copy on the device and
  # must end bit-identical to the server's final model.
  local name=$1
  shift
  "$bin" demo --out "$work/$name" --device "$dev" --set train.precision="$prec" \
    --set train.max_steps="$demo_steps" --set train.batch_size="$demo_batch" \
    --set sync.sync_steps="$demo_sync" "$@" 2>&1 | tail -n 1 | tee -a "$md"
  python3 - "$work/$name" "$demo_steps" "$name" <<'PY' | tee -a "$md"
import json, os, re, sys
out, steps = sys.argv[1], sys.argv[2]
def tensors(path):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
ck = f"{out}/server/checkpoints"
newest = max(f for f in os.listdir(ck) if re.fullmatch(r"round-\d{6}\.safetensors", f))
final = tensors(f"{ck}/{newest}")
for p in range(4):
    mine = tensors(f"{out}/node-{p}/checkpoints/step-{steps}/model.safetensors")
    bad = [k for k in final if mine.get(k) != final[k]]
    assert not bad, f"node {p} differs from the server's final model in {bad[:3]}"
val = [json.loads(l).get("val_loss") for l in open(f"{out}/server/metrics.jsonl")]
val = [v for v in val if v is not None]
print(f"- {sys.argv[3]}: every node ends bit-identical to the server's final model ({newest}); val_loss {val[0]:.3f} -> {val[-1]:.3f}")
assert val[-1] < val[0], "training must lower the validation loss"
PY
}

demo_int4() {
  # 4-bit deltas every 5 steps (nodes quantize and decode on the device), experts at half the
  # shared rate (two fused AdamW calls a step).
  "$bin" demo --out "$work/int4" --device "$dev" --set train.precision="$prec" \
    --set train.max_steps="$int4_steps" --set train.batch_size="$demo_batch" \
    --set sync.wire=int4_delta 2>&1 | tail -n 1 | tee -a "$md"
}

demo_bf16() {
  demo_identity demo --set sync.wire=bf16_delta
}

demo_lossy() {
  # The 100x wires: low-rank factors (configs/spes-tiny.toml's: range finder and the ordered
  # product on the device, the CPU twin in fold.rs), chunked top-k (index_add_ on the device)
  # and strided 2-bit codes.
  demo_identity lowrank --set sync.wire=lowrank_delta
  demo_identity sparse --set sync.wire=sparse_delta
  demo_identity int2-stride --set sync.wire=int2_delta --set sync.stride=4
}

nccl_rank() {
  # Data parallel over c10d: with one GPU, the single-rank NCCL path must give the losses of
  # no group (the CPU twin checks a 2-rank Gloo group the same way).
  local tiny=(--config "$here/../configs/tiny.toml" --device "$dev" --set data.path="$work/demo/data"
    --set train.log_every=1 --set train.eval_every=1000 --set train.max_steps=6)
  "$bin" train "${tiny[@]}" --out "$work/dp1" >/dev/null
  if [ "$dev" = cuda ]; then
    WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
      "$bin" train "${tiny[@]}" --out "$work/dp2" --dist-backend nccl 2>"$work/dp2.log" >/dev/null
    sed 's/\x1b\[[0-9;]*m//g' "$work/dp2.log" | grep -q "backend=Nccl" || { cat "$work/dp2.log"; echo "not on NCCL"; exit 1; }
  else
    WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
      "$bin" train "${tiny[@]}" --out "$work/dp2" --dist-backend gloo 2>"$work/dp2.log" >/dev/null
  fi
  python3 - "$work/dp1" "$work/dp2" <<'PY' | tee -a "$md"
import json, sys
losses = lambda d: [r["loss"] for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "loss" in r]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert len(a) == len(b) == 6, (len(a), len(b))
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"- one rank in a process group vs none: 6 losses within {worst:.1e} relative")
assert worst <= 1e-4
PY
}

section "environment" 15 env_info
section "device and precision" 30 device_and_precision
section "bf16-delta demo: bit-identity" 40 demo_bf16
section "compute copies and fused projections" 20 step_paths
if [ "$mode" != quick ]; then
  section "a SPES node's step" 40 node_step
  section "spes vs PyTorch" 75 vs_pytorch
  section "MoE kernels" 25 moe_kernels
  section "frozen experts in bf16 vs fp32 and the planner" 25 frozen_memory
  section "int4 demo" 20 demo_int4
  section "low-rank, sparse and strided 2-bit demos: bit-identity" 60 demo_lossy
fi
section "one NCCL rank" 10 nccl_rank
say ""
[ "$timed_out" -eq 0 ] || fail "a section ran over its budget"
say "== gpu-check ($mode) passed"
