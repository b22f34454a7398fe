//! `spes bench link`: sync measured over shaped loopback links next to the planner's
//! prediction. For each wire option it runs the demo's server and 4 node processes on a preset
//! (`tiny` by default; merging off, so every round can skip own experts), each node behind its
//! own link, and averages the nodes' sync records over the rounds between the first and the
//! last (the first includes start-up; the last is never overlapped). Each node's utilization is
//! its training time over its wall time in those rounds (compute / (compute + idle)).

use crate::{demo, report};
use anyhow::{bail, Context, Result};
use spes_net::link::LinkSpec;
use spes_net::plan::{self, human_bytes, PlanInput, WireOption};
use spes_train::metrics::{self, NodeLine};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Every node's link.
    #[arg(long, default_value = "100mbit,40ms")]
    link: LinkSpec,
    /// The model preset every run trains (`spes presets`).
    #[arg(long, default_value = "tiny")]
    preset: String,
    #[arg(long, default_value = "runs/bench-link")]
    out: PathBuf,
    /// Rounds per run (≥ 3: the first and last are not measured).
    #[arg(long, default_value_t = 5)]
    rounds: u64,
    #[arg(long, default_value_t = 10)]
    sync_steps: u64,
    /// GB/s the planner assumes for the server's folding and publishing.
    #[arg(long, default_value_t = 1.0)]
    aggregate_gbps: f64,
    /// Billions of values per second the server folds of quantized or sparse uploads (each
    /// value of the tensors covered; `spes bench sync` measures about 0.15–0.3 on 2 cores).
    #[arg(long, default_value_t = 0.5)]
    lossy_gvps: f64,
    /// The same for sparse uploads.
    #[arg(long, default_value_t = crate::plan::sync::SPARSE_GVPS)]
    sparse_gvps: f64,
    /// The same for low-rank uploads (dense-equivalent values).
    #[arg(long, default_value_t = crate::plan::sync::LOWRANK_GVPS)]
    lowrank_gvps: f64,
    /// Billions of values per second the server encodes a lossy wire's download at (every
    /// value of the model; `spes bench sync`'s close column: about 0.04 on `tiny`, whose small
    /// matrices cost more per value, and 0.13–0.15 on `1b`).
    #[arg(long, default_value_t = crate::plan::sync::ENCODE_GVPS)]
    encode_gvps: f64,
    #[arg(long, default_value_t = 1.0)]
    disk_gbps: f64,
    /// `sync.stride` of the strided option.
    #[arg(long, default_value_t = 8)]
    stride: u64,
    /// Wire options to run, by label (`fp32`, `bf16-delta`, …, `int4+overlap`); default: all.
    #[arg(long, value_delimiter = ',')]
    wires: Vec<String>,
}

/// A run's measured means per node and round.
struct Measured {
    up: f64,
    down: f64,
    compute_s: f64,
    sync_s: f64,
    idle_s: f64,
    /// Each node's compute / (compute + idle) over the measured rounds, in peer order.
    utilization: Vec<f64>,
}

pub fn run(a: Args) -> Result<()> {
    if a.rounds < 3 {
        bail!("--rounds must be ≥ 3 (the first and last rounds are not measured)");
    }
    std::fs::create_dir_all(&a.out)?;
    let data = demo::prepare_data(&a.out)?;
    let options = if a.wires.is_empty() {
        WireOption::ALL.to_vec()
    } else {
        a.wires
            .iter()
            .map(|w| {
                WireOption::parse(w).with_context(|| {
                    let labels: Vec<_> = WireOption::ALL.iter().map(|o| o.label()).collect();
                    format!("--wires: unknown option `{w}`, expected one of {labels:?}")
                })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let mut rows = Vec::new();
    for option in options {
        let out = a.out.join(option.label());
        let _ = std::fs::remove_dir_all(&out);
        let mut overrides: Vec<String> = vec![
            format!("sync.sync_steps={}", a.sync_steps),
            format!("train.max_steps={}", a.rounds * a.sync_steps),
            format!("model.preset={}", a.preset),
            "sync.merge_every=0".into(),
            "train.eval_batches=2".into(),
        ];
        overrides.extend(option.overrides(a.stride));
        let cfg = demo::config(&data, &overrides)?;
        eprintln!("bench link: {} over {:?} …", option.label(), a.link);
        demo::launch(
            &out,
            &cfg,
            "cpu",
            Some(a.link),
            false,
            None,
            &demo::Extras::default(),
        )?;
        let peers: Vec<u64> = (0..cfg.sync.nodes as u64).collect();
        let costs: Vec<report::RoundCost> = report::round_costs(&out, &peers)
            .into_iter()
            .filter(|c| c.round >= 2 && c.round < a.rounds && c.nodes == peers.len())
            .collect();
        if costs.is_empty() {
            bail!(
                "{}: no complete middle rounds in {}",
                option.label(),
                out.display()
            );
        }
        let mean = |f: fn(&report::RoundCost) -> f64| {
            costs.iter().map(f).sum::<f64>() / costs.len() as f64
        };
        let m = Measured {
            up: mean(|c| c.bytes_up),
            down: mean(|c| c.bytes_down),
            compute_s: mean(|c| c.compute_s),
            sync_s: mean(|c| c.sync_s),
            idle_s: mean(|c| c.idle_s),
            utilization: node_utilization(&out, &peers, 2..a.rounds),
        };
        let input = PlanInput {
            model: cfg.model.clone(),
            nodes: cfg.sync.nodes,
            diloco: false,
            node_link: a.link,
            server_link: "1000gbit".parse()?,
            shards: 1,
            step_s: m.compute_s / a.sync_steps as f64,
            sync_steps: a.sync_steps,
            overlap_cap: cfg.sync.overlap_cap(),
            stride: a.stride,
            sparse_chunk: cfg.sync.sparse_chunk,
            sparse_k: cfg.sync.sparse_k,
            aggregate_bytes_per_s: a.aggregate_gbps * 1e9,
            lossy_values_per_s: a.lossy_gvps * 1e9,
            sparse_values_per_s: a.sparse_gvps * 1e9,
            lowrank_values_per_s: a.lowrank_gvps * 1e9,
            rank: cfg.sync.rank,
            encode_values_per_s: a.encode_gvps * 1e9,
            disk_bytes_per_s: a.disk_gbps * 1e9,
            apply_scale: 1.0,
            fold_scale: 1.0,
            close_scale: 1.0,
            skew_s: 0.0,
            pace_s: 0.0,
        };
        rows.push((option, m, plan::plan(&input, option)));
    }
    println!(
        "\n{}, 4 nodes, each behind a link of {:.0} Mbit/s up, {:.0} Mbit/s down, {:.0} ms RTT; {} steps per round; means per node and round over rounds 2–{}:\n",
        a.preset,
        a.link.up_bps / 1e6,
        a.link.down_bps / 1e6,
        a.link.rtt.as_secs_f64() * 1e3,
        a.sync_steps,
        a.rounds - 1
    );
    println!("| wire | up / round | down / round | compute s | sync s measured / planned | idle s measured / planned | round s measured / planned | round error | utilization per node (lowest) / planned |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (option, m, p) in rows {
        // A round as the node lives it: its steps, then the time it stood still for the sync.
        let round = m.compute_s + m.idle_s;
        let nodes: Vec<String> = m
            .utilization
            .iter()
            .map(|u| format!("{:.1}", 100.0 * u))
            .collect();
        let lowest = m.utilization.iter().copied().fold(1.0, f64::min);
        println!(
            "| {} | {} | {} | {:.1} | {:.2} / {:.2} | {:.2} / {:.2} | {:.1} / {:.1} | {:+.0} % | {} % ({:.1} %) / {:.1} % |",
            option.label(),
            human_bytes(m.up),
            human_bytes(m.down),
            m.compute_s,
            m.sync_s,
            p.sync_s,
            m.idle_s,
            p.idle_s,
            round,
            p.round_s,
            100.0 * (p.round_s - round) / round,
            nodes.join(" / "),
            100.0 * lowest,
            100.0 * p.compute_s / p.round_s,
        );
    }
    println!("\nsync: upload start to loaded model; idle: training stood still (sync without overlap, plus the node's checkpoint, which the planner leaves out); utilization: compute / (compute + idle) of each node; planned: `spes plan sync` with the measured step time.");
    Ok(())
}

/// Each node's utilization (compute / (compute + idle), [`metrics::utilization`]) over the
/// sync records of `rounds`, in peer order.
fn node_utilization(out: &Path, peers: &[u64], rounds: std::ops::Range<u64>) -> Vec<f64> {
    peers
        .iter()
        .map(|p| {
            let (mut compute, mut idle) = (0.0, 0.0);
            for line in metrics::read::<NodeLine>(&out.join(format!("node-{p}/metrics.jsonl"))) {
                if let NodeLine::Sync(r) = line {
                    if rounds.contains(&r.round) {
                        compute += r.compute_s;
                        idle += r.idle_s;
                    }
                }
            }
            metrics::utilization(compute, idle)
        })
        .collect()
}
