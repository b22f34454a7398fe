//! `data.partition = "disjoint"` on loopback: each node's data directory holds only its own
//! part of the corpus, no part gets two live readers, a node whose data was tokenized with
//! another tokenizer stops before training, and the round records say who read what.

mod common;

use common::*;
use spes_data::{tokenize, Part, TokenizeOptions, TokenizerSource};
use spes_train::metrics::RoundRecord;
use std::path::{Path, PathBuf};

/// 160 kB of the tests' corpus cut into four files; the whole list tokenized for the server,
/// and parts 0/2 and 1/2 of the same list with its tokenizer, each in its own directory as on
/// its own machine.
fn corpus(dir: &Path) -> (PathBuf, [PathBuf; 2]) {
    let text = spes_data::testing::corpus_text(160_000);
    assert!(text.is_ascii(), "byte chunks cut no character");
    let mut inputs = Vec::new();
    for (i, chunk) in text.as_bytes().chunks(40_000).enumerate() {
        let path = dir.join(format!("in/{i}.txt"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, chunk).unwrap();
        inputs.push(path.display().to_string());
    }
    let run = |out: PathBuf, tokenizer: TokenizerSource, part: Option<Part>| {
        let mut o = TokenizeOptions::new(inputs.clone(), out.clone(), tokenizer);
        o.progress = false;
        o.val_fraction = 0.05;
        o.part = part;
        tokenize(&o).unwrap();
        out
    };
    let whole = run(dir.join("whole"), TokenizerSource::Train(512), None);
    let tok = TokenizerSource::File(whole.join("tokenizer.json"));
    let parts = [0, 1].map(|p| {
        run(
            dir.join(format!("part-{p}")),
            tok.clone(),
            Some(Part { index: p, of: 2 }),
        )
    });
    (whole, parts)
}

#[test]
fn disjoint_parts_train_with_one_reader_each() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, parts) = corpus(tmp.path());
    let disjoint = ["data.partition=disjoint"];
    let server_cfg = config(&whole, "spes", 2, &disjoint);
    let server = Server::start(server_cfg.clone(), &tmp.path().join("server"), None);
    let node_cfg = |data: &Path| {
        let mut c = server_cfg.clone();
        c.data.path = data.to_owned();
        c
    };
    let nodes = tmp.path().join("nodes");
    tch::set_num_threads(1);
    let first =
        spes_net::Node::connect(node_options(&node_cfg(&parts[0]), &server.url(), 0, &nodes))
            .unwrap();

    // A second reader of part 0 is refused while node 0 is live.
    let err = spes_net::Node::connect(node_options(&node_cfg(&parts[0]), &server.url(), 1, &nodes))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("is read by live node 0"),
        "{err:#}"
    );
    // A whole corpus where the run wants parts stops at the node.
    let err = spes_net::Node::connect(node_options(&node_cfg(&whole), &server.url(), 1, &nodes))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("holds a whole corpus"),
        "{err:#}"
    );
    // So does a part tokenized with another tokenizer.
    let mut other = TokenizeOptions::new(
        vec![tmp.path().join("in/1.txt").display().to_string()],
        tmp.path().join("other"),
        TokenizerSource::Train(400),
    );
    other.progress = false;
    other.val_fraction = 0.05;
    other.part = Some(Part { index: 0, of: 1 });
    tokenize(&other).unwrap();
    let err = spes_net::Node::connect(node_options(
        &node_cfg(&tmp.path().join("other")),
        &server.url(),
        1,
        &nodes,
    ))
    .err()
    .unwrap();
    assert!(format!("{err:#}").contains("another tokenizer"), "{err:#}");

    let second =
        spes_net::Node::connect(node_options(&node_cfg(&parts[1]), &server.url(), 1, &nodes))
            .unwrap();
    let runs = [first, second].map(|n| std::thread::spawn(move || n.run().unwrap()));
    for r in runs {
        assert_eq!(r.join().unwrap().steps, 6);
    }
    server.finish();
    let records: Vec<RoundRecord> =
        spes_train::metrics::read(&tmp.path().join("server/metrics.jsonl"));
    let closed: Vec<&RoundRecord> = records.iter().filter(|r| r.close.is_some()).collect();
    assert_eq!(closed.len(), 3);
    let ids = |p: &Path| spes_data::Manifest::load(p).unwrap().part_id().unwrap();
    for r in closed {
        assert_eq!(r.data_parts[&0], vec![ids(&parts[0])], "round {}", r.round);
        assert_eq!(r.data_parts[&1], vec![ids(&parts[1])], "round {}", r.round);
    }
}
