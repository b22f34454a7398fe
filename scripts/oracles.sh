#!/usr/bin/env bash
# The oracle runs of issue 52 (docs/results/quality.md#oracles), one seed at a time: the recipe
# grid's centre recipe as SPES at one step a round on the fp32 wire, without an oracle and with
# each, then the centralized baseline (experiments/oracles.toml, the same out folder and data).
# Runs already finished are kept. Data: ../shared/data/tinyshakespeare.txt next to the checkout.
#   scripts/oracles.sh SEED [RUN...]   RUN: base base-lr1 second-moment clip load-balance all
# base-lr1, second-moment and all step the shared tensors at the centralized rate
# (train.node_lr_scale=1): the √nodes rate the rules give them makes up for the averaged
# steps a node's own second moment shortens, which the union's does not.
set -euo pipefail
cd "$(dirname "$0")/.."
seed=$1
shift
spes=${SPES:-target/release/spes}
out=${OUT:-runs/oracles}
common=(--config configs/spes-tiny.toml --set "data.path=$out/data"
  --set train.eval_batches=16 --set sync.overlap=false --set sync.nodes=4
  --set train.max_steps=250 --set train.batch_size=4 --set train.seq_len=256
  --set train.eval_every=25 --set "train.seed=$seed" --set sync.mode=spes
  --set sync.sync_steps=1 --set sync.wire=fp32 --set sync.max_update_factor=0)
if [ ! -f "$out/data/manifest.json" ]; then
  # What `spes experiment` makes of the spec's [data].
  "$spes" tokenize --input ../shared/data/tinyshakespeare.txt --train-tokenizer 8192 \
    --val-fraction 0.05 --out "$out/data"
fi
run() {
  local name=$1 dir=$out/sim-$1/seed-$seed
  shift
  [ -f "$dir/simulate.json" ] && return
  echo "== $name, seed $seed"
  "$spes" simulate "${common[@]}" --out "$dir" "$@"
}
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(base all second-moment base-lr1 clip load-balance)
for name in "${runs[@]}"; do
  case $name in
    base) run base ;;
    base-lr1) run base-lr1 --set train.node_lr_scale=1 ;;
    second-moment | all) run "$name" --oracle "$name" --set train.node_lr_scale=1 ;;
    clip | load-balance) run "$name" --oracle "$name" ;;
    *) echo "unknown run $name" >&2 && exit 2 ;;
  esac
done
"$spes" experiment --spec experiments/oracles.toml --out "$out"
