//! Width: one server and 32 real node processes (one expert each) of a micro model on
//! 127.0.0.1 for 10 rounds of bf16 deltas. Every round closes with all 32 uploads, no live
//! node is evicted, and every node ends bit-identical to the final published model. Bounded:
//! the run must end within 170 s.

mod common;

use common::{tensors, Loopback, Proc};
use std::time::{Duration, Instant};

const NODES: usize = 32;
const ROUNDS: u64 = 10;

#[test]
fn thirty_two_nodes_close_every_round_with_every_upload() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data = spes_data::testing::small_corpus(dir, 60000);
    let config = dir.join("load.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[model]
preset = "tiny"
vocab_size = 512
d_model = 16
n_layers = 1
n_heads = 1
head_dim = 16
n_kv_heads = 1
n_experts = {NODES}
top_k = 2
expert_hidden = 8
context_length = 16

[data]
path = "{}"

[train]
max_steps = {ROUNDS}
batch_size = 2
seq_len = 16
lr = 3e-3
warmup_steps = 1
log_every = 100
eval_batches = 1

[sync]
mode = "spes"
nodes = {NODES}
sync_steps = 1
wire = "bf16_delta"
merge_every = 0
round_timeout_s = 120
lease_s = 60
"#,
            data.display()
        ),
    )
    .unwrap();
    let run = Loopback::new(dir, None);
    let config = ["--config".to_string(), config.display().to_string()];
    let started = Instant::now();
    let server_out = run.server_out();
    let mut server = run.server(&config);
    server.spawn();
    let mut nodes: Vec<Proc> = (0..NODES)
        .map(|p| {
            let mut args = config.to_vec();
            args.extend(["--patience-s".into(), "120".into()]);
            let mut node = run.node(p, &args);
            node.spawn();
            node
        })
        .collect();
    let deadline = started + Duration::from_secs(170);
    for node in &mut nodes {
        node.finish_by(deadline);
    }
    server.finish_by(deadline);
    println!(
        "{NODES} nodes, {ROUNDS} rounds: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let rounds: Vec<serde_json::Value> = std::fs::read_to_string(server_out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rounds.len() as u64, ROUNDS + 1, "rounds 0..={ROUNDS}");
    let all: Vec<u64> = (0..NODES as u64).collect();
    for r in &rounds[1..] {
        let peers: Vec<u64> = serde_json::from_value(r["peers"].clone()).unwrap();
        assert_eq!(
            peers, all,
            "round {} closed without every upload",
            r["round"]
        );
        assert_eq!(r["evicted"], serde_json::json!([]), "round {}", r["round"]);
    }
    let global = tensors(&server_out.join(format!("checkpoints/round-{ROUNDS:06}.safetensors")));
    for p in 0..NODES {
        let local = tensors(&dir.join(format!(
            "node-{p}/checkpoints/step-{ROUNDS}/model.safetensors"
        )));
        for (name, g) in &global {
            assert!(
                local[name].equal(g),
                "node {p}: `{name}` differs from the final model"
            );
        }
    }
}
