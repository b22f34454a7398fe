#!/usr/bin/env bash
# One run of the recipe grid (experiments/recipe-grid.toml) with `spes simulate` instead of
# server and node processes: the same recipe keys, data and scoring (the final global model
# on every window of the validation split), in one process. Paired runs of a change and the
# defaults on a recipe and seed, and their centralized baseline from experiments/sim-grid.toml
# (the same out folder and data), give its ratio (docs/results/quality.md#oracles-which-statistic-of-a-nodes-batch-costs-the-gap-2026-12-06).
#   scripts/sim-grid.sh RECIPE SEED NAME [spes simulate options...]
#   RECIPE: centre nodes-8 wiki seq-128; a run already finished is kept.
# Data: ../shared/data/{tinyshakespeare.txt,wikitext-2/valid.txt} next to the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=$1 seed=$2 name=$3
shift 3
spes=${SPES:-target/release/spes}
out=${OUT:-runs/sim-grid}
case $recipe in
  centre) keys=(sync.nodes=4 train.max_steps=250 train.batch_size=4 train.seq_len=256 train.eval_every=25) ;;
  nodes-8) keys=(sync.nodes=8 train.max_steps=125 train.batch_size=4 train.seq_len=256 train.eval_every=25) ;;
  wiki) keys=(sync.nodes=4 train.max_steps=250 train.batch_size=4 train.seq_len=256 train.eval_every=25) ;;
  seq-128) keys=(sync.nodes=4 train.max_steps=500 train.batch_size=4 train.seq_len=128 train.eval_every=50) ;;
  *) echo "unknown recipe $recipe" >&2 && exit 2 ;;
esac
# What `spes experiment` makes of the spec's [data] (and the wiki recipe's own).
data=$out/data text=../shared/data/tinyshakespeare.txt
if [ "$recipe" = wiki ]; then
  data=$out/data-wiki text=../shared/data/wikitext-2/valid.txt
fi
if [ ! -f "$data/manifest.json" ]; then
  "$spes" tokenize --input "$text" --train-tokenizer 8192 --val-fraction 0.05 --out "$data"
fi
dir=$out/$recipe/$name/seed-$seed
[ -f "$dir/simulate.json" ] && exit 0
# The keys experiments/recipe-grid.toml pins (a change given after them overrides them).
set=(--set "data.path=$data" --set train.eval_batches=16 --set sync.overlap=false --set sync.wire=lowrank_delta
  --set train.second_moment=own --set sync.mode=spes --set "train.seed=$seed")
for k in "${keys[@]}"; do set+=(--set "$k"); done
echo "== $recipe $name seed $seed"
"$spes" simulate --config configs/spes-tiny.toml "${set[@]}" --out "$dir" "$@"
