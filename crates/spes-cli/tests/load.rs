//! Width: one server and 32 real node processes (one expert each) of a micro model on
//! 127.0.0.1 for 10 rounds of bf16 deltas. Every round closes with all 32 uploads, no live
//! node is evicted, and every node ends bit-identical to the final published model. Bounded:
//! the run must end within 170 s.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NODES: usize = 32;
const ROUNDS: u64 = 10;

fn tensors(path: &Path) -> std::collections::BTreeMap<String, tch::Tensor> {
    tch::Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bin = env!("CARGO_BIN_EXE_spes");
    let common = |role: &str| {
        let mut c = Command::new(bin);
        c.arg(role)
            .arg("--config")
            .arg(&config)
            .args(["--device", "cpu", "--threads", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        c
    };
    let started = Instant::now();
    let server_out = dir.join("server");
    let server_log = std::fs::File::create(dir.join("server.log")).unwrap();
    let mut server = common("server")
        .args(["--listen", &format!("127.0.0.1:{port}"), "--no-auth"])
        .arg("--out")
        .arg(&server_out)
        .stderr(server_log)
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let mut nodes: Vec<Child> = (0..NODES)
        .map(|p| {
            let log = std::fs::File::create(dir.join(format!("node-{p}.log"))).unwrap();
            common("node")
                .args(["--server", &url, "--peer", &p.to_string()])
                .arg("--out")
                .arg(dir.join(format!("node-{p}")))
                .args(["--progress", "quiet", "--patience-s", "120"])
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = started + Duration::from_secs(170);
    let show =
        |name: &str| std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
    for (p, n) in nodes.iter_mut().enumerate() {
        loop {
            if let Some(status) = n.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "node {p} failed:\n{}",
                    show(&format!("node-{p}"))
                );
                break;
            }
            if Instant::now() > deadline {
                let _ = server.kill();
                panic!(
                    "node {p} did not finish in time:\n{}",
                    show(&format!("node-{p}"))
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    loop {
        if let Some(status) = server.try_wait().unwrap() {
            assert!(status.success(), "the server failed:\n{}", show("server"));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not finish:\n{}",
            show("server")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
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
