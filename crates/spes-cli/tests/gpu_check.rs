//! `scripts/gpu-check.sh` checked on a CPU: it refuses a binary that lacks what its sections
//! need before it spends any time, and a vs PyTorch section cut short by its time budget keeps
//! the runs that finished.

mod common;

use common::text;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The data rows of `bench vs-pytorch` tables in `md` (its `--rows` lines and its final table).
fn data_rows(md: &str) -> usize {
    md.lines()
        .filter(|l| l.starts_with("| spes |") || l.starts_with("| PyTorch "))
        .count()
}

/// An option after the output directory is refused at once, not taken for the binary or
/// dropped (which ran every section).
#[test]
fn an_option_after_the_output_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    for args in [
        vec![out.display().to_string(), "--only".into(), "env".into()],
        vec![
            out.display().to_string(),
            "target/release/spes".into(),
            "--only".into(),
            "env".into(),
        ],
    ] {
        let o = Command::new("bash")
            .arg(root().join("scripts/gpu-check.sh"))
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(
            text(&o).contains("options go before OUT_DIR"),
            "{}",
            text(&o)
        );
        assert!(!out.join("results.md").exists(), "{args:?}: a section ran");
    }
}

#[test]
fn a_binary_without_its_nccl_part_is_refused_before_any_section() {
    let tmp = tempfile::tempdir().unwrap();
    let caps = r#"{"version":"0.1.0","libtorch":"2.11.0","cuda_built":true,"nccl":false,"cuda_available":true,"gpu":"NVIDIA H100","sm":"9.0","grouped_kernel":true}"#;
    let stub = tmp.path().join("spes");
    std::fs::write(
        &stub,
        format!(
            "#!/bin/sh\nif [ \"$1\" = capabilities ] && [ \"$2\" = --json ]; then\n  echo '{caps}'\n  exit 0\nfi\nexit 1\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = tmp.path().join("out");
    let start = Instant::now();
    let o = Command::new("bash")
        .arg(root().join("scripts/gpu-check.sh"))
        .arg(&out)
        .env("SPES_BIN", &stub)
        .env("GPU_CHECK_WORK", tmp.path().join("work"))
        .output()
        .unwrap();
    let took = start.elapsed();
    let all = text(&o);
    assert!(!o.status.success(), "a binary without NCCL passed: {all}");
    assert!(
        took < Duration::from_secs(5),
        "refused only after {took:?}: {all}"
    );
    assert!(all.contains("NCCL"), "the refusal must name NCCL: {all}");
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("REFUSED") && md.contains("NCCL"), "{md}");
    assert!(!md.contains("\n## "), "a section ran: {md}");
    let sections = std::fs::read_to_string(out.join("results.jsonl")).unwrap_or_default();
    assert!(sections.is_empty(), "{sections}");
}

#[test]
fn a_vs_pytorch_section_that_times_out_keeps_its_finished_rows() {
    let python = root().join(".venv/bin/python");
    assert!(
        python.exists(),
        "scripts/setup.sh installs {}",
        python.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    // The run the script's CPU twin makes (cli.rs's bench_vs_pytorch_compares_the_same_model's
    // size, the variants of the GPU's section), timed to its first row.
    let rows = tmp.path().join("rows.md");
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_spes"))
        .args([
            "bench",
            "vs-pytorch",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--own-experts",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--variants",
            "eager,fused",
            "--python",
        ])
        .arg(&python)
        .arg("--rows")
        .arg(&rows)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let limit = Duration::from_secs(180);
    let first = loop {
        if data_rows(&std::fs::read_to_string(&rows).unwrap_or_default()) > 0 {
            break start.elapsed();
        }
        if let Some(s) = child.try_wait().unwrap() {
            panic!("bench vs-pytorch exited ({s}) before its first row");
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("no row in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Its other runs finish before the script starts, so that nothing runs beside it.
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("bench vs-pytorch still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "bench vs-pytorch: {status}");
    let whole = start.elapsed();

    let budget = first.as_secs_f64().ceil() as u64 + 1;
    let out = tmp.path().join("out");
    let o = Command::new("bash")
        .arg(root().join("scripts/gpu-check.sh"))
        .args(["--cpu", "--only", "vs_pytorch"])
        .arg(&out)
        .env("SPES_BIN", env!("CARGO_BIN_EXE_spes"))
        .env("PYTHON", &python)
        .env("GPU_CHECK_WORK", tmp.path().join("work"))
        .env("GPU_CHECK_BUDGET_vs_pytorch", budget.to_string())
        .output()
        .unwrap();
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(
        data_rows(&md) >= 1,
        "no finished run in results.md (budget {budget} s, first row after {first:?}): {md}\n{}",
        text(&o)
    );
    let jl = std::fs::read_to_string(out.join("results.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(jl.lines().last().unwrap()).unwrap();
    assert_eq!(last["id"], "vs_pytorch", "{jl}");
    // The section has budget - first seconds after its first row; the direct run needed
    // whole - first for its other two. When they clearly need more, the section must have run
    // out of time and the script must say so in its exit status.
    let (slack, rest) = (
        budget as f64 - first.as_secs_f64(),
        (whole - first).as_secs_f64(),
    );
    if rest > slack + 1.0 {
        assert!(
            matches!(last["status"].as_i64(), Some(124 | 137)),
            "expected a timeout (budget {budget} s, rows after the first took {rest:.1} s): {jl}\n{md}"
        );
        assert!(!o.status.success(), "{}", text(&o));
    } else {
        eprintln!("the runs after the first took {rest:.1} s, too few to cut the section surely");
    }
}
