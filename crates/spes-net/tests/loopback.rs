//! SPES and DiLoCo over real gRPC on 127.0.0.1: a server and N nodes in one process.

mod common;

use common::*;
use spes_model::{MoeModel, Role};
use spes_net::proto::JoinRequest;
use spes_net::{payload, Limits, Node, NodeOptions};
use spes_sync::Named;
use spes_train::RunConfig;
use std::path::Path;
use std::sync::mpsc;
use tch::{Device, Kind, Tensor};

fn copy(named: &Named) -> Named {
    named.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
}

fn snapshot(node: &Node) -> Named {
    node.trainer
        .model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect()
}

/// What one node saw in one round.
struct Seen {
    peer: usize,
    round: u64,
    upload: Named,
    after_sync: Named,
}

/// Runs `nodes` nodes for `rounds` rounds in threads, checking each node's own invariants,
/// and returns what they uploaded and loaded.
fn run_nodes(cfg: &RunConfig, url: &str, out: &Path, rounds: u64) -> Vec<Seen> {
    tch::set_num_threads(1);
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..cfg.sync.nodes)
        .map(|peer| {
            let opts = node_options(cfg, url, peer, out);
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut node = Node::connect(opts).unwrap();
                let trained: std::collections::HashSet<String> =
                    node.upload_tensors().into_iter().map(|(n, _)| n).collect();
                // Optimizer state exists for exactly the uploaded (trained) tensors.
                let trained_bytes: u64 = node
                    .upload_tensors()
                    .iter()
                    .map(|(_, t)| t.numel() as u64 * 4)
                    .sum();
                assert_eq!(
                    node.trainer.opt.state_bytes(),
                    2 * trained_bytes,
                    "peer {peer}"
                );
                for name in node.trainer.opt.param_names() {
                    assert!(
                        trained.contains(name),
                        "peer {peer}: optimizer state for untrained `{name}`"
                    );
                }
                for round in 1..=rounds {
                    let before = snapshot(&node);
                    let upload = node.train_round().unwrap();
                    let upload_copy = copy(&upload);
                    let after_train = snapshot(&node);
                    for ((name, b), (_, a)) in before.iter().zip(&after_train) {
                        if trained.contains(name) {
                            assert!(!a.equal(b), "peer {peer}: trained `{name}` did not change");
                        } else {
                            assert!(
                                a.equal(b),
                                "peer {peer}: frozen `{name}` changed between syncs"
                            );
                        }
                    }
                    assert_eq!(node.sync(&upload).unwrap(), round);
                    tx.send(Seen {
                        peer,
                        round,
                        upload: upload_copy,
                        after_sync: snapshot(&node),
                    })
                    .unwrap();
                }
                node.run().unwrap()
            })
        })
        .collect();
    drop(tx);
    let seen: Vec<Seen> = rx.iter().collect();
    for t in threads {
        t.join().unwrap();
    }
    seen
}

fn check_rounds(cfg: &RunConfig, seen: &[Seen], rounds: u64, experts_averaged: bool) {
    let model = MoeModel::new(&cfg.model, Device::Cpu).unwrap();
    let roles: Vec<(String, Role)> = model
        .params()
        .into_iter()
        .map(|p| (p.name, p.role))
        .collect();
    for round in 1..=rounds {
        let this: Vec<&Seen> = seen.iter().filter(|s| s.round == round).collect();
        assert_eq!(
            this.len(),
            cfg.sync.nodes,
            "round {round}: every node synced"
        );
        // Every node holds bit-identical parameters after the round.
        for s in &this[1..] {
            for ((n, a), (_, b)) in this[0].after_sync.iter().zip(&s.after_sync) {
                assert!(
                    a.equal(b),
                    "round {round}: `{n}` differs between node {} and {}",
                    this[0].peer,
                    s.peer
                );
            }
        }
        let global = &this[0].after_sync;
        for ((name, role), (_, value)) in roles.iter().zip(global) {
            let uploads: Vec<&Tensor> = this
                .iter()
                .filter_map(|s| s.upload.iter().find(|(n, _)| n == name).map(|(_, t)| t))
                .collect();
            let averaged = *role == Role::Shared || experts_averaged;
            if averaged {
                assert_eq!(
                    uploads.len(),
                    cfg.sync.nodes,
                    "`{name}` is uploaded by every node"
                );
                let mean = Tensor::stack(&uploads, 0).mean_dim(0, false, Kind::Float);
                let diff = (value - &mean).abs().max().double_value(&[]);
                assert!(
                    diff < 1e-6,
                    "round {round}: `{name}` is not the mean of the uploads ({diff})"
                );
            } else {
                assert_eq!(uploads.len(), 1, "`{name}` is uploaded by its owner only");
                assert!(
                    value.equal(uploads[0]),
                    "round {round}: expert `{name}` is not its owner's upload"
                );
            }
        }
    }
}

#[test]
fn spes_rounds_with_two_and_four_nodes() {
    for nodes in [2, 4] {
        let tmp = tempfile::tempdir().unwrap();
        let data = data(tmp.path());
        // Two nodes keep every server checkpoint, four the newest two.
        let keep = if nodes == 2 { 0 } else { 2 };
        let cfg = config(
            &data,
            "spes",
            nodes,
            &[&format!("sync.keep_checkpoints={keep}")],
        );
        let server = Server::start(cfg.clone(), &tmp.path().join("server"), None);
        let seen = run_nodes(&cfg, &server.url(), tmp.path(), 3);
        check_rounds(&cfg, &seen, 3, false);
        let summary = server.finish();
        assert_eq!(summary.rounds, 3);
        assert_eq!(summary.tokens, 3 * nodes as u64 * 2 * 4 * 32);
        let metrics = std::fs::read_to_string(tmp.path().join("server/metrics.jsonl")).unwrap();
        let rounds: Vec<serde_json::Value> = metrics
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rounds.len(), 4, "round 0 (θ⁰) and three rounds");
        assert!(rounds[3]["val_loss"].as_f64().unwrap() < rounds[0]["val_loss"].as_f64().unwrap());
        assert!(rounds[1]["bytes_in"].as_u64().unwrap() > 0);
        let node0: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join("node-0/summary.json")).unwrap(),
        )
        .unwrap();
        assert!(
            node0["bytes_up"].as_u64().unwrap() > 0 && node0["peak_rss_mb"].as_f64().unwrap() > 0.0
        );
        assert!(std::fs::read_dir(tmp.path().join("server/incoming"))
            .unwrap()
            .next()
            .is_none());
        let mut kept: Vec<String> = std::fs::read_dir(tmp.path().join("server/checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        kept.sort();
        let newest: Vec<String> = (1..=3)
            .map(|r| format!("round-{r:06}.safetensors"))
            .skip(if keep == 0 { 0 } else { 3 - keep })
            .collect();
        if keep == 0 {
            assert!(kept.ends_with(&newest), "{kept:?}");
        } else {
            assert_eq!(kept, newest);
        }
    }
}

#[test]
fn diloco_runs_through_the_same_harness_and_averages_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let arc = spes_data::testing::fixture("eval/arc_easy");
    let tasks = format!("train.eval_tasks=[\"{}\"]", arc.display());
    let extra = [
        "train.max_steps=4",
        &tasks,
        "train.eval_tasks_every=4",
        "train.eval_task_docs=5",
    ];
    let cfg = config(&data, "diloco", 2, &extra);
    let server = Server::start(cfg.clone(), &tmp.path().join("server"), None);
    let seen = run_nodes(&cfg, &server.url(), tmp.path(), 2);
    check_rounds(&cfg, &seen, 2, true);
    server.finish();
    // The server scored the task on θ⁰ and on the round ending at step 4, not at step 2.
    let metrics = std::fs::read_to_string(tmp.path().join("server/metrics.jsonl")).unwrap();
    let scored: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["tasks"]["arc_easy"]["docs"] == 5)
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(scored, vec![0, 4]);
}

#[test]
fn bad_input_is_rejected_and_the_round_still_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(&data, "spes", 2, &["train.max_steps=2"]);
    let server = Server::start(cfg.clone(), &tmp.path().join("server"), None);
    let url = server.url();
    let rt = tokio::runtime::Runtime::new().unwrap();

    // A good upload of peer 0, to corrupt in various ways.
    let good = upload_of(&cfg, 0, |t| t.copy());
    let dir = tmp.path();
    rt.block_on(async {
        let mut wrong = raw_client(&url, "not-the-credential").await;
        let e = wrong
            .join(JoinRequest {
                peer: 0,
                session: 1,
                join: false,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);

        let mut c = raw_client(&url, &cred(7)).await;
        let e = c
            .join(JoinRequest {
                peer: 7,
                session: 1,
                join: false,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(
            e.message().contains("peer 7 is not a member"),
            "{}",
            e.message()
        );

        let mut c = raw_client(&url, &cred(0)).await;
        let mut shape = copy(&good);
        shape[2].1 = Tensor::zeros([3, 3], (Kind::Float, Device::Cpu));
        let e = upload_raw(&mut c, dir, 0, 1, &shape).await.unwrap_err();
        assert!(e.message().contains("take exactly"), "{}", e.message());

        let mut nan = copy(&good);
        nan[0].1 = nan[0].1.fill(f64::INFINITY);
        let e = upload_raw(&mut c, dir, 0, 1, &nan).await.unwrap_err();
        assert!(e.message().contains("non-finite"), "{}", e.message());

        let e = upload_raw(&mut c, dir, 9, 1, &good).await.unwrap_err();
        assert!(
            e.message().contains("for peer 0, not peer 9"),
            "{}",
            e.message()
        );

        // A payload whose bytes do not match the announced checksum.
        let path = dir.join("good.safetensors");
        let (size, _) = payload::write(&path, &good, Kind::Float).unwrap();
        let mut header = header_for(0, 1, size, 1);
        header.parts[0].xxh3 ^= 0xdead;
        let e = upload_with(&mut c, &path, header).await.unwrap_err();
        assert!(e.message().contains("checksum"), "{}", e.message());
    });
    let err = Node::connect(NodeOptions {
        credential: Some(common::cred(0).replace("spes-peer-0-", "spes-peer-0-f")),
        ..node_options(&cfg, &url, 0, dir)
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("not hold a spes peer credential"), "{err}");
    let err = Node::connect(NodeOptions {
        credential: Some(spes_net::auth::credential("another run", 0)),
        ..node_options(&cfg, &url, 0, dir)
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("rejected this node's credential"), "{err}");
    let err = Node::connect(node_options(
        &config(
            &data,
            "spes",
            2,
            &["model.n_experts=4", "train.max_steps=2"],
        ),
        &url,
        0,
        dir,
    ))
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("model.n_experts") && err.contains("differs"),
        "{err}"
    );

    // The real nodes still complete the round correctly, and nothing half-written is left.
    let seen = run_nodes(&cfg, &url, dir, 1);
    check_rounds(&cfg, &seen, 1, false);
    server.finish();
    let lines = metrics(&dir.join("server"));
    assert_eq!(
        lines[1]["rejected"].as_array().unwrap().len(),
        4,
        "{}",
        lines[1]
    );
    assert_eq!(lines[1]["peers"], serde_json::json!([0, 1]));
    assert!(std::fs::read_dir(dir.join("server/incoming"))
        .unwrap()
        .next()
        .is_none());
}

#[test]
fn tls_with_a_private_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(&data, "spes", 1, &["train.max_steps=2"]);
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert_pem, key_pem) = (cert.cert.pem(), cert.signing_key.serialize_pem());
    let server = Server::start(
        cfg.clone(),
        &tmp.path().join("server"),
        Some((cert_pem.clone().into(), key_pem.into())),
    );
    let url = format!("https://localhost:{}", server.addr.port());
    let err = Node::connect(NodeOptions {
        patience_s: 1.0,
        ..node_options(&cfg, &url, 0, tmp.path())
    })
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("cannot reach"),
        "an untrusted certificate is refused: {err}"
    );
    let opts = NodeOptions {
        tls_ca: Some(cert_pem.into()),
        ..node_options(&cfg, &url, 0, tmp.path())
    };
    let summary = Node::connect(opts).unwrap().run().unwrap();
    assert_eq!(summary.steps, 2);
    server.finish();
}

#[test]
fn a_restarted_server_resumes_and_nodes_ride_out_the_outage() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(
        &data,
        "spes",
        2,
        &["train.max_steps=12", "sync.sync_steps=4"],
    );
    let out = tmp.path().join("server");
    let first = Server::start(cfg.clone(), &out, None);
    let (addr, url) = (first.addr, first.url());
    let nodes = spawn_nodes(&cfg, &url, tmp.path(), 0..2);
    // Stop the server once round 1 is published, then start a new one on the same port.
    let metrics = out.join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(&metrics)
        .unwrap_or_default()
        .lines()
        .count()
        < 2
    {
        assert!(std::time::Instant::now() < deadline, "round 1 never closed");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let stopped_after = first.stop().rounds;
    assert!(
        (1..3).contains(&stopped_after),
        "stopped mid-run, after round {stopped_after}"
    );
    let second = Server::start_on(&addr.to_string(), cfg.clone(), &out, None);
    for n in nodes {
        assert_eq!(n.join().unwrap().steps, 12);
    }
    let summary = second.finish();
    assert_eq!(summary.rounds, 3);
    let rounds: Vec<u64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["round"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        rounds,
        vec![0, 1, 2, 3],
        "each round logged once across the restart"
    );
    let a = spes_train::checkpoint::load(&tmp.path().join("node-0/checkpoints/step-12")).unwrap();
    let b = spes_train::checkpoint::load(&tmp.path().join("node-1/checkpoints/step-12")).unwrap();
    let sorted = |v: Named| {
        let mut v = v;
        v.sort_by(|x, y| x.0.cmp(&y.0));
        v
    };
    let (am, bm) = (a.model.unwrap(), b.model.unwrap());
    for ((n, x), (_, y)) in sorted(am).iter().zip(&sorted(bm)) {
        assert!(
            x.equal(y),
            "`{n}` differs between the nodes after the restart"
        );
    }
}

/// The node's sync records (`<out>/node-P/metrics.jsonl`).
fn syncs(dir: &Path, peer: usize) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join(format!("node-{peer}/metrics.jsonl")))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["event"] == "sync")
        .collect()
}

#[test]
fn bf16_deltas_keep_server_and_nodes_bit_identical_and_skip_own_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(&data, "spes", 2, &["sync.wire=bf16_delta"]);
    let server = Server::start(cfg.clone(), &tmp.path().join("server"), None);
    let seen = run_nodes(&cfg, &server.url(), tmp.path(), 3);
    server.finish();
    for round in 1..=3 {
        let this: Vec<&Seen> = seen.iter().filter(|s| s.round == round).collect();
        for ((n, a), (_, b)) in this[0].after_sync.iter().zip(&this[1].after_sync) {
            assert!(a.equal(b), "round {round}: `{n}` differs between the nodes");
        }
    }
    // The nodes hold the server's fp32 model of the last round bit for bit.
    let published = payload::read(
        &tmp.path()
            .join("server/checkpoints/round-000003.safetensors"),
    )
    .unwrap();
    let last = &seen.iter().find(|s| s.round == 3).unwrap().after_sync;
    for (name, t) in last {
        let p = &published.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(p.kind(), Kind::Float);
        assert!(t.equal(p), "`{name}` differs from the server's round 3");
    }
    // Only changes were rounded to bf16, never the fp32 masters.
    let head = &last.iter().find(|(n, _)| n == "lm_head.weight").unwrap().1;
    assert!(!head.equal(&head.to_kind(Kind::BFloat16).to_kind(Kind::Float)));
    let model = MoeModel::new(&cfg.model, Device::Cpu).unwrap();
    let total: u64 = model.params().iter().map(|p| p.tensor.numel() as u64).sum();
    for s in seen.iter().filter(|s| s.round == 1) {
        let values: u64 = s.upload.iter().map(|(_, t)| t.numel() as u64).sum();
        let own_experts = values
            - model
                .params()
                .iter()
                .filter(|p| p.role == Role::Shared)
                .map(|p| p.tensor.numel() as u64)
                .sum::<u64>();
        for (i, sync) in syncs(tmp.path(), s.peer).iter().enumerate() {
            let (up, down) = (
                sync["bytes_up"].as_u64().unwrap(),
                sync["bytes_down"].as_u64().unwrap(),
            );
            assert!(
                up >= 2 * values && up < 2 * values + 64 * 1024,
                "peer {} round {}: {up} bytes up for {values} bf16 values",
                s.peer,
                i + 1
            );
            // Everything in bf16 except this node's own experts, which it already holds.
            let expect = 2 * (total - own_experts);
            assert!(
                down >= expect && down < expect + 64 * 1024,
                "peer {} round {}: {down} bytes down, expected about {expect}",
                s.peer,
                i + 1
            );
        }
    }
}

#[test]
fn overlapped_nodes_train_through_the_sync_and_end_on_the_final_model() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(
        &data,
        "spes",
        2,
        &[
            "sync.wire=bf16_delta",
            "sync.overlap=true",
            "train.max_steps=8",
        ],
    );
    let server = Server::start(cfg.clone(), &tmp.path().join("server"), None);
    for t in spawn_nodes(&cfg, &server.url(), tmp.path(), 0..2) {
        assert_eq!(t.join().unwrap().steps, 8);
    }
    let summary = server.finish();
    assert_eq!(summary.rounds, 4);
    // Rounds 1–3 were applied mid-round (after the upload, training went on); the last one is
    // waited for, so every node ends on the published model.
    let published = payload::read(
        &tmp.path()
            .join("server/checkpoints/round-000004.safetensors"),
    )
    .unwrap();
    for peer in 0..2 {
        let ck =
            spes_train::checkpoint::latest(&tmp.path().join(format!("node-{peer}/checkpoints")))
                .unwrap()
                .unwrap();
        let trainer = spes_train::Trainer::resume_as_saved(cfg.clone(), Device::Cpu, &ck).unwrap();
        for p in trainer.model.params() {
            let g = &published.iter().find(|(n, _)| *n == p.name).unwrap().1;
            assert!(
                p.tensor.equal(g),
                "peer {peer}: `{}` differs from round 4",
                p.name
            );
        }
        let steps: Vec<u64> = syncs(tmp.path(), peer)
            .iter()
            .map(|s| s["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps.len(), 4, "peer {peer}: {steps:?}");
        assert_eq!(*steps.last().unwrap(), 8);
    }
}

#[test]
fn an_acknowledged_upload_survives_a_server_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    // All-ones is far from the global model: this test is about durability, not the bound.
    let cfg = config(
        &data,
        "spes",
        2,
        &["train.max_steps=2", "sync.max_update_factor=0"],
    );
    let out = tmp.path().join("server");
    let first = Server::start(cfg.clone(), &out, None);
    let (addr, url) = (first.addr, first.url());
    // Peer 0 uploads all-ones and is acknowledged; then the server goes down.
    let ones = upload_of(&cfg, 0, |t| t.ones_like());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = raw_client(&url, &cred(0)).await;
        let reply = upload_raw(&mut c, tmp.path(), 0, 1, &ones).await.unwrap();
        assert_eq!(reply.round, 1);
    });
    assert_eq!(first.stop().rounds, 0);
    assert!(out.join("pending/round-000001-peer-0.safetensors").exists());
    // After the restart only node 1 shows up; the round closes with peer 0's upload averaged in.
    let second = Server::start_on(&addr.to_string(), cfg.clone(), &out, None);
    let mut node = Node::connect(node_options(&cfg, &url, 1, tmp.path())).unwrap();
    let upload = copy(&node.train_round().unwrap());
    assert_eq!(node.sync(&upload).unwrap(), 1);
    let head = |named: &Named| {
        named
            .iter()
            .find(|(n, _)| n == "lm_head.weight")
            .unwrap()
            .1
            .shallow_clone()
    };
    let expect = (head(&upload) + 1.0) / 2.0;
    let got = head(&snapshot(&node));
    assert!((got - expect).abs().max().double_value(&[]) < 1e-6);
    node.run().unwrap();
    // The server writes a round's metrics after announcing it: wait for the end of the run.
    second.finish();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let round1: serde_json::Value = serde_json::from_str(metrics.lines().nth(1).unwrap()).unwrap();
    assert_eq!(round1["peers"], serde_json::json!([0, 1]));
    assert!(
        std::fs::read_dir(out.join("pending"))
            .unwrap()
            .next()
            .is_none(),
        "pending uploads cleared after publishing"
    );
}

#[test]
fn a_corrupt_newest_round_falls_back_and_the_node_follows_the_rollback() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    // Whole models at rounds 0, 2 and 4 (the last); rounds 1 and 3 only as their deltas.
    let cfg = config(
        &data,
        "spes",
        1,
        &[
            "train.max_steps=8",
            "sync.checkpoint_every_rounds=2",
            "sync.wire=bf16_delta",
        ],
    );
    let out = tmp.path().join("server");
    let first = Server::start(cfg.clone(), &out, None);
    let (addr, url) = (first.addr, first.url());
    tch::set_num_threads(1);
    let mut node = Node::connect(node_options(&cfg, &url, 0, tmp.path())).unwrap();
    for round in 1..=3 {
        let upload = node.train_round().unwrap();
        assert_eq!(node.sync(&upload).unwrap(), round);
    }
    assert_eq!(first.stop().rounds, 3);
    // A restart rebuilds round 3 from round 2's whole model and round 3's delta.
    assert!(!out.join("checkpoints/round-000003.safetensors").exists());
    let s = Server::start_on(&addr.to_string(), cfg.clone(), &out, None);
    assert_eq!(s.stop().rounds, 3);
    // The newest round's delta rots on disk; the server resumes from round 2, every time.
    let newest = out.join("global/round-000003.delta.parts");
    let mut bytes = std::fs::read(&newest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&newest, bytes).unwrap();
    for _ in 0..3 {
        let s = Server::start_on(&addr.to_string(), cfg.clone(), &out, None);
        assert_eq!(s.stop().rounds, 2);
        let state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("server.json")).unwrap())
                .unwrap();
        let rounds = state["rounds"].as_array().unwrap();
        assert_eq!(rounds.last().unwrap()["round"], 2, "{state}");
        assert_eq!(rounds.last().unwrap()["tokens"], 2 * 2 * 4 * 32);
    }
    // The node, which holds round 3, is told the server collects round 3 again: it takes round
    // 2 and trains on to the end.
    let last = Server::start_on(&addr.to_string(), cfg.clone(), &out, None);
    let summary = node.run().unwrap();
    assert_eq!(summary.steps, 8);
    let done = last.finish();
    assert_eq!(done.rounds, 4);
    assert_eq!(
        done.tokens,
        4 * 2 * 4 * 32,
        "the token count is right after the restarts"
    );
    let rounds: Vec<u64> = metrics(&out)
        .iter()
        .map(|l| l["round"].as_u64().unwrap())
        .collect();
    assert_eq!(rounds, vec![0, 1, 2, 3, 4], "each round logged once");
}

#[test]
fn a_restarted_server_replays_its_deltas_bit_for_bit() {
    for wire in ["bf16_delta", "int4_delta"] {
        let tmp = tempfile::tempdir().unwrap();
        let data = data(tmp.path());
        // No whole model between round 0 and the last: a restart replays every delta.
        let wire_set = format!("sync.wire={wire}");
        let cfg = config(&data, "spes", 2, &["train.max_steps=8", &wire_set]);
        let out = tmp.path().join("server");
        let first = Server::start(cfg.clone(), &out, None);
        let (addr, url) = (first.addr, first.url());
        tch::set_num_threads(1);
        let mut nodes: Vec<Node> = (0..2)
            .map(|p| Node::connect(node_options(&cfg, &url, p, tmp.path())).unwrap())
            .collect();
        for round in 1..=2 {
            let uploads: Vec<Named> = nodes.iter_mut().map(|n| n.train_round().unwrap()).collect();
            std::thread::scope(|s| {
                for (n, u) in nodes.iter_mut().zip(uploads) {
                    s.spawn(move || assert_eq!(n.sync(&u).unwrap(), round));
                }
            });
        }
        // The round as the first server holds it in memory, against the rebuilt one.
        let before = fetch_whole(&url, 2, tmp.path());
        assert_eq!(first.stop().rounds, 2);
        let second = Server::start_on(&addr.to_string(), cfg.clone(), &out, None);
        let after = fetch_whole(&url, 2, tmp.path());
        assert_eq!(before.len(), after.len());
        let by_name = |mut v: Named| {
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        for ((n, a), (_, b)) in by_name(before).iter().zip(&by_name(after)) {
            assert!(
                a.equal(b),
                "{wire}: replayed `{n}` differs from the published one by {}",
                (a - b).abs().max().double_value(&[])
            );
        }
        // The nodes go on with deltas on top of the round they hold: had the replayed round
        // differed by a bit, they would end off the server's final model.
        std::thread::scope(|s| {
            for n in nodes {
                s.spawn(move || assert_eq!(n.run().unwrap().steps, 8));
            }
        });
        assert_eq!(second.finish().rounds, 4);
        // Every wire ends on the final model: a lossy one's last round is sent whole.
        let published = payload::read(&out.join("checkpoints/round-000004.safetensors")).unwrap();
        for peer in 0..2 {
            let dir = tmp.path().join(format!("node-{peer}/checkpoints/step-8"));
            let ck = spes_train::checkpoint::load(&dir).unwrap();
            let model = ck.model.expect("the last checkpoint holds the model");
            for (name, t) in &published {
                let local = &model.iter().find(|(n, _)| n == name).unwrap().1;
                assert!(local.equal(t), "{wire}: node {peer}'s `{name}` differs");
            }
        }
    }
}

/// Runs 2 nodes for 4 rounds with overlap on a lossy wire; checks that the loss falls and that
/// every round's upload and download stay under `up_limit` and `down_limit` of fp32's bytes,
/// but the last, which sends every change whole in bf16 (half of fp32, plus headers).
fn lossy_wire_run(wire: &[&str], up_limit: f64, down_limit: f64) {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let mut sets = vec!["sync.overlap=true", "train.max_steps=8"];
    sets.extend_from_slice(wire);
    let cfg = config(&data, "spes", 2, &sets);
    let server = Server::start(cfg.clone(), &tmp.path().join("server"), None);
    for t in spawn_nodes(&cfg, &server.url(), tmp.path(), 0..2) {
        assert_eq!(t.join().unwrap().steps, 8);
    }
    let summary = server.finish();
    assert_eq!(summary.rounds, 4);
    assert!(summary.final_val_loss.unwrap() < summary.initial_val_loss.unwrap());
    let model = MoeModel::new(&cfg.model, Device::Cpu).unwrap();
    let fp32 = 4.0
        * model
            .params()
            .iter()
            .map(|p| p.tensor.numel() as f64)
            .sum::<f64>();
    for peer in 0..2 {
        let s = syncs(tmp.path(), peer);
        assert_eq!(s.len(), 4, "peer {peer}");
        for (i, sync) in s.iter().enumerate() {
            let (up, down) = (
                sync["bytes_up"].as_u64().unwrap() as f64,
                sync["bytes_down"].as_u64().unwrap() as f64,
            );
            let (up_limit, down_limit) = if i == 3 {
                (0.6, 0.6)
            } else {
                (up_limit, down_limit)
            };
            assert!(
                up > 0.0 && up < up_limit * fp32,
                "{wire:?} peer {peer} sync {i}: {up} bytes up"
            );
            assert!(
                down > 0.0 && down < down_limit * fp32,
                "{wire:?} peer {peer} sync {i}: {down} bytes down of {fp32} in fp32"
            );
        }
        // The last round is flushed whole: more than any round before.
        let up = |i: usize| s[i]["bytes_up"].as_u64().unwrap();
        assert!(up(3) > up(2), "{wire:?} peer {peer}");
    }
}

#[test]
fn sparse_deltas_with_overlap_train_on_a_fraction_of_the_bytes() {
    // 8 of every 64 values at 2.25 bytes each and 4 bytes of levels per chunk (0.34 bytes per
    // value against 4 in fp32), small tensors whole in bf16, plus headers.
    lossy_wire_run(
        &[
            "sync.wire=sparse_delta",
            "sync.sparse_chunk=64",
            "sync.sparse_k=8",
        ],
        0.25,
        0.2,
    );
}

#[test]
fn two_bit_deltas_with_overlap_train_on_a_fourteenth_of_the_bytes() {
    // 0.28 bytes per value (codes and scales) against 4: at most 7 % of fp32, plus headers.
    lossy_wire_run(&["sync.wire=int2_delta"], 0.08, 0.08);
}

/// Runs `cfg` to the end with nodes that reach the server(s) at `urls` (comma-separated
/// shards), and returns the last published model, gathered from every server's `out`.
fn final_model(
    cfg: &RunConfig,
    dir: &Path,
    servers: &[Server],
    outs: &[std::path::PathBuf],
) -> Named {
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let url = urls.join(",");
    for t in spawn_nodes(cfg, &url, dir, 0..cfg.sync.nodes) {
        t.join().unwrap();
    }
    let rounds = cfg.train.max_steps / cfg.sync.sync_steps;
    let mut model = Vec::new();
    for out in outs {
        model.extend(
            payload::read(&out.join(format!("checkpoints/round-{rounds:06}.safetensors"))).unwrap(),
        );
    }
    model.sort_by(|a, b| a.0.cmp(&b.0));
    model
}

#[test]
fn two_server_shards_publish_the_same_model_as_one_server() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(
        &data,
        "spes",
        2,
        &[
            "sync.wire=bf16_delta",
            "sync.overlap=false",
            "sync.merge_every=2",
            "sync.merge_until=100",
            "sync.merge_alpha=0.3",
        ],
    );
    let one_out = tmp.path().join("one/server");
    let one = Server::start(cfg.clone(), &one_out, None);
    let a = final_model(&cfg, &tmp.path().join("one"), &[one], &[one_out]);
    let outs: Vec<_> = (0..2)
        .map(|i| tmp.path().join(format!("two/shard-{i}")))
        .collect();
    let shards: Vec<Server> = (0..2)
        .map(|i| {
            Server::start_shard(
                "127.0.0.1:0",
                cfg.clone(),
                &outs[i],
                None,
                Default::default(),
                (i, 2),
            )
        })
        .collect();
    let b = final_model(&cfg, &tmp.path().join("two"), &shards, &outs);
    // Each shard holds part of the model; together, all of it.
    let part = payload::read(&outs[0].join("checkpoints/round-000003.safetensors")).unwrap();
    assert!(
        !part.is_empty() && part.len() < a.len(),
        "{} of {}",
        part.len(),
        a.len()
    );
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(
            ta.equal(tb),
            "`{na}` differs between one server and two shards"
        );
    }
}

/// The test server's options for `cfg` at `out`, taking each round's settings from `replay`.
fn replaying(
    cfg: &RunConfig,
    out: &Path,
    replay: Option<&spes_net::settings::Choices>,
) -> spes_net::ServerOptions {
    let mut opts = options(cfg.clone(), out, None, Limits::default(), (0, 1));
    opts.replay = replay.cloned();
    opts
}

/// The model a run of `rounds` rounds ended on at the server, checked against every node's
/// last checkpoint (step `steps`), bit for bit.
fn ended_on(out: &Path, nodes: &Path, rounds: u64, steps: u64) -> Named {
    let mut published =
        payload::read(&out.join(format!("checkpoints/round-{rounds:06}.safetensors"))).unwrap();
    published.sort_by(|a, b| a.0.cmp(&b.0));
    for peer in 0..2 {
        let dir = nodes.join(format!("node-{peer}/checkpoints/step-{steps}"));
        let model = spes_train::checkpoint::load(&dir).unwrap().model.unwrap();
        for (name, t) in &published {
            let local = &model.iter().find(|(n, _)| n == name).unwrap().1;
            assert!(
                local.equal(t),
                "node {peer}'s `{name}` differs from the server's"
            );
        }
    }
    published
}

/// Settings that change between rounds, as a replayed choices file says: int4 without
/// overlap, then low rank with a step of overlap, then bf16 without. Every node ends on the
/// server's final model; a server restarted across a change rebuilds its rounds in their own
/// wires and the run ends on the same bits as a straight one. An adaptive server on loopback
/// then chooses for itself (every setting keeps a node busy enough at this target, so it takes
/// the best), records its choices, and a rerun that replays them ends on its bits.
#[test]
fn the_wire_changes_mid_run_and_replays_to_the_last_bit() {
    use spes_net::settings::{Choices, Chosen, CHOICES_FILE};
    use spes_sync::{RoundSettings, Wire};
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(
        &data,
        "spes",
        2,
        &[
            "train.max_steps=12",
            "sync.wire=adaptive",
            "sync.overlap_steps=adaptive",
            "sync.rank=2",
        ],
    );
    let settings = |wire, overlap| RoundSettings {
        wire,
        overlap,
        overlap_steps: 1,
    };
    let schedule = Choices {
        choices: [
            (1, settings(Wire::Int4Delta, false)),
            (3, settings(Wire::LowrankDelta, true)),
            (5, settings(Wire::Bf16Delta, false)),
        ]
        .into_iter()
        .map(|(from_round, settings)| Chosen {
            from_round,
            settings,
            reason: String::new(),
        })
        .collect(),
    };
    let (straight, records) = {
        let dir = tmp.path().join("straight");
        let out = dir.join("server");
        let server = Server::start_options("127.0.0.1:0", replaying(&cfg, &out, Some(&schedule)));
        for n in spawn_nodes(&cfg, &server.url(), &dir, 0..2) {
            assert_eq!(n.join().unwrap().steps, 12);
        }
        assert_eq!(server.finish().rounds, 6);
        (ended_on(&out, &dir, 6, 12), metrics(&out))
    };
    for r in records.iter().filter(|r| r["round"].as_u64().unwrap() > 0) {
        let round = r["round"].as_u64().unwrap();
        let want = schedule.at(round, &cfg.sync);
        let got: RoundSettings = serde_json::from_value(r["settings"].clone())
            .unwrap_or_else(|e| panic!("round {round}: {e} in {r}"));
        assert_eq!(got, want, "round {round}");
    }
    assert!(straight
        .iter()
        .all(|(_, t)| t.isfinite().all().int64_value(&[]) == 1));
    // Nodes driven round by round, the server stopped after round `restart` and started
    // again: a whole model at round 4, then round 5's bf16 delta replayed, which flushed every
    // residual the low-rank rounds held back, so the run ends on a straight run's bits.
    let cfg = RunConfig {
        sync: spes_sync::SyncConfig {
            checkpoint_every_rounds: 4,
            ..cfg.sync.clone()
        },
        ..cfg.clone()
    };
    let stepped = |name: &str, restart: Option<u64>| {
        let dir = tmp.path().join(name);
        let out = dir.join("server");
        let opts = || replaying(&cfg, &out, Some(&schedule));
        let mut server = Server::start_options("127.0.0.1:0", opts());
        let url = server.url();
        tch::set_num_threads(1);
        let mut nodes: Vec<Node> = (0..2)
            .map(|p| Node::connect(node_options(&cfg, &url, p, &dir)).unwrap())
            .collect();
        for round in 1..=5 {
            let uploads: Vec<Named> = nodes.iter_mut().map(|n| n.train_round().unwrap()).collect();
            std::thread::scope(|s| {
                for (n, u) in nodes.iter_mut().zip(uploads) {
                    s.spawn(move || assert_eq!(n.sync(&u).unwrap(), round));
                }
            });
            if restart == Some(round) {
                let addr = server.addr.to_string();
                assert_eq!(server.stop().rounds, round);
                server = Server::start_options(&addr, opts());
            }
        }
        std::thread::scope(|s| {
            for n in nodes {
                s.spawn(move || assert_eq!(n.run().unwrap().steps, 12));
            }
        });
        assert_eq!(server.finish().rounds, 6);
        ended_on(&out, &dir, 6, 12)
    };
    let (once, restarted) = (stepped("stepped", None), stepped("restarted", Some(5)));
    for ((n, a), (_, b)) in once.iter().zip(&restarted) {
        assert!(a.equal(b), "`{n}` differs after a restart across a change");
    }
    // An adaptive run at a target every setting reaches, and its replay. The wire is pinned
    // to bf16, whose payloads are large enough to time (the micro model's low-rank ones are
    // not), and the server chooses the overlap.
    let cfg = RunConfig {
        sync: spes_sync::SyncConfig {
            target_utilization: 0.01,
            wire: Wire::Bf16Delta.into(),
            ..cfg.sync.clone()
        },
        ..cfg.clone()
    };
    let run_adaptive = |name: &str, replay: Option<&Choices>| {
        let dir = tmp.path().join(name);
        let out = dir.join("server");
        let server = Server::start_options("127.0.0.1:0", replaying(&cfg, &out, replay));
        if replay.is_none() {
            // A node too old to follow settings that change is refused by kind.
            let rt = tokio::runtime::Runtime::new().unwrap();
            let old = rt.block_on(async {
                let mut c = raw_client(&server.url(), &cred(0)).await;
                let req = JoinRequest {
                    peer: 0,
                    session: 9,
                    ..Default::default()
                };
                c.join(req).await.unwrap_err()
            });
            assert_eq!(
                spes_net::refusal::kind(&old),
                Some(spes_net::proto::refusal::Kind::TooOld),
                "{old:?}"
            );
        }
        for n in spawn_nodes(&cfg, &server.url(), &dir, 0..2) {
            assert_eq!(n.join().unwrap().steps, 12);
        }
        assert_eq!(server.finish().rounds, 6);
        (ended_on(&out, &dir, 6, 12), out)
    };
    let (chosen, out) = run_adaptive("adaptive", None);
    let choices = Choices::read(&out.join(CHOICES_FILE)).unwrap_or_else(|e| {
        let seen: Vec<String> = metrics(&out)
            .iter()
            .map(|r| {
                format!(
                    "{} {} {}",
                    r["round"],
                    r["planned"].is_object(),
                    r["choice"]
                )
            })
            .collect();
        panic!("{e}: {seen:?}")
    });
    for c in &choices.choices {
        assert!(!c.reason.is_empty() && c.from_round >= 3, "{c:?}");
    }
    let (replayed, _) = run_adaptive("replayed", Some(&choices));
    for ((n, a), (_, b)) in chosen.iter().zip(&replayed) {
        assert!(a.equal(b), "`{n}` differs in the replay of {choices:?}");
    }
}
