//! `spes train` (one machine, every parameter; alone or as data-parallel ranks) and `spes init`.

use crate::args::{rank_setup, ConfigArgs, RanksArgs, RuntimeArgs};
use crate::local_ranks;
use anyhow::Result;
use spes_train::RunConfig;
use std::path::{Path, PathBuf};

/// Train a model on one machine (every parameter), resumable.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Output directory: metrics.jsonl, config.toml, checkpoints/.
    #[arg(long)]
    pub out: PathBuf,
    /// Continue from the newest checkpoint in <out>/checkpoints.
    #[arg(long)]
    pub resume: bool,
    /// Start a fresh run from these weights (a checkpoint directory, e.g. from `spes
    /// upcycle`, or a model.safetensors); the optimizer starts empty.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    #[command(flatten)]
    pub ranks: RanksArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// `spes train`: starts `--local-ranks` ranks, or trains in this process.
pub fn run(a: Args) -> Result<()> {
    let cfg = a.config.load()?;
    if let Some(g) = a.ranks.local_ranks.filter(|&g| g > 1) {
        return local_ranks::launch(g);
    }
    train(
        cfg,
        &a.out,
        a.resume,
        a.init.as_deref(),
        &a.runtime,
        &a.ranks,
    )
}

/// `spes train` in this process: alone, or as one rank of a data-parallel node when a
/// launcher's environment (WORLD_SIZE > 1) says so; only rank 0 prints the summary.
fn train(
    cfg: RunConfig,
    out: &Path,
    resume: bool,
    init: Option<&Path>,
    runtime: &RuntimeArgs,
    ranks: &RanksArgs,
) -> Result<()> {
    use spes_train::data_parallel::DataParallel;
    let (device, rendezvous) = rank_setup(runtime, ranks)?;
    let dp = rendezvous
        .as_ref()
        .map(|r| DataParallel::join(r, device))
        .transpose()?;
    let first = dp.as_ref().is_none_or(DataParallel::is_first);
    tracing::info!(?device, "training {}", out.display());
    let summary = spes_train::run(cfg, out, device, resume, init, first, dp)?;
    if first {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}

/// Write a freshly initialised checkpoint of a config to <out>/step-0 (e.g. to try export-hf).
#[derive(clap::Args)]
pub struct InitArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The checkpoint directory to create.
    #[arg(long)]
    pub out: PathBuf,
}

/// `spes init`: prints the checkpoint directory it wrote.
pub fn init(a: InitArgs) -> Result<()> {
    let dir = init_checkpoint(&a.config.load()?, &a.out)?;
    println!("{}", dir.display());
    Ok(())
}

/// A freshly initialised checkpoint (`<out>/step-0`) of a config; needs no data.
fn init_checkpoint(cfg: &RunConfig, out: &Path) -> Result<PathBuf> {
    let model = spes_model::MoeModel::seeded(&cfg.model, tch::Device::Cpu, cfg.train.seed)?;
    let tensors: Vec<(String, tch::Tensor)> = model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor))
        .collect();
    let state = spes_train::checkpoint::TrainState::fresh(cfg.clone());
    spes_train::checkpoint::save(out, state, &tensors, &[], 1)
}
