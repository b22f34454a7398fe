//! Test support for the workspace's crates (feature `test-support`): small real corpora from
//! `../shared`, tokenized the same way everywhere.

use crate::{tokenize, TokenizeOptions, TokenizerSource};
use std::path::{Path, PathBuf};

/// `../shared` next to the workspace root.
pub fn shared(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
}

/// The first `bytes` bytes of Shakespeare tokenized with a 512-token BPE into `<dir>/data`
/// (5 % of documents held out); returns that directory.
pub fn shakespeare(dir: &Path, bytes: usize) -> PathBuf {
    let src = shared("data/tinyshakespeare.txt");
    let text = std::fs::read_to_string(&src)
        .unwrap_or_else(|e| panic!("tests need {}: {e}", src.display()));
    let input = dir.join("corpus.txt");
    std::fs::write(&input, &text[..bytes.min(text.len())]).expect("writable temp dir");
    let out = dir.join("data");
    let mut opts = TokenizeOptions::new(
        vec![input.display().to_string()],
        out.clone(),
        TokenizerSource::Train(512),
    );
    opts.progress = false;
    opts.val_fraction = 0.05;
    tokenize(&opts).expect("tokenizing the sample");
    out
}
