//! `spes demo`: real decentralized training that needs nothing but the binary. It tokenizes the
//! embedded corpus (Debian's BSD-licensed fortunes, 2.9 MB of English) with a fresh 8k BPE, then
//! starts one `spes server` and N `spes node` processes on loopback (configs/spes-tiny.toml),
//! shows every node's progress, and writes `summary.json`, `report.md` and plots.
//! Interrupted, it stops every process; run again with the same `--out` to resume. With
//! `--link`, every node reaches the server through its own shaped link (spes-net's `link`).

use crate::device::DeviceChoice;
use crate::report;
use anyhow::{bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use spes_data::{TokenizeOptions, TokenizerSource};
use spes_net::link::{LinkSpec, RelaySet};
use spes_train::metrics::{self, DemoSummary, NodeLine, NodeSummary, ProgressLine, RoundRecord};
use spes_train::RunConfig;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CORPUS: &[u8] = include_bytes!("../assets/default-corpus.jsonl.gz");
const SPES_TINY: &str = include_str!("../../../configs/spes-tiny.toml");

/// Tokenizes the embedded corpus into `<out>/data` unless already there.
pub fn prepare_data(out: &Path) -> Result<PathBuf> {
    tokenize_into(&out.join("data"))
}

/// Tokenizes the embedded corpus into `data` unless already there.
fn tokenize_into(data: &Path) -> Result<PathBuf> {
    let data = data.to_path_buf();
    if !data.join(spes_data::shard::MANIFEST).exists() {
        std::fs::create_dir_all(&data)?;
        let corpus = data.join("default-corpus.jsonl.gz");
        spes_data::shard::write_atomic(&corpus, CORPUS)?;
        let opts = TokenizeOptions::new(
            vec![corpus.display().to_string()],
            data.clone(),
            TokenizerSource::Train(8192),
        );
        let m = spes_data::tokenize(&opts)?.manifest;
        println!(
            "tokenized the embedded corpus: {} train / {} validation tokens, vocab {}",
            m.train_tokens, m.val_tokens, m.vocab_size
        );
    }
    Ok(data)
}

/// How the demo's nodes share the corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoPartition {
    /// Every node reads the whole corpus in its own order (the published recipe).
    Shuffle,
    /// Each node holds and reads only its own part; the parts are alike (documents dealt
    /// round robin).
    Disjoint,
    /// Each node holds only its own part, cut from a run of the corpus's sources of its own:
    /// the deliberately unlike split, where reading only one's part should cost the most.
    BySource,
}

/// Cuts the embedded corpus into one part per node under `<out>/parts-<kind>/part-<p>`,
/// tokenized with `<data>`'s tokenizer as `spes tokenize --part p/N` would on each machine,
/// unless already there. The corpus lists its documents source by source, so contiguous runs of
/// documents are runs of sources.
pub fn prepare_parts(
    out: &Path,
    data: &Path,
    nodes: usize,
    kind: DemoPartition,
) -> Result<Vec<PathBuf>> {
    let name = match kind {
        DemoPartition::Shuffle => bail!("a shuffled run has no parts"),
        DemoPartition::Disjoint => "disjoint",
        DemoPartition::BySource => "by-source",
    };
    let root = out.join(format!("parts-{name}"));
    let dirs: Vec<PathBuf> = (0..nodes).map(|p| root.join(format!("part-{p}"))).collect();
    if dirs
        .iter()
        .all(|d| d.join(spes_data::shard::MANIFEST).exists())
    {
        return Ok(dirs);
    }
    let mut docs = Vec::new();
    let read = spes_data::input::ReadOptions {
        text_field: "text".into(),
        skip_bad_records: false,
    };
    let corpus = out.join("default-corpus.jsonl.gz");
    if !corpus.exists() {
        spes_data::shard::write_atomic(&corpus, CORPUS)?;
    }
    spes_data::input::for_each_document(&corpus, &read, &Default::default(), |d| {
        docs.push(d);
        Ok(())
    })?;
    // Several files per part, dealt round robin to the parts as `--part` deals them.
    let files = 4 * nodes;
    let mut chunks: Vec<Vec<&String>> = vec![Vec::new(); files];
    for (i, d) in docs.iter().enumerate() {
        let f = match kind {
            DemoPartition::BySource => {
                // File f holds part f % nodes: part p gets the p-th contiguous run.
                let run = i * nodes / docs.len();
                let within = i % 4;
                within * nodes + run
            }
            _ => i % files,
        };
        chunks[f].push(d);
    }
    let input = root.join("input");
    std::fs::create_dir_all(&input)?;
    let mut inputs = Vec::new();
    for (f, chunk) in chunks.iter().enumerate() {
        let path = input.join(format!("{f:03}.jsonl"));
        let mut text = String::new();
        for d in chunk {
            text.push_str(&serde_json::json!({ "text": d }).to_string());
            text.push('\n');
        }
        spes_data::shard::write_atomic(&path, text.as_bytes())?;
        inputs.push(path.display().to_string());
    }
    for (p, dir) in dirs.iter().enumerate() {
        let mut opts = TokenizeOptions::new(
            inputs.clone(),
            dir.clone(),
            TokenizerSource::File(data.join("tokenizer.json")),
        );
        opts.part = Some(spes_data::Part {
            index: p,
            of: nodes,
        });
        opts.progress = false;
        let m = spes_data::tokenize(&opts)?.manifest;
        println!("part {p}/{nodes} ({name}): {} train tokens", m.train_tokens);
    }
    Ok(dirs)
}

/// A random run secret from the OS, kept in `<out>/secret` (owner-only) across resumes, and
/// each node's credential derived from it in `<out>/node-<p>.credential`.
fn secret_files(out: &Path, nodes: usize) -> Result<(PathBuf, Vec<PathBuf>)> {
    let path = out.join("secret");
    if !path.exists() {
        spes_data::shard::write_secret(&path, crate::auth::new_secret().as_bytes())?;
    }
    let secret = spes_net::auth::read_token(&path)?;
    let credentials = (0..nodes)
        .map(|p| {
            let c = out.join(format!("node-{p}.credential"));
            spes_data::shard::write_secret(&c, spes_net::auth::credential(&secret, p).as_bytes())?;
            Ok(c)
        })
        .collect::<Result<_>>()?;
    Ok((path, credentials))
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn log_file(out: &Path, name: &str) -> Result<std::fs::File> {
    let path = out.join("logs").join(format!("{name}.log"));
    std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join("\n")
}

/// The demo's config: the embedded configs/spes-tiny.toml on `data`, with `overrides`.
pub fn config(data: &Path, overrides: &[String]) -> Result<RunConfig> {
    let mut all = vec![format!("data.path={}", data.display())];
    all.extend(overrides.iter().cloned());
    RunConfig::parse(SPES_TINY, &all).context("embedded configs/spes-tiny.toml")
}

/// Decentralized training on loopback: one server and 4 nodes (separate processes) train
/// the tiny preset with SPES on the embedded corpus; writes report.md with plots.
#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// The embedded corpus tokenized in DIR (tokenized there first if DIR holds none) instead
    /// of in <out>/data: one corpus for several demos.
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Override a key of the embedded configs/spes-tiny.toml (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Put every node behind its own shaped loopback link, e.g. `100mbit,40ms` or
    /// `up=20mbit,down=100mbit,rtt=40ms,loss=0.1%` (rtt is the round trip).
    #[arg(long)]
    pub link: Option<LinkSpec>,
    /// How the nodes share the corpus (data.partition): each node's own part makes its data
    /// directory hold only that part.
    #[arg(long, value_enum, default_value_t = DemoPartition::Shuffle)]
    pub partition: DemoPartition,
    /// Serve the live run page and Prometheus /metrics here while the demo runs
    /// (e.g. 127.0.0.1:8080; open http://127.0.0.1:8080/ in a browser).
    #[arg(long)]
    pub http: Option<std::net::SocketAddr>,
    /// Make node PEER's steps FACTOR times as long (`3=2`: node 3 at half speed; repeatable),
    /// to watch nodes of unlike speed on one machine (`train.slowdown`).
    #[arg(long, value_name = "PEER=FACTOR", value_parser = parse_slowdown)]
    pub slowdown: Vec<(usize, f64)>,
    /// Set a node-local key on node PEER alone (`3:train.memory_gib=1.2`: node 3 declares a
    /// smaller memory budget; repeatable).
    #[arg(long, value_name = "PEER:KEY=VALUE", value_parser = parse_node_set)]
    pub node_set: Vec<(usize, String)>,
    /// Take each round's wire and overlap from an adaptive demo's `server/choices.json`
    /// instead of choosing them (`spes server --replay-choices`).
    #[arg(long, value_name = "FILE")]
    pub replay_choices: Option<PathBuf>,
    /// The server keeps the run's state in this object store too (`spes server --store`).
    #[command(flatten)]
    pub store: crate::args::StoreArgs,
}

/// `PEER:KEY=VALUE`.
fn parse_node_set(s: &str) -> Result<(usize, String), String> {
    match s.split_once(':') {
        Some((p, set)) if set.contains('=') => p
            .trim()
            .parse()
            .map(|p| (p, set.to_string()))
            .map_err(|_| format!("`{s}`: `{p}` is not a peer id")),
        _ => Err(format!(
            "`{s}` is not PEER:KEY=VALUE, such as 3:train.memory_gib=1.2"
        )),
    }
}

/// `PEER=FACTOR` with FACTOR ≥ 1.
fn parse_slowdown(s: &str) -> Result<(usize, f64), String> {
    let parsed = s
        .split_once('=')
        .and_then(|(p, f)| Some((p.trim().parse().ok()?, f.trim().parse().ok()?)));
    match parsed {
        Some((p, f)) if f >= 1.0 => Ok((p, f)),
        _ => Err(format!(
            "`{s}` is not PEER=FACTOR with FACTOR ≥ 1, such as 3=2"
        )),
    }
}

/// What a launch adds to its processes beyond the config.
#[derive(Default)]
pub struct Extras {
    /// The server's HTTP listener.
    pub http: Option<std::net::SocketAddr>,
    /// `train.slowdown` per node.
    pub slowdown: Vec<(usize, f64)>,
    /// Other `--set`s of one node each.
    pub node_set: Vec<(usize, String)>,
    /// The server's `--replay-choices`.
    pub replay_choices: Option<PathBuf>,
    /// The server's `--store` flags.
    pub store: crate::args::StoreArgs,
}

/// Runs the demo: data, server and nodes, then `summary.json` and `report.md`.
pub fn run(a: Args) -> Result<()> {
    let Args {
        out,
        data,
        mut overrides,
        device,
        link,
        partition,
        http,
        slowdown,
        node_set,
        replay_choices,
        store,
    } = a;
    let started = Instant::now();
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let data = match &data {
        Some(dir) => tokenize_into(dir)?,
        None => prepare_data(&out)?,
    };
    if partition != DemoPartition::Shuffle {
        overrides.push("data.partition=disjoint".into());
    }
    let (out, overrides, device) = (out.as_path(), overrides.as_slice(), device.arg());
    let cfg = config(&data, overrides)?;
    let parts = match partition {
        DemoPartition::Shuffle => None,
        kind => Some(prepare_parts(out, &data, cfg.sync.nodes, kind)?),
    };
    let config_toml = launch(
        out,
        &cfg,
        &device,
        link,
        true,
        parts.as_deref(),
        &Extras {
            http,
            slowdown,
            node_set,
            replay_choices,
            store,
        },
    )
    .map_err(|e| {
        if e.is::<Interrupted>() {
            anyhow::anyhow!(
                "{e}. Run `spes demo --out {}` again to resume",
                out.display()
            )
        } else {
            e
        }
    })?;
    let nodes = cfg.sync.nodes;
    report(out, nodes, started, &config_toml)
}

/// [`launch`]'s error when Ctrl-C stopped it; each caller says how to resume.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted; every process is stopped")
    }
}

impl std::error::Error for Interrupted {}

/// Starts one server and `cfg.sync.nodes` node processes under `out` (each node behind its own
/// shaped link if `link` is given, each on its own data directory if `node_data` is given) and
/// waits for all of them; returns the config as written.
pub fn launch(
    out: &Path,
    cfg: &RunConfig,
    device: &str,
    link: Option<LinkSpec>,
    show_progress: bool,
    node_data: Option<&[PathBuf]>,
    extras: &Extras,
) -> Result<String> {
    std::fs::create_dir_all(out.join("logs"))
        .with_context(|| format!("cannot create {}", out.display()))?;
    let config_toml = cfg.to_toml()?;
    let config = out.join("config.toml");
    spes_data::shard::write_atomic(&config, config_toml.as_bytes())?;
    let nodes = cfg.sync.nodes;
    let (secret, credentials) = secret_files(out, nodes)?;
    let port = free_port()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / nodes).max(1).to_string();
    let exe = std::env::current_exe()?;
    let common = |cmd: &mut Command| {
        cmd.arg("--config").arg(&config);
        cmd.args(["--device", device, "--threads", &threads]);
    };

    let mut server = Command::new(&exe);
    server
        .arg("server")
        .args(["--listen", &format!("127.0.0.1:{port}")]);
    server
        .arg("--out")
        .arg(out.join("server"))
        .args(["--linger-s", "30"])
        .arg("--secret-file")
        .arg(&secret);
    server.args(extras.store.to_args());
    if let Some(file) = &extras.replay_choices {
        server.arg("--replay-choices").arg(file);
    }
    if let Some(addr) = extras.http {
        server.args(["--http", &addr.to_string()]);
        eprintln!("live run page: http://{addr}/ (Prometheus: http://{addr}/metrics)");
    }
    common(&mut server);
    let mut children: Vec<(String, Child)> = vec![(
        "server".into(),
        server
            .stdout(log_file(out, "server")?)
            .stderr(log_file(out, "server")?)
            .spawn()
            .context("cannot start the server")?,
    )];
    let bars = if show_progress {
        MultiProgress::new()
    } else {
        MultiProgress::with_draw_target(ProgressDrawTarget::hidden())
    };
    // Relays run until every process is done.
    let server_addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let relays = link
        .map(|spec| RelaySet::start(spec, server_addr, nodes))
        .transpose()?;
    let node_urls: Vec<String> = (0..nodes)
        .map(|i| match &relays {
            Some(r) => format!("http://{}", r.addr(i)),
            None => format!("http://{server_addr}"),
        })
        .collect();
    let style = ProgressStyle::with_template("{prefix:>7} [{bar:30}] {pos}/{len} {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    let server_bar = bars.add(ProgressBar::new(cfg.train.max_steps / cfg.sync.sync_steps));
    server_bar.set_style(style.clone());
    server_bar.set_prefix("server");
    let mut readers = Vec::new();
    for (peer, credential) in credentials.iter().enumerate() {
        let mut node = Command::new(&exe);
        node.arg("node").args(["--server", &node_urls[peer]]);
        node.args(["--peer", &peer.to_string(), "--progress", "json"]);
        node.arg("--out").arg(out.join(format!("node-{peer}")));
        node.arg("--credential-file").arg(credential);
        common(&mut node);
        for (_, f) in extras.slowdown.iter().filter(|(p, _)| *p == peer) {
            node.arg("--set").arg(format!("train.slowdown={f}"));
        }
        for (_, set) in extras.node_set.iter().filter(|(p, _)| *p == peer) {
            node.arg("--set").arg(set);
        }
        if let Some(dir) = node_data.and_then(|d| d.get(peer)) {
            node.arg("--set")
                .arg(format!("data.path={}", dir.display()));
        }
        let mut child = node
            .stdout(Stdio::piped())
            .stderr(log_file(out, &format!("node-{peer}"))?)
            .spawn()
            .with_context(|| format!("cannot start node {peer}"))?;
        let bar = bars.add(ProgressBar::new(cfg.train.max_steps));
        bar.set_style(style.clone());
        bar.set_prefix(format!("node {peer}"));
        let stdout = child.stdout.take().expect("piped");
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(p) = serde_json::from_str::<ProgressLine>(&line) else {
                    continue;
                };
                match p.line {
                    NodeLine::Sync(s) => bar.set_position(s.step),
                    NodeLine::Step(s) => {
                        bar.set_position(s.step);
                        if let (Some(l), Some(tps)) = (&s.losses, s.tokens_per_s) {
                            bar.set_message(format!("loss {:.3} | {tps:.0} tok/s", l.loss));
                        }
                    }
                }
            }
            bar.finish();
        }));
        children.push((format!("node-{peer}"), child));
    }

    let interrupted = interrupt_flag()?;
    let stop_all = |children: &mut Vec<(String, Child)>| {
        for (_, c) in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    let mut done = vec![false; children.len()];
    loop {
        if interrupted.load(Ordering::SeqCst) {
            stop_all(&mut children);
            bars.clear().ok();
            return Err(Interrupted.into());
        }
        let rounds: Vec<RoundRecord> = metrics::read(&out.join("server/metrics.jsonl"));
        if let Some(last) = rounds.last() {
            server_bar.set_position(last.round);
            if let Some(v) = last.val_loss {
                server_bar.set_message(format!("global validation loss {v:.3}"));
            }
        }
        let mut failed = None;
        for (i, (name, child)) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                done[i] = true;
                if !status.success() {
                    failed = Some((name.clone(), status));
                }
            }
        }
        if let Some((name, status)) = failed {
            let log = out.join("logs").join(format!("{name}.log"));
            stop_all(&mut children);
            bars.clear().ok();
            bail!(
                "{name} failed ({status}); its log {} ends with:\n{}",
                log.display(),
                tail(&log)
            );
        }
        if done.iter().all(|d| *d) {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    for r in readers {
        let _ = r.join();
    }
    server_bar.finish();
    drop(relays);
    Ok(config_toml)
}

/// Set by Ctrl-C; the handler is installed once per process (a benchmark launches many runs).
fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    if let Some(f) = FLAG.get() {
        return Ok(f.clone());
    }
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    ctrlc::set_handler(move || set.store(true, Ordering::SeqCst))
        .context("cannot install the Ctrl-C handler")?;
    Ok(FLAG.get_or_init(|| flag).clone())
}

/// Writes `summary.json` and `report.md` of a finished demo.
fn report(out: &Path, nodes: usize, started: Instant, config_toml: &str) -> Result<()> {
    let rounds: Vec<RoundRecord> = metrics::read(&out.join("server/metrics.jsonl"));
    let val = |r: Option<&RoundRecord>| r.and_then(|r| r.val_loss);
    let node_summaries: Vec<NodeSummary> = (0..nodes)
        .map(|p| {
            let path = out.join(format!("node-{p}/summary.json"));
            std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .with_context(|| format!("node {p} left no {}", path.display()))
        })
        .collect::<Result<_>>()?;
    let summary = DemoSummary {
        initial_val_loss: val(rounds.first()),
        final_val_loss: val(rounds.last()),
        tokens: rounds.last().map(|r| r.tokens),
        rounds: rounds.last().map(|r| r.round),
        wall_s: started.elapsed().as_secs_f64(),
        round_costs: report::round_costs(
            out,
            &node_summaries
                .iter()
                .map(|n| n.peer as u64)
                .collect::<Vec<_>>(),
        ),
        nodes: node_summaries,
    };
    spes_data::shard::write_atomic(
        &out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    report::write(out, &summary, config_toml)?;
    let shown = |v: Option<f64>| v.map_or("n/a".into(), |v| v.to_string());
    println!(
        "global validation loss {} -> {} nats/token in {:.0} s; report: {}",
        shown(summary.initial_val_loss),
        shown(summary.final_val_loss),
        summary.wall_s,
        out.join("report.md").display()
    );
    Ok(())
}
