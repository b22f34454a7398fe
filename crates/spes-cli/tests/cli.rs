//! The `spes` binary as a user runs it.

mod common;

use common::{spes, text, SMALL};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// `fixtures/<rel>` of the repository, as an argument.
fn fixture(rel: &str) -> String {
    spes_data::testing::fixture(rel).display().to_string()
}

/// The first 1.1 MB of the tests' corpus as one text file in `dir`, as an argument.
fn corpus_txt(dir: &Path) -> String {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, spes_data::testing::corpus_text(1_100_000)).unwrap();
    path.display().to_string()
}

#[test]
fn tokenize_and_train_through_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let o = spes(&[
        "tokenize",
        "--input",
        &corpus_txt(tmp.path()),
        "--out",
        data.to_str().unwrap(),
        "--train-tokenizer",
        "512",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/tiny.toml");
    let out = tmp.path().join("run");
    let mut args = vec![
        "train",
        "--config",
        config.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--device",
        "cpu",
    ];
    let data_set = format!("data.path={}", data.display());
    let tasks_set = format!("train.eval_tasks=[\"{}\"]", fixture("eval/arc_easy"));
    args.extend([
        "--set",
        &data_set,
        "--set",
        "train.max_steps=30",
        "--set",
        "train.eval_every=30",
    ]);
    args.extend([
        "--set",
        &tasks_set,
        "--set",
        "train.eval_tasks_every=15",
        "--set",
        "train.eval_task_docs=10",
    ]);
    args.extend(SMALL);
    let tb = tmp.path().join("tb");
    let tb_set = format!("train.tensorboard=\"{}\"", tb.display());
    args.extend(["--set", &tb_set]);
    let o = spes(&args);
    assert!(o.status.success(), "{}", text(&o));
    // TensorBoard's own reader finds the trainer's curves.
    let script = "import sys\nfrom tensorboard.backend.event_processing.event_accumulator import EventAccumulator as A\na = A(sys.argv[1]); a.Reload()\nprint(len(a.Scalars('train/loss')), len(a.Scalars('val/loss')))";
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let read = Command::new(&python)
        .args(["-c", script, tb.join("train").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(read.status.success(), "{}", text(&read));
    let counts = String::from_utf8_lossy(&read.stdout);
    assert_eq!(
        counts.trim(),
        "3 2",
        "train/loss every 10 steps, val/loss at 0 and 30"
    );
    // Logs to a pipe carry no colour codes; `--log-format json` writes one object per line.
    let mut resume = args.clone();
    resume.push("--resume");
    let o = spes(&resume);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success() && err.contains("resuming from"), "{err}");
    assert!(!err.contains('\x1b'), "colour codes in a pipe: {err:?}");
    let mut json = vec!["--log-format", "json"];
    json.extend(resume.iter().copied());
    let o = spes(&json);
    assert!(o.status.success(), "{}", text(&o));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["level"] == "INFO"
            && l["fields"]["message"]
                .as_str()
                .unwrap_or("")
                .starts_with("resuming from")),
        "{lines:?}"
    );
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for key in [
        "step",
        "loss",
        "ce",
        "lb_loss",
        "lr",
        "tokens",
        "tokens_per_s",
    ] {
        assert!(
            rows[1].get(key).is_some(),
            "metrics lack `{key}`: {}",
            rows[1]
        );
    }
    let first = rows[0]["val_loss"].as_f64().unwrap();
    let last = rows.last().unwrap()["val_loss"].as_f64().unwrap();
    assert!(last < first - 0.5, "validation loss {first} -> {last}");
    assert!(out.join("checkpoints/step-30/model.safetensors").exists());
    let scored = rows
        .iter()
        .filter(|r| r["tasks"]["arc_easy"]["acc_raw"].is_number())
        .count();
    assert_eq!(scored, 2, "the task hook ran at steps 15 and 30");

    // Evaluation and export of the trained checkpoint, as a user runs them.
    let ck = out.join("checkpoints/step-30");
    let sample = tmp.path().join("sample.txt");
    let wiki = std::fs::read_to_string(fixture("text/wikitext-2-valid-head.txt")).unwrap();
    std::fs::write(&sample, &wiki[..5000]).unwrap();
    let o = spes(&[
        "eval",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--text",
        sample.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["perplexity"].as_f64().unwrap() > 1.0 && v["bits_per_byte"].as_f64().unwrap() > 0.0);
    assert!(v["tokens"].as_u64().unwrap() > 100);
    let o = spes(&[
        "eval",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--tasks",
        &fixture("eval/piqa"),
        "--limit",
        "8",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tasks"][0]["docs"], 8);
    let hf = tmp.path().join("hf");
    let o = spes(&[
        "export-hf",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    for f in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(hf.join(f).exists(), "export lacks {f}");
    }

    args.extend(["--set", "train.max_steps=lots"]);
    let o = spes(&args);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("train.max_steps") && text(&o).contains("u64"),
        "{}",
        text(&o)
    );
}

#[test]
fn safe_defaults_refuse_plaintext_and_missing_secrets() {
    use std::os::unix::fs::PermissionsExt;
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
    let config = config.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("server");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_spes"))
            .args(args)
            .env_remove("SPES_SECRET")
            .env_remove("SPES_CREDENTIAL")
            .output()
            .unwrap()
    };
    let o = run(&["server", "--config", config, "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--secret-file"), "{}", text(&o));

    // Secrets and keys are owner-only from their creation.
    let secret = tmp.path().join("secret");
    assert!(run(&["auth", "secret", "--out", secret.to_str().unwrap()])
        .status
        .success());
    let creds = tmp.path().join("creds");
    let o = run(&[
        "auth",
        "credential",
        "--secret-file",
        secret.to_str().unwrap(),
        "--peer",
        "0",
        "3",
        "--out",
        creds.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let tls = tmp.path().join("tls");
    assert!(run(&["auth", "cert", "--out", tls.to_str().unwrap()])
        .status
        .success());
    for f in [
        secret.clone(),
        creds.join("node-3.credential"),
        tls.join("key.pem"),
    ] {
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", f.display());
    }
    let cred3 = std::fs::read_to_string(creds.join("node-3.credential")).unwrap();
    assert!(cred3.starts_with("spes-peer-3-"), "{cred3}");

    // Plaintext on a non-loopback address is refused unless asked for.
    let o = run(&[
        "server",
        "--config",
        config,
        "--out",
        out.to_str().unwrap(),
        "--secret-file",
        secret.to_str().unwrap(),
        "--listen",
        "0.0.0.0:0",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("--tls-cert") && text(&o).contains("--insecure"),
        "{}",
        text(&o)
    );

    // A node will not send its credential over http:// to another host, nor use another's.
    let node = |server: &str, peer: &str| {
        run(&[
            "node",
            "--config",
            config,
            "--server",
            server,
            "--peer",
            peer,
            "--out",
            tmp.path().join("node").to_str().unwrap(),
            "--credential-file",
            creds.join("node-3.credential").to_str().unwrap(),
            "--patience-s",
            "1",
        ])
    };
    let o = node("http://server.example:50051", "3");
    assert!(!o.status.success());
    assert!(text(&o).contains("plaintext"), "{}", text(&o));
    let o = node("http://127.0.0.1:9", "2");
    assert!(!o.status.success());
    assert!(
        text(&o).contains("credential is for peer 3, but --peer is 2"),
        "{}",
        text(&o)
    );
}

/// The demo on a shrunken schedule, every node behind a shaped link: every artefact a user
/// reads must be there.
#[test]
fn demo_writes_report_plots_and_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo");
    let mut args = vec!["demo", "--out", out.to_str().unwrap(), "--device", "cpu"];
    args.extend(["--link", "800mbit,10ms"]);
    args.extend([
        "--set",
        "train.max_steps=20",
        "--set",
        "sync.sync_steps=10",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.seq_len=64",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.log_every=5",
        "--set",
        "sync.merge_every=10",
        "--set",
        "sync.merge_until=20",
    ]);
    let o = spes(&args);
    assert!(o.status.success(), "{}", text(&o));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for key in ["initial_val_loss", "final_val_loss", "tokens", "wall_s"] {
        assert!(summary[key].is_number(), "summary lacks {key}: {summary}");
    }
    let nodes = summary["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 4);
    for n in nodes {
        for key in ["bytes_up", "bytes_down", "peak_rss_mb"] {
            assert!(n[key].as_f64().unwrap() > 0.0, "node lacks {key}: {n}");
        }
    }
    for png in ["loss.png", "expert_load.png", "sync.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{png}");
        assert!(bytes.len() > 10_000, "{png} is nearly empty");
    }
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        // One merge round: step 10, α = 0.05·(1 − 10/20).
        report.contains("loss.png") && report.contains("(step 10): α = 0.0250"),
        "{report}"
    );
    // Sync cost per round, next to compute, for both rounds: in summary.json, drawn in sync.png.
    let rounds: Vec<u64> = summary["round_costs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["compute_s"].as_f64().unwrap() > 0.0 && c["server_aggregation_s"].is_number())
        .map(|c| c["round"].as_u64().unwrap())
        .collect();
    assert_eq!(rounds, vec![1, 2], "{summary}");
    assert!(
        report.contains("## Sync cost") && report.contains("sync.png"),
        "{report}"
    );
    // Every upload is timed by the server as it received and folded it, and every sync by its
    // node: its upload, its download (without the wait for the round) and its apply.
    let lines = |file: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(out.join(file))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let positive = |v: &serde_json::Value, key: &str| v[key].as_f64().is_some_and(|x| x > 0.0);
    let closed: Vec<serde_json::Value> = lines("server/metrics.jsonl")
        .into_iter()
        .filter(|r| r["peers"].as_array().is_some_and(|p| !p.is_empty()))
        .collect();
    assert_eq!(closed.len(), 2);
    for r in &closed {
        let uploads = r["uploads"].as_array().unwrap();
        let peers: Vec<u64> = uploads
            .iter()
            .map(|u| u["peer"].as_u64().unwrap())
            .collect();
        assert_eq!(peers, [0, 1, 2, 3], "{r}");
        for u in uploads {
            assert!(
                positive(u, "receive_s") && positive(u, "fold_s") && positive(u, "bytes"),
                "{u}"
            );
        }
    }
    for n in 0..4 {
        let syncs: Vec<serde_json::Value> = lines(&format!("node-{n}/metrics.jsonl"))
            .into_iter()
            .filter(|l| l["event"] == "sync")
            .collect();
        assert_eq!(syncs.len(), 2, "node {n}");
        for s in &syncs {
            assert!(
                positive(s, "up_s") && positive(s, "down_s") && positive(s, "apply_s"),
                "node {n}: {s}"
            );
        }
    }
}

fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) && (cmd.contains(" node ") || cmd.contains(" server ")) {
                found.push(cmd);
            }
        }
    }
    found
}

#[test]
fn ctrl_c_stops_every_demo_process() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo-interrupted");
    let mut child = Command::new(env!("CARGO_BIN_EXE_spes"))
        .args([
            "demo",
            "--out",
            out.to_str().unwrap(),
            "--device",
            "cpu",
            "--set",
            "train.batch_size=1",
            "--set",
            "train.seq_len=32",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    while !out.join("node-3/metrics.jsonl").exists() {
        assert!(Instant::now() < deadline, "the demo's nodes never started");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        processes_mentioning(out.to_str().unwrap()).len(),
        5,
        "server and 4 nodes run"
    );
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let code = child.wait().unwrap();
    assert!(!code.success());
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("interrupted"), "{err}");
    let resume = format!("Run `spes demo --out {}` again to resume", out.display());
    assert!(err.contains(&resume), "{err}");
    let left = processes_mentioning(out.to_str().unwrap());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// The experiment harness on a shrunken model: a centralized and a SPES run on one token
/// budget, scored on a held-out text; a spec whose budgets differ is refused before training.
#[test]
fn experiment_runs_variants_and_writes_the_table_and_plot() {
    let tmp = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
    let small: Vec<String> = SMALL
        .iter()
        .filter(|a| **a != "--set")
        .map(|a| format!("{a:?}"))
        .collect();
    let wiki = std::fs::read_to_string(fixture("text/wikitext-2-valid-head.txt")).unwrap();
    let held_out = tmp.path().join("held-out.txt");
    std::fs::write(&held_out, wiki).unwrap();
    let corpus = corpus_txt(tmp.path());
    let spec = |centralized_steps: u32| {
        format!(
            r#"config = {config:?}
seeds = [3]
set = [{small}, "train.max_steps=4", "train.eval_every=2", "train.eval_batches=2",
       "sync.nodes=2", "sync.sync_steps=2", "sync.merge_every=2", "sync.merge_until=4"]
eval_texts = [{held_out:?}]
[data]
inputs = [{text:?}]
vocab = 512
[[run]]
name = "centralized"
set = ["sync.mode=centralized", "train.batch_size=8", "train.max_steps={centralized_steps}"]
[[run]]
name = "spes"
set = ["sync.mode=spes", "sync.outer_lr=0.7", "sync.outer_momentum=0.9"]
"#,
            config = config.display().to_string(),
            small = small.join(", "),
            text = corpus,
            held_out = held_out.display().to_string(),
        )
    };
    let path = tmp.path().join("spec.toml");
    let out = tmp.path().join("out");
    let run = || {
        spes(&[
            "experiment",
            "--spec",
            path.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--device",
            "cpu",
        ])
    };
    std::fs::write(&path, spec(8)).unwrap();
    let o = run();
    assert!(!o.status.success());
    assert!(
        text(&o).contains("run `spes` trains on 1024 tokens, `centralized` on 2048"),
        "{}",
        text(&o)
    );
    std::fs::write(&path, spec(4)).unwrap();
    let o = run();
    assert!(o.status.success(), "{}", text(&o));
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["ratio"], 1.0, "the baseline against itself");
    for r in rows {
        assert_eq!(r["tokens"], 4 * 8 * 32, "{r}");
        let ce = r["held_out"][0]["ce"].as_f64().unwrap();
        assert!(
            ce > 1.0 && ce < 7.0,
            "held-out CE of a barely trained model: {r}"
        );
    }
    assert!(rows[1]["bytes_per_round"].as_f64().unwrap() > 0.0);
    let png = std::fs::read(out.join("val_ce.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    // Finished runs are kept: a second invocation only writes the table again.
    let o = run();
    assert!(
        o.status.success() && !text(&o).contains("[1/2]"),
        "{}",
        text(&o)
    );
}

/// `spes plan memory` against the peak memory `spes bench step` measures on this CPU, within 15 %:
/// `tiny` plain and with activation checkpointing, and `small`, as 4-node SPES nodes in
/// fp32. glibc is told to return every large block at once (a fixed mmap threshold), so the
/// peak follows the live tensors rather than the allocator's reuse (which adds 0–15 % here,
/// what the planner's default headroom is for).
#[test]
fn memory_plan_matches_measured_peak() {
    let cases: [(&str, &str, &[&str]); 3] = [
        ("tiny", "4", &[]),
        ("tiny", "4", &["--activation-checkpointing"]),
        ("small", "2", &[]),
    ];
    for (preset, batch, extra) in cases {
        let mut args = vec![
            "bench",
            "step",
            "--preset",
            preset,
            "--own-experts",
            "4",
            "--batch-size",
            batch,
            "--seq-len",
            "256",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--json",
        ];
        args.extend(extra);
        let o = Command::new(env!("CARGO_BIN_EXE_spes"))
            .args(&args)
            .env("MALLOC_MMAP_THRESHOLD_", "131072")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let stdout = String::from_utf8_lossy(&o.stdout);
        let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        // A CPU has no device allocator: its memory is the process's, and says so.
        assert_eq!(r["device_memory_source"], "rss", "{r}");
        assert!(r["device_peak_reserved_mb"].is_null(), "{r}");
        let measured = r["peak_rss_mb"].as_f64().unwrap();
        let runtime_gb = r["runtime_rss_mb"].as_f64().unwrap() / 1024.0;
        let plan_args = vec![
            "plan".to_string(),
            "memory".to_string(),
            "--preset".into(),
            preset.into(),
            "--nodes".into(),
            "4".into(),
            "--micro-batch".into(),
            batch.into(),
            "--seq-len".into(),
            "256".into(),
            "--precision".into(),
            "fp32".into(),
            "--gpu-mem".into(),
            "24".into(),
            "--runtime-gb".into(),
            runtime_gb.to_string(),
            "--slack".into(),
            "0".into(),
            "--json".into(),
        ];
        let p = spes(&plan_args);
        assert!(p.status.success(), "{}", text(&p));
        let rows: serde_json::Value = serde_json::from_slice(&p.stdout).unwrap();
        let row = usize::from(!extra.is_empty());
        let planned = rows[row]["total"].as_f64().unwrap() / (1 << 20) as f64;
        let ratio = planned / measured;
        println!("{preset} b{batch} {extra:?}: planned {planned:.0} MiB, measured {measured:.0} MiB ({ratio:.3})");
        assert!(
            (0.85..=1.15).contains(&ratio),
            "{preset} {extra:?}: planned {planned:.0} MiB, measured {measured:.0} MiB"
        );
    }
}

/// The side-by-side benchmark runs spes and the PyTorch reference on the same model (it
/// refuses to compare different parameter counts, here with frozen experts), and its ratio
/// column is spes's median over the row's.
#[test]
fn bench_vs_pytorch_compares_the_same_model() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        python.exists(),
        "scripts/setup.sh installs {}",
        python.display()
    );
    let o = Command::new(env!("CARGO_BIN_EXE_spes"))
        .args([
            "bench",
            "vs-pytorch",
            "--preset",
            "tiny",
            "--own-experts",
            "4",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "2",
            "--variants",
            "eager",
            "--device",
            "cpu",
            "--json",
        ])
        .env("PYTHON", &python)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["spes", "PyTorch eager"]);
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    let spes = f(&rows[0], "tokens_per_s_median");
    for r in &rows {
        let med = f(r, "tokens_per_s_median");
        assert!(f(r, "tokens_per_s_min") <= med && med <= f(r, "tokens_per_s_max"));
        assert!((f(r, "spes_ratio") - spes / med).abs() < 1e-9, "{r}");
        assert!(f(r, "peak_memory_mb") > 100.0, "{r}");
        let (model, node) = (f(r, "mfu_model_measured"), f(r, "mfu_node_measured"));
        assert!(model > 0.0 && model < 1.0, "{r}");
        assert!(
            node < model,
            "4 of 16 experts trained: fewer FLOPs a node does, {r}"
        );
        assert_eq!(r["memory_source"], "peak RSS", "{r}");
        assert!(
            r["mfu_model_spec"].is_null(),
            "no specification for a CPU: {r}"
        );
    }
}
