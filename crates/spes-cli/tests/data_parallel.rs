//! `spes train --local-ranks G`: data parallel inside one node over c10d (Gloo on CPU).

mod common;

use common::{spes, text, Loopback, Proc, SMALL};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 10;

/// A small model on the first 200 kB of the tests' corpus, `STEPS` steps, metrics every step.
fn train_args(data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/tiny.toml");
    let mut args: Vec<String> = [
        "train",
        "--config",
        config.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--device",
        "cpu",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(SMALL.iter().map(|s| s.to_string()));
    let sets = [
        format!("data.path={}", data.display()),
        format!("train.max_steps={STEPS}"),
        "train.log_every=1".into(),
        "train.eval_every=1000".into(),
        "train.eval_batches=2".into(),
        format!("train.checkpoint_every={STEPS}"),
    ];
    for s in sets {
        args.push("--set".into());
        args.push(s);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Per-step training loss from `metrics.jsonl`.
fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["loss"].as_f64())
        .collect()
}

fn final_model(run: &Path) -> BTreeMap<String, tch::Tensor> {
    let file = run.join(format!("checkpoints/step-{STEPS}/model.safetensors"));
    tch::Tensor::read_safetensors(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .into_iter()
        .collect()
}

/// Trains `one` (a single process) and `two` (`--local-ranks 2`) and asserts equal losses at
/// every step and equal final weights, both within 1e-5 relative.
/// Returns the AdamW bytes per rank, alone and with 2 ranks (ZeRO-1).
fn assert_equivalent(
    data: &Path,
    tmp: &Path,
    name: &str,
    one: &[&str],
    two: &[&str],
) -> (u64, u64) {
    let (a, b) = (tmp.join(format!("{name}-1")), tmp.join(format!("{name}-2")));
    let o = spes(&train_args(data, &a, one));
    assert!(o.status.success(), "{}", text(&o));
    let alone = optimizer_bytes(&o);
    let mut args = train_args(data, &b, two);
    args.extend(["--local-ranks".into(), "2".into()]);
    let o = spes(&args);
    // Ranks compare checksums of their weights at every logged step (every step here) and
    // fail the run if they differ, so success means bit-identical ranks after each step.
    assert!(o.status.success(), "{}", text(&o));
    let (la, lb) = (losses(&a), losses(&b));
    assert_eq!(la.len(), STEPS as usize);
    for (step, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs(),
            "{name} step {}: {x} vs {y}",
            step + 1
        );
    }
    let (ma, mb) = (final_model(&a), final_model(&b));
    assert_eq!(ma.len(), mb.len());
    for (k, x) in &ma {
        let y = &mb[k];
        let scale = x.abs().max().double_value(&[]).max(1e-12);
        let diff = (x - y).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-5 * scale,
            "{name}: {k} differs by {diff} (scale {scale})"
        );
    }
    (alone, optimizer_bytes(&o))
}

/// `optimizer_state_bytes` of the summary a run prints (rank 0's with several ranks).
fn optimizer_bytes(o: &Output) -> u64 {
    let out = String::from_utf8_lossy(&o.stdout);
    let summary: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    summary["optimizer_state_bytes"].as_u64().unwrap()
}

/// Two ranks of batch 2 equal one process of batch 4 when every loss is a mean over tokens
/// (load balancing off: it is a product of per-batch statistics), and equal one process of
/// two micro-batches of 2 with every loss on, since then each rank's batch is a micro-batch.
/// Each rank holds at most 0.55 of the optimizer state (ZeRO-1), and the final checkpoint,
/// whose moments rank 0 gathered, resumes a single process.
#[test]
fn two_ranks_equal_one_process_with_twice_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = spes_data::testing::small_corpus(tmp.path(), 200_000);
    let no_lb = ["--set", "train.lb_loss_weight=0"];
    assert_equivalent(
        &data,
        tmp.path(),
        "batch",
        &[no_lb[0], no_lb[1], "--set", "train.batch_size=4"],
        &[no_lb[0], no_lb[1], "--set", "train.batch_size=2"],
    );
    let (alone, sharded) = assert_equivalent(
        &data,
        tmp.path(),
        "accum",
        &["--set", "train.batch_size=2", "--set", "train.grad_accum=2"],
        &["--set", "train.batch_size=2"],
    );
    let ratio = sharded as f64 / alone as f64;
    assert!(
        ratio <= 0.55,
        "rank 0 holds {sharded} of {alone} optimizer bytes ({ratio:.3})"
    );
}

/// The direct children of `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the parenthesised command name: state, then the parent's pid.
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
        if after.split_whitespace().nth(1) == Some(&pid.to_string()) {
            out.push(child);
        }
    }
    out
}

/// SIGKILL of one rank mid-run takes the node down at once with a message naming it; rerun
/// with --resume, it continues from the last checkpoint and completes.
#[test]
fn a_killed_rank_stops_the_node_which_then_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = spes_data::testing::small_corpus(tmp.path(), 200_000);
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &run, &["--set", "train.batch_size=2"]);
    let long = [
        "--set",
        "train.max_steps=100000",
        "--set",
        "train.checkpoint_every=5",
    ];
    args.extend(long.iter().map(|s| s.to_string()));
    args.extend(["--local-ranks".into(), "2".into()]);
    let mut node = Command::new(env!("CARGO_BIN_EXE_spes"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let checkpoints = run.join("checkpoints");
    let start = Instant::now();
    while !checkpoints.join("step-5").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint within 120 s"
        );
        if let Some(status) = node.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(node.stderr.as_mut().unwrap(), &mut stderr).unwrap();
            panic!("the node ended before its first checkpoint ({status}): {stderr}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let ranks = children_of(node.id());
    assert_eq!(ranks.len(), 2, "ranks {ranks:?}");
    let victim = *ranks.iter().max().unwrap();
    let killed_at = Instant::now();
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let status = node.wait().unwrap();
    assert!(killed_at.elapsed() < Duration::from_secs(30));
    let mut stderr = String::new();
    std::io::Read::read_to_string(node.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(
        stderr.contains("failed") && stderr.contains("--resume"),
        "{stderr}"
    );
    for rank in ranks {
        assert!(
            !Path::new(&format!("/proc/{rank}")).exists() || is_zombie(rank),
            "rank {rank} survived"
        );
    }

    // Resume with one rank fewer: the node goes on from its newest checkpoint to the end.
    let last: u64 = latest_step(&checkpoints);
    let mut args = train_args(&data, &run, &["--set", "train.batch_size=4", "--resume"]);
    args.extend(["--set".into(), format!("train.max_steps={}", last + 5)]);
    args.extend(["--set".into(), "train.checkpoint_every=5".into()]);
    let o = spes(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(checkpoints.join(format!("step-{}", last + 5)).exists());
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s[s.rfind(')').unwrap() + 1..].trim_start().starts_with('Z'))
        .unwrap_or(true)
}

fn latest_step(checkpoints: &Path) -> u64 {
    std::fs::read_dir(checkpoints)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("step-")?.parse().ok()
        })
        .max()
        .unwrap()
}

/// A SPES run on loopback where node 0 is `spes node --local-ranks 2` and nodes 1 and 2 are
/// single processes, every node keeping its frozen experts resident in bf16 (exact fp32
/// masters aside). Ownership rotates every 2 rounds, so the 2-rank node re-shards its
/// optimizer and experts change between frozen and trained mid-run. Every node ends bit-identical to the final published model (rank 1 of
/// node 0 checks that it holds rank 0's weights after every round and at the end, and fails
/// the node otherwise).
#[test]
fn a_spes_node_of_two_ranks_ends_on_the_published_model() {
    const NODES: usize = 3;
    const MAX: u64 = 12;
    const H: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let data = spes_data::testing::small_corpus(dir, 120_000);
    let config = dir.join("spes.toml");
    let toml = format!(
        r#"
[model]
preset = "micro"
n_experts = 6

[data]
path = "{}"

[train]
max_steps = {MAX}
batch_size = 2
seq_len = 32
lr = 3e-3
warmup_steps = 2
log_every = 1
eval_batches = 2
frozen_experts_bf16 = true

[sync]
mode = "spes"
nodes = {NODES}
sync_steps = {H}
merge_every = 2
merge_until = 6
merge_top_k = 2
rotate_every_rounds = 2
"#,
        data.display()
    );
    std::fs::write(&config, toml).unwrap();
    let run = Loopback::new(dir, None);
    let config = ["--config".to_string(), config.display().to_string()];
    let server_out = run.server_out();
    let mut server_args = config.to_vec();
    server_args.extend(["--linger-s".into(), "20".into()]);
    let mut server = run.server(&server_args);
    server.spawn();
    let mut nodes: Vec<Proc> = (0..NODES)
        .map(|peer| {
            let mut args = config.to_vec();
            args.extend(["--dist-timeout".into(), "60".into()]);
            if peer == 0 {
                args.extend(["--local-ranks".into(), "2".into()]);
            }
            let mut node = run.node(peer, &args);
            node.spawn();
            node
        })
        .collect();
    let show = |log: &str| std::fs::read_to_string(dir.join(log)).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(240);
    for node in &mut nodes {
        node.finish_by(deadline);
    }
    drop(server);

    let final_round = MAX / H;
    let global: BTreeMap<String, tch::Tensor> = tch::Tensor::read_safetensors(
        server_out.join(format!("checkpoints/round-{final_round:06}.safetensors")),
    )
    .unwrap()
    .into_iter()
    .collect();
    for peer in 0..NODES {
        let ck = dir.join(format!(
            "node-{peer}/checkpoints/step-{MAX}/model.safetensors"
        ));
        let local: BTreeMap<String, tch::Tensor> = tch::Tensor::read_safetensors(&ck)
            .unwrap_or_else(|e| panic!("{}: {e}", ck.display()))
            .into_iter()
            .collect();
        assert_eq!(local.len(), global.len());
        for (name, g) in &global {
            assert!(
                local[name].equal(g),
                "node {peer}: `{name}` differs from the published model"
            );
        }
    }
    // Node 0 trained with both ranks: its batches were twice a single node's.
    let tokens = |peer: usize| -> u64 {
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("node-{peer}/summary.json"))).unwrap(),
        )
        .unwrap();
        v["tokens"].as_u64().unwrap()
    };
    assert_eq!(tokens(0), 2 * tokens(1), "{}", show("node-0.log"));
}
