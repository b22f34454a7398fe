//! `spes`: pretrain mixture-of-experts language models.

mod demo;
mod device;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use device::DeviceChoice;
use spes_data::{TokenizeOptions, TokenizerSource};
use spes_model::{ModelConfig, PRESETS};
use spes_train::bench::{bench, BenchOptions};
use spes_train::{Precision, RunConfig};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "spes",
    version,
    about = "Pretrain mixture-of-experts language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text into .npy token shards, a validation split and a manifest.
    Tokenize {
        /// Input files or globs: .txt (documents separated by blank lines), .jsonl, .jsonl.gz.
        #[arg(long, required = true, num_args = 1..)]
        input: Vec<String>,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// A Hugging Face tokenizer.json to use.
        #[arg(
            long,
            conflicts_with = "train_tokenizer",
            required_unless_present = "train_tokenizer"
        )]
        tokenizer: Option<PathBuf>,
        /// Train a byte-level BPE of this vocabulary size on the input instead.
        #[arg(long)]
        train_tokenizer: Option<usize>,
        /// JSON field holding the text in .jsonl inputs.
        #[arg(long, default_value = "text")]
        text_field: String,
        /// Share of documents held out for validation.
        #[arg(long, default_value_t = 0.02)]
        val_fraction: f64,
        /// Tokens per shard file.
        #[arg(long, default_value_t = 100_000_000)]
        shard_tokens: usize,
        /// End-of-text token of a loaded tokenizer, if not one of the usual spellings.
        #[arg(long)]
        eos_token: Option<String>,
    },
    /// Train a model on one machine (every parameter), resumable.
    Train {
        /// Run configuration (TOML with [model], [data], [train]).
        #[arg(long)]
        config: PathBuf,
        /// Output directory: metrics.jsonl, config.toml, checkpoints/.
        #[arg(long)]
        out: PathBuf,
        /// Override a config key, e.g. --set train.max_steps=40 (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
        /// Continue from the newest checkpoint in <out>/checkpoints.
        #[arg(long)]
        resume: bool,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
    },
    /// Measure tokens/s and peak memory of training steps of a preset (random tokens).
    Bench {
        #[arg(long, default_value = "tiny")]
        preset: String,
        #[arg(long, default_value_t = 8)]
        batch_size: usize,
        #[arg(long, default_value_t = 256)]
        seq_len: usize,
        #[arg(long, default_value_t = 5)]
        steps: usize,
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        #[arg(long, value_parser = parse_precision, default_value = "auto")]
        precision: Precision,
        /// Train only this many experts per layer (as a SPES node does); default all.
        #[arg(long)]
        own_experts: Option<usize>,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
        /// Print the result as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print the parameter counts of the built-in model presets.
    Presets,
    /// Tokenize the embedded default corpus and train the tiny preset on it.
    Demo {
        #[arg(long, default_value = "runs/demo")]
        out: PathBuf,
        /// Override a key of the embedded tiny config (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
    },
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    match s {
        "auto" => Ok(Precision::Auto),
        "fp32" => Ok(Precision::Fp32),
        "bf16" => Ok(Precision::Bf16),
        _ => Err(format!("expected auto, fp32 or bf16, got `{s}`")),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tokenize {
            input,
            out,
            tokenizer,
            train_tokenizer,
            text_field,
            val_fraction,
            shard_tokens,
            eos_token,
        } => {
            let source = match (tokenizer, train_tokenizer) {
                (Some(path), _) => TokenizerSource::File(path),
                (None, Some(vocab)) => TokenizerSource::Train(vocab),
                (None, None) => unreachable!("clap requires one of them"),
            };
            let mut opts = TokenizeOptions::new(input, out.clone(), source);
            opts.text_field = text_field;
            opts.val_fraction = val_fraction;
            opts.shard_tokens = shard_tokens;
            opts.eos_token = eos_token;
            let m = spes_data::tokenize(&opts)?;
            println!(
                "{}: {} train tokens in {} shards, {} validation tokens, vocab {} ({:?}), eos {}",
                out.display(),
                m.train_tokens,
                m.train.len(),
                m.val_tokens,
                m.vocab_size,
                m.dtype,
                m.eos_id
            );
        }
        Command::Train {
            config,
            out,
            overrides,
            resume,
            device,
        } => {
            let cfg = RunConfig::load(&config, &overrides)?;
            let device = device::select(device)?;
            tracing::info!(?device, "training {}", out.display());
            let summary = spes_train::run(cfg, &out, device, resume, true)?;
            println!("{}", serde_json::to_string_pretty(&summary)?);
        }
        Command::Bench {
            preset,
            batch_size,
            seq_len,
            steps,
            warmup,
            precision,
            own_experts,
            device,
            json,
        } => {
            let model = ModelConfig::preset(&preset)?;
            let device = device::select(device)?;
            let o = BenchOptions {
                model,
                device,
                precision,
                batch_size,
                seq_len,
                steps: steps.max(1),
                warmup,
                own_experts,
            };
            let r = bench(&o)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("| preset | device | precision | batch×seq | trainable params | optimizer state | step ms | tokens/s | peak RSS |");
                println!("|---|---|---|---|---|---|---|---|---|");
                println!(
                    "| {preset} | {device:?} | {precision:?} | {batch_size}×{seq_len} | {:.1} M of {:.1} M | {:.1} MiB | {:.0} | {:.0} | {:.0} MiB |",
                    r.trainable_params as f64 / 1e6,
                    r.total_params as f64 / 1e6,
                    r.optimizer_state_bytes as f64 / (1 << 20) as f64,
                    r.step_ms,
                    r.tokens_per_s,
                    r.peak_rss_mb
                );
            }
        }
        Command::Presets => {
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
        }
        Command::Demo {
            out,
            overrides,
            device,
        } => {
            let device = device::select(device)?;
            demo::run(&out, &overrides, device).context("demo failed")?;
        }
    }
    Ok(())
}
