#!/usr/bin/env bash
# GPU check: runs a spes binary built elsewhere against the GPU machine's own PyTorch (no
# network) and checks every CUDA path once, the most valuable figures first, each section under
# its own time budget, writing each figure as it goes. A section that fails or runs over its
# budget keeps what it wrote (bench vs-pytorch's finished runs included) and the next one runs.
#
#   scripts/gpu-check.sh [--cpu] [--quick] [--only ID,..] [--skip ID,..] OUT_DIR [path/to/spes]
#
#   --cpu         the CPU twin: every section with --device cpu on tiny shapes, budgets from
#                 cpu_budget below
#   --quick       only env, step_paths, device_precision, demo_bf16 and nccl
#   --only/--skip these sections only / all but these (always in the order below)
#   SPES_BIN      the binary when no path is given (default: target/release/spes of this checkout)
#   PYTHON        the interpreter with torch (default: this checkout's .venv/bin/python if there,
#                 else python3)
#   GPU_CHECK_WORK          scratch directory, emptied first (default OUT_DIR/work)
#   GPU_CHECK_BUDGET_<ID>   seconds, replaces section ID's budget (e.g. GPU_CHECK_BUDGET_nccl=60)
#
# Sections, in order of value: env node_step frozen_memory vs_pytorch kernels step_paths
# device_precision demo_bf16 demo_int4 demo_lossy nccl compile; GPU budgets 525 s in all.
#
# Before the first section the binary must answer `capabilities --json` within 60 s; on a GPU it
# is refused (exit 3, one line naming what it lacks) without CUDA, or without its NCCL part when
# the nccl section is selected. Figures: OUT_DIR/results.md (each figure, each vs PyTorch run's
# row as it finished, a TIMEOUT or FAILED line with the output's tail, and last the --only
# command that reruns those sections), OUT_DIR/results.jsonl (one object a section: id, seconds,
# budget, status), OUT_DIR/log.txt (all output). Both results files are appended to, one header
# line a run. Exit status 0: every section passed; 1: one failed or timed out; 2: bad arguments.
#
# The 15-minute GPU window (one H100 or H200 through the device tool), step by step:
#  1. Here: `cargo build --release -p spes-cli` (.venv's libtorch has CUDA, so spes-ext builds
#     its NCCL part; never set SPES_NO_NCCL).
#  2. `target/release/spes capabilities --json` must say "cuda_built": true, "nccl": true and
#     "libtorch": "2.11.0", the GPU machine's torch (cuda_available is false here: no GPU).
#     Optionally `bash scripts/gpu-check.sh --cpu /tmp/gpucpu target/release/spes` first.
#  3. What travels: the working tree (~5 MB) and carry ["target/release/spes"] (~32 MB; 64 MiB
#     at most together). .venv does not: the binary links the machine's python3 torch, whose
#     torch/lib and nvidia/*/lib this script puts on LD_LIBRARY_PATH.
#  4. One run, timeout_s 600 (the sections take 525 s at most, compile last, so a cut at 600 s
#     costs nothing else):
#       GPU_CHECK_WORK=/tmp/gpu-check bash scripts/gpu-check.sh "$OUT" target/release/spes
#  5. The figures: results.md, results.jsonl and log.txt come back under the reply's files_at;
#     copy them out before the next run (only the latest run's files come back).
#  6. Sections that failed or timed out: results.md's last line is the command that reruns
#     them (--only ID,..), to run at once on the still-warm machine (given back after 30 s
#     idle), GPU_CHECK_BUDGET_<ID>=S raising a budget that was too small.
#
# Estimates beside each section header, on the GPU: S = a spes process's start up to its first
# CUDA kernel (~4 s), P = a Python process's `import torch` and CUDA start (~6 s), B = building
# 1b on the GPU (~3 s), t = one 1b bf16 step at 4×2048 tokens (14.5 TFLOP, ~0.3 s), T =
# tokenizing the embedded corpus (~10 s), D = a demo's server and 4 nodes starting on one GPU
# (~8 s), d = a tiny demo step of 4 nodes sharing the GPU (~0.05 s), C = torch.compile of 1b's
# loss, forward and backward (~60 s).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
usage="usage: $0 [--cpu] [--quick] [--only ID,..] [--skip ID,..] OUT_DIR [path/to/spes]"

# Sections: id, title, GPU budget (s), estimate. This order is the order they run in.
ids=()
declare -A title gpu_budget estimate budget
def() { ids+=("$1"); title[$1]=$2; gpu_budget[$1]=$3; estimate[$1]=$4; }
def env "environment" 15 "import torch + nvidia-smi + spes --version ≈ 6 s"
def node_step "1b SPES node step: all experts, the node's 4, checkpointing" 45 "3(S+B) + 3·7t ≈ 27 s"
def frozen_memory "frozen experts in bf16 vs fp32 and the planner" 30 "2(S+B) + 2·3t + 2 plan memory ≈ 17 s"
def vs_pytorch "spes vs PyTorch eager and fused" 60 "(S+B) + 2(P+B) + 3·7t ≈ 31 s"
def kernels "MoE kernels: grouped vs loop" 35 "3(S+B) + 2 batches + 2·7t ≈ 27 s"
def step_paths "compute copies, fused projections and head accumulation vs their twins; op counts" 25 "(S+B) + 4 batches ≈ 12 s"
def device_precision "device and precision" 20 "2S + 8 tiny steps ≈ 10 s"
def demo_bf16 "bf16-delta demo: bit-identity" 45 "T + D + 300d + 6 rounds ≈ 35 s"
def demo_int4 "int4 demo" 20 "D + 100d + 20 rounds ≈ 17 s"
def demo_lossy "low-rank, sparse and strided 2-bit demos: bit-identity" 75 "3(D + 300d + 6 rounds) ≈ 75 s"
def nccl "one NCCL rank" 40 "T if no corpus yet + 2S + 12 tiny steps + NCCL init ≈ 25 s"
def compile "spes vs PyTorch torch.compile" 120 "(S+B) + (P+B) + C + 2·7t ≈ 80 s"
quick_ids=" env step_paths device_precision demo_bf16 nccl "

# ==== --cpu budgets (s): 2 × each section's time measured on the 2-core CPU machine (at least
# 10 s): `bash scripts/gpu-check.sh --cpu /tmp/gpucpu target/suite/spes`, 2026-12-06, commit 807a157,
# 244 s in all; results.jsonl's seconds in the comments. ====
declare -A cpu_budget=(
  [env]=10              # 1.9 s
  [node_step]=10        # 2.7 s
  [frozen_memory]=10    # 2.3 s
  [vs_pytorch]=13       # 6.5 s
  [kernels]=10          # 2.6 s
  [step_paths]=10       # 1.2 s
  [device_precision]=17 # 8.4 s
  [demo_bf16]=69        # 34.1 s
  [demo_int4]=36        # 18.0 s
  [demo_lossy]=190      # 94.9 s
  [nccl]=25             # 12.5 s
  [compile]=115         # 57.1 s
)

cpu=0 quick=0 only="" skip=""
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) cpu=1 ;;
    --quick) quick=1 ;;
    --only|--skip)
      [ $# -ge 2 ] || { echo "$1 needs section ids: ${ids[*]}" >&2; exit 2; }
      if [ "$1" = --only ]; then only=$2; else skip=$2; fi
      shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "unknown option $1; $usage" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
# An option after OUT_DIR would otherwise be taken for the binary, or dropped, and the whole
# check run: on a lent GPU that spends the budget on sections nobody asked for.
[ $# -le 2 ] && [[ ${2:-} != -* ]] || { echo "options go before OUT_DIR: $usage" >&2; exit 2; }
for list in "$only" "$skip"; do
  IFS=, read -ra given <<<"$list"
  for id in "${given[@]}"; do
    [ -n "$id" ] || continue
    [ -n "${title[$id]+x}" ] || { echo "unknown section '$id'; the sections are: ${ids[*]}" >&2; exit 2; }
  done
done
selected=() total=0
for id in "${ids[@]}"; do
  if [ -n "$only" ]; then
    [[ ",$only," == *",$id,"* ]] || continue
  elif [ "$quick" = 1 ]; then
    [[ $quick_ids == *" $id "* ]] || continue
  fi
  if [[ ",$skip," == *",$id,"* ]]; then continue; fi
  var=GPU_CHECK_BUDGET_$id
  if [ "$cpu" = 1 ]; then b=${cpu_budget[$id]}; else b=${gpu_budget[$id]}; fi
  b=${!var:-$b}
  [[ $b =~ ^[1-9][0-9]*$ ]] || { echo "$var must be a whole number of seconds, not '$b'" >&2; exit 2; }
  budget[$id]=$b
  total=$((total + b))
  selected+=("$id")
done
[ ${#selected[@]} -gt 0 ] || { echo "no section selected; the sections are: ${ids[*]}" >&2; exit 2; }

out=$(mkdir -p "$1" && realpath "$1")
bin=$(realpath "${2:-${SPES_BIN:-$root/target/release/spes}}")
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3; fi
md="$out/results.md"
jl="$out/results.jsonl"
log="$out/log.txt"
work=${GPU_CHECK_WORK:-$out/work}
rm -rf "$work"
mkdir -p "$work"
work=$(realpath "$work")

# The binary links libtorch from the machine's PyTorch: torch/lib, and the CUDA runtime
# libraries that install brought (site-packages/nvidia/*/lib); found without importing torch.
libs=$("$py" - <<'PY'
import glob, importlib.util, os
spec = importlib.util.find_spec("torch")
if spec and spec.submodule_search_locations:
    torch = spec.submodule_search_locations[0]
    nvidia = sorted(glob.glob(os.path.join(os.path.dirname(torch), "nvidia", "*", "lib")))
    print(":".join([os.path.join(torch, "lib")] + nvidia))
PY
) || libs=""
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+${libs:+:}$LD_LIBRARY_PATH}"

say() { echo "$*" | tee -a "$md"; }
mode=gpu
[ "$cpu" = 0 ] || mode=cpu
[ "$quick" = 0 ] || mode="$mode, quick"
say ""
say "# gpu-check ($mode) $(date -u +%Y-%m-%dT%H:%M:%SZ): ${selected[*]} (budgets $total s in all); $bin"

# Preflight: the binary must answer at once, and on a GPU have what the sections need.
need_nccl=0
if [ "$cpu" = 0 ] && [[ " ${selected[*]} " == *" nccl "* ]]; then need_nccl=1; fi
# 60 s: the first process on a fresh GPU machine loads libtorch_cuda from a cold disk.
if ! caps=$(timeout --kill-after=1 60 "$bin" capabilities --json 2>"$work/capabilities.err"); then
  say "REFUSED: $bin did not answer 'capabilities --json' within 60 s: $(tail -n 3 "$work/capabilities.err" | tr '\n' ' ')"
  exit 3
fi
if ! line=$("$py" - "$caps" "$cpu" "$need_nccl" <<'PY'
import json, sys
caps, cpu, need_nccl = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
try:
    c = json.loads(caps.strip().splitlines()[-1])
    assert isinstance(c, dict)
except (ValueError, IndexError, AssertionError):
    print(f"REFUSED: 'capabilities --json' printed no JSON object: {caps[:200]!r}")
    sys.exit(1)
yes = lambda k: "yes" if c.get(k) else "no"
gpu = f"{c.get('gpu')} (SM {c.get('sm')})" if c.get("cuda_available") else "none"
print(f"capabilities: spes {c.get('version')}, libtorch {c.get('libtorch')}, CUDA build {yes('cuda_built')}, "
      f"NCCL part {yes('nccl')}, CUDA device {gpu}, grouped MoE kernel by default {yes('grouped_kernel')}")
missing = []
if not cpu and not c.get("cuda_built"):
    missing.append("CUDA in the build (cuda_built is false: its libtorch has no CUDA)")
if not cpu and not c.get("cuda_available"):
    missing.append("a usable CUDA device (cuda_available is false)")
if not cpu and c.get("cuda_available") and not c.get("sm"):
    missing.append("a description of its GPU (sm is null: the CUDA part did not load, so the grouped kernel could not be chosen)")
if need_nccl and not c.get("nccl"):
    missing.append("NCCL (nccl is false: spes-ext was built without its NCCL part; the nccl section needs it, or pass --skip nccl)")
if missing:
    print("REFUSED before any section: this binary lacks " + "; ".join(missing))
    sys.exit(1)
PY
); then
  say "$line"
  exit 3
fi
say "$line"

if [ "$cpu" = 1 ]; then
  dev=cpu; prec=fp32; big=tiny; big_tokens="--batch-size 2 --seq-len 64"; steps="--steps 2 --warmup 1"
  # The vs PyTorch sections at the size of cli.rs's bench_vs_pytorch test, which
  # tests/gpu_check.rs times to set a budget that cuts the section after its first row.
  vs_shape="--batch-size 1 --seq-len 16 --steps 1 --warmup 0"
  demo_steps=20; demo_sync=5; demo_batch=4; int4_steps=10
else
  dev=cuda; prec=bf16; big=1b; big_tokens="--batch-size 4 --seq-len 2048"; steps="--steps 5 --warmup 2"
  vs_shape="$big_tokens $steps"
  demo_steps=300; demo_sync=50; demo_batch=32; int4_steps=100
fi
own="--own-experts 4"
repeats=1
export bin py root md work dev prec big big_tokens steps vs_shape own repeats
export demo_steps demo_sync demo_batch int4_steps

failed=()
# section ID: runs s_ID under its budget, keeps its vs PyTorch rows, records how it went.
section() {
  local id=$1 b=${budget[$1]} est=${estimate[$1]} start rc secs
  if [ "$cpu" = 1 ]; then est="2 × measured CPU time (cpu_budget)"; fi
  say ""
  say "## ${title[$id]} [$id] (budget $b s, estimate: $est)"
  start=$(date +%s.%N)
  set +e
  timeout --kill-after=5 "$b" bash -c "set -euo pipefail; $(declare -f); s_$id" 2>&1 | tee -a "$log" "$work/out-$id.txt"
  rc=${PIPESTATUS[0]}
  set -e
  secs=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  if [ -s "$work/rows-$id.md" ]; then
    say "each run as it finished:"
    tee -a "$md" <"$work/rows-$id.md"
  fi
  python3 -c "import json, sys; print(json.dumps({'id': sys.argv[1], 'section': sys.argv[2], 'seconds': float(sys.argv[3]), 'budget': int(sys.argv[4]), 'status': int(sys.argv[5])}))" \
    "$id" "${title[$id]}" "$secs" "$b" "$rc" >>"$jl"
  case "$rc" in
    0) say "ok in $secs s" ;;
    124|137) say "TIMEOUT after $secs s (its figures so far are above)"; failed+=("$id") ;;
    *) say "FAILED: exited $rc after $secs s; the end of its output:"
       tail -n 15 "$work/out-$id.txt" | sed 's/^/    /' | tee -a "$md"
       failed+=("$id") ;;
  esac
}

s_env() {
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' | tee -a "$md"
  if [ "$dev" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$md"
  fi
  "$bin" --version | tee -a "$md"
}

# tokens/s, step time and peak memory of one `spes bench step --json` run, as a results line.
bench_line() {
  local label=$1; shift
  local r
  r=$("$bin" bench step "$@" --json | tail -n 1)
  python3 - "$label" "$r" <<'PY' | tee -a "$md"
import json, sys
label, r = sys.argv[1], json.loads(sys.argv[2])
if r.get("device_peak_allocated_mb") is not None:
    mem = f"device peak {r['device_peak_allocated_mb']:.0f} MiB allocated / {r['device_peak_reserved_mb']:.0f} MiB reserved"
else:
    mem = f"peak RSS {r['peak_rss_mb']:.0f} MiB"
print(f"- {label}: {r['tokens_per_s']:.0f} tokens/s, step {r['step_ms']:.0f} ms, {mem} ({r.get('device_memory_source', 'rss')})")
PY
}

s_node_step() {
  # A SPES node's step on the big preset: all experts trained, then the node's share, then
  # with activation checkpointing.
  bench_line "$big all experts trained" --preset "$big" --device "$dev" --precision "$prec" $big_tokens $steps
  bench_line "$big SPES node (4 experts per layer)" --preset "$big" --device "$dev" --precision "$prec" $big_tokens $steps $own
  bench_line "$big SPES node, activation checkpointing" --preset "$big" --device "$dev" --precision "$prec" $big_tokens $steps $own --activation-checkpointing
}

s_frozen_memory() {
  # Frozen experts resident in bf16 (CUDA's default) against fp32, and the planner against
  # both (the planner counts tensors: compared with the allocator's peak allocated bytes).
  for frozen in bf16 fp32; do
    local m p
    m=$("$bin" bench step --preset "$big" --device "$dev" --precision "$prec" $big_tokens $own --steps 2 --warmup 1 --frozen-experts $frozen --json | tail -n 1)
    p=$("$bin" plan memory --preset "$big" --nodes 4 --micro-batch 4 --seq-len 2048 --gpu-mem 140 \
      --frozen-experts $frozen --slack 0 --json)
    python3 - "$m" "$p" $frozen <<'PY' | tee -a "$md"
import json, sys
m = json.loads(sys.argv[1])
measured = m.get("device_peak_allocated_mb") or m["peak_rss_mb"]
source = "allocated, caching allocator" if m.get("device_peak_allocated_mb") else "peak RSS"
p = json.loads(sys.argv[2])[0]["total"] / 2**20
print(f"- frozen experts {sys.argv[3]}: measured {measured:.0f} MiB ({source}), planned {p:.0f} MiB (no headroom), planned / measured {p / measured:.3f}")
PY
  done
}

# bench vs-pytorch for section $1 with variants $2; each run's row lands in rows-$1.md as it
# finishes, which `section` copies into results.md even when the section runs out of time.
vs_pytorch_run() {
  "$bin" bench vs-pytorch --preset "$big" --device "$dev" --precision "$prec" $vs_shape $own \
    --repeats "$repeats" --variants "$2" --python "$py" --rows "$work/rows-$1.md" | tee -a "$md"
}

s_vs_pytorch() {
  # spes against the same model in plain PyTorch: tokens/s, memory and MFU.
  vs_pytorch_run vs_pytorch eager,fused
}

s_compile() {
  # The same against the loss under torch.compile: last, its compile time being the least sure.
  vs_pytorch_run compile compile
}

s_kernels() {
  # The grouped kernel (_grouped_mm) must match the loop within rounding.
  local d
  d=$("$bin" bench step --preset "$big" --device "$dev" --precision "$prec" $big_tokens $own --steps 1 --warmup 0 --compare-moe-kernels --json | tail -n 1)
  python3 - "$d" <<'PY' | tee -a "$md"
import json, sys
d = json.loads(sys.argv[1])["moe_kernels"]
loss, grad = d["loss_rel"], d["grad_rel"]
print(f"- grouped vs loop: loss {loss:.2e}, gradients {grad:.2e} apart (relative)")
assert loss < 2e-2 and grad < 5e-2, "the grouped kernel must match the loop within bf16 rounding"
PY
  for kernel in loop grouped; do
    bench_line "moe kernel $kernel" --preset "$big" --device "$dev" --precision "$prec" $big_tokens $own $steps --moe-kernel $kernel
  done
}

s_step_paths() {
  # The step's CUDA paths against their CPU twins: the compute copies made once per optimizer
  # step (bf16 copies of the trained weights, fused q/k/v and gate/up) against per-micro-batch
  # casts; the LM head's gradient accumulated in fp32 inside its product (addmm with an fp32
  # output, CUDA only) against each chunk's bf16 product added. Then the top-level ATen calls
  # of one step by phase (what launches cost on the host).
  local d
  d=$("$bin" bench step --preset "$big" --device "$dev" --precision bf16 $big_tokens $own --steps 1 --warmup 0 --compare-step-paths --compare-head --count-ops --json | tail -n 1)
  python3 - "$d" <<'PY' | tee -a "$md"
import json, sys
r = json.loads(sys.argv[1])
d = r["step_paths"]
print(f"- compute copies + fused projections vs per-micro-batch casts: loss {d['loss_rel']:.2e}, gradients {d['grad_rel']:.2e} apart (relative)")
h = r["head_paths"]
print(f"- LM head gradient accumulated in fp32 vs bf16 product then add: loss {h['loss_rel']:.2e}, gradients {h['grad_rel']:.2e} apart (relative)")
c = r["op_counts"]
print(f"- top-level ATen calls in one step: forward {c['forward']:.0f}, backward {c['backward']:.0f}, optimizer {c['optimizer']:.0f}, bookkeeping {c['bookkeeping']:.0f}, other {c['other']:.0f}")
assert d["loss_rel"] < 1e-2 and d["grad_rel"] < 5e-2, "the once-per-step compute copies must match the casts"
assert h["loss_rel"] < 1e-6 and h["grad_rel"] < 5e-2, "the fused head accumulation must match its twin within bf16 rounding"
PY
}

s_device_precision() {
  # --device cuda must pick the GPU and fail loudly otherwise; both precisions run.
  bench_line "tiny $dev bf16" --preset tiny --device "$dev" --precision bf16 --steps 3 --warmup 1
  bench_line "tiny $dev fp32" --preset tiny --device "$dev" --precision fp32 --steps 3 --warmup 1
}

# Every demo trains on one tokenized corpus, $work/data: the first demo tokenizes it there.
demo() {
  "$bin" demo --data "$work/data" --device "$dev" --set train.precision="$prec" \
    --set train.batch_size="$demo_batch" "$@" 2>&1 | tail -n 1 | tee -a "$md"
}

demo_identity() {
  # Server + 4 nodes over deltas of one wire form ($1: a directory under $work; then --set
  # overrides): every node applies the published deltas to its fp32 copy on the device and
  # must end bit-identical to the server's final model.
  local name=$1
  shift
  demo --out "$work/$name" --set train.max_steps="$demo_steps" --set sync.sync_steps="$demo_sync" "$@"
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

s_demo_bf16() {
  demo_identity demo --set sync.wire=bf16_delta
}

s_demo_int4() {
  # 4-bit deltas every 5 steps (nodes quantize and decode on the device), experts at half the
  # shared rate (two fused AdamW calls a step).
  demo --out "$work/int4" --set train.max_steps="$int4_steps" --set sync.wire=int4_delta
}

s_demo_lossy() {
  # The 100x wires: low-rank factors (configs/spes-tiny.toml's: range finder and the ordered
  # product on the device, the CPU twin in fold.rs), chunked top-k (index_add_ on the device)
  # and strided 2-bit codes.
  demo_identity lowrank --set sync.wire=lowrank_delta
  demo_identity sparse --set sync.wire=sparse_delta
  demo_identity int2-stride --set sync.wire=int2_delta --set sync.stride=4
}

s_nccl() {
  # Data parallel over c10d: with one GPU, the single-rank NCCL path must give the losses of
  # no group (the CPU twin checks a 1-rank Gloo group the same way). The demos' corpus, made
  # here when no demo ran before.
  [ -f "$work/data/manifest.json" ] || "$bin" tokenize --out "$work/data" --train-tokenizer 8192 \
    --input "$root/crates/spes-cli/assets/default-corpus.jsonl.gz"
  local tiny=(--config "$root/configs/tiny.toml" --device "$dev" --set data.path="$work/data"
    --set train.log_every=1 --set train.eval_every=1000 --set train.max_steps=6)
  "$bin" train "${tiny[@]}" --out "$work/dp1" >/dev/null
  local backend=gloo
  [ "$dev" = cpu ] || backend=nccl
  WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    "$bin" train "${tiny[@]}" --out "$work/dp2" --dist-backend "$backend" 2>"$work/dp2.log" >/dev/null
  if [ "$backend" = nccl ]; then
    local log
    log=$(sed 's/\x1b\[[0-9;]*m//g' "$work/dp2.log")
    [[ $log == *"backend=Nccl"* ]] || { cat "$work/dp2.log"; echo "not on NCCL"; exit 1; }
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

for id in "${selected[@]}"; do
  section "$id"
done
say ""
if [ ${#failed[@]} -gt 0 ]; then
  rerun="${GPU_CHECK_WORK:+GPU_CHECK_WORK=$GPU_CHECK_WORK }bash scripts/gpu-check.sh$([ "$cpu" = 0 ] || echo " --cpu") --only $(IFS=,; echo "${failed[*]}") $out $bin"
  say "== gpu-check ($mode): ${failed[*]} failed or timed out; rerun them: $rerun"
  exit 1
fi
say "== gpu-check ($mode) passed"
