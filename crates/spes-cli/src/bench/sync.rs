//! `spes bench sync`: what a SPES node saves against a DiLoCo node. Per-node trainable bytes,
//! optimizer state and traffic per round are derived from the presets' shapes; peak RSS is
//! measured by running a SPES-node and a DiLoCo-node training step each in its own process.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use spes_model::ModelConfig;
use std::process::Command;

/// Per-node memory and traffic of SPES vs DiLoCo for presets, the server's measured
/// aggregation throughput (bytes of uploads per second, on the first preset), and measured
/// peak RSS of a SPES node vs a DiLoCo node training `tiny` (each in its own process).
#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_delimiter = ',', default_value = "tiny,1b")]
    presets: Vec<String>,
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Bytes per value on the wire: 4 (fp32) or 2 (bf16).
    #[arg(long, default_value_t = 4)]
    wire_bytes: u64,
    /// Rounds of the server-aggregation measurement (on the first preset).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Micro-batch of the measured steps.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// Only these wires in the aggregation table (`bf16_delta`, `lowrank_delta`, …); all when
    /// empty. A large preset's table takes minutes per wire.
    #[arg(long, value_delimiter = ',')]
    wires: Vec<String>,
}

/// `spes bench sync`: the three tables.
pub fn run(a: Args) -> Result<()> {
    traffic_table(&a.presets, a.nodes, a.wire_bytes)?;
    aggregation(&a.presets[0], a.nodes, a.rounds, &a.wires)?;
    measured_rss("tiny", a.nodes, a.batch_size, a.seq_len)
}

fn mib(bytes: u64) -> String {
    let m = bytes as f64 / (1u64 << 20) as f64;
    if m >= 10_240.0 {
        format!("{:.1} GiB", m / 1024.0)
    } else {
        format!("{m:.1} MiB")
    }
}

/// Prints the analytic table for `presets` with `nodes` nodes and `wire_bytes` per value.
fn traffic_table(presets: &[String], nodes: usize, wire_bytes: u64) -> Result<()> {
    println!("| preset | mode | trainable params / node | trainable bytes | optimizer state | upload / round | download / round |");
    println!("|---|---|---|---|---|---|---|");
    for name in presets {
        let cfg = ModelConfig::preset(name)?;
        if nodes == 0 || nodes > cfg.n_experts {
            bail!("--nodes must be in 1..={} for preset {name}", cfg.n_experts);
        }
        let n = cfg.param_counts();
        // The busiest node of a contiguous split owns ⌈E/N⌉ experts per layer.
        let own = cfg.n_experts.div_ceil(nodes) as u64;
        let spes = n.shared + cfg.n_layers as u64 * own * n.per_expert;
        for (mode, trainable) in [("spes", spes), ("diloco", n.total)] {
            println!(
                "| {name} | {mode} | {:.1} M | {} | {} | {} | {} |",
                trainable as f64 / 1e6,
                mib(4 * trainable),
                mib(8 * trainable),
                mib(wire_bytes * trainable),
                mib(wire_bytes * n.total),
            );
        }
    }
    Ok(())
}

/// Runs `spes bench step --json` in a child process and returns its result.
fn bench_child(preset: &str, own_experts: usize, batch: usize, seq: usize) -> Result<Value> {
    let out = Command::new(std::env::current_exe()?)
        .args([
            "bench", "step", "--json", "--device", "cpu", "--preset", preset,
        ])
        .args(["--own-experts", &own_experts.to_string()])
        .args([
            "--batch-size",
            &batch.to_string(),
            "--seq-len",
            &seq.to_string(),
        ])
        .output()
        .context("cannot run `spes bench step`")?;
    if !out.status.success() {
        bail!(
            "`spes bench step` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("`spes bench step --json` printed no JSON")
}

/// Measures a SPES node (owning E/N experts) against a DiLoCo node (all experts) on `preset`.
fn measured_rss(preset: &str, nodes: usize, batch: usize, seq: usize) -> Result<()> {
    let cfg = ModelConfig::preset(preset)?;
    let own = cfg.n_experts.div_ceil(nodes);
    println!();
    println!("| {preset}, one training step of {batch}×{seq} tokens on CPU | trainable params | optimizer state | tokens/s | peak RSS |");
    println!("|---|---|---|---|---|");
    let mut rss = Vec::new();
    for (label, n) in [
        (
            format!("spes node ({own} of {} experts)", cfg.n_experts),
            own,
        ),
        ("diloco node (all experts)".into(), cfg.n_experts),
    ] {
        let r = bench_child(preset, n, batch, seq)?;
        let peak = r["peak_rss_mb"].as_f64().unwrap_or(0.0);
        rss.push(peak);
        println!(
            "| {label} | {:.2} M | {} | {:.0} | {peak:.0} MiB |",
            r["trainable_params"].as_f64().unwrap_or(0.0) / 1e6,
            mib(r["optimizer_state_bytes"].as_u64().unwrap_or(0)),
            r["tokens_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    println!(
        "\nSPES node peak RSS is {:.0} MiB lower than the DiLoCo node's.",
        rss[1] - rss[0]
    );
    Ok(())
}

/// Measures how fast a server takes uploads in: each node's payload is mapped from disk
/// (not copied), validated and folded in, then the round closes (merge off) — the server's
/// whole path for a round. Prints bytes of uploads per second for both wires.
fn aggregation(preset: &str, nodes: usize, rounds: usize, only: &[String]) -> Result<()> {
    use spes_sync::{Coordinator, Delta, Layout, Ownership, Scope, Start, SyncConfig, Wire, Work};
    let cfg = ModelConfig::preset(preset)?;
    if nodes == 0 || nodes > cfg.n_experts {
        bail!(
            "--nodes must be in 1..={} for preset {preset}",
            cfg.n_experts
        );
    }
    tch::manual_seed(0);
    let model = spes_model::MoeModel::new(&cfg, tch::Device::Cpu)?;
    let layout = Layout::of(&model);
    let global: spes_sync::Named = model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect();
    // A large preset's model twice would not fit beside the uploads.
    drop(model);
    let scope = Scope::Spes(Ownership::resolve(&[], cfg.n_experts, nodes)?);
    let dir = tempfile::tempdir()?;
    let forms = [
        ("bf16_delta", Wire::Bf16Delta, 1),
        ("int8_delta", Wire::Int8Delta, 1),
        ("int4_delta", Wire::Int4Delta, 1),
        ("int2_delta", Wire::Int2Delta, 1),
        ("int2_delta, stride 8", Wire::Int2Delta, 8),
        ("sparse_delta (64 of 4096)", Wire::SparseDelta, 1),
        ("lowrank_delta (rank 16)", Wire::LowrankDelta, 1),
        ("fp32", Wire::Fp32, 1),
    ];
    let name_of = |label: &'static str| label.split([' ', ',']).next().unwrap_or(label);
    if let Some(w) = only
        .iter()
        .find(|w| !forms.iter().any(|f| name_of(f.0) == *w))
    {
        bail!(
            "--wires: unknown wire `{w}`; expected some of {:?}",
            forms.map(|f| name_of(f.0))
        );
    }
    println!();
    println!("| {preset}, {nodes} nodes | upload bytes / round | encode / node | read | validate + fold | close | throughput | values / s | folded values / s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (label, wire, stride) in forms {
        let name = name_of(label);
        if !only.is_empty() && !only.iter().any(|w| w == name) {
            continue;
        }
        let sync = SyncConfig {
            mode: spes_sync::Mode::Spes,
            sync_steps: 100,
            wire: wire.into(),
            stride,
            round_timeout_s: 1e9,
            lease_s: 1e9,
            evict_after_s: 1e9,
            merge_every: 0,
            ..SyncConfig::default()
        };
        let mut paths = Vec::new();
        let (mut bytes, mut values) = (0u64, 0u64);
        let mut encode_s = 0.0;
        for peer in 0..nodes {
            let mut upload: spes_sync::Named = Vec::new();
            for ((name, role, _), (_, g)) in layout.entries.iter().zip(&global) {
                if !scope.uploads(peer, *role) {
                    continue;
                }
                let change = g.randn_like() * 1e-4;
                // Dense-equivalent: every value of the tensors covered, whatever is sent.
                values += change.numel() as u64;
                let t = std::time::Instant::now();
                match wire {
                    Wire::Fp32 => upload.push((name.clone(), g + change)),
                    _ => upload.extend(Delta::of_change(&change, &sync, 1).into_wire(name)),
                }
                encode_s += t.elapsed().as_secs_f64();
            }
            let kind = spes_sync::delta::payload_kind(wire);
            let path = dir.path().join(format!("{peer}.safetensors"));
            let (size, _) = spes_net::payload::write(&path, &upload, kind)?;
            bytes += size;
            paths.push(path);
        }
        let mut times = Vec::new();
        for i in 0..rounds as u64 {
            // Each measured round opens at 1 + i·stride, so the uploads' stride fits it.
            let mut coord = Coordinator::new(
                layout.clone(),
                scope.clone(),
                sync.clone(),
                Some(1.0),
                Start {
                    global: global
                        .iter()
                        .map(|(n, t)| (n.clone(), t.shallow_clone()))
                        .collect(),
                    published: i * stride,
                    gone: Default::default(),
                    caps: Default::default(),
                },
                0.0,
            );
            let round = coord.round();
            let (mut read, mut fold) = (0.0, 0.0);
            for (peer, path) in paths.iter().enumerate() {
                let t = std::time::Instant::now();
                let fold_in = |named| {
                    read += t.elapsed().as_secs_f64();
                    let t = std::time::Instant::now();
                    let folded = coord.upload(peer, 0, round, named, Work::default(), 0.0);
                    fold += t.elapsed().as_secs_f64();
                    folded
                };
                // Safety: `Coordinator::upload` keeps none of an upload's storage.
                unsafe { spes_net::payload::with_mapped(path, fold_in) }?
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            let t = std::time::Instant::now();
            coord.close(0.0);
            times.push((
                read + fold + t.elapsed().as_secs_f64(),
                read,
                fold,
                t.elapsed().as_secs_f64(),
            ));
        }
        times.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (total, read, fold, close) = times[times.len() / 2];
        println!(
            "| {label} | {} | {:.3} s | {read:.3} s | {fold:.3} s | {close:.3} s | {:.2} GB/s | {:.2} G | {:.2} G |",
            mib(bytes),
            encode_s / nodes as f64,
            bytes as f64 / total / 1e9,
            values as f64 / total / 1e9,
            values as f64 / (read + fold) / 1e9
        );
    }
    println!("\n(encode: a node's whole upload into the wire form, once; median round of {rounds}; throughput = upload bytes / (read + validate + fold + close); values: of the tensors uploaded (dense-equivalent: sent or not, strided or not), per second of the whole path; folded values: the same per second of read + validate + fold, the rate `spes plan sync --lossy-gvps / --sparse-gvps / --lowrank-gvps` take)");
    Ok(())
}
