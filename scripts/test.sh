#!/usr/bin/env bash
# The whole test suite: set-up (first time only), release build, every test of the workspace.
# Tests read ../shared (corpora, tokenizer) next to the checkout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
cargo test --release --workspace "$@"
