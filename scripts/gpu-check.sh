#!/usr/bin/env bash
# GPU check, self-contained: on a machine with an NVIDIA GPU and PyTorch 2.11 installed (no
# network needed), runs a spes binary built elsewhere against that PyTorch's libtorch, confirms
# CUDA is used, benchmarks bf16 training steps (alone and side by side with PyTorch), checks
# the grouped MoE kernel against the loop, compares frozen experts in bf16 and fp32 with the
# memory planner, trains the tiny preset in bf16 (nodes must end bit-identical to the server)
# and over 4-bit deltas, and runs 2 ranks.
#   scripts/gpu-check.sh [path/to/spes]      (PYTHON=... picks the interpreter that has torch)
set -euo pipefail
bin=$(realpath "${1:-target/release/spes}")
py=${PYTHON:-python3}
torch_lib=$("$py" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
echo "== torch $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') at $torch_lib"
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== --device cuda must pick the GPU (fails loudly otherwise)"
"$bin" bench --preset tiny --device cuda --precision bf16 --steps 10 --warmup 3
"$bin" bench --preset tiny --device cuda --precision fp32 --steps 10 --warmup 3
echo "== 1b preset, bf16, 4x2048 tokens per step (all experts trained, then a SPES node's 1/4)"
"$bin" bench --preset 1b --device cuda --precision bf16 --batch-size 4 --seq-len 2048 --steps 5 --warmup 2
"$bin" bench --preset 1b --device cuda --precision bf16 --batch-size 4 --seq-len 2048 --steps 5 --warmup 2 --own-experts 4

echo "== activation checkpointing on CUDA (1b, SPES node's share; compare memory with the run above)"
"$bin" bench --preset 1b --device cuda --precision bf16 --batch-size 4 --seq-len 2048 --steps 5 --warmup 2 --own-experts 4 --activation-checkpointing

echo "== spes vs the same model in plain PyTorch (eager, fused AdamW, torch.compile), 1b bf16, a SPES node's share"
"$bin" bench-vs-pytorch --preset 1b --device cuda --precision bf16 --batch-size 4 --seq-len 2048 \
  --own-experts 4 --steps 5 --warmup 3 --repeats 2 --python "$py"

echo "== MoE kernels on CUDA: grouped (_grouped_mm, the default) against the loop, then each one's speed"
one_b=(--preset 1b --device cuda --precision bf16 --batch-size 4 --seq-len 2048 --own-experts 4)
diff=$("$bin" bench "${one_b[@]}" --steps 1 --warmup 0 --compare-moe-kernels --json | tail -n 1)
python3 - "$diff" <<'PY'
import json, sys
d = json.loads(sys.argv[1])["moe_kernels"]
loss, grad = d["loss_rel"], d["grad_rel"]
print(f"grouped vs loop: loss {loss:.2e}, gradients {grad:.2e} apart (relative)")
assert loss < 2e-2 and grad < 5e-2, "the grouped kernel must match the loop within bf16 rounding"
PY
for kernel in loop grouped loop grouped; do
  r=$("$bin" bench "${one_b[@]}" --steps 5 --warmup 2 --moe-kernel $kernel --json | tail -n 1)
  python3 - "$r" $kernel <<'PY'
import json, sys
r = json.loads(sys.argv[1])
tps, ms, mem = r["tokens_per_s"], r["step_ms"], r["gpu_memory_mb"]
print(f"moe kernel {sys.argv[2]}: {tps:.0f} tokens/s, step {ms:.0f} ms, GPU memory {mem} MiB")
PY
done

echo "== frozen experts resident in bf16 (default on CUDA) vs fp32, and the memory planner against both"
for frozen in bf16 fp32; do
  measured=$("$bin" bench "${one_b[@]}" --steps 3 --warmup 1 --frozen-experts $frozen --json | tail -n 1)
  planned=$("$bin" plan-memory --preset 1b --nodes 4 --micro-batch 4 --seq-len 2048 --gpu-mem 140 \
    --frozen-experts $frozen --slack 0 --json)
  python3 - "$measured" "$planned" $frozen <<'PY'
import json, sys
m = json.loads(sys.argv[1])["gpu_memory_mb"]
p = json.loads(sys.argv[2])[0]["total"] / 2**20
print(f"frozen experts {sys.argv[3]}: nvidia-smi {m} MiB, planned {p:.0f} MiB (no headroom, 1 GiB runtime)")
if m:
    print(f"  planned / measured = {p / m:.3f}")
PY
done

echo "== SPES demo (server + 4 nodes) in bf16 on CUDA, embedded corpus"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin" demo --out "$work/demo" --device cuda --set train.precision=bf16 --set train.max_steps=300 \
  --set train.batch_size=32 2>&1 | tail -n 2
python3 - "$work/demo" <<'PY'
import json, sys
out = sys.argv[1]
rows = lambda f: [json.loads(l) for l in open(f"{out}/{f}")]
val = [r["val_loss"] for r in rows("server/metrics.jsonl") if r.get("val_loss") is not None]
tps = sorted(r["tokens_per_s"] for r in rows("node-0/metrics.jsonl") if "tokens_per_s" in r)
print(f"global val_loss {val[0]:.3f} -> {val[-1]:.3f}; node 0 median tokens/s {tps[len(tps)//2]:.0f}")
assert val[-1] < val[0] - 1.0, "bf16 CUDA training must lower the validation loss"

# The delta wire's invariant on CUDA: every node applies the published bf16 deltas to its fp32
# copy on the GPU and must end bit-identical to the server's final model.
def tensors(path):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
final = tensors(f"{out}/server/global/round-000006.safetensors")
for p in range(4):
    mine = tensors(f"{out}/node-{p}/checkpoints/step-300/model.safetensors")
    bad = [k for k in final if mine.get(k) != final[k]]
    assert not bad, f"node {p} differs from the server's final model in {bad[:3]}"
print("every node ends bit-identical to the server's final model (bf16 deltas applied on CUDA)")
PY
echo "== 4-bit deltas on CUDA (nodes quantize on the GPU and decode the round there)"
"$bin" demo --out "$work/int4" --device cuda --set train.precision=bf16 --set train.max_steps=100 \
  --set train.batch_size=32 --set sync.wire=int4_delta 2>&1 | tail -n 1
python3 - "$work/int4" <<'PY'
import json, sys
val = [r["val_loss"] for r in map(json.loads, open(f"{sys.argv[1]}/server/metrics.jsonl"))
       if r.get("val_loss") is not None]
print(f"int4_delta: global val_loss {val[0]:.3f} -> {val[-1]:.3f}")
assert val[-1] < val[0] - 1.0, "training over 4-bit deltas on CUDA must lower the validation loss"
PY
echo "== data parallel inside a node: 2 ranks over c10d (Gloo) with CUDA tensors, ZeRO-1"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || echo "only $gpus GPU: both ranks share cuda:0 (NCCL is not built yet; Gloo stages through the host)"
"$bin" train --config "$(dirname "$0")/../configs/tiny.toml" --device cuda --out "$work/dp" \
  --set data.path="$work/demo/data" --set train.max_steps=20 --set train.log_every=5 \
  --set train.eval_every=20 --set train.checkpoint_every=20 --set train.precision=bf16 --local-ranks 2 | tail -n 9
test -f "$work/dp/checkpoints/step-20/optimizer.safetensors"
echo "2 CUDA ranks trained 20 steps in lockstep (checked every 5 steps) and wrote one checkpoint"
echo "== gpu-check passed"
