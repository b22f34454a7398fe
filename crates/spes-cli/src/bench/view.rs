//! `spes bench view`: the live page on a long run. A real server publishes round 0 of a micro
//! model of the asked shape and stops; its restart point is moved to round `--rounds`, and a
//! generated `metrics.jsonl` of that many rounds (expert load, per-node timeline, events) put
//! beside it; the real server then restarts on them with `--http` on, and headless Chromium
//! loads its page: payload, server time and render time.

use anyhow::{bail, Context, Result};
use spes_net::view::browser;
use spes_net::view::http::HttpOptions;
use spes_train::metrics::{MetricsLog, NodeRound, RoundClose, RoundRecord};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The live page on a long run: payload and headless Chromium's render time.
#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 10_000)]
    pub rounds: u64,
    #[arg(long, default_value_t = 64)]
    pub nodes: usize,
    #[arg(long, default_value_t = 16)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub experts: usize,
    /// Page loads timed.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[arg(long, default_value = "runs/bench-view")]
    pub out: PathBuf,
    /// The browser (default: $CHROMIUM, else /usr/bin/chromium).
    #[arg(long)]
    pub chromium: Option<PathBuf>,
}

/// A deterministic round of a run of `nodes` nodes owning `experts` experts in turn.
fn record(a: &Args, round: u64) -> RoundRecord {
    let f = round as f64;
    let members: Vec<usize> = (0..a.nodes).collect();
    let nodes = members
        .iter()
        .map(|&p| {
            let jitter = ((round * 31 + p as u64 * 17) % 100) as f64 / 100.0;
            NodeRound {
                peer: p,
                round: round.saturating_sub(1),
                compute_s: 30.0 + 5.0 * jitter,
                sync_s: 3.0 + jitter,
                idle_s: 0.5 * jitter,
                bytes_up: 2_000_000 + (jitter * 1e5) as u64,
                bytes_down: 8_000_000,
                up_s: 1.0 + jitter,
                down_s: 1.5,
                apply_s: 0.3,
            }
        })
        .collect();
    RoundRecord {
        round,
        step: round * 25,
        tokens: round * 25 * 32_768 * a.nodes as u64,
        owners: (0..a.experts)
            .map(|e| (e + round as usize / 1000) % a.nodes)
            .collect(),
        members,
        close: (round > 0).then(|| RoundClose {
            peers: (0..a.nodes).collect(),
            evicted: if round.is_multiple_of(997) {
                vec![round as usize % a.nodes]
            } else {
                vec![]
            },
            joined: if round.is_multiple_of(1009) {
                vec![round as usize % a.nodes]
            } else {
                vec![]
            },
            bytes_in: 2_000_000 * a.nodes as u64,
            bytes_out: 8_000_000 * a.nodes as u64,
            aggregation_s: 0.8,
            round_s: 35.0,
            rejected: if round.is_multiple_of(313) {
                vec![format!("peer 3 round {round}: round {round} is closed")]
            } else {
                vec![]
            },
            nodes,
            ..Default::default()
        }),
        val_loss: Some(3.0 + 8.0 / (1.0 + f / 200.0)),
        expert_load: Some(
            (0..a.layers)
                .map(|l| {
                    (0..a.experts)
                        .map(|e| {
                            (1.0 + 0.5 * (((l * 7 + e * 13) % 11) as f64 / 11.0))
                                / a.experts as f64
                                / 1.25
                        })
                        .collect()
                })
                .collect(),
        ),
        ..Default::default()
    }
}

fn attr(dom: &str, name: &str) -> Option<String> {
    let at = dom.find(&format!("{name}=\""))?;
    dom[at + name.len() + 2..]
        .split('"')
        .next()
        .map(str::to_owned)
}

/// A micro model of `layers` × `experts` on `nodes` nodes, `sync_steps` 25, long enough for
/// twice `rounds` rounds.
fn config(a: &Args) -> Result<spes_train::RunConfig> {
    let text = format!(
        "[model]\npreset = \"tiny\"\nvocab_size = 256\nd_model = 16\nn_layers = {}\nn_heads = 1\n\
         head_dim = 16\nn_kv_heads = 1\nn_experts = {}\nexpert_hidden = 8\ncontext_length = 16\n\
         [data]\npath = \"none\"\n[train]\nmax_steps = {}\nbatch_size = 1\nseq_len = 16\n\
         [sync]\nmode = \"spes\"\nnodes = {}\nsync_steps = 25\nwire = \"int4_delta\"\n",
        a.layers,
        a.experts,
        a.rounds * 2 * 25,
        a.nodes
    );
    spes_train::RunConfig::parse(&text, &[])
}

/// Runs the real server on `out` until `ready` says so, then stops it.
fn run_server(
    rt: &tokio::runtime::Runtime,
    cfg: &spes_train::RunConfig,
    out: &std::path::Path,
    http: Option<std::net::TcpListener>,
    ready: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let opts = spes_net::ServerOptions {
        cfg: cfg.clone(),
        out: out.to_owned(),
        secret: None,
        tls: None,
        init: None,
        device: tch::Device::Cpu,
        linger_s: 0.0,
        limits: spes_net::Limits::default(),
        shard: (0, 1),
        http: http.map(|l| (l, HttpOptions::default())),
        store: None,
        replay: None,
    };
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(spes_net::server::serve(opts, listener, async {
        let _ = stopped.await;
    }));
    let result = ready();
    let _ = stop.send(());
    rt.block_on(server)??;
    result
}

/// `spes bench view`.
pub fn run(a: Args) -> Result<()> {
    let chromium = a.chromium.clone().unwrap_or_else(browser::chromium);
    if !chromium.exists() {
        bail!(
            "no browser at {} (scripts/setup.sh --tests installs chromium; or --chromium)",
            chromium.display()
        );
    }
    let cfg = config(&a)?;
    let _ = std::fs::remove_dir_all(&a.out);
    std::fs::create_dir_all(&a.out)?;
    let rt = tokio::runtime::Runtime::new()?;
    // 1. The real server's restart point after round 0...
    let state = a.out.join("server.json");
    run_server(&rt, &cfg, &a.out, None, || {
        let until = Instant::now() + Duration::from_secs(60);
        while !state.exists() {
            anyhow::ensure!(Instant::now() < until, "the server published no round 0");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    })?;
    // ...moved to round `rounds` (the same weights), with a log of that many rounds.
    let mut st: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state)?)?;
    st["rounds"][0]["round"] = a.rounds.into();
    st["fulls"][0]["round"] = a.rounds.into();
    st["record"] = serde_json::Value::Null;
    spes_data::shard::write_atomic(&state, serde_json::to_string(&st)?.as_bytes())?;
    let _ = std::fs::remove_file(a.out.join("metrics.jsonl"));
    let mut log = MetricsLog::open(&a.out, None)?;
    for r in 0..=a.rounds {
        log.write(&record(&a, r))?;
    }
    drop(log);
    let file_bytes = std::fs::metadata(a.out.join("metrics.jsonl"))?.len();
    // 2. The real server restarts on them, with its HTTP listener.
    let http = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = http.local_addr()?;
    let started = Instant::now();
    run_server(&rt, &cfg, &a.out, Some(http), || {
        measure(&a, &chromium, addr, file_bytes, started)
    })
}

/// Times the page, `/api/run` and `/metrics` of the server at `addr`, and Chromium loading the
/// page.
fn measure(
    a: &Args,
    chromium: &Path,
    addr: std::net::SocketAddr,
    file_bytes: u64,
    started: Instant,
) -> Result<()> {
    // The listener answers once the server has read its state and history.
    let until = Instant::now() + Duration::from_secs(120);
    while browser::get(addr, "/metrics").is_err() {
        anyhow::ensure!(
            Instant::now() < until,
            "the restarted server never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let load_s = started.elapsed().as_secs_f64();
    let [page, api, metrics] = ["/", "/api/run", "/metrics"].map(|p| browser::get(addr, p));
    let (page, api, metrics) = (page?, api?, metrics?);
    println!(
        "{} rounds, {} nodes, {} × {} experts: metrics.jsonl {:.1} MB; the restarted server answered after {:.2} s\n",
        a.rounds,
        a.nodes,
        a.layers,
        a.experts,
        file_bytes as f64 / 1e6,
        load_s
    );
    println!("| request | bytes | server + loopback ms |\n|---|---|---|");
    for (what, r) in [
        ("/ (page with the view)", page),
        ("/api/run", api),
        ("/metrics", metrics),
    ] {
        anyhow::ensure!(r.code == 200, "GET {what}: HTTP {}", r.code);
        let ms = r.elapsed.as_secs_f64() * 1e3;
        println!("| {what} | {} | {ms:.1} |", r.body.len());
    }
    println!("\n| load | round shown | render ms (page's own clock, navigation to first render) | chromium process s | heatmap cells | member rows |\n|---|---|---|---|---|---|");
    for i in 0..a.repeats {
        let profile = tempfile::tempdir()?;
        let t = Instant::now();
        let url = format!("http://{addr}/");
        let dom = browser::headless_dom(chromium, &url, profile.path(), None)?;
        let wall = t.elapsed().as_secs_f64();
        let body = &dom[dom.find("<body").unwrap_or(0)..];
        let ms =
            attr(body, "data-render-ms").context("the page did not render (no data-render-ms)")?;
        // Count what was drawn, not the script's own text.
        let drawn = |from: &str, to: &str, what: &str| {
            body.find(from).map_or(0, |at| {
                let part = &body[at..];
                part[..part.find(to).unwrap_or(part.len())]
                    .matches(what)
                    .count()
            })
        };
        let cells = drawn("id=\"heatmap\"", "</svg>", "<rect class=\"cell\"");
        let rows = drawn("id=\"members\"", "</table>", "<tr data-peer=");
        let round = attr(body, "data-round").unwrap_or_default();
        println!(
            "| {} | {round} | {ms} | {wall:.2} | {cells} | {rows} |",
            i + 1
        );
    }
    Ok(())
}
