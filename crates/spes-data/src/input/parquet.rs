//! Parquet corpora: one string column of documents, streamed a row group at a time and a
//! batch of records at a time within it, so a file never sits in memory whole.

use super::ReadOptions;
use anyhow::{bail, Context, Result};
use parquet::basic::Type as Physical;
use parquet::column::reader::get_typed_column_reader;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::{FileReader, SerializedFileReader};
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Records decoded per read within a row group.
const BATCH: usize = 256;

/// Reads the documents of column `opts.text_field`; returns the records skipped with their
/// broken row groups.
pub(super) fn read(
    path: &Path,
    opts: &ReadOptions,
    progress: &AtomicU64,
    each: &mut dyn FnMut(String) -> Result<()>,
) -> Result<u64> {
    let name = path.display();
    let file = File::open(path).with_context(|| format!("cannot open input {name}"))?;
    let reader = SerializedFileReader::new(file)
        .with_context(|| format!("input {name}: not a readable parquet file"))?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let field = &opts.text_field;
    let Some(column) = schema
        .columns()
        .iter()
        .position(|c| c.path().string() == *field)
    else {
        let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
        bail!(
            "input {name}: no column `{field}` (set --text-field); columns: {}",
            names.join(", ")
        );
    };
    let descr = schema.column(column);
    if descr.physical_type() != Physical::BYTE_ARRAY || descr.max_rep_level() > 0 {
        bail!("input {name}: column `{field}` is not a string column");
    }
    let nullable = descr.max_def_level() > 0;
    let mut skipped = 0u64;
    for group in 0..reader.num_row_groups() {
        let meta = reader.metadata().row_group(group);
        let rows = meta.num_rows().max(0) as u64;
        let bytes = meta.compressed_size().max(0) as u64;
        let mut done = 0u64;
        let mut bad_values = 0u64;
        // The parquet crate can panic on corrupt pages: that is a broken row group too.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            read_group(
                &reader,
                group,
                column,
                nullable,
                opts,
                &mut done,
                &mut bad_values,
                each,
            )
        }))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the parquet reader panicked on its pages")));
        if bad_values > 0 {
            tracing::debug!(
                "input {name}: row group {group}: skipped {bad_values} values that are not UTF-8"
            );
            skipped += bad_values;
        }
        progress.fetch_add(bytes, Ordering::Relaxed);
        if let Err(e) = result {
            if e.is::<Pass>() {
                // The callback failed (a full disk, say), not the file: never skip that.
                return Err(e.downcast::<Pass>().expect("checked").0);
            }
            let what =
                format!("input {name}: row group {group} ({rows} rows) is unreadable: {e:#}");
            if !opts.skip_bad_records {
                bail!("{what} (pass --skip-bad-records to count and skip broken records)");
            }
            tracing::debug!("skipped {what}");
            skipped += rows.saturating_sub(done);
        }
    }
    Ok(skipped)
}

/// An error of the document callback carried through a row group's read unchanged.
#[derive(Debug)]
struct Pass(anyhow::Error);

impl std::fmt::Display for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Pass {}

#[allow(clippy::too_many_arguments)]
fn read_group(
    reader: &SerializedFileReader<File>,
    group: usize,
    column: usize,
    nullable: bool,
    opts: &ReadOptions,
    done: &mut u64,
    bad_values: &mut u64,
    each: &mut dyn FnMut(String) -> Result<()>,
) -> Result<()> {
    let rg = reader.get_row_group(group)?;
    // The column's physical type was checked against the schema, so this cannot panic.
    let mut col = get_typed_column_reader::<ByteArrayType>(rg.get_column_reader(column)?);
    let mut values: Vec<ByteArray> = Vec::with_capacity(BATCH);
    let mut defs: Vec<i16> = Vec::with_capacity(BATCH);
    loop {
        values.clear();
        defs.clear();
        let (records, _, _) =
            col.read_records(BATCH, nullable.then_some(&mut defs), None, &mut values)?;
        if records == 0 {
            return Ok(());
        }
        for v in values.drain(..) {
            match String::from_utf8(v.data().to_vec()) {
                Ok(text) => each(text).map_err(|e| anyhow::Error::new(Pass(e)))?,
                // One bad value is one bad record, not its whole row group.
                Err(_) if opts.skip_bad_records => *bad_values += 1,
                Err(_) => bail!("a value of the text column is not UTF-8"),
            }
        }
        *done += records as u64;
    }
}
