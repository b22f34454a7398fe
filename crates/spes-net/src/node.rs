//! `spes node`: trains the shared parameters and its own experts (all others frozen: no
//! gradient, no optimizer state), and every `sync_steps` uploads exactly those tensors, waits for
//! the round's aggregate, loads every parameter from it and goes on with its AdamW state and LR
//! schedule. It checkpoints after each round, so a restarted node resumes where it was.

use crate::auth::AddToken;
use crate::payload;
use crate::proto::spes_client::SpesClient;
use crate::proto::{DoneRequest, FetchRequest, JoinRequest};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use spes_model::{MoeModel, Role};
use spes_sync::{Named, Scope};
use spes_train::trainer::MetricsLog;
use spes_train::{checkpoint, RunConfig, Trainer};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};
use tonic::codegen::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

type Client = SpesClient<InterceptedService<Channel, AddToken>>;

/// How a node shows its progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// A live progress bar on the terminal.
    Bar,
    /// One JSON object per logged step and per sync on stdout (for `spes demo`).
    Json,
    Quiet,
}

/// How to run a node.
pub struct NodeOptions {
    /// The node's own config: its `data.path` is used; model, sync and training keys must
    /// match the server's.
    pub cfg: RunConfig,
    /// `http://host:port` or `https://host:port`.
    pub server: String,
    pub peer: usize,
    pub out: PathBuf,
    pub token: Option<String>,
    /// PEM CA certificate to trust for `https` (else the web PKI roots).
    pub tls_ca: Option<Vec<u8>>,
    pub device: Device,
    pub progress: Progress,
    /// Keep retrying an unreachable server (or waiting for a round) this many seconds.
    pub patience_s: f64,
}

/// What a finished node reports (`<out>/summary.json`).
#[derive(Clone, Debug, Serialize)]
pub struct NodeSummary {
    pub peer: usize,
    pub steps: u64,
    pub tokens: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub trainable_params: u64,
    pub optimizer_state_bytes: u64,
    pub peak_rss_mb: f64,
    pub wall_s: f64,
}

/// A connected node and its local trainer.
pub struct Node {
    peer: usize,
    out: PathBuf,
    rt: tokio::runtime::Runtime,
    client: Client,
    pub trainer: Trainer,
    scope: Scope,
    progress: Progress,
    bar: ProgressBar,
    log: MetricsLog,
    patience: Duration,
    max_payload: u64,
    bytes_up: u64,
    bytes_down: u64,
    window: (u64, f64),
    started: Instant,
}

/// Keys that may differ between a node's config and the server's.
const LOCAL_TRAIN_KEYS: &[&str] = &[
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
];

/// A node's model, sync and training settings must equal the server's; says which key differs.
fn check_compatible(local: &RunConfig, server: &RunConfig) -> Result<()> {
    let (l, s) = (
        toml::Value::try_from(local)?,
        toml::Value::try_from(server)?,
    );
    for section in ["model", "sync", "train"] {
        let Some(table) = s.get(section).and_then(|t| t.as_table()) else {
            continue;
        };
        for (key, sv) in table {
            if section == "train" && LOCAL_TRAIN_KEYS.contains(&key.as_str()) {
                continue;
            }
            let lv = l.get(section).and_then(|t| t.get(key));
            if lv != Some(sv) {
                let shown = lv
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "nothing".into());
                bail!("config key `{section}.{key}` differs: this node has {shown}, the server has {sv}");
            }
        }
    }
    Ok(())
}

async fn connect_client(opts: &NodeOptions) -> Result<Client> {
    let mut endpoint = Endpoint::from_shared(opts.server.clone())
        .with_context(|| format!("--server `{}` is not a valid URL", opts.server))?
        .connect_timeout(Duration::from_secs(10));
    if opts.server.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        tls = match &opts.tls_ca {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(ca)),
            None => tls.with_webpki_roots(),
        };
        endpoint = endpoint
            .tls_config(tls)
            .context("invalid TLS configuration")?;
    }
    let channel = endpoint.connect_lazy();
    Ok(SpesClient::with_interceptor(
        channel,
        AddToken::new(opts.token.as_deref())?,
    ))
}

/// Whether a failed call may succeed later (server restarting, round not yet published).
fn transient(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
    )
}

impl Node {
    /// Connects, joins, and brings a fresh or resumed trainer to the newest published model.
    pub fn connect(opts: NodeOptions) -> Result<Node> {
        let rt = tokio::runtime::Runtime::new()?;
        let client = rt.block_on(connect_client(&opts))?;
        let patience = Duration::from_secs_f64(opts.patience_s);
        let peer = opts.peer;
        let reply = retry(&rt, patience, "join", || {
            let mut c = client.clone();
            async move { c.join(JoinRequest { peer: peer as u32 }).await }
        })
        .map_err(|e| explain(e, &opts.server))?
        .into_inner();
        let server_cfg =
            RunConfig::parse(&reply.config_toml, &[]).context("the server's config")?;
        check_compatible(&opts.cfg, &server_cfg)?;
        let mut cfg = server_cfg;
        cfg.data = opts.cfg.data.clone();
        cfg.train.seed += 1000 * peer as u64;
        let scope = crate::scope_of(&cfg)?;
        std::fs::create_dir_all(&opts.out)
            .with_context(|| format!("cannot create {}", opts.out.display()))?;
        let ck_root = opts.out.join("checkpoints");
        let resumed = checkpoint::latest(&ck_root)?;
        let trainable = |role: Role| scope.uploads(peer, role);
        let trainer = match &resumed {
            Some(dir) => Trainer::resume_from(cfg.clone(), opts.device, dir, trainable)?,
            None => {
                let model = MoeModel::new(&cfg.model, opts.device)?;
                Trainer::with_model(cfg.clone(), opts.device, model, trainable, 0)?
            }
        };
        let max_payload = trainer
            .model
            .params()
            .iter()
            .map(|p| p.tensor.numel() as u64 * 4 + 256)
            .sum::<u64>()
            + (1 << 20);
        let log = MetricsLog::open(&opts.out, resumed.as_ref().map(|_| trainer.step))?;
        let bar = match opts.progress {
            Progress::Bar => {
                let bar = ProgressBar::new(cfg.train.max_steps);
                bar.set_style(
                    ProgressStyle::with_template(
                        "node {prefix} step {pos}/{len} [{bar:25}] {msg} | eta {eta}",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                bar.set_prefix(peer.to_string());
                bar
            }
            _ => ProgressBar::hidden(),
        };
        let mut node = Node {
            peer,
            out: opts.out,
            rt,
            client,
            trainer,
            scope,
            progress: opts.progress,
            bar,
            log,
            patience,
            max_payload,
            bytes_up: 0,
            bytes_down: 0,
            window: (0, 0.0),
            started: Instant::now(),
        };
        let h = cfg.sync.sync_steps;
        let at = node.trainer.step / h;
        if resumed.is_none() || reply.published_round > at {
            // Fresh: start from θ⁰ (or the newest model when joining late); resumed but behind:
            // skip to the newest model, as the rounds it missed closed without it.
            let newest = resumed.is_some() || reply.published_round > 0;
            let (round, _) = node.fetch_and_load(if newest { None } else { Some(0) })?;
            node.trainer.step = round * h;
        }
        Ok(node)
    }

    /// The tensors this node trains and uploads, in the model's order (sharing storage).
    pub fn upload_tensors(&self) -> Named {
        self.trainer
            .model
            .params()
            .into_iter()
            .filter(|p| self.scope.uploads(self.peer, p.role))
            .map(|p| (p.name, p.tensor.detach()))
            .collect()
    }

    fn set_decayed_lb(&mut self) {
        let cfg = &self.trainer.cfg;
        let s = &cfg.sync;
        if !s.decayed_lb || !matches!(self.scope, Scope::Spes(_)) {
            return;
        }
        let ramp = (s.decayed_lb_fraction * cfg.train.max_steps as f64).max(1.0);
        let gamma = s.decayed_lb_start
            + (1.0 - s.decayed_lb_start) * (self.trainer.step as f64 / ramp).min(1.0);
        let scale: Vec<f32> = (0..cfg.model.n_experts)
            .map(|e| {
                let own = self
                    .scope
                    .uploads(self.peer, Role::Expert { layer: 0, index: e });
                if own {
                    gamma as f32
                } else {
                    1.0
                }
            })
            .collect();
        let t = Tensor::from_slice(&scale)
            .to_device(self.trainer.device)
            .to_kind(Kind::Float);
        self.trainer.model.set_lb_count_scale(Some(t));
    }

    /// Trains until the next sync step and returns the tensors to upload.
    pub fn train_round(&mut self) -> Result<Named> {
        let h = self.trainer.cfg.sync.sync_steps;
        let log_every = self.trainer.cfg.train.log_every;
        loop {
            self.set_decayed_lb();
            let s = self.trainer.train_step();
            if !s.loss.is_finite() {
                bail!(
                    "node {}: loss became {} at step {}",
                    self.peer,
                    s.loss,
                    self.trainer.step
                );
            }
            self.window.0 += s.tokens;
            self.window.1 += s.seconds;
            let step = self.trainer.step;
            if step.is_multiple_of(log_every) || step.is_multiple_of(h) {
                let tps = self.window.0 as f64 / self.window.1.max(1e-9);
                self.window = (0, 0.0);
                let mut record = s.record(step, self.trainer.tokens, tps);
                record["round"] = json!(step.div_ceil(h));
                self.log.write(record.clone())?;
                self.report(record, format!("loss {:.3} | {tps:.0} tok/s", s.loss));
            }
            self.bar.set_position(step);
            if step.is_multiple_of(h) {
                return Ok(self.upload_tensors());
            }
        }
    }

    fn report(&self, mut record: serde_json::Value, message: String) {
        match self.progress {
            Progress::Bar => self.bar.set_message(message),
            Progress::Json => {
                record["peer"] = json!(self.peer);
                record["max_steps"] = json!(self.trainer.cfg.train.max_steps);
                println!("{record}");
            }
            Progress::Quiet => {}
        }
    }

    /// Uploads `upload` for the round that ends at the current step, then loads the aggregate.
    /// Returns the round whose model is now loaded.
    pub fn sync(&mut self, upload: &Named) -> Result<u64> {
        let t0 = Instant::now();
        let h = self.trainer.cfg.sync.sync_steps;
        let round = self.trainer.step / h;
        let path = self.out.join("upload.safetensors");
        payload::write(&path, upload, self.trainer.cfg.sync.payload_dtype)?;
        let size = std::fs::metadata(&path)?.len();
        let (peer, client) = (self.peer, self.client.clone());
        let sent = retry(&self.rt, self.patience, "upload", || {
            let mut c = client.clone();
            let path = path.clone();
            async move {
                let stream = payload::send(&path, peer, round)
                    .map_err(|e| Status::internal(format!("{e:#}")))?;
                let stream = tokio_stream::StreamExt::filter_map(stream, |r| r.ok());
                c.upload(stream).await
            }
        });
        let _ = std::fs::remove_file(&path);
        let target = match sent {
            Ok(_) => {
                self.bytes_up += size;
                Some(round)
            }
            Err(s) if s.code() == Code::AlreadyExists => Some(round),
            Err(s) if s.code() == Code::FailedPrecondition && s.message().contains("is closed") => {
                tracing::warn!("node {}: {}; skipping ahead", self.peer, s.message());
                None
            }
            Err(s) => return Err(explain(s, "the server")),
        };
        let (loaded, bytes) = self.fetch_and_load(target)?;
        if loaded > round {
            self.trainer.step = loaded * h;
        }
        self.trainer
            .save_checkpoint(&self.out.join("checkpoints"))?;
        let record = json!({
            "event": "sync", "step": self.trainer.step, "round": loaded, "bytes_up": size,
            "bytes_down": bytes, "sync_s": t0.elapsed().as_secs_f64(),
        });
        self.log.write(record.clone())?;
        self.report(record, format!("synced round {loaded}"));
        Ok(loaded)
    }

    /// Fetches round `round` (waiting for it) or the newest, loads it; returns (round, bytes).
    fn fetch_and_load(&mut self, round: Option<u64>) -> Result<(u64, u64)> {
        let dest = self.out.join("global.safetensors.part");
        let (peer, client, max) = (self.peer, self.client.clone(), self.max_payload);
        let d = dest.clone();
        let fetched = retry(&self.rt, self.patience, "fetch", || {
            let mut c = client.clone();
            let d = d.clone();
            async move {
                let req = FetchRequest {
                    peer: peer as u32,
                    round: round.unwrap_or(0),
                    newest: round.is_none(),
                    wait_ms: 20_000,
                };
                let stream = c.fetch(req).await?.into_inner();
                payload::receive(stream, &d, max).await
            }
        });
        let header = match fetched {
            Ok(h) => h,
            // The server keeps only recent rounds; a node that fell behind takes the newest.
            Err(s) if s.code() == Code::NotFound && round.is_some() => {
                tracing::warn!(
                    "node {}: {}; taking the newest model",
                    self.peer,
                    s.message()
                );
                return self.fetch_and_load(None);
            }
            Err(s) => return Err(explain(s, "the server")),
        };
        let named = payload::read(&dest)?;
        let _ = std::fs::remove_file(&dest);
        let source = format!("global model of round {}", header.round);
        self.trainer.model.load(&named, &source)?;
        self.bytes_down += header.total_bytes;
        Ok((header.round, header.total_bytes))
    }

    /// Trains and syncs until `max_steps`, tells the server, then writes `<out>/summary.json`.
    pub fn run(mut self) -> Result<NodeSummary> {
        while self.trainer.step < self.trainer.cfg.train.max_steps {
            let upload = self.train_round()?;
            self.sync(&upload)?;
        }
        self.bar.finish_and_clear();
        let (peer, client) = (self.peer, self.client.clone());
        // Best effort: a server already gone has nothing left to wait for.
        let said = retry(&self.rt, Duration::from_secs(10), "done", || {
            let mut c = client.clone();
            async move { c.done(DoneRequest { peer: peer as u32 }).await }
        });
        if let Err(s) = said {
            tracing::warn!(
                "node {peer}: could not tell the server it is done: {}",
                s.message()
            );
        }
        let summary = self.summary();
        spes_data::shard::write_atomic(
            &self.out.join("summary.json"),
            serde_json::to_string_pretty(&summary)?.as_bytes(),
        )?;
        Ok(summary)
    }

    pub fn summary(&self) -> NodeSummary {
        NodeSummary {
            peer: self.peer,
            steps: self.trainer.step,
            tokens: self.trainer.tokens,
            bytes_up: self.bytes_up,
            bytes_down: self.bytes_down,
            trainable_params: self
                .trainer
                .model
                .trainable_params()
                .iter()
                .map(|p| p.tensor.numel() as u64)
                .sum(),
            optimizer_state_bytes: self.trainer.opt.state_bytes(),
            peak_rss_mb: spes_train::bench::peak_rss_mb(),
            wall_s: self.started.elapsed().as_secs_f64(),
        }
    }
}

/// Runs `call` until it succeeds, fails for good, or `patience` ran out on transient errors.
fn retry<T, F, Fut>(
    rt: &tokio::runtime::Runtime,
    patience: Duration,
    what: &str,
    mut call: F,
) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let start = Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match rt.block_on(call()) {
            Ok(v) => return Ok(v),
            Err(s) if transient(&s) && start.elapsed() < patience => {
                tracing::debug!("{what}: {} (retrying)", s.message());
                if s.code() != Code::Unavailable || !s.message().contains("not published yet") {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
            Err(s) => return Err(s),
        }
    }
}

/// Turns a final gRPC failure into an error that says what to do.
fn explain(s: Status, server: &str) -> anyhow::Error {
    match s.code() {
        Code::Unauthenticated => {
            anyhow::anyhow!("{server} rejected this node's token: check --token-file")
        }
        Code::Unavailable => anyhow::anyhow!("cannot reach {server}: {}", s.message()),
        _ => anyhow::anyhow!("{server} refused: {}", s.message()),
    }
}
