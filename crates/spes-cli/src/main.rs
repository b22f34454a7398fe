//! `spes`: pretrain mixture-of-experts language models. `run` dispatches each command to the
//! module that implements it, next to the flags it takes.

mod args;
mod auth;
mod bench;
mod capabilities;
mod demo;
mod device;
#[cfg(test)]
mod doc_commands;
#[cfg(test)]
mod doc_names;
mod experiment;
mod hf;
mod local_ranks;
mod logging;
mod node_cmd;
mod plan;
mod report;
mod score;
mod serve;
mod simulate;
mod status;
mod tokenize_cmd;
mod train_cmd;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use spes_model::{ModelConfig, PRESETS};

#[derive(Parser)]
#[command(
    name = "spes",
    version,
    about = "Pretrain mixture-of-experts language models"
)]
struct Cli {
    /// How log lines are written: `text` (coloured only on a terminal) or `json` (one object
    /// per line, for log shippers).
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text into .npy token shards, a validation split and a manifest.
    Tokenize(tokenize_cmd::Args),
    /// Work on tokenized data: `spes data import` token files other tools wrote.
    Data(tokenize_cmd::DataArgs),
    /// Train a model on one machine (every parameter), resumable.
    Train(train_cmd::Args),
    /// Write a freshly initialised checkpoint of a config to <out>/step-0 (e.g. to try export-hf).
    Init(train_cmd::InitArgs),
    /// Export a checkpoint as a Hugging Face model folder (OLMoE, Qwen3-MoE or FlexOlmo).
    ExportHf(hf::ExportArgs),
    /// Build a MoE checkpoint from a dense Hugging Face model (Llama, Mistral, Qwen2, Qwen3, OLMo2).
    Upcycle(hf::UpcycleArgs),
    /// Score a checkpoint: perplexity and bits per byte of a text, or downstream tasks.
    Eval(score::Args),
    /// Run the SPES (or DiLoCo) parameter server of a decentralized run.
    /// The config needs a [sync] section with mode = "spes" or "diloco".
    Server(serve::Args),
    /// The state of a running decentralized run, from its server: members, leases, loss,
    /// rounds and the last events; once or `--watch SECONDS`.
    Status(status::Args),
    /// Run one node of a decentralized run: trains the shared parameters and its own experts.
    /// Its config's data.path is used; model, sync and training keys must match the server's.
    Node(node_cmd::Args),
    /// Run secrets, node credentials and TLS certificates: `secret`, `credential`, `cert`.
    #[command(subcommand)]
    Auth(auth::Auth),
    /// Benchmarks that print tables: `step`, `vs-pytorch`, `sync`, `link`, `load`, `soak`,
    /// `view`.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Print the parameter counts of the built-in model presets.
    Presets,
    /// What this binary was built with and can do here: CUDA, the NCCL part, the grouped MoE
    /// kernel, the libtorch it links (`--json` for scripts).
    Capabilities(capabilities::Args),
    /// Decentralized training on loopback: one server and 4 nodes (separate processes) train
    /// the tiny preset with SPES on the embedded corpus; writes report.md with plots.
    Demo(demo::Args),
    /// Run named variants of one config (centralized, SPES, DiLoCo, overrides) on the same data
    /// and tokens for several seeds, one after another on loopback, and write a table and a
    /// plot of their validation loss (experiments/tiny-ablation.toml). Resumes.
    Experiment(experiment::Args),
    /// A whole decentralized run in this process (the server's coordinator and every node,
    /// stepped in turn, no network): try a recipe, a wire or an overlap delay on one machine.
    Simulate(simulate::Args),
    /// What a run will cost before it starts: `sync` (a round on given links, every wire)
    /// and `memory` (one rank's device memory, whether it fits).
    #[command(subcommand)]
    Plan(plan::Plan),
}

fn main() {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tokenize(a) => tokenize_cmd::run(a),
        Command::Data(a) => tokenize_cmd::data(a),
        Command::Train(a) => train_cmd::run(a),
        Command::Init(a) => train_cmd::init(a),
        Command::ExportHf(a) => hf::export(a),
        Command::Upcycle(a) => hf::upcycle(a),
        Command::Eval(a) => score::run(a),
        Command::Server(a) => serve::run(a),
        Command::Node(a) => node_cmd::run(a),
        Command::Status(a) => status::run(a),
        Command::Auth(a) => auth::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Presets => presets(),
        Command::Capabilities(a) => capabilities::run(a),
        Command::Demo(a) => demo::run(a).context("demo failed"),
        Command::Experiment(a) => experiment::command(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Plan(a) => plan::run(a),
    }
}

/// `spes presets`: a Markdown table of the built-in presets' parameter counts.
fn presets() -> Result<()> {
    println!("| preset | total | active | shared | per expert |");
    println!("|---|---|---|---|---|");
    for name in PRESETS {
        let n = ModelConfig::preset(name)?.param_counts();
        let b = |x: u64| format!("{:.3} B", x as f64 / 1e9);
        println!(
            "| {name} | {} | {} | {} | {:.2} M |",
            b(n.total),
            b(n.active),
            b(n.shared),
            n.per_expert as f64 / 1e6
        );
    }
    Ok(())
}
