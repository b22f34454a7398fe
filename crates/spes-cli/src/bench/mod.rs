//! `spes bench <what>`: the benchmark harnesses, each printing a table (some also `--json`).
//! Each runs at its smallest size in `tests/benches.rs`, so none rots between measurements.

mod link;
mod load;
mod soak;
mod step;
mod sync;
mod view;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Bench {
    /// Tokens/s and peak memory of training steps of a preset (random tokens).
    Step(step::BenchArgs),
    /// The same steps side by side with the model written in plain PyTorch
    /// (scripts/bench_pytorch.py, eager, fused AdamW and torch.compile), alternated over
    /// several rounds: tokens/s, spes's ratio, peak memory and MFU in one table.
    VsPytorch(step::VsPytorchArgs),
    /// Per-node memory and traffic of SPES vs DiLoCo for presets, the server's measured
    /// aggregation throughput (bytes of uploads per second, on the first preset), and measured
    /// peak RSS of a SPES node vs a DiLoCo node training `tiny` (each in its own process).
    Sync(sync::Args),
    /// Sync on `tiny` over shaped loopback links for every wire option (server and 4 nodes as
    /// processes), printed next to the planner's prediction.
    Link(link::Args),
    /// One server process driven by many virtual peers (16 to 128 and more) over loopback:
    /// round latency, uploads per second and the server's peak RSS against node count.
    Load(load::Args),
    /// A server and 4 nodes of a micro model for 1,000+ rounds, sampled every 100: memory,
    /// disk, growing files and round latency, to show nothing grows with a run's length.
    Soak(soak::Args),
    /// The live run page on a long run (10,000 rounds by default): payload, server time and
    /// headless Chromium's render time.
    View(view::Args),
}

/// Runs the harness `what` names.
pub fn run(what: Bench) -> Result<()> {
    match what {
        Bench::Step(a) => step::run_bench(&a),
        Bench::VsPytorch(a) => step::run_vs_pytorch(&a),
        Bench::Sync(a) => sync::run(a),
        Bench::Link(a) => link::run(a),
        Bench::Load(a) => load::run(a),
        Bench::Soak(a) => soak::run(a),
        Bench::View(a) => view::run(a),
    }
}
