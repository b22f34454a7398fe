use spes_data::{
    tokenize, Loader, Manifest, TokenDtype, TokenizeOptions, TokenizerSource, ValWindows,
};
use std::path::{Path, PathBuf};

fn corpus(dir: &Path) -> PathBuf {
    // Real English: the first 120 kB of the repository's corpus, as paragraphs.
    let path = dir.join("corpus.txt");
    std::fs::write(&path, spes_data::testing::corpus_text(120_000)).unwrap();
    path
}

fn tokenized(dir: &Path, vocab: usize) -> Manifest {
    let input = corpus(dir);
    let mut opts = TokenizeOptions::new(
        vec![input.display().to_string()],
        dir.join("tok"),
        TokenizerSource::Train(vocab),
    );
    opts.progress = false;
    opts.val_fraction = 0.05;
    opts.shard_tokens = 10_000;
    tokenize(&opts).unwrap().manifest
}

#[test]
fn tokenize_writes_shards_manifest_and_a_reusable_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tokenized(tmp.path(), 1000);
    assert_eq!(m.dtype, TokenDtype::Uint16);
    assert!(
        m.vocab_size <= 1000 && m.vocab_size > 900,
        "{}",
        m.vocab_size
    );
    assert!(m.train.len() >= 3, "small shards: {}", m.train.len());
    assert!(m.val_documents > 0 && m.train_documents > 10 * m.val_documents);
    let reloaded = Manifest::load(&tmp.path().join("tok")).unwrap();
    assert_eq!(reloaded.train_tokens, m.train_tokens);
    // Shards are plain .npy: header magic and the uint16 dtype string.
    let bytes = std::fs::read(tmp.path().join("tok").join(&m.train[0].file)).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    assert!(String::from_utf8_lossy(&bytes[..128]).contains("'<u2'"));
    // Documents end with EOS, and a loaded tokenizer reproduces the same ids.
    let tok = tokenizers::Tokenizer::from_file(tmp.path().join("tok/tokenizer.json")).unwrap();
    let mut loader = Loader::open(&tmp.path().join("tok"), 64, 0, 0).unwrap();
    let batch = loader.next_batch(50);
    assert!(batch.contains(&(m.eos_id as i64)));
    let again = tok.encode("First Citizen:", false).unwrap();
    let mut opts = TokenizeOptions::new(
        vec![corpus(tmp.path()).display().to_string()],
        tmp.path().join("tok2"),
        TokenizerSource::File(tmp.path().join("tok/tokenizer.json")),
    );
    opts.progress = false;
    opts.val_fraction = 0.05;
    let m2 = tokenize(&opts).unwrap().manifest;
    assert_eq!(
        m2.train_tokens, m.train_tokens,
        "same tokenizer, same split, same count"
    );
    assert!(!again.get_ids().is_empty());
}

#[test]
fn a_large_vocabulary_gets_uint32_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let input = corpus(tmp.path());
    let neox = spes_data::testing::neox_tokenizer(tmp.path());
    let mut opts = TokenizeOptions::new(
        vec![input.display().to_string()],
        tmp.path().join("tok"),
        TokenizerSource::File(neox),
    );
    opts.progress = false;
    let m = tokenize(&opts).unwrap().manifest;
    assert!(m.vocab_size > 50_000);
    assert_eq!(m.dtype, TokenDtype::for_vocab(m.vocab_size));
    // Sanity: a 50k vocabulary still fits uint16; force the uint32 path through the writer.
    assert_eq!(TokenDtype::for_vocab(70_000), TokenDtype::Uint32);
    let info =
        spes_data::shard::write_shard(tmp.path(), "big", &[70_000, 1, 2], TokenDtype::Uint32)
            .unwrap();
    let shard = spes_data::shard::Shard::open(tmp.path(), &info, TokenDtype::Uint32).unwrap();
    let mut out = Vec::new();
    shard.read_into(0, 3, &mut out);
    assert_eq!(out, vec![70_000, 1, 2]);
}

#[test]
fn loader_is_deterministic_resumable_and_covers_every_window() {
    let tmp = tempfile::tempdir().unwrap();
    tokenized(tmp.path(), 600);
    let dir = tmp.path().join("tok");
    let mut a = Loader::open(&dir, 32, 7, 0).unwrap();
    let epoch = a.windows_per_epoch();
    let first: Vec<Vec<i64>> = (0..5).map(|_| a.next_batch(4)).collect();
    let mut b = Loader::open(&dir, 32, 7, 8).unwrap();
    assert_eq!(
        b.next_batch(4),
        first[2],
        "resume from position 8 == third batch"
    );
    let mut c = Loader::open(&dir, 32, 8, 0).unwrap();
    assert_ne!(c.next_batch(4), first[0], "another seed, another order");
    // One epoch visits each window exactly once: windows are distinct slices.
    let mut d = Loader::open(&dir, 32, 7, 0).unwrap();
    let all = d.next_batch(epoch as usize);
    let mut rows: Vec<&[i64]> = all.chunks(33).collect();
    rows.sort();
    rows.dedup();
    assert_eq!(rows.len() as u64, epoch);
    // The next epoch is reshuffled differently.
    let next = d.next_batch(4);
    assert_ne!(next, first[0]);
    let val = ValWindows::open(&dir, 32).unwrap();
    let batches = val.batches(3, 2);
    assert!(!batches.is_empty() && batches.iter().all(|(n, v)| v.len() == n * 33));
}

#[test]
fn corrupt_or_truncated_shards_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tokenized(tmp.path(), 600);
    let dir = tmp.path().join("tok");
    let shard = dir.join(&m.train[1].file);
    let original = std::fs::read(&shard).unwrap();

    std::fs::write(&shard, &original[..original.len() / 2]).unwrap();
    let err = Loader::open(&dir, 32, 0, 0).err().unwrap().to_string();
    assert!(
        err.contains(&m.train[1].file) && err.contains("truncated"),
        "{err}"
    );

    let mut flipped = original.clone();
    flipped[200] ^= 0xff;
    std::fs::write(&shard, &flipped).unwrap();
    let err = Loader::open(&dir, 32, 0, 0).err().unwrap().to_string();
    assert!(
        err.contains(&m.train[1].file) && err.contains("corrupt"),
        "{err}"
    );

    std::fs::write(&shard, &original).unwrap();
    Loader::open(&dir, 32, 0, 0).unwrap();
    std::fs::write(dir.join("manifest.json"), "{ not json").unwrap();
    let err = Loader::open(&dir, 32, 0, 0).err().unwrap().to_string();
    assert!(err.contains("manifest.json"), "{err}");
}

#[test]
fn bad_inputs_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut opts = TokenizeOptions::new(
        vec![tmp.path().join("nope-*.txt").display().to_string()],
        tmp.path().join("tok"),
        TokenizerSource::Train(500),
    );
    opts.progress = false;
    let err = tokenize(&opts).unwrap_err().to_string();
    assert!(
        err.contains("nope-*.txt") && err.contains("matches no file"),
        "{err}"
    );

    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n").unwrap();
    opts.inputs = vec![bad.display().to_string()];
    let err = format!("{:#}", tokenize(&opts).unwrap_err());
    assert!(
        err.contains("bad.jsonl:2") && err.contains("`text`"),
        "{err}"
    );
}

#[test]
fn jsonl_gz_documents_are_read() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("docs.jsonl.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&path).unwrap(),
        flate2::Compression::default(),
    );
    for i in 0..400 {
        writeln!(
            gz,
            "{}",
            serde_json::json!({"text": format!("document number {i} says hello world")})
        )
        .unwrap();
    }
    gz.finish().unwrap();
    let mut opts = TokenizeOptions::new(
        vec![path.display().to_string()],
        tmp.path().join("tok"),
        TokenizerSource::Train(300),
    );
    opts.progress = false;
    let m = tokenize(&opts).unwrap().manifest;
    assert_eq!(m.train_documents + m.val_documents, 400);
}
