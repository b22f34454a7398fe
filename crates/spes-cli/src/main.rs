//! `spes`: pretrain mixture-of-experts language models. `run` dispatches each command to the
//! module that implements it, next to the flags it takes.

mod args;
mod capabilities;
mod demo;
mod device;
#[cfg(test)]
mod doc_commands;
#[cfg(test)]
mod doc_names;
mod experiment;
mod hf;
mod link_bench;
mod load_bench;
mod local_ranks;
mod logging;
mod node_cmd;
mod plan_memory;
mod plan_sync;
mod report;
mod score;
mod secrets;
mod serve;
mod simulate;
mod soak;
mod status;
mod step_bench;
mod sync_bench;
mod tokenize_cmd;
mod train_cmd;
mod view_bench;

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
    /// Write a new random run secret (owner-only) for `spes server --secret-file`.
    GenSecret(secrets::GenSecretArgs),
    /// Derive node credentials from the run secret: each authorizes exactly one peer id.
    /// Prints them, or writes DIR/node-<peer>.credential (owner-only) with --out.
    Credential(secrets::CredentialArgs),
    /// Write a self-signed TLS certificate and key (cert.pem, key.pem) for `spes server`.
    GenCert(secrets::GenCertArgs),
    /// Measure tokens/s and peak memory of training steps of a preset (random tokens).
    Bench(step_bench::BenchArgs),
    /// The same steps side by side with the model written in plain PyTorch
    /// (scripts/bench_pytorch.py, eager, fused AdamW and torch.compile), alternated over
    /// several rounds: tokens/s, spes's ratio, peak memory and MFU in one table.
    BenchVsPytorch(step_bench::VsPytorchArgs),
    /// Per-node memory and traffic of SPES vs DiLoCo for presets, the server's measured
    /// aggregation throughput (bytes of uploads per second, on the first preset), and measured
    /// peak RSS of a SPES node vs a DiLoCo node training `tiny` (each in its own process).
    BenchSync(sync_bench::Args),
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
    /// What a round costs on given links, for every wire option: a discrete-event model of
    /// compute, uploads and downloads over per-node links and the server's shared link.
    PlanSync(plan_sync::Args),
    /// What one rank of a node needs in device memory, by category, with and without
    /// activation checkpointing; whether it fits, and the largest micro-batch that does.
    PlanMemory(plan_memory::Args),
    /// Measures sync on `tiny` over shaped loopback links for every wire option (server and 4
    /// nodes as processes) and prints it next to the planner's prediction.
    BenchLink(link_bench::Args),
    /// One server process driven by many virtual peers (16 to 128 and more) over loopback:
    /// round latency, uploads per second and the server's peak RSS against node count.
    BenchLoad(load_bench::Args),
    /// A server and 4 nodes of a micro model for 1,000+ rounds, sampled every 100: memory,
    /// disk, growing files and round latency, to show nothing grows with a run's length.
    BenchSoak(soak::Args),
    /// The live run page on a long run (10,000 rounds by default): payload, server time and
    /// headless Chromium's render time.
    BenchView(view_bench::Args),
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
        Command::GenSecret(a) => secrets::gen_secret(a),
        Command::Credential(a) => secrets::credentials(a),
        Command::GenCert(a) => secrets::gen_cert(a),
        Command::Bench(a) => step_bench::run_bench(&a),
        Command::BenchVsPytorch(a) => step_bench::run_vs_pytorch(&a),
        Command::BenchSync(a) => sync_bench::run(a),
        Command::Presets => presets(),
        Command::Capabilities(a) => capabilities::run(a),
        Command::Demo(a) => demo::run(a).context("demo failed"),
        Command::Experiment(a) => experiment::command(a),
        Command::Simulate(a) => simulate::run(a),
        Command::PlanSync(a) => plan_sync::run(a),
        Command::PlanMemory(a) => plan_memory::run(a),
        Command::BenchLink(a) => link_bench::run(a),
        Command::BenchLoad(a) => load_bench::run(a),
        Command::BenchSoak(a) => soak::run(a),
        Command::BenchView(a) => view_bench::run(a),
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
