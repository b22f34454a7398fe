//! `spes simulate`: a whole decentralized run in this process (the server's coordinator and
//! every node, stepped in turn, no network), to try a recipe, a wire or an overlap delay on one
//! machine. Without `--config` it simulates the demo (configs/spes-tiny.toml on the embedded
//! corpus).

use crate::args::RuntimeArgs;
use crate::demo;
use anyhow::Result;
use spes_train::oracle::Oracle;
use spes_train::simulate::{simulate, SimOptions};
use spes_train::RunConfig;
use std::path::PathBuf;

/// Simulate a decentralized run in one process.
#[derive(clap::Args)]
pub struct Args {
    /// Run configuration with a [sync] section (default: the demo's configs/spes-tiny.toml
    /// on the embedded corpus, tokenized into <out>/data).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a config key, e.g. --set sync.wire=int2_delta (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// Where the demo's corpus is tokenized, and `simulate.json` written.
    #[arg(long, default_value = "runs/simulate")]
    out: PathBuf,
    /// With sync.overlap: the steps every node trains between its upload and applying the
    /// round's result.
    #[arg(long, default_value_t = 0)]
    delay_steps: u64,
    /// Score the global model every this many steps (0: train.eval_every).
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Write every node's change of the rounds `--dump-rounds` names to this directory
    /// (`round-<r>-node-<p>.safetensors`), for scripts/wire_study.py.
    #[arg(long, requires = "dump_rounds")]
    dump_changes: Option<PathBuf>,
    /// The rounds `--dump-changes` writes, e.g. 10,40,70.
    #[arg(long, value_delimiter = ',')]
    dump_rounds: Vec<u64>,
    /// Measuring tool: every node takes these statistics of each step from the union of all
    /// nodes' batches instead of its own (second-moment, clip, load-balance, or all;
    /// comma-separated). Steps run in lockstep across the nodes.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(Oracle::NAMES))]
    oracle: Vec<String>,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

/// Runs the simulation, prints the result and writes `<out>/simulate.json`.
pub fn run(a: Args) -> Result<()> {
    let device = a.runtime.device()?;
    std::fs::create_dir_all(&a.out)?;
    let data = match &a.config {
        Some(_) => None,
        None => Some(demo::prepare_data(&a.out)?),
    };
    let load = |sets: &[String]| match (&a.config, &data) {
        (Some(path), _) => RunConfig::load(path, sets),
        (None, Some(data)) => demo::config(data, sets),
        (None, None) => unreachable!("the demo's data is prepared without --config"),
    };
    let oracle = Oracle::parse(&a.oracle)?;
    let mut cfg = load(&a.overrides)?;
    // An oracle measures against a node's own second moment: where the rule chose the union
    // estimate, the node's own is taken instead (and the rate rule follows it).
    if oracle.any() && cfg.derived.iter().any(|d| d.key == "train.second_moment") {
        let mut sets = a.overrides.clone();
        sets.push("train.second_moment=own".into());
        cfg = load(&sets)?;
    }
    if let Some(dir) = &a.dump_changes {
        std::fs::create_dir_all(dir)?;
    }
    let opts = SimOptions {
        delay_steps: a.delay_steps,
        eval_every: a.eval_every,
        dump_changes: a.dump_changes.clone().map(|d| (d, a.dump_rounds.clone())),
        oracle,
    };
    let r = simulate(&cfg, device, &opts)?;
    for (step, loss) in &r.curve {
        println!("step {step:>6}  val loss {loss:.4}");
    }
    println!(
        "final val loss {:.4} (every validation window {:.4}); {:.3} MiB per node and round (up + down); {:.0} s",
        r.final_val_loss,
        r.final_all_windows,
        r.bytes_per_round / (1 << 20) as f64,
        r.wall_s
    );
    let json = serde_json::json!({
        "final_val_loss": r.final_val_loss,
        "final_all_windows": r.final_all_windows,
        "oracle": opts.oracle,
        "curve": r.curve,
        "bytes_per_round": r.bytes_per_round,
        "wall_s": r.wall_s,
        "delay_steps": a.delay_steps,
        "config": cfg,
    });
    spes_data::shard::write_atomic(
        &a.out.join("simulate.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )?;
    Ok(())
}
