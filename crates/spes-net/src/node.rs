//! `spes node`: trains the shared parameters and its own experts (all others frozen: no
//! gradient, no optimizer state), and every `sync_steps` uploads exactly those tensors — as
//! deltas from the last global model on the delta wires (spes-sync's `delta`) — then applies the
//! round's aggregate and goes on with its AdamW state and LR schedule. With `sync.overlap` the
//! upload and download run on another thread while training goes on. It checkpoints after each
//! round (recording the round its weights hold), so a restarted node resumes where it was.
//!
//! A background task renews the node's lease (training never blocks it). Each published round
//! says who owns which expert next; when that changes (a node left or joined), the node trains
//! its new experts with fresh AdamW moments. Refusals are decided on their typed kind
//! ([`crate::refusal`]): a closed round names the round to load, and the node loads exactly it.
//! A sharded server is several URLs; the node talks to every shard in parallel ([`Link`]).

use crate::auth::{credential_peer, is_loopback_url, AddToken};
use crate::proto::refusal::Kind as Refused;
use crate::proto::spes_client::SpesClient;
use crate::proto::{DoneRequest, FetchRequest, JoinReply, JoinRequest, PayloadHeader};
use crate::{fault, payload, refusal};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use spes_model::{MoeModel, Role};
use spes_sync::delta::{self, WirePart};
use spes_sync::Named;
use spes_train::data_parallel::DataParallel;
use spes_train::trainer::MetricsLog;
use spes_train::Wire;
use spes_train::{checkpoint, Mode, RunConfig, Trainer};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};
use tonic::codegen::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

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
    /// This peer's credential (`spes credential`); `None` for a server run with `--no-auth`.
    pub credential: Option<String>,
    /// PEM CA certificate to trust for `https` (else the web PKI roots).
    pub tls_ca: Option<Vec<u8>>,
    pub device: Device,
    pub progress: Progress,
    /// Keep retrying an unreachable server (or waiting for a round) this many seconds.
    pub patience_s: f64,
    /// Become a member if this peer id is not one yet (a new node joining a running run).
    pub join: bool,
    /// Allow sending the credential in plaintext to a host that is not loopback.
    pub insecure: bool,
    /// A node of several ranks: this process is rank 0 of this group; the other ranks run
    /// [`spes_train::follow`].
    pub data_parallel: Option<DataParallel>,
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
    /// Owns the runtime that `link` and the heartbeat task run on.
    _rt: tokio::runtime::Runtime,
    link: Link,
    pub trainer: Trainer,
    /// `owned[e]`: this node trains expert e in the current round (all of them in DiLoCo).
    owned: Vec<bool>,
    /// Delta wire: the last loaded global model's trained tensors, in fp32.
    base: Option<Base>,
    /// Delta wire: the deltas of the last upload that a later load needs (own experts, or all
    /// of them when progress since the upload is kept), by name.
    sent: HashMap<String, Sent>,
    expert_names: HashSet<String>,
    /// Overlap: the upload and fetch running while training goes on.
    pending: Option<Pending>,
    round_compute_s: f64,
    session: u64,
    /// Set by the heartbeat task when another process took this peer id.
    lost: Arc<Mutex<Option<String>>>,
    _lock: std::fs::File,
    progress: Progress,
    bar: ProgressBar,
    log: MetricsLog,
    bytes_up: u64,
    bytes_down: u64,
    window: (u64, f64),
    started: Instant,
    /// The checkpoint being written while training goes on.
    checkpointing: Option<std::thread::JoinHandle<Result<PathBuf>>>,
}

impl Drop for Node {
    fn drop(&mut self) {
        // A checkpoint is renamed into place whole or not at all; finishing it keeps the work.
        if let Err(e) = self.finish_checkpoint() {
            tracing::warn!("{e:#}");
        }
    }
}

/// In a node checkpoint: the round whose global model its weights were loaded from.
const LOADED_ROUND: &str = "loaded-round";

/// Keys that may differ between a node's config and the server's.
const LOCAL_TRAIN_KEYS: &[&str] = &[
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    // How a node computes is its own affair.
    "activation_checkpointing",
    "moe_kernel",
    "frozen_experts_bf16",
];

/// Sync keys only the server reads: how often it archives the model and how many it keeps.
const SERVER_SYNC_KEYS: &[&str] = &["checkpoint_every_rounds", "keep_checkpoints"];

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
        let own = match section {
            "train" => LOCAL_TRAIN_KEYS,
            "sync" => SERVER_SYNC_KEYS,
            _ => &[],
        };
        for (key, sv) in table {
            if own.contains(&key.as_str()) {
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

/// How long a stream may stay silent, and how long unary calls may take.
const IDLE: Duration = Duration::from_secs(20);
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a fetch asks the server to wait for an unpublished round.
const FETCH_WAIT: Duration = Duration::from_secs(20);

async fn connect_client(opts: &NodeOptions, url: &str) -> Result<Client> {
    if url.starts_with("http://")
        && opts.credential.is_some()
        && !opts.insecure
        && !is_loopback_url(url)
    {
        bail!(
            "refusing to send this node's credential in plaintext to {url}: use https:// (the \
             server needs --tls-cert/--tls-key), or pass --insecure on a network you trust"
        );
    }
    // Keepalive pings find a black-holed connection within ~15 s; the channel then reconnects.
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .with_context(|| format!("--server `{url}` is not a valid URL"))?
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .tcp_keepalive(Some(Duration::from_secs(30)));
    if url.starts_with("https://") {
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
    Ok(
        SpesClient::with_interceptor(channel, AddToken::new(opts.credential.as_deref())?)
            .max_decoding_message_size(payload::MAX_MESSAGE_BYTES),
    )
}

/// Whether a failed call may succeed later (server restarting or busy, round not published).
fn transient(s: &Status) -> bool {
    match refusal::kind(s) {
        Some(k) => k == Refused::Retry,
        None => matches!(
            s.code(),
            Code::Unavailable
                | Code::Unknown
                | Code::Cancelled
                | Code::DeadlineExceeded
                | Code::Aborted
                | Code::Internal
                | Code::ResourceExhausted
        ),
    }
}

/// A unary request with a deadline.
fn call<T>(msg: T) -> Request<T> {
    let mut req = Request::new(msg);
    req.set_timeout(CALL_TIMEOUT);
    req
}

/// The node's process identity, kept in `<out>/session` so a restarted node takes its peer
/// id back at once while any other process is refused until the lease expires.
fn session_of(out: &Path) -> Result<u64> {
    let path = out.join("session");
    if let Ok(text) = std::fs::read_to_string(&path) {
        if let Ok(s) = u64::from_str_radix(text.trim(), 16) {
            return Ok(s);
        }
    }
    let s = rand::random::<u64>() | 1;
    spes_data::shard::write_secret(&path, format!("{s:016x}\n").as_bytes())?;
    Ok(s)
}

/// Joins (or rejoins) the run as `peer`, retrying through outages.
fn join_run(
    rt: &tokio::runtime::Handle,
    client: &Client,
    patience: Duration,
    peer: usize,
    session: u64,
    join: bool,
) -> Result<JoinReply, Status> {
    retry(rt, patience, "join", || {
        let mut c = client.clone();
        let req = JoinRequest {
            peer: peer as u32,
            session,
            join,
        };
        async move { c.join(call(req)).await }
    })
    .map(|r| r.into_inner())
}

/// Whether a node owning the experts marked in `owned` trains a parameter of this role.
fn trains(owned: &[bool], role: Role) -> bool {
    match role {
        Role::Shared => true,
        Role::Expert { index, .. } => owned[index],
    }
}

/// Holds `<out>/lock` exclusively, so two nodes never share an output directory.
fn lock_out(out: &Path) -> Result<std::fs::File> {
    let path = out.join("lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    f.try_lock().map_err(|_| {
        anyhow::anyhow!(
            "another spes node is running with --out {}: give each node its own directory",
            out.display()
        )
    })?;
    Ok(f)
}

/// One tensor's delta as it travels: dense bf16, or compressed (sparse or quantized).
enum Sent {
    Dense(Tensor),
    Compressed(delta::Compressed),
}

impl Sent {
    fn share(&self) -> Sent {
        match self {
            Sent::Dense(t) => Sent::Dense(t.shallow_clone()),
            Sent::Compressed(c) => Sent::Compressed(c.share()),
        }
    }

    /// In place: `base ← base + f32(self)`, as the server computes it.
    fn apply_(&self, base: &mut Tensor) {
        match self {
            Sent::Dense(d) => delta::apply_(base, d),
            Sent::Compressed(c) => c.apply_(base),
        }
    }

    /// `x − f32(self)`.
    fn subtract_from(&self, x: &Tensor) -> Tensor {
        tch::no_grad(|| match self {
            Sent::Dense(d) => x - d.to_device(x.device()).to_kind(Kind::Float),
            Sent::Compressed(c) => c.subtract_from(x),
        })
    }
}

/// The deltas of a payload by tensor, checked against the model's shapes and the run's wire.
fn group_deltas(
    named: Named,
    params: &[spes_model::Param],
    form: delta::WireForm,
    source: &str,
) -> Result<HashMap<String, Sent>> {
    let shape_of = |name: &str| {
        params
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.tensor.size())
            .with_context(|| format!("{source}: unknown tensor `{name}`"))
    };
    let mut out = HashMap::new();
    let mut parts: HashMap<String, HashMap<WirePart, Tensor>> = HashMap::new();
    for (wire, t) in named {
        if let Some((name, part)) = delta::split_wire_name(&wire) {
            parts.entry(name.to_owned()).or_default().insert(part, t);
            continue;
        }
        let shape = shape_of(&wire)?;
        if t.size() != shape || t.kind() != Kind::BFloat16 {
            bail!(
                "{source}: `{wire}` is {:?} {:?}, expected a bf16 delta of shape {shape:?}",
                t.kind(),
                t.size()
            );
        }
        out.insert(wire, Sent::Dense(t));
    }
    for (name, mut got) in parts {
        let numel: i64 = shape_of(&name)?.iter().product();
        let pair = form.parts().and_then(|(a, b)| {
            let (a, b) = (got.remove(&a)?, got.remove(&b)?);
            got.is_empty().then_some((a, b))
        });
        let Some((a, b)) = pair else {
            bail!("{source}: `{name}` is not a {form:?} delta");
        };
        let c = delta::Compressed::from_parts(form, numel, a, b)
            .map_err(|e| anyhow::anyhow!("{source}: `{name}`: {e}"))?;
        out.insert(name, Sent::Compressed(c));
    }
    Ok(out)
}

/// The last loaded global model's trained tensors (fp32, on the node's device), and its round.
struct Base {
    round: u64,
    values: HashMap<String, Tensor>,
}

impl Base {
    /// Copies the trainable tensors of `model`, which holds round `round` exactly.
    fn of(model: &MoeModel, round: u64) -> Base {
        Base {
            round,
            values: model
                .trainable_params()
                .into_iter()
                .map(|p| (p.name, p.tensor.detach().copy()))
                .collect(),
        }
    }
}

/// What to fetch.
#[derive(Clone, Copy, Debug)]
struct Ask {
    /// `None`: the newest round.
    round: Option<u64>,
    have_previous: bool,
    skip_own: bool,
}

impl Ask {
    fn newest() -> Ask {
        Ask {
            round: None,
            have_previous: false,
            skip_own: false,
        }
    }
}

/// The upload for one server shard: its file, size and checksum.
struct UploadFile {
    path: PathBuf,
    size: u64,
    xxh3: u64,
}

/// One round from every server shard: the merged header (shard 0's, with every shard's total
/// and whether any left this node's own experts out) and each shard's header and file.
struct Fetched {
    header: PayloadHeader,
    files: Vec<(PayloadHeader, PathBuf)>,
}

impl Fetched {
    /// Every shard's tensors (memory-mapped reads); the files are removed.
    fn read(&self) -> Result<Named> {
        let mut out = Vec::new();
        for (h, path) in &self.files {
            let named = payload::read_parts(path, &h.parts);
            let _ = std::fs::remove_file(path);
            out.extend(named?);
        }
        Ok(out)
    }
}

/// How an upload and the fetch after it went.
enum Exchange {
    Fetched { fetched: Fetched, up: u64 },
    UploadRefused(Status),
    FetchFailed { status: Status, up: u64 },
}

/// An upload and fetch running on another thread (overlap), and when it started.
struct Pending {
    thread: std::thread::JoinHandle<Exchange>,
    started: Instant,
    round: u64,
}

/// One server shard (`spes server --shard i/k`; the whole model when unsharded).
#[derive(Clone)]
struct Shard {
    client: Client,
    /// The tensors it owns; `None`: all of them.
    names: Option<Arc<HashSet<String>>>,
    /// The exact size of its whole fp32 slice on the wire; another announced size is refused.
    full_bytes: u64,
    /// The most a delta of its slice may take: every tensor in bf16 (sparse and quantized
    /// deltas take less), with room for the parts' headers.
    delta_max: u64,
}

/// The node's side of the network: the server shards and what calls need. Cloneable, so the
/// overlap thread can run an exchange while the node trains.
#[derive(Clone)]
struct Link {
    handle: tokio::runtime::Handle,
    shards: Vec<Shard>,
    peer: usize,
    session: u64,
    patience: Duration,
    out: PathBuf,
}

impl Link {
    /// The shard that owns a tensor (or a sparse delta's part of it).
    fn shard_of(&self, wire_name: &str) -> usize {
        let name = delta::split_wire_name(wire_name).map_or(wire_name, |(n, _)| n);
        self.shards
            .iter()
            .position(|s| s.names.as_ref().is_none_or(|n| n.contains(name)))
            .unwrap_or(0)
    }

    /// Runs `f` for every shard at once, results in shard order.
    fn on_all<T: Send>(
        &self,
        f: impl Fn(usize, &Shard) -> Result<T, Status> + Sync,
    ) -> Vec<Result<T, Status>> {
        if self.shards.len() == 1 {
            return vec![f(0, &self.shards[0])];
        }
        std::thread::scope(|scope| {
            let f = &f;
            let running: Vec<_> = self
                .shards
                .iter()
                .enumerate()
                .map(|(i, s)| scope.spawn(move || f(i, s)))
                .collect();
            running
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(Status::internal("a shard call panicked")))
                })
                .collect()
        })
    }

    /// Joins (or renews) at every shard; returns shard 0's reply after checking each shard
    /// sits where `--server` lists it.
    fn join(&self, join: bool) -> Result<JoinReply, Status> {
        let k = self.shards.len();
        let replies = self.on_all(|i, s| {
            let reply = join_run(&self.handle, &s.client, self.patience, self.peer, self.session, join)?;
            let (shard, shards) = (reply.shard as usize, (reply.shards as usize).max(1));
            if (shard, shards) != (i, k) {
                return Err(Status::failed_precondition(format!(
                    "server {} of --server is shard {shard} of {shards}; list all {shards} shards' URLs in shard order",
                    i + 1
                )));
            }
            Ok(reply)
        });
        let mut replies = replies.into_iter().collect::<Result<Vec<_>, _>>()?;
        Ok(replies.swap_remove(0))
    }

    /// Uploads every shard's file for `round`; the first refusal (in shard order) wins.
    fn upload(&self, round: u64, files: &[UploadFile]) -> Result<(), Status> {
        let results = self.on_all(|i, s| {
            let f = &files[i];
            let header = PayloadHeader {
                peer: self.peer as u32,
                round,
                total_bytes: f.size,
                parts: vec![payload::part(f.size, f.xxh3)],
                session: self.session,
                ..Default::default()
            };
            retry(&self.handle, self.patience, "upload", || {
                let (mut c, path, header) = (s.client.clone(), f.path.clone(), header.clone());
                async move {
                    let stream = payload::send(vec![path], header, move |i| {
                        if i == 0 {
                            fault::point("upload", round);
                        }
                    });
                    let stream = tokio_stream::StreamExt::filter_map(stream, |r| r.ok());
                    c.upload(stream).await
                }
            })
            .map(|_| ())
        });
        results.into_iter().collect()
    }

    /// Fetches a round from shard `i` (waiting for it) into `<out>/global-<i>.part`.
    fn fetch_one(&self, i: usize, ask: &Ask) -> Result<(PayloadHeader, PathBuf), Status> {
        let s = &self.shards[i];
        let dest = self.out.join(format!("global-{i}.part"));
        let (peer, full, delta_max) = (self.peer, s.full_bytes, s.delta_max);
        let ask = *ask;
        let header = retry(&self.handle, self.patience, "fetch", || {
            let mut c = s.client.clone();
            let d = dest.clone();
            async move {
                let mut req = Request::new(FetchRequest {
                    peer: peer as u32,
                    round: ask.round.unwrap_or(0),
                    newest: ask.round.is_none(),
                    wait_ms: FETCH_WAIT.as_millis() as u32,
                    have_previous: ask.have_previous,
                    skip_own: ask.skip_own,
                });
                req.set_timeout(FETCH_WAIT + CALL_TIMEOUT);
                let mut stream = c.fetch(req).await?.into_inner();
                let header = payload::read_header(&mut stream, IDLE).await?;
                let fits = if header.delta {
                    ask.have_previous && header.total_bytes <= delta_max
                } else {
                    header.total_bytes == full
                };
                if !fits {
                    return Err(Status::invalid_argument(format!(
                        "the server announces a {}-byte {}; this model takes exactly {full} \
                         bytes in fp32 and at most {delta_max} as a delta",
                        header.total_bytes,
                        if header.delta { "delta" } else { "model" },
                    )));
                }
                fault::point("download", header.round);
                payload::receive_body(&mut stream, &d, &header, IDLE).await?;
                Ok(header)
            }
        })?;
        Ok((header, dest))
    }

    /// Fetches a round from every shard: the newest means shard 0's newest, which the others
    /// then send as well. The shards must agree on the round, its form and who trains next.
    fn fetch(&self, ask: &Ask) -> Result<Fetched, Status> {
        let mut ask = *ask;
        let first = match ask.round {
            None if self.shards.len() > 1 => {
                let f = self.fetch_one(0, &ask)?;
                ask.round = Some(f.0.round);
                Some(f)
            }
            _ => None,
        };
        let skip = usize::from(first.is_some());
        let rest = self.on_all(|i, _| {
            if i < skip {
                return Err(Status::cancelled("fetched first"));
            }
            self.fetch_one(i, &ask)
        });
        let mut files: Vec<(PayloadHeader, PathBuf)> = first.into_iter().collect();
        for r in rest.into_iter().skip(skip) {
            files.push(r?);
        }
        let h0 = &files[0].0;
        let agree = files.iter().all(|(h, _)| {
            (h.round, h.delta, &h.owners, &h.members)
                == (h0.round, h0.delta, &h0.owners, &h0.members)
        });
        if !agree {
            return Err(Status::failed_precondition(
                "the server shards disagree on the round, its form or its members",
            ));
        }
        let header = PayloadHeader {
            total_bytes: files.iter().map(|(h, _)| h.total_bytes).sum(),
            skipped_own: files.iter().any(|(h, _)| h.skipped_own),
            parts: Vec::new(),
            ..h0.clone()
        };
        Ok(Fetched { header, files })
    }

    /// Uploads round `round`, then fetches it as `ask` says.
    fn exchange(&self, round: u64, files: Vec<UploadFile>, ask: Ask) -> Exchange {
        let sent = self.upload(round, &files);
        for f in &files {
            let _ = std::fs::remove_file(&f.path);
        }
        let up = match sent {
            Ok(()) => files.iter().map(|f| f.size).sum(),
            Err(s) if refusal::kind(&s) == Some(Refused::Duplicate) => 0,
            Err(s) => return Exchange::UploadRefused(s),
        };
        match self.fetch(&ask) {
            Ok(fetched) => Exchange::Fetched { fetched, up },
            Err(status) => Exchange::FetchFailed { status, up },
        }
    }
}

impl Node {
    /// Connects, joins, and brings a fresh or resumed trainer to the newest published model
    /// (or, for a node joining a running run, to the round it becomes a member from).
    pub fn connect(opts: NodeOptions) -> Result<Node> {
        let peer = opts.peer;
        if let Some(c) = &opts.credential {
            match credential_peer(c) {
                Some(p) if p == peer => {}
                Some(p) => bail!("this credential is for peer {p}, but --peer is {peer}"),
                None => bail!("the credential file does not hold a spes peer credential (spes credential makes one)"),
            }
        }
        std::fs::create_dir_all(&opts.out)
            .with_context(|| format!("cannot create {}", opts.out.display()))?;
        let lock = lock_out(&opts.out)?;
        let session = session_of(&opts.out)?;
        let rt = tokio::runtime::Runtime::new()?;
        let urls: Vec<&str> = opts
            .server
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let shards = urls
            .iter()
            .map(|url| {
                Ok(Shard {
                    client: rt.block_on(connect_client(&opts, url))?,
                    names: None,
                    full_bytes: 0,
                    delta_max: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if shards.is_empty() {
            bail!("--server names no server");
        }
        let mut link = Link {
            handle: rt.handle().clone(),
            shards,
            peer,
            session,
            patience: Duration::from_secs_f64(opts.patience_s),
            out: opts.out.clone(),
        };
        let reply = link.join(opts.join).map_err(|e| explain(e, &opts.server))?;
        let server_cfg =
            RunConfig::parse(&reply.config_toml, &[]).context("the server's config")?;
        check_compatible(&opts.cfg, &server_cfg)?;
        let mut cfg = server_cfg;
        cfg.data = opts.cfg.data.clone();
        // LOCAL_TRAIN_KEYS: this node's own.
        let (t, mine) = (&mut cfg.train, &opts.cfg.train);
        t.log_every = mine.log_every;
        t.eval_every = mine.eval_every;
        t.eval_batches = mine.eval_batches;
        t.checkpoint_every = mine.checkpoint_every;
        t.keep_checkpoints = mine.keep_checkpoints;
        t.activation_checkpointing = mine.activation_checkpointing;
        t.moe_kernel = mine.moe_kernel;
        t.frozen_experts_bf16 = mine.frozen_experts_bf16;
        cfg.train.seed += 1000 * peer as u64;
        let ck_root = opts.out.join("checkpoints");
        let resumed = checkpoint::latest(&ck_root)?;
        let mut trainer = match &resumed {
            Some(dir) => Trainer::resume_as_saved(cfg.clone(), opts.device, dir)?,
            None => {
                let model = {
                    let _rng = crate::INIT_RNG.lock().unwrap_or_else(|e| e.into_inner());
                    MoeModel::new(&cfg.model, opts.device)?
                };
                Trainer::with_model(cfg.clone(), opts.device, model, |_| false, 0)?
            }
        };
        if let Some(dp) = opts.data_parallel {
            trainer.lead(dp)?;
        }
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
        let n_experts = cfg.model.n_experts;
        let layout = spes_sync::Layout::of(&trainer.model);
        let k = link.shards.len();
        for (i, shard) in link.shards.iter_mut().enumerate() {
            let slice = layout.shard(i, k);
            let entries = |kind| {
                slice
                    .entries
                    .iter()
                    .map(move |(n, _, s)| (n.as_str(), s.as_slice(), kind))
            };
            shard.full_bytes = payload::expected_size(entries(Kind::Float));
            // Dense bf16 deltas; sparse (density ≤ 0.3: ≤ 1.8 bytes per value) and quantized
            // ones (≤ 1.04 bytes per value) take less.
            shard.delta_max = 2 * payload::expected_size(entries(Kind::BFloat16));
            shard.names =
                (k > 1).then(|| Arc::new(slice.entries.into_iter().map(|(n, _, _)| n).collect()));
        }
        let expert_names = trainer
            .model
            .params()
            .into_iter()
            .filter(|p| matches!(p.role, Role::Expert { .. }))
            .map(|p| p.name)
            .collect();
        let mut node = Node {
            peer,
            out: opts.out,
            _rt: rt,
            link,
            trainer,
            owned: vec![false; n_experts],
            base: None,
            sent: HashMap::new(),
            expert_names,
            pending: None,
            round_compute_s: 0.0,
            session,
            lost: Arc::new(Mutex::new(None)),
            _lock: lock,
            progress: opts.progress,
            bar,
            log,
            bytes_up: 0,
            bytes_down: 0,
            window: (0, 0.0),
            started: Instant::now(),
            checkpointing: None,
        };
        node.start_heartbeat(reply.lease_ms);
        let loaded = resumed.as_ref().and_then(|dir| {
            std::fs::read_to_string(dir.join(LOADED_ROUND))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
        });
        node.enter(&reply, resumed.is_some(), loaded)?;
        Ok(node)
    }

    /// Brings the node to the model it trains next, after a join.
    /// `loaded`: the round a resumed checkpoint's weights hold, if it says.
    fn enter(&mut self, reply: &JoinReply, resumed: bool, loaded: Option<u64>) -> Result<()> {
        if reply.member_from > 0 {
            return self.wait_for_membership(reply.member_from);
        }
        let h = self.trainer.cfg.sync.sync_steps;
        // Without overlap a checkpoint is taken right after loading round step / h.
        let at = match loaded {
            Some(r) => Some(r),
            None if !self.keeps_progress() => Some(self.trainer.step / h),
            None => None,
        };
        let Some(at) = at.filter(|&r| resumed && reply.published_round == r) else {
            // Fresh: start from θ⁰ (or the newest model when starting late); resumed but
            // behind (or ahead of a server that rolled back): take the newest model.
            let newest = resumed || reply.published_round > 0;
            let header = self.fetch_and_load(if newest { None } else { Some(0) })?;
            return self.follow(&header);
        };
        let owned: Vec<bool> = (0..self.owned.len())
            .map(|e| reply.owned_experts.contains(&(e as u32)))
            .collect();
        self.set_owned(owned)?;
        if self.trainer.cfg.sync.wire != Wire::Fp32 {
            if !self.keeps_progress() && self.trainer.step.is_multiple_of(h) {
                // Saved right after loading round `at`: the trained tensors are that round's.
                self.base = Some(Base::of(&self.trainer.model, at));
            } else {
                self.fetch_base(at)?;
            }
        }
        Ok(())
    }

    /// Takes round `round`'s trained tensors as the delta base, keeping the weights (which
    /// hold progress made since that round).
    fn fetch_base(&mut self, round: u64) -> Result<()> {
        let ask = Ask {
            round: Some(round),
            have_previous: false,
            skip_own: false,
        };
        let fetched = match self.link.fetch(&ask) {
            Ok(f) => f,
            Err(s) if s.code() == Code::NotFound => {
                tracing::warn!(
                    "node {}: {}; taking the newest model",
                    self.peer,
                    s.message()
                );
                let header = self.fetch_and_load(None)?;
                return self.follow(&header);
            }
            Err(s) => return Err(explain(s, "the server")),
        };
        let mut named: HashMap<String, Tensor> = fetched.read()?.into_iter().collect();
        let mut values = HashMap::new();
        for p in self.trainer.model.trainable_params() {
            let t = named
                .remove(&p.name)
                .with_context(|| format!("round {round} from the server lacks `{}`", p.name))?;
            values.insert(
                p.name,
                t.to_device(self.trainer.device).to_kind(Kind::Float),
            );
        }
        self.base = Some(Base { round, values });
        Ok(())
    }

    /// Renews the lease every `lease/4` on the runtime's worker threads.
    fn start_heartbeat(&self, lease_ms: u64) {
        let every = Duration::from_millis((lease_ms / 4).max(50));
        for shard in &self.link.shards {
            let (peer, session, client, lost) = (
                self.peer as u32,
                self.session,
                shard.client.clone(),
                self.lost.clone(),
            );
            self.link.handle.spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let mut c = client.clone();
                    let mut req = Request::new(JoinRequest {
                        peer,
                        session,
                        join: false,
                    });
                    req.set_timeout(every.max(Duration::from_secs(2)));
                    match c.heartbeat(req).await {
                        Ok(_) => {}
                        Err(s) if refusal::kind(&s) == Some(Refused::PeerTaken) => {
                            *lost.lock().unwrap() = Some(s.message().to_owned());
                            return;
                        }
                        Err(s) => tracing::debug!("heartbeat: {}", s.message()),
                    }
                }
            });
        }
    }

    /// Trains exactly `owned` experts (plus the shared parameters) from now on.
    fn set_owned(&mut self, owned: Vec<bool>) -> Result<()> {
        if owned == self.owned && self.trainer.opt.param_names().next().is_some() {
            return Ok(());
        }
        let r = self.trainer.set_trainable(|role| trains(&owned, role))?;
        let overlap = self.keeps_progress();
        let mut reset = false;
        if let Some(base) = &mut self.base {
            for p in self.trainer.model.params() {
                let now = p.tensor.requires_grad();
                match (base.values.contains_key(&p.name), now) {
                    // A newly trained tensor was frozen: it holds the global value.
                    (false, true) => {
                        base.values.insert(p.name, p.tensor.detach().copy());
                    }
                    // A dropped one goes back to the global value (local progress is lost).
                    (true, false) => {
                        let b = base.values.remove(&p.name).expect("present");
                        if overlap {
                            tch::no_grad(|| p.tensor.shallow_clone().copy_(&b));
                            reset = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        let experts: Vec<usize> = (0..owned.len()).filter(|&e| owned[e]).collect();
        if !r.fresh.is_empty() || !r.dropped.is_empty() {
            tracing::info!(
                "node {}: trains experts {experts:?} from step {}: {} tensors start fresh AdamW moments, {} dropped",
                self.peer,
                self.trainer.step,
                r.fresh.len(),
                r.dropped.len()
            );
        }
        self.owned = owned;
        if reset {
            self.trainer.model.refresh_resident();
            self.trainer.publish_weights()?;
        }
        Ok(())
    }

    /// Takes the ownership a fetched round announces for the next round; waits to be admitted
    /// again if this node is not a member of it.
    fn follow(&mut self, header: &PayloadHeader) -> Result<()> {
        if !header.members.contains(&(self.peer as u32)) {
            tracing::warn!(
                "node {}: not a member of round {}; asking to join again",
                self.peer,
                header.round + 1
            );
            return self.rejoin();
        }
        let owned = (0..self.owned.len())
            .map(|e| match header.owners.get(e) {
                Some(&o) => o as usize == self.peer,
                None => self.trainer.cfg.sync.mode == Mode::Diloco,
            })
            .collect();
        self.set_owned(owned)
    }

    /// Joins again (after an eviction) and waits until this node is a member.
    fn rejoin(&mut self) -> Result<()> {
        let reply = self
            .link
            .join(false)
            .map_err(|e| explain(e, "the server"))?;
        let from = if reply.member_from > 0 {
            reply.member_from
        } else {
            reply.published_round + 1
        };
        self.wait_for_membership(from)
    }

    /// Loads round `from - 1` (waiting for it) and follows its ownership.
    fn wait_for_membership(&mut self, from: u64) -> Result<()> {
        tracing::info!(
            "node {}: member from round {from}; waiting for round {}",
            self.peer,
            from - 1
        );
        let header = self.fetch_and_load(Some(from - 1))?;
        self.follow(&header)
    }

    /// The tensors this node trains and uploads, in the model's order (sharing storage).
    pub fn upload_tensors(&self) -> Named {
        self.trainer
            .model
            .params()
            .into_iter()
            .filter(|p| trains(&self.owned, p.role))
            .map(|p| (p.name, p.tensor.detach()))
            .collect()
    }

    fn set_decayed_lb(&mut self) {
        let cfg = &self.trainer.cfg;
        let s = &cfg.sync;
        if !s.decayed_lb || s.mode != Mode::Spes {
            return;
        }
        let ramp = (s.decayed_lb_fraction * cfg.train.max_steps as f64).max(1.0);
        let gamma = s.decayed_lb_start
            + (1.0 - s.decayed_lb_start) * (self.trainer.step as f64 / ramp).min(1.0);
        let scale: Vec<f32> = self
            .owned
            .iter()
            .map(|&own| if own { gamma as f32 } else { 1.0 })
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
            let s = self.trainer.train_step()?;
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
            self.round_compute_s += s.seconds;
            let step = self.trainer.step;
            fault::point("train", step);
            if step.is_multiple_of(log_every) || step.is_multiple_of(h) {
                self.trainer.check_ranks_in_sync()?;
                let tps = self.window.0 as f64 / self.window.1.max(1e-9);
                self.window = (0, 0.0);
                let mut record = s.record(step, self.trainer.tokens, tps);
                record["round"] = json!(step.div_ceil(h));
                self.log.write(record.clone())?;
                self.report(record, format!("loss {:.3} | {tps:.0} tok/s", s.loss));
            }
            self.bar.set_position(step);
            if self
                .pending
                .as_ref()
                .is_some_and(|p| p.thread.is_finished())
            {
                self.settle_pending()?;
            }
            if self.trainer.step.is_multiple_of(h) {
                // The previous round must be in before this one's delta is taken from it.
                let before = self.trainer.step;
                if self.pending.is_some() {
                    self.settle_pending()?;
                }
                if self.trainer.step == before {
                    return Ok(self.upload_tensors());
                }
            }
        }
    }

    /// Overlap: uploads and fetches the round that ends now on another thread while this one
    /// trains on; the result is applied when it is in ([`Node::train_round`]).
    fn start_sync(&mut self, upload: &Named) -> Result<()> {
        self.check_lost()?;
        let round = self.trainer.step / self.trainer.cfg.sync.sync_steps;
        let files = self.write_upload(upload)?;
        let ask = self.fetch_ask(round);
        let link = self.link.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sync-{round}"))
            .spawn(move || link.exchange(round, files, ask))?;
        self.pending = Some(Pending {
            thread,
            started: Instant::now(),
            round,
        });
        Ok(())
    }

    /// Waits for the overlapped exchange (if still running) and applies it.
    fn settle_pending(&mut self) -> Result<()> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let t = Instant::now();
        let exchange = p
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("node {}: the sync thread panicked", self.peer))?;
        self.settle(exchange, p.round, p.started, t)?;
        Ok(())
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

    /// The wire form of `upload` (the tensors this node trains, as values): whole fp32 tensors,
    /// or bf16 deltas from the last global model, kept in `self.sent` as the round needs them.
    /// Writes it to `<out>/upload.safetensors`; returns the file's size and checksum.
    fn write_upload(&mut self, upload: &Named) -> Result<Vec<UploadFile>> {
        let sync = &self.trainer.cfg.sync;
        let (wire, kind) = match &self.base {
            Some(base) if sync.wire != Wire::Fp32 => {
                let keep_all = self.keeps_progress();
                let mut wire = Vec::with_capacity(upload.len());
                self.sent.clear();
                for (name, t) in upload {
                    let b = base.values.get(name).with_context(|| {
                        format!("node {}: no base copy of trained `{name}`", self.peer)
                    })?;
                    let sent = if sync.wire.is_lossy() {
                        let v = tch::no_grad(|| t - b);
                        let c = delta::compress(&v, crate::wire_form(sync));
                        wire.extend(c.share().into_wire(name));
                        Sent::Compressed(c)
                    } else {
                        let d = delta::encode(t, b);
                        wire.push((name.clone(), d.shallow_clone()));
                        Sent::Dense(d)
                    };
                    if keep_all || self.expert_names.contains(name) {
                        self.sent.insert(name.clone(), sent);
                    }
                }
                (wire, Kind::BFloat16)
            }
            _ => (
                upload
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect(),
                Kind::Float,
            ),
        };
        // One file per server shard, each with the tensors that shard owns.
        let mut per_shard: Vec<Named> = (0..self.link.shards.len()).map(|_| Vec::new()).collect();
        for (name, t) in wire {
            per_shard[self.link.shard_of(&name)].push((name, t));
        }
        per_shard
            .into_iter()
            .enumerate()
            .map(|(i, named)| {
                let path = self.out.join(format!("upload-{i}.safetensors"));
                let (size, xxh3) = payload::write(&path, &named, kind)?;
                Ok(UploadFile { path, size, xxh3 })
            })
            .collect()
    }

    /// Uploads `upload` for the round that ends at the current step, then loads the aggregate
    /// (or whatever round the server says to load). Returns the round now loaded.
    pub fn sync(&mut self, upload: &Named) -> Result<u64> {
        self.check_lost()?;
        let t0 = Instant::now();
        let round = self.trainer.step / self.trainer.cfg.sync.sync_steps;
        let files = self.write_upload(upload)?;
        let ask = self.fetch_ask(round);
        let exchange = self.link.exchange(round, files, ask);
        self.settle(exchange, round, t0, t0)
    }

    fn check_lost(&self) -> Result<()> {
        if let Some(why) = self.lost.lock().unwrap().clone() {
            bail!(
                "node {}: another process took this peer id: {why}",
                self.peer
            );
        }
        Ok(())
    }

    /// Whether this node's weights carry more than the global model after a sync: steps
    /// trained since the upload (overlap) or what a lossy wire has not sent yet.
    fn keeps_progress(&self) -> bool {
        let s = &self.trainer.cfg.sync;
        s.overlaps() || s.wire.is_lossy()
    }

    /// How to fetch round `round`: as a delta if this node holds round − 1 exactly.
    fn fetch_ask(&self, round: u64) -> Ask {
        let have_previous = self.base.as_ref().is_some_and(|b| b.round + 1 == round);
        Ask {
            round: Some(round),
            have_previous,
            skip_own: have_previous && self.trainer.cfg.sync.skip_own_experts,
        }
    }

    /// Acts on how an upload and fetch went: loads the fetched round, or whatever round the
    /// server's refusal names; then follows the round's ownership and checkpoints.
    fn settle(
        &mut self,
        exchange: Exchange,
        round: u64,
        t0: Instant,
        idle_from: Instant,
    ) -> Result<u64> {
        let (up, target) = match exchange {
            Exchange::Fetched { fetched, up } => {
                self.bytes_up += up;
                let header = fetched.header.clone();
                let down = header.total_bytes;
                self.load(&header, fetched.read()?, true)?;
                self.follow(&header)?;
                return self.finish_sync(t0, idle_from, up, down);
            }
            Exchange::FetchFailed { status, up } => {
                self.bytes_up += up;
                if status.code() == Code::NotFound {
                    tracing::warn!(
                        "node {}: {}; taking the newest model",
                        self.peer,
                        status.message()
                    );
                    (up, None)
                } else {
                    return Err(explain(status, "the server"));
                }
            }
            Exchange::UploadRefused(s) => match (refusal::kind(&s), refusal::of_status(&s)) {
                (Some(Refused::Duplicate), _) => (0, Some(round)),
                (Some(Refused::Closed), Some(r)) => {
                    tracing::warn!(
                        "node {}: {}; loading round {}",
                        self.peer,
                        s.message(),
                        r.round
                    );
                    (0, Some(r.round))
                }
                (Some(Refused::NotOpen), Some(r)) if r.round <= round => {
                    tracing::warn!(
                        "node {}: the server is collecting round {} (it lost newer rounds); taking its newest model",
                        self.peer,
                        r.round
                    );
                    (0, None)
                }
                (Some(Refused::NotMember), _) => {
                    tracing::warn!("node {}: {}", self.peer, s.message());
                    self.rejoin()?;
                    return self.finish_sync(t0, idle_from, 0, 0);
                }
                _ => return Err(explain(s, "the server")),
            },
        };
        let header = self.fetch_and_load(target)?;
        self.follow(&header)?;
        self.finish_sync(t0, idle_from, up, header.total_bytes)
    }

    /// Checkpoints and logs a sync: `sync_s` from the upload to the loaded model, `idle_s` the
    /// time training stood still for it (checkpoint included), `compute_s` the round's steps.
    fn finish_sync(&mut self, t0: Instant, idle_from: Instant, up: u64, down: u64) -> Result<u64> {
        let sync_s = t0.elapsed().as_secs_f64();
        let h = self.trainer.cfg.sync.sync_steps;
        let loaded = self
            .base
            .as_ref()
            .map(|b| b.round)
            .unwrap_or(self.trainer.step / h);
        // Written on a thread while the next round trains; the one before must be done, so
        // at most one copy of the state is in flight.
        self.finish_checkpoint()?;
        // With overlap the step does not say which round the weights hold; this file does.
        let snapshot = self
            .trainer
            .snapshot(&self.out.join("checkpoints"))?
            .context("rank 0 holds the node's checkpoint")?
            .with_file(LOADED_ROUND, loaded.to_string().into_bytes());
        self.checkpointing = Some(std::thread::spawn(move || snapshot.write()));
        let record = json!({
            "event": "sync", "step": self.trainer.step, "round": loaded, "bytes_up": up,
            "bytes_down": down, "sync_s": sync_s, "idle_s": idle_from.elapsed().as_secs_f64(),
            "compute_s": std::mem::take(&mut self.round_compute_s),
        });
        self.log.write(record.clone())?;
        self.report(record, format!("synced round {loaded}"));
        Ok(loaded)
    }

    /// Fetches round `round` (waiting for it) or the newest and loads it; without overlap the
    /// trainer's step becomes that round's last step. Returns the payload's header (with the
    /// next round's ownership).
    fn fetch_and_load(&mut self, round: Option<u64>) -> Result<PayloadHeader> {
        // No upload of this node counted for this round: its own experts come back too.
        let ask = match round {
            Some(r) => Ask {
                skip_own: false,
                ..self.fetch_ask(r)
            },
            None => Ask::newest(),
        };
        let fetched = match self.link.fetch(&ask) {
            Ok(f) => f,
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
        let header = fetched.header.clone();
        self.load(&header, fetched.read()?, false)?;
        Ok(header)
    }

    /// Loads a fetched payload: a whole model, or a delta applied to the fp32 base this node
    /// keeps (bit-identical to the server's model, see spes-sync's `delta`). With overlap, the
    /// progress made since the upload is kept on top: θ ← global + (θ_now − θ_uploaded).
    ///
    /// Progress is kept only after this node's own upload counted (`after_upload`); otherwise
    /// the node takes the round exactly, as a refused or unknown upload did not count.
    fn load(&mut self, header: &PayloadHeader, named: Named, after_upload: bool) -> Result<()> {
        let source = format!("round {} from the server", header.round);
        let h = self.trainer.cfg.sync.sync_steps;
        // Sparse or quantized: what was not sent stays in this node's weights; overlap: so do the steps
        // trained since the upload.
        let keep_progress = after_upload
            && header.delta
            && (self.trainer.cfg.sync.wire.is_lossy()
                || self.trainer.cfg.sync.overlaps() && self.trainer.step > header.round * h);
        if header.delta {
            self.apply_delta(header, named, keep_progress, &source)?;
            // In place, unlike `MoeModel::load`, which refreshes the copies itself.
            self.trainer.model.refresh_resident();
        } else {
            self.trainer.model.load(&named, &source)?;
            drop(named);
            self.base = (self.trainer.cfg.sync.wire != Wire::Fp32)
                .then(|| Base::of(&self.trainer.model, header.round));
        }
        self.sent.clear();
        if !keep_progress {
            self.trainer.step = header.round * h;
        }
        self.bytes_down += header.total_bytes;
        self.trainer.publish_weights()
    }

    fn apply_delta(
        &mut self,
        header: &PayloadHeader,
        named: Named,
        keep_progress: bool,
        source: &str,
    ) -> Result<()> {
        let base = self
            .base
            .as_mut()
            .filter(|b| b.round + 1 == header.round)
            .with_context(|| {
                format!(
                    "{source}: a delta, but this node does not hold round {}",
                    header.round.saturating_sub(1)
                )
            })?;
        let params = self.trainer.model.params();
        let form = crate::wire_form(&self.trainer.cfg.sync);
        let mut deltas = group_deltas(named, &params, form, source)?;
        if header.skipped_own {
            for (name, d) in &self.sent {
                if self.expert_names.contains(name) {
                    deltas.entry(name.clone()).or_insert_with(|| d.share());
                }
            }
        }
        tch::no_grad(|| -> Result<()> {
            for p in &params {
                let d = deltas.get(&p.name);
                let mut theta = p.tensor.shallow_clone();
                match base.values.get_mut(&p.name) {
                    Some(b) => {
                        let progress = if keep_progress {
                            let sent = self.sent.get(&p.name).with_context(|| {
                                format!("{source}: no uploaded delta of `{}` kept", p.name)
                            })?;
                            Some(sent.subtract_from(&(&theta - &*b)))
                        } else {
                            None
                        };
                        if let Some(d) = d {
                            d.apply_(b);
                        }
                        theta.copy_(b);
                        if let Some(pr) = progress {
                            let _ = theta.g_add_(&pr);
                        }
                    }
                    None => {
                        if let Some(d) = d {
                            d.apply_(&mut theta);
                        }
                    }
                }
            }
            Ok(())
        })?;
        base.round = header.round;
        Ok(())
    }

    /// Trains and syncs until `max_steps`, tells the server, then writes `<out>/summary.json`.
    pub fn run(mut self) -> Result<NodeSummary> {
        let (max, overlap) = (
            self.trainer.cfg.train.max_steps,
            self.trainer.cfg.sync.overlaps(),
        );
        while self.trainer.step < max {
            let upload = self.train_round()?;
            // The last round is always waited for, so every node ends on the final model.
            if overlap && self.trainer.step < max {
                self.start_sync(&upload)?;
            } else {
                self.sync(&upload)?;
            }
        }
        // Every rank of this node must end on the final model too.
        self.trainer.check_ranks_in_sync()?;
        self.finish_checkpoint()?;
        self.trainer.release_followers()?;
        self.bar.finish_and_clear();
        let peer = self.peer;
        // Best effort: a server already gone has nothing left to wait for.
        let said = self.link.on_all(|_, s| {
            retry(&self.link.handle, Duration::from_secs(10), "done", || {
                let mut c = s.client.clone();
                async move { c.done(call(DoneRequest { peer: peer as u32 })).await }
            })
        });
        if let Some(Err(s)) = said.into_iter().find(|r| r.is_err()) {
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

    /// Waits for the checkpoint being written, if any.
    fn finish_checkpoint(&mut self) -> Result<()> {
        match self.checkpointing.take() {
            Some(writing) => writing
                .join()
                .map_err(|_| anyhow::anyhow!("node {}: the checkpoint writer panicked", self.peer))?
                .map(drop),
            None => Ok(()),
        }
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
    rt: &tokio::runtime::Handle,
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
                // The server already waited for an unpublished round; ask again at once.
                let waited =
                    s.code() == Code::Unavailable && refusal::kind(&s) == Some(Refused::Retry);
                if !waited {
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
        Code::Unauthenticated => anyhow::anyhow!(
            "{server} rejected this node's credential: check --credential-file (made by `spes credential` from the run secret)"
        ),
        Code::Unavailable => anyhow::anyhow!("cannot reach {server}: {}", s.message()),
        _ => anyhow::anyhow!("{server} refused: {}", s.message()),
    }
}
