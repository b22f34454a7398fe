//! Test support for the workspace's crates (feature `test-support`): a small real corpus from
//! the repository itself (the demo's embedded corpus, `crates/spes-cli/assets/`), tokenized the
//! same way everywhere, so the tests need nothing beside the checkout.

use crate::{tokenize, TokenizeOptions, TokenizerSource};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// `fixtures/<rel>` of the repository (small slices of public datasets, licences in
/// `fixtures/README.md`).
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(rel)
}

/// The fixtures' real Hugging Face tokenizer (GPT-NeoX BPE, 50k entries), unpacked into `dir`
/// once (written whole under a temporary name, then renamed, so concurrent tests agree).
pub fn neox_tokenizer(dir: &Path) -> PathBuf {
    let path = dir.join("gpt-neox-olmo-dolma-v1_5.json");
    if !path.exists() {
        let gz = fixture("tokenizers/gpt-neox-olmo-dolma-v1_5.json.gz");
        let mut json = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(std::fs::File::open(&gz).expect("the fixture")),
            &mut json,
        )
        .expect("a gzipped tokenizer");
        std::fs::create_dir_all(dir).expect("a writable directory");
        let tmp = dir.join(format!(
            "tokenizer.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&tmp, json).expect("a writable directory");
        std::fs::rename(&tmp, &path).expect("a writable directory");
    }
    path
}

/// The demo's corpus (Debian fortunes, BSD licence: `assets/DEFAULT-CORPUS-LICENSE` beside it).
pub fn corpus_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../spes-cli/assets/default-corpus.jsonl.gz")
}

/// The corpus's documents in order, each trimmed, those that are blank or hold a blank line
/// left out (so each is one paragraph of a text file whose paragraphs are documents).
pub fn corpus_documents() -> Vec<String> {
    let file = std::fs::File::open(corpus_file())
        .unwrap_or_else(|e| panic!("{}: {e}", corpus_file().display()));
    BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|l| {
            let l = l.expect("the corpus is gzipped UTF-8");
            let v: serde_json::Value = serde_json::from_str(&l).expect("a JSON line");
            v["text"].as_str().expect("a text field").trim().to_owned()
        })
        .filter(|d| !d.is_empty() && !d.lines().any(|l| l.trim().is_empty()))
        .collect()
}

/// The first `bytes` bytes (or fewer, ending at a character) of the corpus's documents as
/// paragraphs of one text, separated by blank lines.
pub fn corpus_text(bytes: usize) -> String {
    let mut text = String::new();
    for d in corpus_documents() {
        if text.len() >= bytes {
            break;
        }
        text.push_str(&d);
        text.push_str("\n\n");
    }
    let mut end = bytes.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

/// The first `bytes` bytes of the corpus ([`corpus_text`]) tokenized with a 512-token BPE into
/// `<dir>/data` (5 % of documents held out); returns that directory.
pub fn small_corpus(dir: &Path, bytes: usize) -> PathBuf {
    let input = dir.join("corpus.txt");
    std::fs::write(&input, corpus_text(bytes)).expect("writable temp dir");
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
