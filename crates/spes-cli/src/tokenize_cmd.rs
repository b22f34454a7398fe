//! `spes tokenize`: text into token shards, a validation split and a manifest (spes-data).

use anyhow::Result;
use spes_data::{TokenizeOptions, TokenizerSource};
use std::path::PathBuf;

/// Tokenize text into .npy token shards, a validation split and a manifest.
#[derive(clap::Args)]
pub struct Args {
    /// Input files or globs: .txt (documents separated by blank lines), .jsonl, .jsonl.gz.
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<String>,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// A Hugging Face tokenizer.json to use.
    #[arg(
        long,
        conflicts_with = "train_tokenizer",
        required_unless_present = "train_tokenizer"
    )]
    pub tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE of this vocabulary size on the input instead.
    #[arg(long)]
    pub train_tokenizer: Option<usize>,
    /// JSON field holding the text in .jsonl inputs.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Share of documents held out for validation.
    #[arg(long, default_value_t = 0.02)]
    pub val_fraction: f64,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// End-of-text token of a loaded tokenizer, if not one of the usual spellings.
    #[arg(long)]
    pub eos_token: Option<String>,
}

/// `spes tokenize`: prints what it wrote.
pub fn run(a: Args) -> Result<()> {
    let Args {
        input,
        out,
        tokenizer,
        train_tokenizer,
        text_field,
        val_fraction,
        shard_tokens,
        eos_token,
    } = a;
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
    Ok(())
}
