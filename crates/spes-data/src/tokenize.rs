//! `spes tokenize`: documents → token shards + tokenizer + validation split + manifest.

use crate::input::{estimated_bytes, expand_inputs, for_each_document};
use crate::shard::{write_shard, Manifest, ShardInfo, TokenDtype};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// End-of-text token added to tokenizers that spes trains.
pub const EOS_TOKEN: &str = "<|endoftext|>";

/// Where the tokenizer comes from.
#[derive(Clone, Debug)]
pub enum TokenizerSource {
    /// A Hugging Face `tokenizer.json`.
    File(PathBuf),
    /// Train a byte-level BPE of this vocabulary size on the input.
    Train(usize),
}

/// Options of `spes tokenize`.
#[derive(Clone, Debug)]
pub struct TokenizeOptions {
    pub inputs: Vec<String>,
    pub out: PathBuf,
    pub tokenizer: TokenizerSource,
    /// JSON field holding the text in `.jsonl` inputs.
    pub text_field: String,
    /// Share of documents held out for validation (chosen by a hash of the document index).
    pub val_fraction: f64,
    pub shard_tokens: usize,
    /// Override the end-of-text token of a loaded tokenizer.
    pub eos_token: Option<String>,
    pub progress: bool,
}

impl TokenizeOptions {
    /// Defaults for everything but inputs, output and tokenizer.
    pub fn new(inputs: Vec<String>, out: PathBuf, tokenizer: TokenizerSource) -> Self {
        TokenizeOptions {
            inputs,
            out,
            tokenizer,
            text_field: "text".into(),
            val_fraction: 0.02,
            shard_tokens: 100_000_000,
            eos_token: None,
            progress: true,
        }
    }
}

/// Most text fed to BPE training; larger corpora are trained on their first documents.
const MAX_TRAIN_TOKENIZER_BYTES: usize = 512 << 20;
/// Documents encoded per parallel batch.
const ENCODE_BATCH_BYTES: usize = 8 << 20;

/// Runs the whole pipeline and returns the manifest it wrote.
pub fn tokenize(opts: &TokenizeOptions) -> Result<Manifest> {
    if !(0.0..1.0).contains(&opts.val_fraction) {
        bail!(
            "--val-fraction must be in [0, 1), got {}",
            opts.val_fraction
        );
    }
    let files = expand_inputs(&opts.inputs)?;
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create {}", opts.out.display()))?;
    let tokenizer = match &opts.tokenizer {
        TokenizerSource::File(path) => Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))?,
        TokenizerSource::Train(vocab) => train_bpe(&files, opts, *vocab)?,
    };
    let eos_id = find_eos(&tokenizer, opts.eos_token.as_deref())?;
    let vocab_size = tokenizer.get_vocab_size(true);
    let tokenizer_json = tokenizer
        .to_string(false)
        .map_err(|e| anyhow::anyhow!("cannot serialise tokenizer: {e}"))?;
    crate::shard::write_atomic(&opts.out.join("tokenizer.json"), tokenizer_json.as_bytes())?;

    let mut w = SplitWriter {
        out: opts.out.clone(),
        dtype: TokenDtype::for_vocab(vocab_size),
        shard_tokens: opts.shard_tokens.max(1),
        train: Split::default(),
        val: Split::default(),
    };
    let bar = progress_bar(opts.progress, estimated_bytes(&files), "tokenizing");
    let mut doc_index = 0u64;
    let mut batch: Vec<String> = Vec::new();
    let mut batch_bytes = 0;
    for file in &files {
        let mut last = 0;
        for_each_document(file, &opts.text_field, |doc, seen| {
            bar.inc(seen - last);
            last = seen;
            batch_bytes += doc.len();
            batch.push(doc);
            if batch_bytes >= ENCODE_BATCH_BYTES {
                encode_batch(&tokenizer, &mut batch, eos_id, &mut doc_index, opts, &mut w)?;
                batch_bytes = 0;
            }
            Ok(())
        })?;
    }
    encode_batch(&tokenizer, &mut batch, eos_id, &mut doc_index, opts, &mut w)?;
    bar.finish_and_clear();
    if w.train.documents == 0 {
        bail!("the input holds no document to train on");
    }
    w.flush(false, true)?;
    w.flush(true, true)?;
    let manifest = Manifest {
        format_version: 1,
        tokenizer: "tokenizer.json".into(),
        vocab_size,
        eos_id,
        dtype: w.dtype,
        train_documents: w.train.documents,
        val_documents: w.val.documents,
        train_tokens: w.train.shards.iter().map(|s| s.tokens).sum(),
        val_tokens: w.val.shards.iter().map(|s| s.tokens).sum(),
        train: w.train.shards,
        val: w.val.shards,
        inputs: files.iter().map(|f| f.display().to_string()).collect(),
    };
    manifest.save(&opts.out)?;
    Ok(manifest)
}

fn progress_bar(show: bool, len: u64, what: &'static str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what);
    bar
}

/// Whether document `i` goes to validation: a fixed hash, so the split is reproducible.
fn is_val(i: u64, fraction: f64) -> bool {
    let h = xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
    (h % 1_000_000) < (fraction * 1_000_000.0) as u64
}

fn encode_batch(
    tokenizer: &Tokenizer,
    batch: &mut Vec<String>,
    eos_id: u32,
    doc_index: &mut u64,
    opts: &TokenizeOptions,
    w: &mut SplitWriter,
) -> Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let docs = std::mem::take(batch);
    let encodings = tokenizer
        .encode_batch(docs, false)
        .map_err(|e| anyhow::anyhow!("tokenizer failed: {e}"))?;
    for enc in encodings {
        let val = is_val(*doc_index, opts.val_fraction);
        *doc_index += 1;
        let split = if val { &mut w.val } else { &mut w.train };
        split.buffer.extend_from_slice(enc.get_ids());
        split.buffer.push(eos_id);
        split.documents += 1;
        w.flush(val, false)?;
    }
    Ok(())
}

#[derive(Default)]
struct Split {
    buffer: Vec<u32>,
    shards: Vec<ShardInfo>,
    documents: u64,
}

struct SplitWriter {
    out: PathBuf,
    dtype: TokenDtype,
    shard_tokens: usize,
    train: Split,
    val: Split,
}

impl SplitWriter {
    /// Writes full shards; with `all`, also the remainder.
    fn flush(&mut self, val: bool, all: bool) -> Result<()> {
        let (split, prefix) = if val {
            (&mut self.val, "val")
        } else {
            (&mut self.train, "train")
        };
        while split.buffer.len() >= self.shard_tokens || (all && !split.buffer.is_empty()) {
            let n = split.buffer.len().min(self.shard_tokens);
            let name = format!("{prefix}-{:05}.npy", split.shards.len());
            let info = write_shard(&self.out, &name, &split.buffer[..n], self.dtype)?;
            split.shards.push(info);
            split.buffer.drain(..n);
        }
        Ok(())
    }
}

/// The end-of-text id: the override, else the first known EOS spelling in the vocabulary.
fn find_eos(tokenizer: &Tokenizer, name: Option<&str>) -> Result<u32> {
    if let Some(name) = name {
        return tokenizer
            .token_to_id(name)
            .with_context(|| format!("--eos-token `{name}` is not in the tokenizer's vocabulary"));
    }
    for candidate in [EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>"] {
        if let Some(id) = tokenizer.token_to_id(candidate) {
            return Ok(id);
        }
    }
    bail!("the tokenizer has no known end-of-text token; pass --eos-token")
}

/// Trains a byte-level BPE (GPT-2 style, no prefix space) with [`EOS_TOKEN`] as id 0.
fn train_bpe(files: &[PathBuf], opts: &TokenizeOptions, vocab: usize) -> Result<Tokenizer> {
    if vocab < 257 {
        bail!("--train-tokenizer: vocabulary size must be > 256 (the byte alphabet), got {vocab}");
    }
    let mut docs = Vec::new();
    let mut bytes = 0;
    for file in files {
        if bytes >= MAX_TRAIN_TOKENIZER_BYTES {
            break;
        }
        for_each_document(file, &opts.text_field, |doc, _| {
            if bytes < MAX_TRAIN_TOKENIZER_BYTES {
                bytes += doc.len();
                docs.push(doc);
            }
            Ok(())
        })?;
    }
    let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
        .show_progress(opts.progress)
        .vocab_size(vocab)
        .min_frequency(2)
        .special_tokens(vec![AddedToken::from(EOS_TOKEN, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer
        .with_pre_tokenizer(Some(byte_level))
        .with_decoder(Some(byte_level))
        .with_post_processor(Some(byte_level));
    tokenizer
        .train(&mut trainer, docs.iter())
        .map_err(|e| anyhow::anyhow!("BPE training failed: {e}"))?;
    Ok(tokenizer)
}

/// Loads the tokenizer of a tokenized data directory.
pub fn load_tokenizer(dir: &Path, manifest: &Manifest) -> Result<Tokenizer> {
    let path = dir.join(&manifest.tokenizer);
    Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))
}
