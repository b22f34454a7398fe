//! Corpora at scale: every input format gives the same tokens, broken records are named or
//! counted, runs resume byte-identically and do not depend on the thread count, parts split the
//! input list, mixtures keep their weights, and token files other tools wrote train as spes's.

use spes_data::import::{import, write_megatron, ImportOptions};
use spes_data::{
    tokenize, Loader, Manifest, Part, Share, Source, TokenDtype, TokenizeOptions, TokenizerSource,
    ValWindows,
};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The fixtures' GPT-NeoX tokenizer, unpacked once into this test binary's temp directory.
fn shared_tokenizer() -> PathBuf {
    spes_data::testing::neox_tokenizer(Path::new(env!("CARGO_TARGET_TMPDIR")))
}

/// The first `n` documents of the repository's corpus (one paragraph each).
fn documents(n: usize) -> Vec<String> {
    let mut docs = spes_data::testing::corpus_documents();
    assert!(docs.len() >= n, "the corpus has {} documents", docs.len());
    docs.truncate(n);
    docs
}

fn jsonl(docs: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for d in docs {
        writeln!(
            out,
            "{}",
            serde_json::json!({ "text": d, "meta": {"n": d.len()} })
        )
        .unwrap();
    }
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

/// A parquet file with a `text` column and an `id` column, `per_group` rows a row group.
fn write_parquet(path: &Path, docs: &[String], per_group: usize) {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let schema = Arc::new(
        parse_message_type("message doc { required int64 id; optional binary text (UTF8); }")
            .unwrap(),
    );
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    for (g, chunk) in docs.chunks(per_group).enumerate() {
        let mut rg = w.next_row_group().unwrap();
        let mut id = rg.next_column().unwrap().unwrap();
        let ids: Vec<i64> = (0..chunk.len())
            .map(|i| (g * per_group + i) as i64)
            .collect();
        id.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        id.close().unwrap();
        let mut text = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = chunk.iter().map(|d| ByteArray::from(d.as_str())).collect();
        let defs = vec![1i16; chunk.len()];
        text.typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .unwrap();
        text.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn options(inputs: Vec<PathBuf>, out: PathBuf) -> TokenizeOptions {
    let mut opts = TokenizeOptions::new(
        inputs.iter().map(|p| p.display().to_string()).collect(),
        out,
        TokenizerSource::File(shared_tokenizer()),
    );
    opts.progress = false;
    opts.val_fraction = 0.0;
    opts
}

/// Every token of a tokenized directory's train split, in stream order.
fn stream(dir: &Path) -> Vec<i64> {
    let m = Manifest::load(dir).unwrap();
    let mut out = Vec::new();
    for info in &m.train {
        let shard = spes_data::shard::Shard::open(dir, info, m.dtype).unwrap();
        shard.read_into(0, shard.len() as usize, &mut out);
    }
    out
}

/// Every file of a directory with its bytes, hidden ones included.
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            out.insert(
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            );
        } else {
            out.insert(format!("{}/", p.display()), Vec::new());
        }
    }
    out
}

#[test]
fn every_format_gives_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = documents(300);
    let t = tmp.path();
    let txt = t.join("docs.txt");
    std::fs::write(&txt, docs.join("\n\n")).unwrap();
    let body = jsonl(&docs);
    std::fs::write(t.join("docs.jsonl"), &body).unwrap();
    std::fs::write(t.join("docs.jsonl.gz"), gzip(&body)).unwrap();
    std::fs::write(t.join("docs.json.gz"), gzip(&body)).unwrap();
    std::fs::write(
        t.join("docs.jsonl.zst"),
        zstd::encode_all(&body[..], 3).unwrap(),
    )
    .unwrap();
    write_parquet(&t.join("docs.parquet"), &docs, 64);
    let reference = {
        let m = tokenize(&options(vec![txt], t.join("out-txt")))
            .unwrap()
            .manifest;
        assert_eq!(m.train_documents, 300);
        stream(&t.join("out-txt"))
    };
    for name in [
        "docs.jsonl",
        "docs.jsonl.gz",
        "docs.json.gz",
        "docs.jsonl.zst",
        "docs.parquet",
    ] {
        let out = t.join(format!("out-{name}"));
        let m = tokenize(&options(vec![t.join(name)], out.clone()))
            .unwrap()
            .manifest;
        assert_eq!(m.train_documents, 300, "{name}");
        let got = stream(&out);
        let first_difference = got.iter().zip(&reference).position(|(a, b)| a != b);
        assert!(
            got.len() == reference.len() && first_difference.is_none(),
            "{name} tokenizes differently: {} tokens against {}, first difference at {first_difference:?}",
            got.len(),
            reference.len()
        );
    }
    // A directory is searched for corpus files: all six, in name order.
    let m = tokenize(&options(vec![t.to_owned()], t.join("../all-of-it"))).unwrap();
    assert_eq!(m.manifest.inputs.len(), 6);
    assert_eq!(m.manifest.train_documents, 6 * 300);
    std::fs::remove_dir_all(t.join("../all-of-it")).unwrap();
}

#[test]
fn broken_records_are_named_or_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let docs = documents(40);
    let mut body = jsonl(&docs[..20]);
    body.extend_from_slice(b"{\"text\": \"cut short\n");
    body.extend_from_slice(&jsonl(&docs[20..]));
    let bad = t.join("bad.jsonl.zst");
    std::fs::write(&bad, zstd::encode_all(&body[..], 3).unwrap()).unwrap();
    let err = format!(
        "{:#}",
        tokenize(&options(vec![bad.clone()], t.join("a"))).unwrap_err()
    );
    assert!(
        err.contains("bad.jsonl.zst:21") && err.contains("--skip-bad-records"),
        "{err}"
    );
    let mut opts = options(vec![bad], t.join("b"));
    opts.skip_bad_records = true;
    let m = tokenize(&opts).unwrap().manifest;
    assert_eq!((m.skipped_records, m.train_documents), (1, 40));

    // A row group whose pages are garbage: the error names it; skipping counts its rows.
    let pq = t.join("bad.parquet");
    write_parquet(&pq, &docs, 10);
    let mut bytes = std::fs::read(&pq).unwrap();
    let (start, len) = {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let r = SerializedFileReader::new(std::fs::File::open(&pq).unwrap()).unwrap();
        let col = r.metadata().row_group(2).column(1);
        let (s, l) = col.byte_range();
        (s as usize, l as usize)
    };
    bytes[start..start + len].iter_mut().for_each(|b| *b = 0xA5);
    std::fs::write(&pq, &bytes).unwrap();
    let err = format!(
        "{:#}",
        tokenize(&options(vec![pq.clone()], t.join("c"))).unwrap_err()
    );
    assert!(err.contains("bad.parquet: row group 2 (10 rows)"), "{err}");
    let mut opts = options(vec![pq], t.join("d"));
    opts.skip_bad_records = true;
    let m = tokenize(&opts).unwrap().manifest;
    assert_eq!((m.skipped_records, m.train_documents), (10, 30));
}

/// Inputs for the resume and thread tests: several files of each kind.
fn corpus_files(t: &Path) -> Vec<PathBuf> {
    let docs = documents(600);
    let mut files = Vec::new();
    for (i, chunk) in docs.chunks(100).enumerate() {
        let path = t.join(format!("in/part-{i}.jsonl.zst"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, zstd::encode_all(&jsonl(chunk)[..], 3).unwrap()).unwrap();
        files.push(path);
    }
    files
}

#[test]
fn output_is_the_same_for_any_thread_count_and_after_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let files = corpus_files(t);
    let run = |out: &str, threads: usize| {
        let mut opts = options(files.clone(), t.join(out));
        opts.val_fraction = 0.1;
        opts.shard_tokens = 4000;
        opts.threads = threads;
        opts
    };
    tokenize(&run("one", 1)).unwrap();
    tokenize(&run("two", 2)).unwrap();
    let one = tree(&t.join("one"));
    assert!(one.keys().filter(|k| k.starts_with("train-")).count() > 6);
    assert_eq!(one, tree(&t.join("two")), "1 and 2 threads differ");

    // A run that dies at its third file (garbage of the same size, as a crash mid-file
    // leaves the inputs unchanged): the files before it are recorded, a temp file is left
    // behind, and no manifest is written. Run again, it resumes and ends identical.
    let third = std::fs::read(&files[2]).unwrap();
    std::fs::write(&files[2], vec![0x5Au8; third.len()]).unwrap();
    assert!(tokenize(&run("resumed", 1)).is_err());
    let resumed = t.join("resumed");
    assert!(!resumed.join("manifest.json").exists());
    std::fs::write(
        resumed.join("train-000002-000.npy.tmp-999"),
        b"half a shard",
    )
    .unwrap();
    std::fs::write(&files[2], &third).unwrap();
    let report = tokenize(&run("resumed", 2)).unwrap();
    assert!(
        (2..6).contains(&report.resumed_files),
        "{}",
        report.resumed_files
    );
    assert_eq!(
        tree(&resumed),
        one,
        "a resumed run differs from an uninterrupted one"
    );
}

#[test]
fn parts_split_the_input_list_and_keep_each_files_split() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let files = corpus_files(t);
    let mut whole = options(files.clone(), t.join("whole"));
    whole.val_fraction = 0.1;
    let whole = tokenize(&whole).unwrap().manifest;
    let mut parts = Vec::new();
    for p in 0..3 {
        let mut opts = options(files.clone(), t.join(format!("part-{p}")));
        opts.val_fraction = 0.1;
        opts.part = Some(Part { index: p, of: 3 });
        let m = tokenize(&opts).unwrap().manifest;
        assert_eq!(m.part, Some(Part { index: p, of: 3 }));
        assert_eq!(m.inputs.len(), 2, "six files dealt to three parts");
        parts.push(m);
    }
    let sum = |f: fn(&Manifest) -> u64| parts.iter().map(f).sum::<u64>();
    assert_eq!(sum(|m| m.train_tokens), whole.train_tokens);
    assert_eq!(sum(|m| m.val_tokens), whole.val_tokens);
    assert_eq!(Part::parse("3/16").unwrap(), Part { index: 3, of: 16 });
    assert!(Part::parse("16/16").is_err() && Part::parse("x").is_err());
}

#[test]
fn a_mixture_draws_by_weight_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let files = corpus_files(t);
    let mut a = options(files[..3].to_vec(), t.join("a"));
    a.val_fraction = 0.1;
    let mut b = options(files[3..].to_vec(), t.join("b"));
    b.val_fraction = 0.1;
    tokenize(&a).unwrap();
    tokenize(&b).unwrap();
    let sources = [
        Source {
            path: t.join("a"),
            weight: 0.75,
        },
        Source {
            path: t.join("b"),
            weight: 0.25,
        },
    ];
    let mut loader = Loader::open_mixture(&sources, 32, 5, 0).unwrap();
    let first = loader.next_batch(10_000);
    let share = loader.drawn()[0] as f64 / 10_000.0;
    assert!((share - 0.75).abs() <= 0.0075, "first source drew {share}");
    let mut resumed = Loader::open_mixture(&sources, 32, 5, 6_000).unwrap();
    assert_eq!(resumed.next_batch(4_000), first[6_000 * 33..]);
    // Three readers of the seed, each taking every third draw, read between them the stream
    // one reader reads, in its order, and each resumes where it stopped.
    let row = 33;
    for index in 0..3 {
        let share = Share { index, of: 3 };
        let mine = Loader::open_share(&sources, 32, 5, 0, share)
            .unwrap()
            .next_batch(3_000);
        for (i, w) in mine.chunks(row).enumerate() {
            let at = i * 3 + index as usize;
            assert_eq!(
                w,
                &first[at * row..(at + 1) * row],
                "reader {index}, draw {i}"
            );
        }
        let mut again = Loader::open_share(&sources, 32, 5, 1_000, share).unwrap();
        assert_eq!(again.next_batch(2_000), mine[1_000 * row..]);
        assert_eq!(again.drawn().iter().sum::<u64>(), 3_000);
    }
    // Windows of the first source come from its tokens alone: its share of windows that
    // exist only there.
    let val = ValWindows::open_mixture(&sources, 32).unwrap();
    assert!(!val.batches(8, 4).is_empty());
    // Mixtures combine with parts: each source a part of its own list.
    let mut pa = options(files[..3].to_vec(), t.join("pa"));
    pa.part = Some(Part { index: 0, of: 2 });
    pa.val_fraction = 0.1;
    tokenize(&pa).unwrap();
    let parted = [
        Source {
            path: t.join("pa"),
            weight: 0.5,
        },
        Source {
            path: t.join("b"),
            weight: 0.5,
        },
    ];
    let mut l = Loader::open_mixture(&parted, 32, 5, 0).unwrap();
    l.next_batch(100);
    assert!(l.drawn()[0].abs_diff(50) <= 2, "{:?}", l.drawn());
    // Sources made with other tokenizers do not mix.
    let mut other = TokenizeOptions::new(
        vec![files[0].display().to_string()],
        t.join("other"),
        TokenizerSource::Train(300),
    );
    other.progress = false;
    other.val_fraction = 0.1;
    tokenize(&other).unwrap();
    let bad = [
        sources[0].clone(),
        Source {
            path: t.join("other"),
            weight: 1.0,
        },
    ];
    let err = Loader::open_mixture(&bad, 32, 5, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("different tokenizers"), "{err}");
}

#[test]
fn token_files_of_other_tools_give_spes_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let files = corpus_files(t);
    let ours = t.join("ours");
    let m = tokenize(&options(files, ours.clone())).unwrap().manifest;
    let tokens: Vec<u16> = stream(&ours).iter().map(|&x| x as u16).collect();
    assert_eq!(m.dtype, TokenDtype::Uint16);
    let val = 500u64;
    // spes's reference: the same tokens with the last 500 held out.
    let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|t| t.to_le_bytes()).collect() };
    let split = tokens.len() - val as usize;

    // Headerless memmap named .npy (OLMo's), a real NumPy .npy, and Megatron .bin/.idx.
    let raw = t.join("olmo-tokens.npy");
    std::fs::write(&raw, bytes(&tokens)).unwrap();
    let npy = t.join("numpy");
    std::fs::create_dir_all(&npy).unwrap();
    spes_data::shard::write_shard(
        &npy,
        "tokens",
        &tokens.iter().map(|&x| x as u32).collect::<Vec<_>>(),
        TokenDtype::Uint16,
    )
    .unwrap();
    let npy = npy.join("tokens-000.npy");
    let docs: Vec<Vec<u16>> = tokens.chunks(777).map(<[u16]>::to_vec).collect();
    let mega = t.join("mega_text_document");
    write_megatron(&mega, &docs).unwrap();

    let imported = |name: &str, input: PathBuf, dtype: Option<TokenDtype>, val: u64| -> PathBuf {
        let out = t.join(name);
        let m = import(&ImportOptions {
            inputs: vec![input],
            out: out.clone(),
            tokenizer: shared_tokenizer(),
            eos_token: None,
            dtype,
            val_tokens: val,
        })
        .unwrap();
        assert_eq!(
            (m.train_tokens, m.val_tokens),
            (tokens.len() as u64 - val, val),
            "{name}"
        );
        out
    };
    // The same tokens tokenized by spes give the same batches from every layout.
    let expected = Loader::open(&ours, 64, 3, 0).unwrap().next_batch(24);
    let dirs = [
        imported("from-raw", raw.clone(), Some(TokenDtype::Uint16), 0),
        imported("from-npy", npy.clone(), None, 0),
        imported("from-megatron", mega.with_extension("bin"), None, 0),
    ];
    for dir in &dirs {
        let mut l = Loader::open(dir, 64, 3, 0).unwrap();
        assert_eq!(l.next_batch(24), expected, "{}", dir.display());
    }
    // With the last file's tail held out, the validation split reads it.
    let held = imported("held-out", mega.with_extension("bin"), None, val);
    let v = ValWindows::open(&held, 64).unwrap().batches(1, 1);
    assert_eq!(v[0].1[..], stream(&ours)[split..split + 65]);
    // A headerless file without a dtype is refused, never read as tokens.
    let err = import(&ImportOptions {
        inputs: vec![raw],
        out: t.join("refused"),
        tokenizer: shared_tokenizer(),
        eos_token: None,
        dtype: None,
        val_tokens: val,
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("--dtype"), "{err}");
}

#[test]
fn a_tokenizer_made_for_inference_neither_truncates_nor_pads_documents() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let docs = documents(50);
    let input = t.join("docs.jsonl");
    std::fs::write(&input, jsonl(&docs)).unwrap();
    let plain = tokenize(&options(vec![input.clone()], t.join("plain")))
        .unwrap()
        .manifest;
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shared_tokenizer()).unwrap()).unwrap();
    json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0});
    json["padding"] = serde_json::json!({"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": null, "pad_id": 1, "pad_type_id": 0, "pad_token": "<|padding|>"});
    let limited = t.join("limited.json");
    std::fs::write(&limited, json.to_string()).unwrap();
    let mut opts = options(vec![input], t.join("limited"));
    opts.tokenizer = TokenizerSource::File(limited);
    let m = tokenize(&opts).unwrap().manifest;
    assert_eq!(m.train_tokens, plain.train_tokens);
    assert_eq!(stream(&t.join("limited")), stream(&t.join("plain")));
}
