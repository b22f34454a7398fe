#!/usr/bin/env bash
# GPU check, self-contained: on a machine with an NVIDIA GPU and PyTorch 2.11 installed (no
# network needed), runs a spes binary built elsewhere against that PyTorch's libtorch, confirms
# CUDA is used, benchmarks bf16 training steps (alone and side by side with PyTorch), checks
# the grouped MoE kernel against the loop, compares frozen experts in bf16 and fp32 with the
# memory planner, trains the tiny preset in bf16 (nodes must end bit-identical to the server)
# and over 4-bit deltas, and runs data-parallel ranks over NCCL (equivalence and scaling with
# 2+ GPUs; the single-rank NCCL path with one).
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

# The delta wires' invariant on CUDA: every node applies the published deltas to its fp32 copy
# on the GPU and must end bit-identical to the server's final model (the newest round file).
identical() { python3 - "$1" "$2" <<'PY'
import json, os, re, sys
out, steps = sys.argv[1], sys.argv[2]
def tensors(path):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
newest = max(f for f in os.listdir(f"{out}/server/global") if re.fullmatch(r"round-\d{6}\.safetensors", f))
final = tensors(f"{out}/server/global/{newest}")
for p in range(4):
    mine = tensors(f"{out}/node-{p}/checkpoints/step-{steps}/model.safetensors")
    bad = [k for k in final if mine.get(k) != final[k]]
    assert not bad, f"node {p} differs from the server's final model in {bad[:3]}"
print(f"every node ends bit-identical to the server's final model ({newest})")
PY
}
val_drop() { python3 - "$1" "$2" <<'PY'
import json, sys
out, what = sys.argv[1], sys.argv[2]
rows = lambda f: [json.loads(l) for l in open(f"{out}/{f}")]
val = [r["val_loss"] for r in rows("server/metrics.jsonl") if r.get("val_loss") is not None]
tps = sorted(r["tokens_per_s"] for r in rows("node-0/metrics.jsonl") if "tokens_per_s" in r)
print(f"{what}: global val_loss {val[0]:.3f} -> {val[-1]:.3f}; node 0 median tokens/s {tps[len(tps)//2]:.0f}")
assert val[-1] < val[0] - 1.0, f"{what} on CUDA must lower the validation loss"
PY
}
echo "== SPES demo (server + 4 nodes) in bf16 on CUDA over bf16 deltas, 6 rounds of 50 steps"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin" demo --out "$work/demo" --device cuda --set train.precision=bf16 --set train.max_steps=300 \
  --set train.batch_size=32 --set sync.wire=bf16_delta --set sync.sync_steps=50 2>&1 | tail -n 2
val_drop "$work/demo" "bf16 deltas"
identical "$work/demo" 300
echo "== configs/spes-tiny.toml's own settings on CUDA: 4-bit deltas every 5 steps (nodes quantize"
echo "   and decode on the GPU), experts at half the shared rate (two fused AdamW calls a step)"
"$bin" demo --out "$work/int4" --device cuda --set train.precision=bf16 --set train.max_steps=100 \
  --set train.batch_size=32 2>&1 | tail -n 1
# No bit-identity check here: on the quantized wires each node keeps what its rounds have not
# sent yet in its own weights (error feedback), so its weights are the global model plus that.
val_drop "$work/int4" "int4 deltas, expert_lr_scale 0.5"
echo "== data parallel inside a node over c10d: NCCL with a GPU per rank, ZeRO-1"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
tiny=(--config "$(dirname "$0")/../configs/tiny.toml" --device cuda --set data.path="$work/demo/data"
  --set train.log_every=1 --set train.eval_every=1000 --set train.max_steps=10)
losses() { python3 -c 'import json, sys; print(json.dumps([r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r]))' "$1/metrics.jsonl"; }
same() { python3 - "$1" "$2" "$3" <<'PY'
import json, sys
a, b, what = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
assert len(a) == len(b) == 10, (len(a), len(b))
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"{what}: 10 losses within {worst:.1e} relative")
assert worst <= 1e-4, f"{what} must match the single process"
PY
}
uses_nccl() { sed 's/\x1b\[[0-9;]*m//g' "$1" | grep -q "backend=Nccl" || { cat "$1"; echo "not on NCCL"; exit 1; }; echo "ranks joined an NCCL group"; }
if [ "$gpus" -ge 2 ]; then
  # The CPU test two_ranks_equal_one_process_with_twice_the_batch, on GPUs over NCCL (fp32,
  # load balancing off so every loss is a mean over tokens).
  "$bin" train "${tiny[@]}" --out "$work/dp1" --set train.batch_size=4 --set train.lb_loss_weight=0 >/dev/null
  "$bin" train "${tiny[@]}" --out "$work/dp2" --set train.batch_size=2 --set train.lb_loss_weight=0 \
    --local-ranks 2 --dist-backend nccl 2>"$work/dp2.log" >/dev/null
  uses_nccl "$work/dp2.log"
  same "$(losses "$work/dp1")" "$(losses "$work/dp2")" "2 ranks x batch 2 over NCCL vs 1 process x batch 4"
  echo "== scaling: 1b in bf16, tokens/s with 1 and $gpus ranks (each rank 4x2048 tokens per step)"
  for run in "1 true" "$gpus true" "$gpus false"; do
    set -- $run
    "$bin" train --config "$(dirname "$0")/../configs/1b.toml" --device cuda --out "$work/scale-$1-$2" \
      --set data.path="$work/demo/data" --set train.precision=bf16 --set train.batch_size=4 \
      --set train.seq_len=2048 --set train.max_steps=8 --set train.log_every=1 \
      --set train.eval_every=1000 --set train.checkpoint_every=1000 \
      --set train.overlap_grad_reduce="$2" --local-ranks "$1" >/dev/null
    python3 - "$work/scale-$1-$2" "$1" "$2" <<'PY'
import json, sys
tps = sorted(r["tokens_per_s"] for r in map(json.loads, open(f"{sys.argv[1]}/metrics.jsonl"))
             if "tokens_per_s" in r and r.get("step", 0) > 2)
print(f"{sys.argv[2]} rank(s), reduction overlapped with backward: {sys.argv[3]}: median {tps[len(tps) // 2]:.0f} tokens/s")
PY
  done
else
  echo "only $gpus GPU: no multi-GPU equivalence or scaling; checking the single-rank NCCL path"
  "$bin" train "${tiny[@]}" --out "$work/dp1" >/dev/null
  WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    "$bin" train "${tiny[@]}" --out "$work/dp-nccl" --dist-backend nccl 2>"$work/dp-nccl.log" >/dev/null
  uses_nccl "$work/dp-nccl.log"
  same "$(losses "$work/dp1")" "$(losses "$work/dp-nccl")" "1 rank in an NCCL group vs no group"
fi
echo "== 2 ranks with CUDA tensors, bf16, a checkpoint (NCCL on 2 GPUs; on 1 GPU both share it over Gloo)"
"$bin" train --config "$(dirname "$0")/../configs/tiny.toml" --device cuda --out "$work/dp" \
  --set data.path="$work/demo/data" --set train.max_steps=20 --set train.log_every=5 \
  --set train.eval_every=20 --set train.checkpoint_every=20 --set train.precision=bf16 --local-ranks 2 | tail -n 9
test -f "$work/dp/checkpoints/step-20/optimizer.safetensors"
echo "2 CUDA ranks trained 20 steps in lockstep (checked every 5 steps) and wrote one checkpoint"
echo "== gpu-check passed"
