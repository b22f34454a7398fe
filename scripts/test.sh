#!/usr/bin/env bash
# The whole test suite: set-up (first time only), build (the `suite` profile of Cargo.toml,
# optimized but quick to compile), every test of the workspace.
# Everything the tests read is in the repository (fixtures/, the demo corpus) or made by them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" --tests
cd "$root"
cargo test --profile suite --workspace "$@"
