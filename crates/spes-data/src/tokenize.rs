//! `spes tokenize`: documents → token shards + tokenizer + validation split + manifest.
//!
//! Files are tokenized in parallel, each into its own shards (`train-<file>-<k>.npy`), so the
//! output depends on the inputs alone, not on the thread count or the order work finishes in.
//! A finished file leaves a record under `.progress/`; a run started again with the same
//! arguments skips the files recorded there and ends byte-identical to one that never stopped.

use crate::input::{expand_inputs, for_each_document, FileCounts, ReadOptions};
use crate::shard::{
    self, hash_file, write_atomic, Manifest, Part, ShardInfo, ShardWriter, TokenDtype, MANIFEST,
};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
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
    /// JSON field or parquet column holding the text.
    pub text_field: String,
    /// Share of documents held out for validation (chosen by a hash of each document's text).
    pub val_fraction: f64,
    /// Most tokens per shard file.
    pub shard_tokens: usize,
    /// Override the end-of-text token of a loaded tokenizer.
    pub eos_token: Option<String>,
    pub progress: bool,
    /// Worker threads; 0 means every core.
    pub threads: usize,
    /// Count and skip broken records instead of stopping at the first.
    pub skip_bad_records: bool,
    /// Tokenize only this part of the input list (files dealt round robin).
    pub part: Option<Part>,
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
            threads: 0,
            skip_bad_records: false,
            part: None,
        }
    }
}

/// What a run did, for its closing line.
#[derive(Clone, Debug)]
pub struct TokenizeReport {
    pub manifest: Manifest,
    /// Files found done by an earlier, interrupted run and skipped.
    pub resumed_files: usize,
    /// Document bytes tokenized by this run.
    pub text_bytes: u64,
    /// Tokens written by this run.
    pub tokens: u64,
    pub seconds: f64,
}

/// Most text fed to BPE training; larger corpora are trained on their first documents.
const MAX_TRAIN_TOKENIZER_BYTES: usize = 512 << 20;
/// Document text encoded per call of the tokenizer.
const ENCODE_BATCH_BYTES: usize = 1 << 20;
/// Where finished files are recorded until the manifest is written.
const PROGRESS: &str = ".progress";

/// What the output of a run depends on: a resumed run must match it exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct RunKey {
    /// Every input file of the list with its size (the part's files are chosen from it).
    inputs: Vec<(String, u64)>,
    tokenizer: String,
    text_field: String,
    val_fraction: f64,
    shard_tokens: usize,
    eos_token: Option<String>,
    skip_bad_records: bool,
    part: Option<Part>,
}

/// One finished input file.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct FileRecord {
    index: usize,
    counts: FileTotals,
    train: Vec<ShardInfo>,
    val: Vec<ShardInfo>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
struct FileTotals {
    train_documents: u64,
    val_documents: u64,
    text_bytes: u64,
    skipped: u64,
}

/// Runs the whole pipeline and returns what it wrote.
pub fn tokenize(opts: &TokenizeOptions) -> Result<TokenizeReport> {
    let started = Instant::now();
    if !(0.0..1.0).contains(&opts.val_fraction) {
        bail!(
            "--val-fraction must be in [0, 1), got {}",
            opts.val_fraction
        );
    }
    let all = expand_inputs(&opts.inputs)?;
    let files: Vec<(usize, PathBuf)> = all
        .iter()
        .cloned()
        .enumerate()
        .filter(|(i, _)| opts.part.is_none_or(|p| p.holds(*i)))
        .collect();
    if files.is_empty() {
        bail!(
            "part {} of {} input files holds no file",
            opts.part.expect("only a part can be empty"),
            all.len()
        );
    }
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create {}", opts.out.display()))?;
    let key = RunKey {
        inputs: all
            .iter()
            .map(|f| (f.display().to_string(), f.metadata().map_or(0, |m| m.len())))
            .collect(),
        tokenizer: match &opts.tokenizer {
            TokenizerSource::File(path) => format!("file {}", hash_file(path)?),
            TokenizerSource::Train(vocab) => format!("train {vocab}"),
        },
        text_field: opts.text_field.clone(),
        val_fraction: opts.val_fraction,
        shard_tokens: opts.shard_tokens,
        eos_token: opts.eos_token.clone(),
        skip_bad_records: opts.skip_bad_records,
        part: opts.part,
    };
    let progress_dir = opts.out.join(PROGRESS);
    let done = resume(&opts.out, &key)?;
    let tokenizer_path = opts.out.join(shard::TOKENIZER);
    let tokenizer = if done.is_some() {
        // The tokenizer the interrupted run wrote, trained or copied: training again need not
        // give the same one.
        let t = Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tokenizer_path.display()))?;
        for_corpus(t)?
    } else {
        let tokenizer = match &opts.tokenizer {
            TokenizerSource::File(path) => Tokenizer::from_file(path)
                .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))?,
            TokenizerSource::Train(vocab) => {
                let inputs: Vec<PathBuf> = files.iter().map(|(_, f)| f.clone()).collect();
                train_bpe(&inputs, opts, *vocab)?
            }
        };
        let json = tokenizer
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("cannot serialise tokenizer: {e}"))?;
        write_atomic(&tokenizer_path, json.as_bytes())?;
        let tokenizer = for_corpus(tokenizer)?;
        std::fs::create_dir_all(&progress_dir)
            .with_context(|| format!("cannot create {}", progress_dir.display()))?;
        write_atomic(
            &progress_dir.join("run.json"),
            serde_json::to_string_pretty(&key)?.as_bytes(),
        )?;
        tokenizer
    };
    let mut records = done.unwrap_or_default();
    let resumed_files = records.len();
    let eos_id = find_eos(&tokenizer, opts.eos_token.as_deref())?;
    let vocab_size = vocab_size(&tokenizer);
    let dtype = TokenDtype::for_vocab(vocab_size);
    let todo: Vec<&(usize, PathBuf)> = files
        .iter()
        .filter(|(i, _)| !records.iter().any(|r| r.index == *i))
        .collect();

    let total: u64 = todo
        .iter()
        .map(|(_, f)| f.metadata().map_or(0, |m| m.len()))
        .sum();
    let bar = progress_bar(opts.progress, total, "tokenizing");
    let read_bytes = AtomicU64::new(0);
    let job = FileJob {
        opts,
        tokenizer: &tokenizer,
        eos_id,
        dtype,
        read_bytes: &read_bytes,
        bar: &bar,
    };
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("cannot start the tokenizing threads")?;
    let new: Vec<FileRecord> = pool.install(|| {
        todo.par_iter()
            .map(|(i, path)| job.run(*i, path))
            .collect::<Result<_>>()
    })?;
    bar.finish_and_clear();
    let text_bytes = new.iter().map(|r| r.counts.text_bytes).sum();
    let tokens = new
        .iter()
        .flat_map(|r| r.train.iter().chain(&r.val))
        .map(|s| s.tokens)
        .sum();
    records.extend(new);
    records.sort_by_key(|r| r.index);

    let sum = |f: fn(&FileTotals) -> u64| records.iter().map(|r| f(&r.counts)).sum::<u64>();
    if sum(|c| c.train_documents) == 0 {
        bail!("the input holds no document to train on");
    }
    let train: Vec<ShardInfo> = records.iter().flat_map(|r| r.train.clone()).collect();
    let val: Vec<ShardInfo> = records.iter().flat_map(|r| r.val.clone()).collect();
    let manifest = Manifest {
        train_documents: sum(|c| c.train_documents),
        val_documents: sum(|c| c.val_documents),
        part: opts.part,
        input_list_xxh3: list_checksum(&all)?,
        skipped_records: sum(|c| c.skipped),
        ..Manifest::over(
            &opts.out,
            &shard::Vocab {
                vocab_size,
                eos_id,
                dtype,
            },
            train,
            val,
            files.iter().map(|(_, f)| f.display().to_string()).collect(),
        )?
    };
    manifest.save(&opts.out)?;
    std::fs::remove_dir_all(&progress_dir)
        .with_context(|| format!("cannot remove {}", progress_dir.display()))?;
    Ok(TokenizeReport {
        manifest,
        resumed_files,
        text_bytes,
        tokens,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The checksum naming an input list: every file's path below the list's common directory, and
/// its size, so machines that mount the corpus in different places agree on it.
fn list_checksum(files: &[PathBuf]) -> Result<String> {
    let dirs: Vec<&Path> = files.iter().filter_map(|f| f.parent()).collect();
    let mut common = dirs.first().map(|d| d.to_path_buf()).unwrap_or_default();
    for d in &dirs {
        while !d.starts_with(&common) {
            if !common.pop() {
                break;
            }
        }
    }
    let entries: Vec<(String, u64)> = files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(&common).unwrap_or(f);
            (
                rel.display().to_string(),
                f.metadata().map_or(0, |m| m.len()),
            )
        })
        .collect();
    Ok(format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(&serde_json::to_vec(&entries)?)
    ))
}

/// A loaded tokenizer as a corpus needs it: many `tokenizer.json` files carry truncation (to
/// 512 tokens, say) or padding for inference, which would cut documents or write pad ids into
/// the training stream. The file written to the output keeps them.
fn for_corpus(mut t: Tokenizer) -> Result<Tokenizer> {
    t.with_truncation(None)
        .map_err(|e| anyhow::anyhow!("cannot turn the tokenizer's truncation off: {e}"))?;
    t.with_padding(None);
    Ok(t)
}

/// Ids the token files must hold: the largest id + 1, which a vocabulary with gaps makes more
/// than its number of entries.
pub(crate) fn vocab_size(t: &Tokenizer) -> usize {
    let largest = t
        .get_vocab(true)
        .values()
        .copied()
        .max()
        .map_or(0, |m| m as usize + 1);
    largest.max(t.get_vocab_size(true))
}

/// The files an interrupted run with the same key finished, or `None` to start afresh (which
/// clears what a run with other arguments left).
fn resume(out: &Path, key: &RunKey) -> Result<Option<Vec<FileRecord>>> {
    let dir = out.join(PROGRESS);
    let same = std::fs::read_to_string(dir.join("run.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<RunKey>(&t).ok())
        .is_some_and(|k| k == *key);
    remove_temp_files(out)?;
    // A previous manifest is stale as soon as any file is tokenized again.
    let _ = std::fs::remove_file(out.join(MANIFEST));
    if !same {
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
        }
        return Ok(None);
    }
    let mut records = Vec::new();
    for entry in
        std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))?
    {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !name.starts_with("file-") || !name.ends_with(".json") {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let record: FileRecord = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a progress record", path.display()))?;
        records.push(record);
    }
    Ok(Some(records))
}

/// Removes the temp files a killed run left beside the shards.
fn remove_temp_files(out: &Path) -> Result<()> {
    for entry in std::fs::read_dir(out).with_context(|| format!("cannot list {}", out.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .contains(".tmp-")
        {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// Tokenizes one input file into its own shards.
struct FileJob<'a> {
    opts: &'a TokenizeOptions,
    tokenizer: &'a Tokenizer,
    eos_id: u32,
    dtype: TokenDtype,
    read_bytes: &'a AtomicU64,
    bar: &'a ProgressBar,
}

impl FileJob<'_> {
    fn run(&self, index: usize, path: &Path) -> Result<FileRecord> {
        let out = &self.opts.out;
        let shard_tokens = self.opts.shard_tokens as u64;
        let mut train =
            ShardWriter::new(out, format!("train-{index:06}"), self.dtype, shard_tokens);
        let mut val = ShardWriter::new(out, format!("val-{index:06}"), self.dtype, shard_tokens);
        let mut totals = FileTotals::default();
        let mut batch: Vec<String> = Vec::new();
        let mut batch_bytes = 0;
        let mut encode = |batch: &mut Vec<String>, totals: &mut FileTotals| -> Result<()> {
            let docs = std::mem::take(batch);
            let fraction = self.opts.val_fraction;
            let held_out: Vec<bool> = docs.iter().map(|d| is_val(d, fraction)).collect();
            let encodings = self
                .tokenizer
                .encode_batch(docs, false)
                .map_err(|e| anyhow::anyhow!("input {}: tokenizer failed: {e}", path.display()))?;
            for (enc, is_val) in encodings.into_iter().zip(held_out) {
                let (w, n) = if is_val {
                    (&mut val, &mut totals.val_documents)
                } else {
                    (&mut train, &mut totals.train_documents)
                };
                w.push(enc.get_ids())?;
                w.push(&[self.eos_id])?;
                *n += 1;
            }
            self.bar
                .set_position(self.read_bytes.load(Ordering::Relaxed));
            Ok(())
        };
        let read = ReadOptions {
            text_field: self.opts.text_field.clone(),
            skip_bad_records: self.opts.skip_bad_records,
        };
        let FileCounts {
            text_bytes,
            skipped,
        } = for_each_document(path, &read, self.read_bytes, |d| {
            batch_bytes += d.len();
            batch.push(d);
            if batch_bytes >= ENCODE_BATCH_BYTES {
                batch_bytes = 0;
                encode(&mut batch, &mut totals)?;
            }
            Ok(())
        })?;
        encode(&mut batch, &mut totals)?;
        if skipped > 0 {
            tracing::warn!("input {}: skipped {skipped} broken records", path.display());
        }
        totals.text_bytes = text_bytes;
        totals.skipped = skipped;
        let record = FileRecord {
            index,
            counts: totals,
            train: train.finish()?,
            val: val.finish()?,
        };
        write_atomic(
            &out.join(PROGRESS).join(format!("file-{index:06}.json")),
            serde_json::to_string(&record)?.as_bytes(),
        )?;
        Ok(record)
    }
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

/// Whether a document goes to validation: a fixed hash of its text, so a document (and every
/// copy of it) lands in the same split whichever file, part, format or run holds it, and a
/// run on parts is scored on the same documents as one on the whole list.
fn is_val(doc: &str, fraction: f64) -> bool {
    let h = xxhash_rust::xxh3::xxh3_64(doc.as_bytes());
    (h % 1_000_000) < (fraction * 1_000_000.0) as u64
}

/// The end-of-text id: the override, else the first known EOS spelling in the vocabulary.
pub(crate) fn find_eos(tokenizer: &Tokenizer, name: Option<&str>) -> Result<u32> {
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
    let read = ReadOptions {
        text_field: opts.text_field.clone(),
        skip_bad_records: opts.skip_bad_records,
    };
    let seen = AtomicU64::new(0);
    for file in files {
        if bytes >= MAX_TRAIN_TOKENIZER_BYTES {
            break;
        }
        for_each_document(file, &read, &seen, |doc| {
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
