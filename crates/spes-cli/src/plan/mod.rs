//! `spes plan <what>`: what a run will cost before it starts, from shapes and links alone.

mod memory;
pub mod sync;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Plan {
    /// What a round costs on given links, for every wire option: a discrete-event model of
    /// compute, uploads and downloads over per-node links and the server's shared link.
    Sync(sync::Args),
    /// What one rank of a node needs in device memory, by category, with and without
    /// activation checkpointing; whether it fits, and the largest micro-batch that does.
    Memory(memory::Args),
}

/// Runs the planner `what` names.
pub fn run(what: Plan) -> Result<()> {
    match what {
        Plan::Sync(a) => sync::run(a),
        Plan::Memory(a) => memory::run(a),
    }
}
