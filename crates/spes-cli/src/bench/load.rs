//! `spes bench load`: how one server holds up as the run grows wide. For each node count it
//! starts a real `spes server` process on a micro model with one expert per node, and drives
//! it with that many virtual peers in this process: each joins, then every round uploads a
//! precomputed bf16 delta of exactly the tensors it trains and fetches the round back without
//! its own experts through the node's own transport (`spes_net::node::VirtualPeer`: the same
//! calls, retries and payload checks), over real gRPC on loopback. Peers do not train, so a round
//! measures the server alone. Prints round latency (p50/p99), uploads per second, the
//! server's own bytes out per round (fetch headers, payloads it streamed, what it put in a
//! store) and peak RSS against node count, with the planner's round time beside each. With
//! `--store`, the server keeps the run in that store and peers read rounds through presigned
//! URLs; every node count then trains one model (as many experts as the largest count), so
//! the server's bytes out can be compared across counts, and the peers' store GETs are shown.

use anyhow::{bail, Context, Result};
use spes_net::link::LinkSpec;
use spes_net::node::VirtualPeer;
use spes_net::plan::{self, PlanInput, WireOption};
use spes_sync::{Delta, Layout};
use spes_train::RunConfig;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Node counts to run, one server each.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128")]
    nodes: Vec<usize>,
    /// Rounds per node count (the first is not measured).
    #[arg(long, default_value_t = 20)]
    rounds: u64,
    #[arg(long, default_value = "runs/bench-load")]
    out: PathBuf,
    /// The server's store; each node count runs under its own prefix `<URL>/<time>-nodes-N`.
    #[command(flatten)]
    store: crate::args::StoreArgs,
}

/// The micro model with `experts` experts and a run of `nodes` peers for `rounds` rounds.
fn config(data: &Path, experts: usize, nodes: usize, rounds: u64) -> Result<RunConfig> {
    let text = format!(
        r#"
[model]
preset = "tiny"
vocab_size = 8192
d_model = 64
n_layers = 2
n_heads = 2
head_dim = 32
n_kv_heads = 2
n_experts = {experts}
top_k = 2
expert_hidden = 64
context_length = 64

[data]
path = "{}"

[train]
max_steps = {rounds}
batch_size = 2
seq_len = 64
eval_batches = 1

[sync]
mode = "spes"
nodes = {nodes}
sync_steps = 1
wire = "bf16_delta"
merge_every = 0
round_timeout_s = 600
lease_s = 120
checkpoint_every_rounds = 1000
"#,
        data.display()
    );
    RunConfig::parse(&text, &[])
}

/// What one node count measured.
struct Row {
    nodes: usize,
    p50_s: f64,
    p99_s: f64,
    uploads_per_s: f64,
    peak_rss_mb: f64,
    upload_bytes: u64,
    planned_s: f64,
    /// The server's bytes out per measured round: to nodes, and put in the store.
    out_per_round: f64,
    store_per_round: f64,
    /// Peers' GETs of the store per measured round, and fetches the store failed.
    gets_per_round: f64,
    fallbacks: u64,
}

pub fn run(a: Args) -> Result<()> {
    if a.rounds < 2 {
        bail!("--rounds must be ≥ 2 (the first round is not measured)");
    }
    std::fs::create_dir_all(&a.out)?;
    let data = crate::demo::prepare_data(&a.out)?;
    let largest = a.nodes.iter().copied().max().unwrap_or(1);
    if let Some(n) = (a.store.store.is_some())
        .then(|| a.nodes.iter().find(|&&n| largest % n != 0))
        .flatten()
    {
        bail!("--nodes {n} does not divide {largest}: with --store every count trains the same {largest} experts");
    }
    let mut rows = Vec::new();
    for &n in &a.nodes {
        eprintln!("bench load: {n} virtual peers …");
        rows.push(measure(&a, &data, n, largest)?);
    }
    let (experts, reads) = match &a.store.store {
        Some(_) => (
            format!("{largest} experts at every count"),
            "rounds read from the store through presigned URLs",
        ),
        None => (
            "one expert per peer".into(),
            "rounds streamed by the server",
        ),
    };
    println!("\nOne `spes server` process, virtual peers on loopback (no training), bf16 deltas, {experts}, {reads}, {} rounds (round 1 not measured):\n", a.rounds);
    println!("| nodes | upload / peer | round p50 | round p99 | planned round | uploads / s | server out / round | of it to the store | store GETs / round | fallbacks | server peak RSS |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {:.3} s | {:.3} s | {:.3} s | {:.0} | {} | {} | {:.0} | {} | {:.0} MiB |",
            r.nodes,
            plan::human_bytes(r.upload_bytes as f64),
            r.p50_s,
            r.p99_s,
            r.planned_s,
            r.uploads_per_s,
            plan::human_bytes(r.out_per_round + r.store_per_round),
            plan::human_bytes(r.store_per_round),
            r.gets_per_round,
            r.fallbacks,
            r.peak_rss_mb
        );
    }
    println!("\nround: from the round's first upload to the last peer holding it; planned: `spes plan sync`'s round for these shapes on unlimited loopback links with no compute (1 GB/s folding and disk); server out: the server's own counters (its round records): fetch headers, payloads it streamed, and what it put in the store (deltas, uploads kept, whole models, manifests); store GETs: made by the peers.");
    Ok(())
}

fn measure(a: &Args, data: &Path, nodes: usize, largest: usize) -> Result<Row> {
    let experts = if a.store.store.is_some() {
        largest
    } else {
        nodes
    };
    let cfg = config(data, experts, nodes, a.rounds)?;
    let out = a.out.join(format!("nodes-{nodes}"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let config_path = out.join("config.toml");
    std::fs::write(&config_path, toml::to_string(&cfg)?)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut server = ServerProc(
        Command::new(std::env::current_exe()?)
            .args(["server", "--config"])
            .arg(&config_path)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--no-auth"])
            .args(["--device", "cpu", "--linger-s", "5"])
            .arg("--out")
            .arg(out.join("server"))
            .args(store_args(&a.store, nodes))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(out.join("server.log"))?)
            .spawn()
            .context("cannot start the server")?,
    );
    let url = format!("http://127.0.0.1:{port}");
    let model = spes_model::MoeModel::new(&cfg.model, tch::Device::Cpu)?;
    let layout = Layout::of(&model);
    let scope = spes_sync::Scope::of(&cfg.sync, cfg.model.n_experts)?;
    let rt = tokio::runtime::Runtime::new()?;
    let peers: Vec<VirtualPeer> = (0..nodes)
        .map(|id| {
            let wire: spes_sync::Named = layout
                .entries
                .iter()
                .filter(|(_, role, _)| scope.uploads(id, *role))
                .flat_map(|(name, _, shape)| {
                    let change =
                        tch::Tensor::randn(shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu))
                            * 1e-4;
                    Delta::of_change(&change, &cfg.sync, 1).into_wire(name)
                })
                .collect();
            let upload = (wire, tch::Kind::BFloat16);
            let dir = out.join(format!("peer-{id}"));
            VirtualPeer::open(&url, None, id, &layout, upload, &rt, dir)
        })
        .collect::<Result<_>>()?;
    let upload_bytes = peers[0].upload_bytes();
    for p in &peers {
        p.join()?;
    }
    let mut times = Vec::new();
    let started = Instant::now();
    let mut gets_before = 0;
    for round in 1..=a.rounds {
        if round == 2 {
            gets_before = peers.iter().map(VirtualPeer::store_gets).sum();
        }
        let t = Instant::now();
        // Every peer at once, each on its own thread, as nodes would be.
        std::thread::scope(|s| {
            let running: Vec<_> = peers.iter().map(|p| s.spawn(|| p.round(round))).collect();
            running
                .into_iter()
                .try_for_each(|t| t.join().expect("a virtual peer panicked"))
        })?;
        if round > 1 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let total = started.elapsed().as_secs_f64();
    let gets: u64 = peers.iter().map(VirtualPeer::store_gets).sum();
    let peak_rss_mb = server.peak_rss_mb();
    for p in &peers {
        p.done();
    }
    server.wait(Duration::from_secs(30));
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let unlimited: LinkSpec = "1000gbit".parse()?;
    let planned = plan::plan(
        &PlanInput {
            model: cfg.model.clone(),
            nodes,
            diloco: false,
            node_link: unlimited,
            server_link: unlimited,
            shards: 1,
            step_s: 0.0,
            sync_steps: 1,
            overlap_cap: 1,
            stride: cfg.sync.stride,
            sparse_chunk: cfg.sync.sparse_chunk,
            sparse_k: cfg.sync.sparse_k,
            aggregate_bytes_per_s: 1e9,
            lossy_values_per_s: 1.5e8,
            sparse_values_per_s: crate::plan::sync::SPARSE_GVPS * 1e9,
            lowrank_values_per_s: crate::plan::sync::LOWRANK_GVPS * 1e9,
            rank: cfg.sync.rank,
            encode_values_per_s: crate::plan::sync::ENCODE_GVPS * 1e9,
            disk_bytes_per_s: 1e9,
            apply_scale: 1.0,
            fold_scale: 1.0,
            close_scale: 1.0,
            skew_s: 0.0,
            pace_s: 0.0,
        },
        WireOption::Bf16DeltaSkipOwn,
    );
    // The server's own counters, per round it published after the first.
    let measured: Vec<serde_json::Value> =
        std::fs::read_to_string(out.join("server/metrics.jsonl"))?
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["round"].as_u64().is_some_and(|r| r >= 2) && v.get("bytes_out").is_some())
            .collect();
    let per_round = |key: &str| {
        let sum: u64 = measured.iter().map(|v| v[key].as_u64().unwrap_or(0)).sum();
        sum as f64 / measured.len().max(1) as f64
    };
    let fallbacks = measured
        .iter()
        .map(|v| v["store_fallbacks"].as_u64().unwrap_or(0))
        .sum();
    Ok(Row {
        nodes,
        out_per_round: per_round("bytes_out"),
        store_per_round: per_round("store_bytes_out"),
        gets_per_round: (gets - gets_before) as f64 / (a.rounds - 1) as f64,
        fallbacks,
        p50_s: at(0.5),
        p99_s: at(0.99),
        uploads_per_s: (nodes as u64 * a.rounds) as f64 / total,
        peak_rss_mb,
        upload_bytes,
        planned_s: planned.round_s,
    })
}

/// The server's `--store` flags for the run of `nodes` peers: a prefix of its own.
fn store_args(store: &crate::args::StoreArgs, nodes: usize) -> Vec<std::ffi::OsString> {
    let mut store = store.clone();
    if let Some(url) = &mut store.store {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        *url = format!("{}/{stamp}-nodes-{nodes}", url.trim_end_matches('/'));
    }
    store.to_args()
}

/// The server process, killed if the bench stops early.
struct ServerProc(Child);

impl ServerProc {
    fn peak_rss_mb(&self) -> f64 {
        spes_train::process::peak_rss_mb(self.0.id())
    }

    fn wait(&mut self, limit: Duration) {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
