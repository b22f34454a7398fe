#!/usr/bin/env bash
# The oracle runs of issue 52 (docs/results/quality.md#oracles-which-statistic-of-a-nodes-batch-costs-the-gap-2026-12-06),
# one seed at a time: the recipe grid's centre recipe as SPES at one step a round on the fp32
# wire, without an oracle and with each (scripts/sim-grid.sh), then the centralized baseline.
#   scripts/oracles.sh SEED [RUN...]   RUN: base base-lr1 second-moment clip load-balance all
# base-lr1, second-moment and all step the shared tensors at the centralized rate
# (train.node_lr_scale=1): the √nodes rate the rules give them makes up for the averaged
# steps a node's own second moment shortens, which the union's does not.
set -euo pipefail
cd "$(dirname "$0")/.."
seed=$1
shift
h1=(--set sync.sync_steps=1 --set sync.wire=fp32 --set sync.max_update_factor=0)
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(base all second-moment base-lr1 clip load-balance)
for name in "${runs[@]}"; do
  case $name in
    base) args=() ;;
    base-lr1) args=(--set train.node_lr_scale=1) ;;
    second-moment | all) args=(--oracle "$name" --set train.node_lr_scale=1) ;;
    clip | load-balance) args=(--oracle "$name") ;;
    *) echo "unknown run $name" >&2 && exit 2 ;;
  esac
  scripts/sim-grid.sh centre "$seed" "h1-$name" "${h1[@]}" "${args[@]}"
done
