//! `spes bench step` (training steps of a preset on random tokens) and `spes bench vs-pytorch`
//! (the same steps side by side with the model written in plain PyTorch).

use crate::args::{parse_moe_kernel, parse_precision, RuntimeArgs};
use anyhow::{bail, Context, Result};
use spes_model::{ModelConfig, MoeKernel};
use spes_train::bench::{bench, matmul_peak_flops, median, BenchOptions};
use spes_train::{compute_kind, moe_kernel, MoeKernelChoice, Precision};
use std::path::PathBuf;
use std::process::Command;
use tch::Kind;

/// The steps to measure, shared by both commands.
#[derive(clap::Args)]
pub struct StepArgs {
    #[arg(long, default_value = "tiny")]
    preset: String,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    #[arg(long, default_value_t = 5)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, value_parser = parse_precision, default_value = "auto")]
    precision: Precision,
    /// Train only this many experts per layer (as a SPES node does); default all.
    #[arg(long)]
    own_experts: Option<usize>,
    /// How MoE layers run their experts: auto (grouped in bf16 on SM 9.x GPUs, else the loop),
    /// loop or grouped.
    #[arg(long, value_parser = parse_moe_kernel, default_value = "auto")]
    moe_kernel: MoeKernelChoice,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

/// `spes bench step`'s options beyond the steps.
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    step: StepArgs,
    /// Recompute each block during backward instead of keeping its activations.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Frozen experts: auto (bf16-resident on CUDA), bf16 or fp32.
    #[arg(long, default_value = "auto", value_parser = ["auto", "bf16", "fp32"])]
    frozen_experts: String,
    /// First run one batch through both MoE kernels and report how far apart they are.
    #[arg(long)]
    compare_moe_kernels: bool,
    /// First run one batch with the step's compute copies (bf16 weights made once per
    /// optimizer step, q/k/v and gate/up fused) and with per-matmul casts, and report how far
    /// apart they are (mixed precision).
    #[arg(long)]
    compare_step_paths: bool,
    /// First run one batch with the LM head's gradient accumulated in fp32 inside its product
    /// (CUDA, bf16) and as its CPU twin does (each chunk's product added), and report how far
    /// apart they are.
    #[arg(long)]
    compare_head: bool,
    /// Also count the top-level ATen operator calls of the timed steps (libtorch's
    /// RecordFunction; slows the steps) and print them per optimizer step and phase.
    #[arg(long)]
    count_ops: bool,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// `spes bench vs-pytorch`'s options beyond the steps.
#[derive(clap::Args)]
pub struct VsPytorchArgs {
    #[command(flatten)]
    step: StepArgs,
    /// Rounds of runs; each round runs spes and every variant once, in a rotating order.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// PyTorch variants: eager (AdamW's default implementation), fused (AdamW(fused=True)),
    /// compile (the loss under torch.compile, fused AdamW).
    #[arg(long, value_delimiter = ',', default_value = "eager,fused,compile",
          value_parser = ["eager", "fused", "compile"])]
    variants: Vec<String>,
    /// Python interpreter with torch (default: $PYTHON, else .venv/bin/python, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also append each run to FILE as a Markdown table line the moment it finishes, so a run
    /// cut short (a GPU check's time budget) keeps what it measured.
    #[arg(long)]
    rows: Option<PathBuf>,
}

/// `spes bench step`: measure in this process and print a table or JSON.
pub fn run_bench(a: &BenchArgs) -> Result<()> {
    let s = &a.step;
    let device = s.runtime.device()?;
    let o = BenchOptions {
        model: ModelConfig::preset(&s.preset)?,
        device,
        precision: s.precision,
        batch_size: s.batch_size,
        seq_len: s.seq_len,
        steps: s.steps.max(1),
        warmup: s.warmup,
        own_experts: s.own_experts,
        activation_checkpointing: a.activation_checkpointing,
        moe_kernel: s.moe_kernel,
        frozen_experts_bf16: match a.frozen_experts.as_str() {
            "auto" => None,
            f => Some(f == "bf16"),
        },
        compare_moe_kernels: a.compare_moe_kernels,
        compare_step_paths: a.compare_step_paths,
        count_ops: a.count_ops,
        compare_head: a.compare_head,
    };
    let r = bench(&o)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!("| preset | device | precision | batch×seq | trainable params | optimizer state | step ms | optimizer ms | tokens/s | peak RSS | device peak (allocated / reserved) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {device:?} | {:?} | {}×{} | {:.1} M of {:.1} M | {:.1} MiB | {:.0} | {:.1} | {:.0} | {:.0} MiB | {} |",
        s.preset,
        s.precision,
        s.batch_size,
        s.seq_len,
        r.trainable_params as f64 / 1e6,
        r.total_params as f64 / 1e6,
        r.optimizer_state_bytes as f64 / (1 << 20) as f64,
        r.step_ms,
        r.optimizer_ms,
        r.tokens_per_s,
        r.peak_rss_mb,
        match (r.device_peak_allocated_mb, r.device_peak_reserved_mb) {
            (Some(a), Some(b)) => format!("{a:.0} / {b:.0} MiB (caching allocator)"),
            _ => "n/a (CPU: the process's RSS)".into(),
        }
    );
    if let Some(d) = &r.moe_kernels {
        println!(
            "grouped vs loop MoE kernel on one batch: loss {:.2e} apart, gradients {:.2e} (relative)",
            d.loss_rel, d.grad_rel
        );
    }
    if let Some(d) = &r.head_paths {
        println!(
            "LM head gradient accumulated in fp32 in its product vs product then add on one batch: loss {:.2e} apart, gradients {:.2e} (relative)",
            d.loss_rel, d.grad_rel
        );
    }
    if let Some(c) = &r.op_counts {
        println!();
        println!("| top-level ATen calls per optimizer step | forward | backward | optimizer | bookkeeping | other | outside forward and backward |");
        println!("|---|---|---|---|---|---|---|");
        println!(
            "| {} steps | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            o.steps,
            c.forward,
            c.backward,
            c.optimizer,
            c.bookkeeping,
            c.other,
            c.outside_forward_backward()
        );
    }
    if let Some(d) = &r.step_paths {
        println!(
            "step compute copies vs per-matmul casts on one batch: loss {:.2e} apart, gradients {:.2e} (relative)",
            d.loss_rel, d.grad_rel
        );
    }
    Ok(())
}

/// One run of one implementation, each in its own process: the fields that `spes bench step
/// --json` and `bench_pytorch.py` both print.
#[derive(Clone, Debug, serde::Deserialize)]
struct Run {
    tokens_per_s: f64,
    step_ms: f64,
    peak_rss_mb: f64,
    device_peak_allocated_mb: Option<f64>,
    device_peak_reserved_mb: Option<f64>,
    total_params: u64,
    trainable_params: u64,
}

impl Run {
    /// Its peak memory: the caching allocator's peak reserved bytes on CUDA (what the card
    /// had to hold), the process's peak RSS on CPU.
    fn memory_mb(&self) -> f64 {
        self.device_peak_reserved_mb.unwrap_or(self.peak_rss_mb)
    }
}

/// What MFU divides by: the FLOPs counted per token, both ways, and the peaks.
struct Mfu {
    /// Model FLOPs (every expert trained, PaLM's convention: what other stacks print).
    model: f64,
    /// The FLOPs a SPES node does (no weight gradients for frozen experts).
    node: f64,
    /// The matmul peak measured on this device, and the card's specification (bf16 dense) where
    /// it is known.
    measured: f64,
    spec: Option<f64>,
}

/// Dense bf16 tensor-core peaks by card name (NVIDIA's datasheets).
fn spec_peak(gpu: &str, kind: Kind) -> Option<f64> {
    if kind != Kind::BFloat16 {
        return None;
    }
    [("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12)]
        .into_iter()
        .find(|(name, _)| gpu.contains(name))
        .map(|(_, p)| p)
}

/// One row of the side-by-side table.
#[derive(Debug, serde::Serialize)]
struct Row {
    name: String,
    tokens_per_s_median: f64,
    tokens_per_s_min: f64,
    tokens_per_s_max: f64,
    step_ms_median: f64,
    /// spes's median tokens/s over this row's.
    spes_ratio: f64,
    /// Peak over the repeats: the caching allocator's peak reserved memory on CUDA, the
    /// process's peak RSS on CPU ([`Row::memory_source`]).
    peak_memory_mb: f64,
    memory_source: &'static str,
    /// CUDA: the most the tensors took at once (the caching allocator's peak allocated).
    peak_allocated_mb: Option<f64>,
    /// Median tokens/s × FLOPs per token over a peak: model FLOPs or the node's, over the
    /// measured matmul peak or the card's specification.
    mfu_model_measured: f64,
    mfu_node_measured: f64,
    mfu_model_spec: Option<f64>,
    mfu_node_spec: Option<f64>,
}

/// `spes bench vs-pytorch`: alternate `spes bench step` and `scripts/bench_pytorch.py` (each run a
/// fresh process), then print tokens/s, memory and MFU side by side.
pub fn run_vs_pytorch(a: &VsPytorchArgs) -> Result<()> {
    let s = &a.step;
    let model = ModelConfig::preset(&s.preset)?;
    let device = s.runtime.device()?;
    let cuda = device.is_cuda();
    let kind = compute_kind(s.precision, device);
    let bf16 = kind == Kind::BFloat16;
    let kernel = match moe_kernel(s.moe_kernel, device, kind) {
        MoeKernel::Loop => "loop",
        MoeKernel::Grouped => "grouped",
    };
    let (steps, repeats) = (s.steps.max(1), a.repeats.max(1));
    let script = tempfile::Builder::new()
        .prefix("bench_pytorch")
        .suffix(".py")
        .tempfile()?;
    std::fs::write(
        script.path(),
        include_str!("../../../../scripts/bench_pytorch.py"),
    )?;
    let python = a.python.clone().unwrap_or_else(default_python);
    let exe = std::env::current_exe()?;

    let common = |cmd: &mut Command| {
        cmd.arg("--batch-size")
            .arg(s.batch_size.to_string())
            .arg("--seq-len")
            .arg(s.seq_len.to_string())
            .arg("--steps")
            .arg(steps.to_string())
            .arg("--warmup")
            .arg(s.warmup.to_string())
            .arg("--device")
            .arg(if cuda { "cuda" } else { "cpu" })
            .arg("--precision")
            .arg(if bf16 { "bf16" } else { "fp32" })
            .arg("--moe-kernel")
            .arg(kernel);
        if let Some(n) = s.own_experts {
            cmd.arg("--own-experts").arg(n.to_string());
        }
        if let Some(n) = s.runtime.threads {
            cmd.arg("--threads").arg(n.to_string());
        }
    };
    let mut names = vec!["spes".to_string()];
    names.extend(a.variants.iter().map(|v| format!("PyTorch {v}")));
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); names.len()];
    let gpu = match device {
        tch::Device::Cuda(i) => spes_ext::nccl::cuda_device(i).ok().map(|d| d.name),
        _ => None,
    };
    let mfu = Mfu {
        model: model.train_flops_per_token(s.seq_len),
        node: model.node_train_flops_per_token(s.seq_len, s.own_experts),
        measured: matmul_peak_flops(device, kind),
        spec: gpu.as_deref().and_then(|g| spec_peak(g, kind)),
    };
    let memory_source = if cuda {
        "caching allocator, peak reserved"
    } else {
        "peak RSS"
    };
    let mut rows_file = a
        .rows
        .as_ref()
        .map(|path| {
            let fresh = std::fs::metadata(path).map_or(true, |m| m.len() == 0);
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot write --rows {}", path.display()))?;
            if fresh {
                use std::io::Write;
                writeln!(f, "| run | round | tokens/s | step ms | memory MiB ({memory_source}) | MFU model / measured peak | MFU node / measured peak |")?;
                writeln!(f, "|---|---|---|---|---|---|---|")?;
            }
            anyhow::Ok(f)
        })
        .transpose()?;
    for round in 0..repeats {
        for i in (0..names.len()).map(|i| (i + round) % names.len()) {
            let mut cmd = if i == 0 {
                let mut c = Command::new(&exe);
                c.args(["bench", "step", "--json", "--preset", &s.preset]);
                c
            } else {
                let mut c = Command::new(&python);
                c.arg(script.path())
                    .arg("--model")
                    .arg(serde_json::to_string(&model)?)
                    .arg("--variant")
                    .arg(&a.variants[i - 1]);
                c
            };
            common(&mut cmd);
            eprintln!("round {}/{repeats}: {}", round + 1, names[i]);
            let r = run_json(&mut cmd, &names[i])?;
            let line = format!(
                "| {} | {} | {:.0} | {:.1} | {:.0} | {:.1} % | {:.1} % |",
                names[i],
                round + 1,
                r.tokens_per_s,
                r.step_ms,
                r.memory_mb(),
                100.0 * r.tokens_per_s * mfu.model / mfu.measured,
                100.0 * r.tokens_per_s * mfu.node / mfu.measured
            );
            eprintln!("{line}");
            if let Some(f) = rows_file.as_mut() {
                use std::io::Write;
                writeln!(f, "{line}")?;
                f.flush()?;
            }
            runs[i].push(r);
        }
    }
    check_same_model(&names, &runs)?;

    let spes_median = median(runs[0].iter().map(|r| r.tokens_per_s).collect());
    let rows: Vec<Row> = names
        .iter()
        .zip(&runs)
        .map(|(name, rs)| {
            let tps: Vec<f64> = rs.iter().map(|r| r.tokens_per_s).collect();
            let med = median(tps.clone());
            Row {
                name: name.clone(),
                tokens_per_s_median: med,
                tokens_per_s_min: tps.iter().copied().fold(f64::INFINITY, f64::min),
                tokens_per_s_max: tps.iter().copied().fold(0.0, f64::max),
                step_ms_median: median(rs.iter().map(|r| r.step_ms).collect()),
                spes_ratio: spes_median / med,
                peak_memory_mb: rs.iter().map(Run::memory_mb).fold(0.0, f64::max),
                memory_source,
                peak_allocated_mb: rs
                    .iter()
                    .filter_map(|r| r.device_peak_allocated_mb)
                    .reduce(f64::max),
                mfu_model_measured: med * mfu.model / mfu.measured,
                mfu_node_measured: med * mfu.node / mfu.measured,
                mfu_model_spec: mfu.spec.map(|p| med * mfu.model / p),
                mfu_node_spec: mfu.spec.map(|p| med * mfu.node / p),
            }
        })
        .collect();
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!(
        "{} on {}, {}, {}×{} tokens per step, {} MoE kernel, {}; {} rounds of {} timed steps after {} warm-up",
        s.preset,
        if cuda { "cuda" } else { "cpu" },
        if bf16 { "bf16" } else { "fp32" },
        s.batch_size,
        s.seq_len,
        kernel,
        s.own_experts
            .map_or("all experts trained".into(), |n| format!("{n} experts per layer trained")),
        repeats,
        steps,
        s.warmup
    );
    println!(
        "matmul peak measured {:.1} GFLOP/s ({}), specification {}; {:.2} MFLOP per token as model FLOPs, {:.2} as the node's (frozen experts: no weight gradient)",
        mfu.measured / 1e9,
        if bf16 { "bf16" } else { "fp32" },
        mfu.spec.map_or("unknown for this device".into(), |p| format!(
            "{:.1} TFLOP/s ({})",
            p / 1e12,
            gpu.as_deref().unwrap_or("?")
        )),
        mfu.model / 1e6,
        mfu.node / 1e6
    );
    let pct = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{:.1} %", 100.0 * v));
    println!("| run | tokens/s median | min | max | step ms | spes ÷ run | {memory_source} MiB | MFU model / measured | MFU node / measured | MFU model / spec | MFU node / spec |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.1} % | {:.1} % | {} | {} |",
            r.name,
            r.tokens_per_s_median,
            r.tokens_per_s_min,
            r.tokens_per_s_max,
            r.step_ms_median,
            r.spes_ratio,
            r.peak_memory_mb,
            100.0 * r.mfu_model_measured,
            100.0 * r.mfu_node_measured,
            pct(r.mfu_model_spec),
            pct(r.mfu_node_spec)
        );
    }
    Ok(())
}

/// Runs `cmd` and parses the last line of its output as a [`Run`] (other fields ignored).
fn run_json(cmd: &mut Command, name: &str) -> Result<Run> {
    let out = cmd
        .output()
        .with_context(|| format!("{name}: cannot start {:?}", cmd.get_program()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("{name} failed ({}):\n{}", out.status, tail.join("\n"));
    }
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .with_context(|| format!("{name}: expected a JSON result, got `{last}`"))
}

/// The comparison means something only if both sides built and trained the same tensors.
fn check_same_model(names: &[String], runs: &[Vec<Run>]) -> Result<()> {
    let spes = &runs[0][0];
    for (name, rs) in names.iter().zip(runs).skip(1) {
        let r = &rs[0];
        if (r.total_params, r.trainable_params) != (spes.total_params, spes.trainable_params) {
            bail!(
                "{name} built a different model: {} parameters, {} trainable; spes: {}, {}",
                r.total_params,
                r.trainable_params,
                spes.total_params,
                spes.trainable_params
            );
        }
    }
    Ok(())
}

fn default_python() -> PathBuf {
    if let Some(p) = std::env::var_os("PYTHON") {
        return p.into();
    }
    let venv = PathBuf::from(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        "python3".into()
    }
}
