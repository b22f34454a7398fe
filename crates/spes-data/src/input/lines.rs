//! Line-based corpora: plain text (documents separated by blank lines) and JSON lines, each
//! plain, gzip or zstd.

use super::{Compression, ReadOptions};
use anyhow::{bail, Context, Result};
use flate2::read::MultiGzDecoder;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

/// Reads every record of one file into `each`; returns the number of records skipped as broken.
pub(super) fn read(
    path: &Path,
    raw: impl Read,
    compression: Compression,
    json: bool,
    opts: &ReadOptions,
    each: &mut dyn FnMut(String) -> Result<()>,
) -> Result<u64> {
    let name = path.display();
    let raw = BufReader::with_capacity(1 << 20, raw);
    let mut reader: Box<dyn BufRead> = match compression {
        Compression::None => Box::new(raw),
        // Multi-member: `cat a.gz b.gz` and bgzip output are valid gzip streams.
        Compression::Gzip => Box::new(BufReader::with_capacity(1 << 20, MultiGzDecoder::new(raw))),
        Compression::Zstd => Box::new(BufReader::with_capacity(
            1 << 20,
            zstd::stream::read::Decoder::with_buffer(raw)
                .with_context(|| format!("input {name}: not a zstd stream"))?,
        )),
    };
    let mut skipped = 0u64;
    let mut bad = |what: String| -> Result<()> {
        if opts.skip_bad_records {
            skipped += 1;
            tracing::debug!("skipped {what}");
            Ok(())
        } else {
            bail!("{what} (pass --skip-bad-records to count and skip broken records)")
        }
    };
    let mut line = Vec::new();
    let mut doc = String::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                // A truncated or corrupt compressed stream: what follows cannot be read.
                bad(format!(
                    "input {name}: unreadable after line {line_no}: {e}"
                ))?;
                break;
            }
        }
        line_no += 1;
        let Ok(text) = std::str::from_utf8(&line) else {
            bad(format!("input {name}:{line_no}: not UTF-8"))?;
            continue;
        };
        if json {
            if text.trim().is_empty() {
                continue;
            }
            match document_of(text, &opts.text_field) {
                Ok(d) => each(d)?,
                Err(why) => bad(format!("input {name}:{line_no}: {why}"))?,
            }
        } else if text.trim().is_empty() {
            each(end_document(&mut doc))?;
        } else {
            doc.push_str(text);
            // A text without blank lines must not become one document the size of its file.
            if doc.len() >= MAX_TEXT_DOCUMENT {
                each(end_document(&mut doc))?;
            }
        }
    }
    each(end_document(&mut doc))?;
    Ok(skipped)
}

/// The longest `.txt` document: longer runs of lines without a blank one are cut at a line.
const MAX_TEXT_DOCUMENT: usize = 16 << 20;

/// A text document: its lines, without the line break that ends the last one, so a paragraph
/// reads the same as the string a JSON line would hold.
fn end_document(doc: &mut String) -> String {
    let mut d = std::mem::take(doc);
    let kept = d.trim_end_matches(['\n', '\r']).len();
    d.truncate(kept);
    d
}

/// The text field of one JSON line, or why it has none.
fn document_of(line: &str, field: &str) -> std::result::Result<String, String> {
    let mut object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line)
        .map_err(|e| format!("not a JSON object ({e}); expected one object per line"))?;
    match object.remove(field) {
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(serde_json::Value::Null) => Ok(String::new()),
        Some(_) => Err(format!("field `{field}` is not a string")),
        None => Err(format!("no field `{field}` (set --text-field)")),
    }
}
