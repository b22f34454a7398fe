//! `spes demo`: a real training run that needs nothing but the binary. It tokenizes the embedded
//! default corpus (Debian's BSD-licensed fortunes, 2.9 MB of English) with a freshly trained 8k
//! BPE, then trains the `tiny` preset on it.

use anyhow::{Context, Result};
use spes_data::{TokenizeOptions, TokenizerSource};
use spes_train::RunConfig;
use std::path::Path;
use tch::Device;

const CORPUS: &[u8] = include_bytes!("../assets/default-corpus.jsonl.gz");
const TINY_CONFIG: &str = include_str!("../../../configs/tiny.toml");

pub fn run(out: &Path, overrides: &[String], device: Device) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let data = out.join("data");
    if !data.join(spes_data::shard::MANIFEST).exists() {
        let corpus = out.join("default-corpus.jsonl.gz");
        spes_data::shard::write_atomic(&corpus, CORPUS)?;
        let opts = TokenizeOptions::new(
            vec![corpus.display().to_string()],
            data.clone(),
            TokenizerSource::Train(8192),
        );
        let m = spes_data::tokenize(&opts)?;
        println!(
            "tokenized the embedded corpus: {} train / {} validation tokens, vocab {}",
            m.train_tokens, m.val_tokens, m.vocab_size
        );
    }
    let mut all = vec![format!("data.path={}", data.display())];
    all.extend(overrides.iter().cloned());
    let cfg = RunConfig::parse(TINY_CONFIG, &all).context("embedded configs/tiny.toml")?;
    let run_dir = out.join("train");
    let resume = spes_train::checkpoint::latest(&run_dir.join("checkpoints"))?.is_some();
    let summary = spes_train::run(cfg, &run_dir, device, resume, true)?;
    let text = serde_json::to_string_pretty(&summary)?;
    spes_data::shard::write_atomic(&out.join("summary.json"), text.as_bytes())?;
    println!("{text}");
    if let Some(initial) = summary.initial_val_loss {
        println!(
            "validation loss {initial:.3} -> {:.3} nats/token over {} tokens in {:.0} s; metrics in {}",
            summary.final_val_loss,
            summary.tokens,
            summary.wall_s,
            run_dir.join("metrics.jsonl").display()
        );
    }
    Ok(())
}
