//! Reading documents from corpus files: plain text, JSON lines (plain, gzip or zstd) and
//! parquet, given as paths, globs or directories.

mod lines;
mod parquet;

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// How a corpus file is laid out, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Documents separated by one or more blank lines.
    Text(Compression),
    /// One JSON object per line (`.jsonl`, and `.json` as Dolma and SlimPajama ship it).
    JsonLines(Compression),
    /// Apache Parquet with a string column of documents.
    Parquet,
}

/// Stream compression of a line-based file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Extensions `spes tokenize` reads, for error messages and directory scans.
pub const SUPPORTED: &str = ".txt, .jsonl, .json (each optionally .gz or .zst) and .parquet";

impl Format {
    /// The format of `path` from its extension, or `None` if spes does not read it.
    pub fn of(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
        let (stem, compression) = if let Some(s) = name.strip_suffix(".gz") {
            (s, Compression::Gzip)
        } else if let Some(s) = name.strip_suffix(".zst") {
            (s, Compression::Zstd)
        } else {
            (name.as_str(), Compression::None)
        };
        if stem.ends_with(".txt") {
            Some(Format::Text(compression))
        } else if stem.ends_with(".jsonl") || stem.ends_with(".json") {
            Some(Format::JsonLines(compression))
        } else if stem.ends_with(".parquet") && compression == Compression::None {
            Some(Format::Parquet)
        } else {
            None
        }
    }
}

/// Expands paths, glob patterns and directories (searched recursively for files spes reads), in
/// the order given, each pattern's matches sorted; a pattern that matches nothing is an error.
pub fn expand_inputs(patterns: &[String]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for pattern in patterns {
        let mut matched = Vec::new();
        for entry in glob::glob(pattern)
            .with_context(|| format!("--input `{pattern}` is not a valid glob"))?
        {
            let path = entry
                .with_context(|| format!("--input `{pattern}`: cannot read a matching path"))?;
            if path.is_dir() {
                walk(&path, &mut matched)?;
            } else if path.is_file() {
                matched.push(path);
            }
        }
        if matched.is_empty() {
            bail!("--input `{pattern}` matches no file (spes reads {SUPPORTED})");
        }
        matched.sort();
        files.extend(matched);
    }
    for f in &files {
        if Format::of(f).is_none() {
            bail!(
                "input {}: unsupported extension; expected {SUPPORTED}",
                f.display()
            );
        }
    }
    Ok(files)
}

/// The files under `dir` that spes reads. Hidden entries and tokenized directories (an output
/// inside its own input, say) are skipped.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if dir.join(crate::shard::MANIFEST).exists() || dir.join(".progress").exists() {
        return Ok(());
    }
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let path = entry
            .with_context(|| format!("cannot list {}", dir.display()))?
            .path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        {
            continue;
        }
        if path.is_dir() {
            walk(&path, out)?;
        } else if Format::of(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

/// How documents are taken out of records.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    /// JSON field or parquet column holding the document text.
    pub text_field: String,
    /// Count and skip broken records (a bad JSON line, an unreadable row group, a truncated
    /// compressed tail) instead of failing on the first.
    pub skip_bad_records: bool,
}

/// What reading one file found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileCounts {
    /// Bytes of document text passed on.
    pub text_bytes: u64,
    /// Records skipped as broken (only with `skip_bad_records`).
    pub skipped: u64,
}

/// Calls `each(document)` for every non-empty document of `path`, in file order, adding the
/// file bytes consumed to `progress` as it goes.
pub fn for_each_document(
    path: &Path,
    opts: &ReadOptions,
    progress: &AtomicU64,
    mut each: impl FnMut(String) -> Result<()>,
) -> Result<FileCounts> {
    let format = Format::of(path).with_context(|| {
        format!(
            "input {}: unsupported extension; expected {SUPPORTED}",
            path.display()
        )
    })?;
    let mut counts = FileCounts::default();
    let mut pass = |doc: String| -> Result<()> {
        if doc.trim().is_empty() {
            return Ok(());
        }
        counts.text_bytes += doc.len() as u64;
        each(doc)
    };
    let skipped = match format {
        Format::Parquet => parquet::read(path, opts, progress, &mut pass)?,
        Format::Text(c) | Format::JsonLines(c) => {
            let file = File::open(path)
                .with_context(|| format!("cannot open input {}", path.display()))?;
            let json = matches!(format, Format::JsonLines(_));
            lines::read(
                path,
                Counting {
                    inner: file,
                    progress,
                },
                c,
                json,
                opts,
                &mut pass,
            )?
        }
    };
    counts.skipped = skipped;
    Ok(counts)
}

/// A reader that adds the bytes it reads to a shared progress counter.
struct Counting<'a, R> {
    inner: R,
    progress: &'a AtomicU64,
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}
