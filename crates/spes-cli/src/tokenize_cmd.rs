//! `spes tokenize` (text into token shards, a validation split and a manifest) and
//! `spes data import` (a manifest over token files other tools wrote), both spes-data.

use anyhow::Result;
use spes_data::import::{import, ImportOptions};
use spes_data::{Part, TokenDtype, TokenizeOptions, TokenizerSource};
use std::path::PathBuf;

/// Tokenize text into .npy token shards, a validation split and a manifest.
#[derive(clap::Args)]
pub struct Args {
    /// Input files, globs or directories (searched recursively): .txt (documents separated
    /// by blank lines), .jsonl / .json (one object per line), each optionally .gz or .zst,
    /// and .parquet.
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<String>,
    /// Output directory. Run the same command again after a crash: it resumes.
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
    /// JSON field or parquet column holding the text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Share of documents held out for validation.
    #[arg(long, default_value_t = 0.02)]
    pub val_fraction: f64,
    /// Most tokens per shard file.
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// End-of-text token of a loaded tokenizer, if not one of the usual spellings.
    #[arg(long)]
    pub eos_token: Option<String>,
    /// Worker threads (0: every core). The output is the same for any count.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Count and skip broken records (bad JSON lines, unreadable row groups) instead of
    /// stopping at the first.
    #[arg(long)]
    pub skip_bad_records: bool,
    /// Tokenize only part p of N of the input list (files dealt round robin), e.g. 3/16: each
    /// machine of a run with data.partition = "disjoint" tokenizes and stores its own parts.
    #[arg(long, value_parser = Part::parse)]
    pub part: Option<Part>,
}

/// `spes tokenize`: prints what it wrote and how fast.
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
        threads,
        skip_bad_records,
        part,
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
    opts.threads = threads;
    opts.skip_bad_records = skip_bad_records;
    opts.part = part;
    let r = spes_data::tokenize(&opts)?;
    let m = &r.manifest;
    println!(
        "{}: {} train tokens in {} shards, {} validation tokens, vocab {} ({:?}), eos {}{}",
        out.display(),
        m.train_tokens,
        m.train.len(),
        m.val_tokens,
        m.vocab_size,
        m.dtype,
        m.eos_id,
        m.part.map(|p| format!(", part {p}")).unwrap_or_default()
    );
    if r.resumed_files > 0 {
        println!("resumed: {} input files were done already", r.resumed_files);
    }
    if m.skipped_records > 0 {
        println!("skipped {} broken records", m.skipped_records);
    }
    let secs = r.seconds.max(1e-9);
    println!(
        "{} tokens from {:.1} MB of text in {:.1} s: {:.0} tokens/s, {:.2} MB/s",
        r.tokens,
        r.text_bytes as f64 / 1e6,
        r.seconds,
        r.tokens as f64 / secs,
        r.text_bytes as f64 / 1e6 / secs
    );
    Ok(())
}

/// Work on tokenized data.
#[derive(clap::Args)]
pub struct DataArgs {
    #[command(subcommand)]
    pub command: DataCommand,
}

#[derive(clap::Subcommand)]
pub enum DataCommand {
    /// Train from token files other tools wrote, without tokenizing again: NumPy .npy,
    /// headerless memmaps (OLMo's; give --dtype) and Megatron-LM .bin + .idx pairs. Writes a
    /// manifest that checksums them where they are.
    Import(ImportArgs),
}

/// Flags of `spes data import`.
#[derive(clap::Args)]
pub struct ImportArgs {
    /// Token files in stream order (a Megatron .bin needs its .idx beside it).
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// Output directory for manifest.json and tokenizer.json.
    #[arg(long)]
    pub out: PathBuf,
    /// The tokenizer.json the tokens were made with.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// End-of-text token, if not one of the usual spellings.
    #[arg(long)]
    pub eos_token: Option<String>,
    /// Element type of headerless files: uint16, uint32, int32 or int64.
    #[arg(long, value_parser = TokenDtype::parse)]
    pub dtype: Option<TokenDtype>,
    /// Tokens held out for validation from the end of the last file.
    #[arg(long, default_value_t = 1_000_000)]
    pub val_tokens: u64,
}

/// `spes data ...`.
pub fn data(a: DataArgs) -> Result<()> {
    match a.command {
        DataCommand::Import(a) => {
            let m = import(&ImportOptions {
                inputs: a.input,
                out: a.out.clone(),
                tokenizer: a.tokenizer,
                eos_token: a.eos_token,
                dtype: a.dtype,
                val_tokens: a.val_tokens,
            })?;
            println!(
                "{}: {} train and {} validation tokens over {} files ({:?}), vocab {}, eos {}",
                a.out.display(),
                m.train_tokens,
                m.val_tokens,
                m.inputs.len(),
                m.dtype,
                m.vocab_size,
                m.eos_id
            );
            Ok(())
        }
    }
}
