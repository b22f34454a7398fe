//! Reading documents from `.txt`, `.jsonl` and `.jsonl.gz` files given as paths or globs.

use anyhow::{bail, Context, Result};
use flate2::read::GzDecoder;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Expands paths and glob patterns, in the order given; a pattern that matches nothing is an error.
pub fn expand_inputs(patterns: &[String]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for pattern in patterns {
        let mut matched: Vec<PathBuf> = glob::glob(pattern)
            .with_context(|| format!("--input `{pattern}` is not a valid glob"))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("--input `{pattern}`: cannot read a matching path"))?;
        matched.retain(|p| p.is_file());
        if matched.is_empty() {
            bail!("--input `{pattern}` matches no file");
        }
        matched.sort();
        files.extend(matched);
    }
    Ok(files)
}

/// Expected uncompressed size of the files, for progress bars (`.gz` counted as 4× its size).
pub fn estimated_bytes(files: &[PathBuf]) -> u64 {
    let size = |f: &PathBuf| f.metadata().map(|m| m.len()).unwrap_or(0);
    let gz = |f: &PathBuf| f.to_string_lossy().ends_with(".gz");
    files
        .iter()
        .map(|f| if gz(f) { 4 * size(f) } else { size(f) })
        .sum()
}

/// Calls `each(document, uncompressed_bytes_read_so_far_in_this_file)` for every document.
///
/// `.txt`: documents are separated by one or more blank lines. `.jsonl[.gz]`: one JSON object
/// per line whose `text_field` holds the document.
pub fn for_each_document(
    path: &Path,
    text_field: &str,
    mut each: impl FnMut(String, u64) -> Result<()>,
) -> Result<()> {
    let name = path.to_string_lossy();
    let file = File::open(path).with_context(|| format!("cannot open input {name}"))?;
    let gz = name.ends_with(".gz");
    let jsonl = name.ends_with(".jsonl") || name.ends_with(".jsonl.gz");
    let txt = name.ends_with(".txt") || name.ends_with(".txt.gz");
    if !jsonl && !txt {
        bail!("input {name}: unsupported extension; expected .txt, .jsonl or .jsonl.gz");
    }
    let mut reader: Box<dyn BufRead> = if gz {
        Box::new(BufReader::new(GzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    };
    let mut seen = 0u64;
    let mut line = String::new();
    let mut doc = String::new();
    let mut line_no = 0usize;
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .with_context(|| format!("input {name}: read error after line {line_no}"))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        seen += n as u64;
        if jsonl {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&line)
                .with_context(|| format!("input {name}:{line_no}: not a JSON object"))?;
            let text = v
                .get(text_field)
                .and_then(|t| t.as_str())
                .with_context(|| {
                    format!("input {name}:{line_no}: no string field `{text_field}`")
                })?;
            if !text.is_empty() {
                each(text.to_owned(), seen)?;
            }
        } else if line.trim().is_empty() {
            if !doc.trim().is_empty() {
                each(std::mem::take(&mut doc), seen)?;
            }
            doc.clear();
        } else {
            doc.push_str(&line);
        }
    }
    if !doc.trim().is_empty() {
        each(doc, seen)?;
    }
    Ok(())
}
