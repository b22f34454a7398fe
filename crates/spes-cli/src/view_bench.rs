//! `spes bench-view`: the live page on a long run. Writes a generated `metrics.jsonl` of many
//! rounds (expert load, per-node timeline, events), loads it the way a restarted server does
//! (`History::of` over `metrics::read`), serves it with the server's HTTP listener and page,
//! and times headless Chromium rendering it: payload, server time and render time.

use anyhow::{bail, Context, Result};
use spes_net::view::http::{Endpoints, HttpOptions};
use spes_net::view::{History, NodeView, RunInfo, RunView};
use spes_train::metrics::{MetricsLog, NodeReport, NodeRound, RoundClose, RoundRecord, StepLosses};
use std::io::{Read, Write};
use std::path::PathBuf;
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
    #[arg(long, default_value = "/usr/bin/chromium")]
    pub chromium: PathBuf,
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

fn get(addr: std::net::SocketAddr, path: &str) -> Result<(Duration, usize)> {
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = Vec::new();
    s.read_to_end(&mut body)?;
    let head = body
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("an HTTP reply")?;
    Ok((t.elapsed(), body.len() - head - 4))
}

fn attr(dom: &str, name: &str) -> Option<String> {
    let at = dom.find(&format!("{name}=\""))?;
    dom[at + name.len() + 2..]
        .split('"')
        .next()
        .map(str::to_owned)
}

/// `spes bench-view`.
pub fn run(a: Args) -> Result<()> {
    if !a.chromium.exists() {
        bail!(
            "no browser at {} (scripts/setup.sh installs chromium; or --chromium)",
            a.chromium.display()
        );
    }
    std::fs::create_dir_all(&a.out)?;
    let _ = std::fs::remove_file(a.out.join("metrics.jsonl"));
    let mut log = MetricsLog::open(&a.out, None)?;
    for r in 0..=a.rounds {
        log.write(&record(&a, r))?;
    }
    drop(log);
    let file_bytes = std::fs::metadata(a.out.join("metrics.jsonl"))?.len();
    let t = Instant::now();
    let history = History::of(&spes_train::metrics::read(&a.out.join("metrics.jsonl")));
    let load_s = t.elapsed().as_secs_f64();
    let newest = record(&a, a.rounds);
    let nodes = (0..a.nodes)
        .map(|peer| NodeView {
            peer,
            member: true,
            lease_age_s: Some(if peer == 3 { 25.0 } else { 2.0 }),
            experts: (0..a.experts)
                .filter(|e| newest.owners[*e] == peer)
                .collect(),
            uploads: a.rounds,
            bytes_in: a.rounds * 2_000_000,
            bytes_out: a.rounds * 8_000_000,
            refusals: 0,
            report: Some(NodeReport {
                step: a.rounds * 25,
                tokens: a.rounds * 25 * 32_768,
                tokens_per_s: 27_000.0,
                losses: StepLosses {
                    loss: 3.1,
                    ce: 3.0,
                    lr: 3e-4,
                    ..Default::default()
                },
                sync: newest
                    .close
                    .as_ref()
                    .and_then(|c| c.nodes.iter().find(|n| n.peer == peer).cloned()),
            }),
            report_age_s: Some(1.0),
        })
        .collect();
    let view = RunView {
        run: RunInfo {
            round: a.rounds,
            final_round: a.rounds * 2,
            open_round: a.rounds + 1,
            tokens: newest.tokens,
            sync_steps: 25,
            wire: "int4_delta".into(),
            n_layers: a.layers,
            n_experts: a.experts,
            lease_s: 20.0,
            uptime_s: 3600.0 * 24.0 * 4.0,
            val_loss: newest.val_loss,
            initial_val_loss: Some(11.0),
            shard: "0/1".into(),
            done: false,
        },
        nodes,
        loss: history.loss(),
        rounds: history.rounds(),
        timeline: history.timeline(),
        expert_load: history.expert_load.clone(),
        events: history.events(),
        counters: Default::default(),
    };
    let rt = tokio::runtime::Runtime::new()?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shared = std::sync::Arc::new(view);
    let endpoints = Endpoints {
        metrics: {
            let v = shared.clone();
            Box::new(move || spes_net::view::prom::render(&v))
        },
        run_json: {
            let v = shared.clone();
            Some(Box::new(move || {
                serde_json::to_string(&*v).unwrap_or_default()
            }))
        },
    };
    let server = rt.spawn(spes_net::view::http::serve(
        listener,
        HttpOptions::default(),
        endpoints,
        async {
            let _ = stopped.await;
        },
    ));
    let (page_t, page_bytes) = get(addr, "/")?;
    let (api_t, api_bytes) = get(addr, "/api/run")?;
    let (metrics_t, metrics_bytes) = get(addr, "/metrics")?;
    println!(
        "{} rounds, {} nodes, {} × {} experts: metrics.jsonl {:.1} MB, loaded in {:.2} s\n",
        a.rounds,
        a.nodes,
        a.layers,
        a.experts,
        file_bytes as f64 / 1e6,
        load_s
    );
    println!("| request | bytes | server + loopback ms |\n|---|---|---|");
    for (what, t, b) in [
        ("/ (page with the view)", page_t, page_bytes),
        ("/api/run", api_t, api_bytes),
        ("/metrics", metrics_t, metrics_bytes),
    ] {
        println!("| {what} | {b} | {:.1} |", t.as_secs_f64() * 1e3);
    }
    println!("\n| load | render ms (page's own clock, navigation to first render) | chromium process s | heatmap cells | rows |\n|---|---|---|---|---|");
    for i in 0..a.repeats {
        let profile = tempfile::tempdir()?;
        let t = Instant::now();
        let o = std::process::Command::new(&a.chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                &format!("--user-data-dir={}", profile.path().display()),
                "--dump-dom",
                &format!("http://{addr}/"),
            ])
            .output()
            .context("cannot run chromium")?;
        let wall = t.elapsed().as_secs_f64();
        let dom = String::from_utf8_lossy(&o.stdout);
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
        println!("| {} | {ms} | {wall:.2} | {cells} | {rows} |", i + 1);
    }
    let _ = stop.send(());
    let _ = rt.block_on(server);
    Ok(())
}
