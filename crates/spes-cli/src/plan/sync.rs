//! `spes plan sync`: the planner's tables (spes-net's `plan`) for presets and node counts.

use anyhow::{bail, Result};
use spes_model::ModelConfig;
use spes_net::link::LinkSpec;
use spes_net::plan::{self, PlanInput, WireOption};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_delimiter = ',', default_value = "1b")]
    presets: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "16")]
    nodes: Vec<usize>,
    /// Every node's link: `100mbit,40ms`, or `up=…,down=…,rtt=…`.
    #[arg(long, default_value = "100mbit,40ms")]
    link: LinkSpec,
    /// The server's link (its rate is shared by all nodes).
    #[arg(long, default_value = "10gbit")]
    server_link: LinkSpec,
    /// Server processes (`spes server --shard i/k`), each with such a link.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Seconds per optimizer step on a node.
    #[arg(long, default_value_t = 0.45)]
    step_s: f64,
    #[arg(long, default_value_t = 100)]
    sync_steps: u64,
    /// With overlap, the most steps a node trains past its upload before it waits
    /// (`sync.overlap_steps`; 0: --sync-steps).
    #[arg(long, default_value_t = 0)]
    overlap_steps: u64,
    /// The strided option: one value in this many per round (`sync.stride`).
    #[arg(long, default_value_t = 8)]
    stride: u64,
    /// Sparse wire: values per chunk (`sync.sparse_chunk`).
    #[arg(long, default_value_t = 4096)]
    sparse_chunk: i64,
    /// Sparse wire: entries sent per chunk (`sync.sparse_k`).
    #[arg(long, default_value_t = 64)]
    sparse_k: i64,
    /// GB of uploads the server folds in per second (`spes bench sync` measures it).
    #[arg(long, default_value_t = spes_net::plan::AGGREGATE_GBPS)]
    aggregate_gbps: f64,
    /// Billions of values per second the server decodes and folds of quantized uploads (each
    /// value sent; `spes bench sync` measures it).
    #[arg(long, default_value_t = LOSSY_GVPS)]
    lossy_gvps: f64,
    /// The same for sparse uploads (`spes bench sync` measures it).
    #[arg(long, default_value_t = SPARSE_GVPS)]
    sparse_gvps: f64,
    /// The same for low-rank uploads (`spes bench sync` measures it).
    #[arg(long, default_value_t = LOWRANK_GVPS)]
    lowrank_gvps: f64,
    /// Low-rank wire: the rank of each matrix's factors (`sync.rank`).
    #[arg(long, default_value_t = 16)]
    rank: i64,
    /// Billions of values per second the server encodes a lossy wire's download at (every
    /// value of the model; `spes bench sync`'s close column).
    #[arg(long, default_value_t = ENCODE_GVPS)]
    encode_gvps: f64,
    /// GB per second the server writes a published round at.
    #[arg(long, default_value_t = spes_net::plan::DISK_GBPS)]
    disk_gbps: f64,
    /// DiLoCo: every node exchanges every parameter.
    #[arg(long)]
    diloco: bool,
}

pub use spes_net::plan::{ENCODE_GVPS, LOSSY_GVPS, LOWRANK_GVPS, SPARSE_GVPS};

/// The planner's input for `preset` with `nodes` nodes.
pub fn input(a: &Args, preset: &str, nodes: usize) -> Result<PlanInput> {
    let model = ModelConfig::preset(preset)?;
    if nodes == 0 || (!a.diloco && nodes > model.n_experts) {
        bail!(
            "--nodes must be in 1..={} for preset {preset}",
            model.n_experts
        );
    }
    Ok(PlanInput {
        model,
        nodes,
        diloco: a.diloco,
        node_link: a.link,
        server_link: a.server_link,
        shards: a.shards.max(1),
        step_s: a.step_s,
        sync_steps: a.sync_steps,
        overlap_cap: spes_sync::SyncConfig {
            sync_steps: a.sync_steps,
            overlap_steps: a.overlap_steps.into(),
            ..Default::default()
        }
        .overlap_cap(),
        stride: a.stride.max(1),
        sparse_chunk: a.sparse_chunk,
        sparse_k: a.sparse_k,
        aggregate_bytes_per_s: a.aggregate_gbps * 1e9,
        lossy_values_per_s: a.lossy_gvps * 1e9,
        sparse_values_per_s: a.sparse_gvps * 1e9,
        lowrank_values_per_s: a.lowrank_gvps * 1e9,
        rank: a.rank,
        encode_values_per_s: a.encode_gvps * 1e9,
        disk_bytes_per_s: a.disk_gbps * 1e9,
        apply_scale: 1.0,
        fold_scale: 1.0,
        close_scale: 1.0,
        skew_s: 0.0,
        pace_s: 0.0,
    })
}

/// The option shard advice is about: the leanest wire whose loss cost docs/results/sync-cost.md
/// measured as acceptable.
const ADVISED: WireOption = WireOption::Int2Overlap;

/// Where one server stops being enough: the first node count whose [`ADVISED`] rounds idle
/// over a point more than with an unlimited server (link, folding and disk).
fn server_limit(base: &PlanInput, max_nodes: usize) -> Option<usize> {
    (2..=max_nodes).find(|&n| {
        let mut i = base.clone();
        i.nodes = n;
        i.shards = 1;
        let one = plan::plan(&i, ADVISED).idle_share;
        let unlimited = plan::plan(&plan::unlimited_server(&i), ADVISED).idle_share;
        one > unlimited + 0.01
    })
}

pub fn run(a: Args) -> Result<()> {
    for preset in &a.presets {
        for &nodes in &a.nodes {
            let experts = ModelConfig::preset(preset)?.n_experts;
            if !a.diloco && nodes > experts {
                println!("\n{preset}, {nodes} nodes: not a SPES run ({preset} has {experts} experts; every node owns one or more).");
                continue;
            }
            let i = input(&a, preset, nodes)?;
            println!(
                "\n{preset}, {nodes} nodes, node link {:.0} Mbit/s, RTT {:.0} ms, server link {:.0} Gbit/s × {} shard(s), {} steps × {:.2} s:\n",
                i.node_link.down_bps / 1e6,
                i.node_link.rtt.as_secs_f64() * 1e3,
                i.server_link.down_bps / 1e9,
                i.shards,
                i.sync_steps,
                i.step_s
            );
            print!("{}", plan::table(&i));
        }
        let experts = ModelConfig::preset(preset)?.n_experts;
        let max = if a.diloco { 64 } else { experts.min(64) };
        let base = input(&a, preset, a.nodes[0].min(max))?;
        match server_limit(&base, max) {
            Some(n) => {
                println!("\n{preset}: one server becomes the bottleneck (link or folding) at {n} nodes ({} idles a point more than with an unlimited server).", ADVISED.label());
                for &nodes in a.nodes.iter().filter(|&&m| m >= n && m <= max) {
                    let mut i = input(&a, preset, nodes)?;
                    let floor = plan::plan(&plan::unlimited_server(&i), ADVISED).idle_share;
                    i.shards = 1;
                    match plan::shards_needed(&i, ADVISED, floor + 0.01) {
                        Some(k) => println!("  at {nodes} nodes, {k} shards (`spes server --shard i/{k}`) bring it back to {:.0} % idle.", 100.0 * floor),
                        None => println!("  at {nodes} nodes, even 64 shards do not."),
                    }
                }
            }
            None => println!("\n{preset}: one server is enough up to {max} nodes on these links."),
        }
    }
    Ok(())
}
