//! `spes eval`: a checkpoint's perplexity and bits per byte of a text, or its accuracy on
//! ranked-classification tasks; and how any model of a config is scored.

use crate::args::RuntimeArgs;
use anyhow::{Context, Result};
use spes_train::RunConfig;
use std::path::{Path, PathBuf};

/// Score a checkpoint: perplexity and bits per byte of a text, or downstream tasks.
#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// A text file, tokenized whole and scored in windows of the training context.
    #[arg(long, conflicts_with = "tasks", required_unless_present = "tasks")]
    pub text: Option<PathBuf>,
    /// Task directories with requests.jsonl.gz, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tasks: Vec<PathBuf>,
    /// Score only the first N documents of each task.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// tokenizer.json to use (default: the one of the checkpoint's training data).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Write the JSON here instead of stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// `spes eval`: prints the scores as JSON, or writes them to `--out`.
pub fn run(a: Args) -> Result<()> {
    let Args {
        checkpoint,
        text,
        tasks,
        limit,
        batch_size,
        tokenizer,
        out,
        runtime,
    } = a;
    let device = runtime.device()?;
    let result = eval(
        &checkpoint,
        text.as_deref(),
        &tasks,
        limit,
        batch_size,
        tokenizer.as_deref(),
        device,
    )?;
    let json = serde_json::to_string_pretty(&result)?;
    match out {
        Some(path) => spes_data::shard::write_atomic(&path, json.as_bytes())?,
        None => println!("{json}"),
    }
    Ok(())
}

/// `spes eval`: a text's perplexity and bits per byte, or task accuracies, as JSON.
fn eval(
    checkpoint: &Path,
    text: Option<&Path>,
    tasks: &[PathBuf],
    limit: Option<usize>,
    batch: usize,
    tokenizer: Option<&Path>,
    device: tch::Device,
) -> Result<serde_json::Value> {
    let ck = spes_train::checkpoint::load(checkpoint)?;
    let cfg = &ck.state.config;
    let model = spes_model::MoeModel::new(&cfg.model, device)?;
    let weights = ck.model.with_context(|| {
        format!(
            "{} holds no model: a SPES node's mid-run checkpoints leave the weights to the \
             server; score the node's last checkpoint (step = train.max_steps)",
            checkpoint.display()
        )
    })?;
    let named: Vec<(String, tch::Tensor)> = weights
        .into_iter()
        .map(|(n, t)| (n, t.to_device(device)))
        .collect();
    model.load(&named, &checkpoint.display().to_string())?;
    let sc = scoring(cfg, tokenizer, batch, device)?;
    if let Some(path) = text {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        return Ok(serde_json::to_value(spes_eval::score_text(
            &model, &sc, &text,
        )?)?);
    }
    let mut results = Vec::new();
    for dir in tasks {
        let task = spes_eval::load_task(dir)?;
        results.push(spes_eval::score_task(&model, &sc, &task, limit, true)?);
    }
    Ok(serde_json::json!({ "tasks": results }))
}

/// How a model of `cfg` is scored: its training data's tokenizer (or `tokenizer`) and
/// windows of its training context.
pub fn scoring(
    cfg: &RunConfig,
    tokenizer: Option<&Path>,
    batch: usize,
    device: tch::Device,
) -> Result<spes_eval::Scoring> {
    let manifest = spes_data::Manifest::load(cfg.data.primary()).ok();
    let tok_path = match (tokenizer, &manifest) {
        (Some(t), _) => t.to_owned(),
        (None, Some(m)) => cfg.data.primary().join(&m.tokenizer),
        (None, None) => anyhow::bail!(
            "the checkpoint's data directory {} is gone; pass --tokenizer",
            cfg.data.primary().display()
        ),
    };
    let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tok_path.display()))?;
    Ok(spes_eval::Scoring {
        tokenizer,
        eos: manifest.map_or(0, |m| m.eos_id),
        ctx: cfg.train.seq_len,
        batch,
        device,
    })
}
