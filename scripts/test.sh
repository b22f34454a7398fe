#!/usr/bin/env bash
# The whole test suite: set-up (first time only), the module-graph check, build (the `suite`
# profile of Cargo.toml, optimized but quick to compile), every test of the workspace.
# Everything the tests read is in the repository (fixtures/, the demo corpus) or made by them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" --tests
cd "$root"
# The modules of each crate import one way (ARCHITECTURE.md): a circle fails before the build.
python3 scripts/module-graph.py --quiet
cargo test --profile suite --workspace "$@"
