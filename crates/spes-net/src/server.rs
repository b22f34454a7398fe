//! `spes server`: a gRPC shell around the spes-sync [`Coordinator`]. It creates or loads θ⁰,
//! takes uploads (validated, folded into running sums one at a time), closes rounds when every
//! node uploaded or the round timed out, persists and publishes each global model, scores it on
//! the validation split, and logs every round to `metrics.jsonl`.
//!
//! On disk under `--out`: `global/round-NNNNNN.safetensors` (the newest two rounds),
//! `server.json` (the newest published round, written after its file: the restart point),
//! `checkpoints/round-NNNNNN.safetensors` every `sync.checkpoint_every_rounds`, `incoming/`
//! (uploads being received), `pending/` (accepted uploads of the open round, re-applied after a
//! restart) and `metrics.jsonl`.

use crate::auth::CheckToken;
use crate::payload;
use crate::proto::spes_server::{Spes, SpesServer};
use crate::proto::{
    Chunk, DoneReply, DoneRequest, FetchRequest, JoinReply, JoinRequest, UploadReply,
};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use spes_data::shard::write_atomic;
use spes_data::ValWindows;
use spes_model::MoeModel;
use spes_sync::{Coordinator, Layout, MergeSchedule, Named, RoundReport, RoundRules, Scope};
use spes_train::trainer::MetricsLog;
use spes_train::{Mode, RunConfig};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Device;
use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// How to run a server.
pub struct ServerOptions {
    pub cfg: RunConfig,
    pub out: PathBuf,
    /// Required bearer token; `None` only when the operator disabled auth explicitly.
    pub token: Option<String>,
    /// PEM certificate chain and private key, to serve TLS.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    /// Initial weights (a safetensors file with this model's tensor names) instead of a fresh init.
    pub init: Option<PathBuf>,
    /// Device for scoring the published model.
    pub device: Device,
    /// After the last round, keep serving until every node said it is done or this long passed.
    pub linger_s: f64,
}

/// What a finished server reports.
#[derive(Clone, Debug, Serialize)]
pub struct ServerSummary {
    pub rounds: u64,
    pub tokens: u64,
    pub initial_val_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    pub wall_s: f64,
}

/// The restart point, rewritten atomically after each published round.
#[derive(Serialize, Deserialize)]
struct ServerState {
    format_version: u32,
    round: u64,
    file: String,
    xxh3: String,
    tokens: u64,
    initial_val_loss: Option<f64>,
}

const STATE_FILE: &str = "server.json";

/// Scores published models: validation loss, expert load, and tasks when due.
struct Evaluator {
    model: MoeModel,
    val: ValWindows,
    batch: usize,
    max_batches: usize,
    device: Device,
    tasks: Option<spes_train::task_hook::TaskHook>,
}

/// What scoring a published model found.
struct Scored {
    val_loss: f64,
    expert_load: Vec<Vec<f64>>,
    tasks: Option<serde_json::Value>,
}

impl Evaluator {
    fn score(&self, global: &Named, step: u64) -> Result<Scored> {
        self.model.load(global, "published model")?;
        let (val_loss, expert_load) = spes_train::validation_stats(
            &self.model,
            &self.val,
            self.batch,
            self.max_batches,
            self.device,
        );
        let tasks = match self.tasks.as_ref().filter(|t| t.due(step)) {
            Some(t) => Some(t.score(&self.model)?),
            None => None,
        };
        Ok(Scored {
            val_loss,
            expert_load,
            tasks,
        })
    }
}

/// Traffic and events since the last round line.
#[derive(Default)]
struct RoundIo {
    bytes_in: u64,
    bytes_out: u64,
    rejected: Vec<String>,
    /// Nodes that said they finished (kept across rounds).
    done: BTreeSet<usize>,
    round_started: f64,
}

struct State {
    cfg: RunConfig,
    out: PathBuf,
    coord: Mutex<Coordinator>,
    published: watch::Sender<u64>,
    final_round: u64,
    started: Instant,
    max_payload: u64,
    io: Mutex<RoundIo>,
    metrics: Mutex<MetricsLog>,
    eval: Option<Mutex<Evaluator>>,
    progress: Mutex<ServerState>,
}

impl State {
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn round_path(&self, round: u64) -> PathBuf {
        self.out
            .join("global")
            .join(format!("round-{round:06}.safetensors"))
    }

    /// Closes the open round if it is ready. Called after each upload and by the timer.
    fn close_if_ready(&self) -> Result<()> {
        let mut coord = self.coord.lock().unwrap();
        if !coord.ready(self.now()) {
            return Ok(());
        }
        let t0 = Instant::now();
        let report = coord.close();
        let (global, round) = coord.global();
        let global: Named = global
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        drop(coord);
        let aggregation_s = t0.elapsed().as_secs_f64();
        self.publish(&global, round)?;
        let scored = match &self.eval {
            Some(e) => Some(e.lock().unwrap().score(&global, report.step)?),
            None => None,
        };
        self.log_round(&report, aggregation_s, scored)?;
        Ok(())
    }

    /// Writes the round's file and the restart point, prunes old rounds, then announces it.
    fn publish(&self, global: &Named, round: u64) -> Result<()> {
        let path = self.round_path(round);
        payload::write(&path, global, self.cfg.sync.payload_dtype)?;
        let (_, xxh3) = payload::digest(&path)?;
        let every = self.cfg.sync.checkpoint_every_rounds;
        if round.is_multiple_of(every) || round == self.final_round {
            let ck = self
                .out
                .join("checkpoints")
                .join(format!("round-{round:06}.safetensors"));
            std::fs::copy(&path, &ck).with_context(|| format!("cannot write {}", ck.display()))?;
        }
        {
            let mut st = self.progress.lock().unwrap();
            st.round = round;
            st.file = path.file_name().unwrap().to_string_lossy().to_string();
            st.xxh3 = format!("{xxh3:016x}");
            write_atomic(
                &self.out.join(STATE_FILE),
                serde_json::to_string_pretty(&*st)?.as_bytes(),
            )?;
        }
        if round >= 2 {
            let _ = std::fs::remove_file(self.round_path(round - 2));
        }
        for peer in 0..self.cfg.sync.nodes {
            let _ = std::fs::remove_file(self.pending_path(round, peer));
        }
        self.published.send_replace(round);
        Ok(())
    }

    fn log_round(&self, r: &RoundReport, aggregation_s: f64, scored: Option<Scored>) -> Result<()> {
        let (val_loss, expert_load, tasks) = match scored {
            Some(s) => (Some(s.val_loss), Some(s.expert_load), s.tasks),
            None => (None, None, None),
        };
        let tokens = {
            let mut st = self.progress.lock().unwrap();
            st.tokens +=
                r.peers.len() as u64 * self.cfg.sync.sync_steps * self.cfg.tokens_per_step();
            st.tokens
        };
        let now = self.now();
        let io = {
            let mut io = self.io.lock().unwrap();
            let taken = std::mem::take(&mut *io);
            io.round_started = now;
            io.done = taken.done.clone();
            taken
        };
        let merges: Vec<_> = r
            .merges
            .iter()
            .map(|m| json!({"layer": m.layer, "expert": m.expert, "neighbours": m.neighbours}))
            .collect();
        self.metrics.lock().unwrap().write(json!({
            "round": r.round, "step": r.step, "tokens": tokens, "peers": r.peers,
            "missing": r.missing, "bytes_in": io.bytes_in, "bytes_out": io.bytes_out,
            "aggregation_s": aggregation_s, "round_s": now - io.round_started,
            "val_loss": val_loss, "expert_load": expert_load, "merge_alpha": r.merge_alpha,
            "merges": merges, "rejected": io.rejected, "tasks": tasks,
        }))?;
        tracing::info!(
            "round {} published: peers {:?}{}{}",
            r.round,
            r.peers,
            val_loss
                .map(|v| format!(", val_loss {v:.4}"))
                .unwrap_or_default(),
            r.merge_alpha
                .map(|a| format!(", merged {} experts with α {a:.4}", r.merges.len()))
                .unwrap_or_default()
        );
        Ok(())
    }

    fn reject(&self, peer: u32, round: u64, status: Status) -> Status {
        tracing::warn!(
            "rejected upload of peer {peer} for round {round}: {}",
            status.message()
        );
        let mut io = self.io.lock().unwrap();
        io.rejected
            .push(format!("peer {peer} round {round}: {}", status.message()));
        status
    }
}

struct Service {
    state: Arc<State>,
}

fn peer_in_range(peer: u32, peers: usize) -> Result<usize, Status> {
    let p = peer as usize;
    if p >= peers {
        return Err(Status::invalid_argument(format!(
            "peer {peer} is out of range: this run has nodes 0..{peers}"
        )));
    }
    Ok(p)
}

#[tonic::async_trait]
impl Spes for Service {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let s = &self.state;
        let peer = peer_in_range(req.get_ref().peer, s.cfg.sync.nodes)?;
        let coord = s.coord.lock().unwrap();
        let owned = (0..s.cfg.model.n_experts)
            .filter(|&e| {
                coord
                    .scope()
                    .uploads(peer, spes_model::Role::Expert { layer: 0, index: e })
            })
            .map(|e| e as u32)
            .collect();
        let published_round = coord.global().1;
        drop(coord);
        tracing::info!("node {peer} joined");
        Ok(Response::new(JoinReply {
            config_toml: toml::to_string(&s.cfg).map_err(|e| Status::internal(e.to_string()))?,
            peers: s.cfg.sync.nodes as u32,
            owned_experts: owned,
            published_round,
        }))
    }

    type FetchStream = ReceiverStream<Result<Chunk, Status>>;

    async fn fetch(
        &self,
        req: Request<FetchRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let s = self.state.clone();
        let r = req.into_inner();
        let peer = peer_in_range(r.peer, s.cfg.sync.nodes)?;
        let mut rx = s.published.subscribe();
        let round = if r.newest {
            *rx.borrow()
        } else {
            let wait = Duration::from_millis(r.wait_ms as u64);
            match tokio::time::timeout(wait, rx.wait_for(|&p| p >= r.round)).await {
                Ok(Ok(_)) => r.round,
                _ => {
                    return Err(Status::unavailable(format!(
                        "round {} is not published yet",
                        r.round
                    )))
                }
            }
        };
        let path = s.round_path(round);
        let size = std::fs::metadata(&path).map(|m| m.len()).map_err(|_| {
            Status::not_found(format!(
                "round {round} is no longer kept; the newest is {}",
                *s.published.borrow()
            ))
        })?;
        let stream =
            payload::send(&path, peer, round).map_err(|e| Status::internal(format!("{e:#}")))?;
        s.io.lock().unwrap().bytes_out += size;
        Ok(Response::new(stream))
    }

    async fn done(&self, req: Request<DoneRequest>) -> Result<Response<DoneReply>, Status> {
        let s = &self.state;
        let peer = peer_in_range(req.get_ref().peer, s.cfg.sync.nodes)?;
        s.io.lock().unwrap().done.insert(peer);
        tracing::info!("node {peer} finished");
        Ok(Response::new(DoneReply {}))
    }

    async fn upload(
        &self,
        req: Request<Streaming<Chunk>>,
    ) -> Result<Response<UploadReply>, Status> {
        let s = self.state.clone();
        let incoming = s.out.join("incoming");
        let part = incoming.join(format!(
            "upload-{}-{:x}.part",
            std::process::id(),
            xxhash_rust::xxh3::xxh3_64(&s.now().to_le_bytes())
        ));
        let received = payload::receive(req.into_inner(), &part, s.max_payload).await;
        let header = match received {
            Ok(h) => h,
            Err(e) => {
                let _ = std::fs::remove_file(&part);
                return Err(s.reject(u32::MAX, 0, e));
            }
        };
        s.io.lock().unwrap().bytes_in += header.total_bytes;
        let state = s.clone();
        let result = tokio::task::spawn_blocking(move || -> Result<UploadReply, Status> {
            let s = state;
            // The part file is removed unless accepted, when it becomes the pending copy.
            let accepted = (|| {
                let peer = peer_in_range(header.peer, s.cfg.sync.nodes)?;
                let named =
                    payload::read(&part).map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
                s.accept(peer, header.round, named, &part)
            })();
            let _ = std::fs::remove_file(&part);
            accepted?;
            s.close_if_ready()
                .map_err(|e| Status::internal(format!("{e:#}")))?;
            let round = header.round;
            let closed = *s.published.borrow() >= round;
            Ok(UploadReply {
                round,
                round_closed: closed,
            })
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        result
            .map(Response::new)
            .map_err(|e| s.reject(header.peer, header.round, e))
    }
}

impl State {
    /// After a restart: folds in the open round's uploads that were acknowledged before.
    fn reapply_pending(&self) -> Result<()> {
        let open = self.coord.lock().unwrap().round();
        for peer in 0..self.cfg.sync.nodes {
            let path = self.pending_path(open, peer);
            if path.exists() {
                let named = payload::read(&path)?;
                self.coord
                    .lock()
                    .unwrap()
                    .upload(peer, open, named, self.now())?;
                tracing::info!(
                    "re-applied the acknowledged upload of peer {peer} for round {open}"
                );
            }
        }
        for stale in std::fs::read_dir(self.out.join("pending"))? {
            let path = stale?.path();
            let keep = (0..self.cfg.sync.nodes).any(|p| path == self.pending_path(open, p));
            if !keep {
                let _ = std::fs::remove_file(path);
            }
        }
        Ok(())
    }

    fn pending_path(&self, round: u64, peer: usize) -> PathBuf {
        self.out
            .join("pending")
            .join(format!("round-{round:06}-peer-{peer}.safetensors"))
    }

    /// Folds an upload into the open round and keeps its file in `pending/` until the round is
    /// published, so an acknowledged upload survives a server crash.
    fn accept(
        &self,
        peer: usize,
        round: u64,
        named: Named,
        file: &std::path::Path,
    ) -> Result<(), Status> {
        {
            let mut coord = self.coord.lock().unwrap();
            if round != coord.round() {
                let (_, published) = coord.global();
                return Err(Status::failed_precondition(if round < coord.round() {
                    format!("round {round} is closed: fetch round {published} and continue")
                } else {
                    format!(
                        "round {round} is not open yet: collecting round {}",
                        coord.round()
                    )
                }));
            }
            if coord.uploaded().contains(&peer) {
                return Err(Status::already_exists(format!(
                    "peer {peer} already uploaded round {round}"
                )));
            }
            coord
                .upload(peer, round, named, self.now())
                .map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
            std::fs::rename(file, self.pending_path(round, peer))
                .map_err(|e| Status::internal(format!("cannot keep the upload: {e}")))?;
        }
        Ok(())
    }
}

/// Loads the restart point, or creates θ⁰ (fresh init from the seed, or `init`) as round 0.
fn initial_global(opts: &ServerOptions, model: &MoeModel) -> Result<(Named, ServerState)> {
    let state_path = opts.out.join(STATE_FILE);
    if state_path.exists() {
        let text = std::fs::read_to_string(&state_path)?;
        let st: ServerState = serde_json::from_str(&text)
            .with_context(|| format!("{} is corrupt", state_path.display()))?;
        let path = opts.out.join("global").join(&st.file);
        let (_, xxh3) = payload::digest(&path)?;
        if format!("{xxh3:016x}") != st.xxh3 {
            bail!(
                "{} is corrupt or truncated (checksum mismatch with {})",
                path.display(),
                state_path.display()
            );
        }
        model.load(&payload::read(&path)?, &path.display().to_string())?;
        tracing::info!("resuming after round {} from {}", st.round, path.display());
        return Ok((snapshot(model), st));
    }
    if let Some(init) = &opts.init {
        let named = tch::Tensor::read_safetensors(init)
            .with_context(|| format!("cannot read initial weights {}", init.display()))?;
        model.load(&named, &init.display().to_string())?;
    }
    let st = ServerState {
        format_version: 1,
        round: 0,
        file: String::new(),
        xxh3: String::new(),
        tokens: 0,
        initial_val_loss: None,
    };
    Ok((snapshot(model), st))
}

fn snapshot(model: &MoeModel) -> Named {
    model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect()
}

/// Runs a server on an already bound listener until the last round is published and fetched
/// (or `linger_s` passed), or until `shutdown` resolves.
pub async fn serve(
    opts: ServerOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<ServerSummary> {
    let cfg = opts.cfg.clone();
    let scope: Scope = crate::scope_of(&cfg)?;
    for dir in ["global", "checkpoints", "incoming", "pending"] {
        let d = opts.out.join(dir);
        std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    for stale in std::fs::read_dir(opts.out.join("incoming"))? {
        let _ = std::fs::remove_file(stale?.path());
    }
    tch::manual_seed(cfg.train.seed as i64);
    let model = MoeModel::new(&cfg.model, opts.device)?;
    let (global, mut progress) = initial_global(&opts, &model)?;
    let layout = Layout::of(&model);
    let max_payload = layout
        .entries
        .iter()
        .map(|(_, _, s)| s.iter().product::<i64>() as u64 * 4 + 256)
        .sum::<u64>()
        + (1 << 20);
    let eval = match ValWindows::open(&cfg.data.path, cfg.train.seq_len) {
        Ok(val) => Some(Mutex::new(Evaluator {
            model,
            val,
            batch: cfg.train.batch_size,
            max_batches: cfg.train.eval_batches,
            device: opts.device,
            tasks: spes_train::task_hook::TaskHook::load(&cfg, opts.device)?,
        })),
        Err(e) => {
            tracing::warn!("no validation loss on the server: {e:#}");
            None
        }
    };
    let s = &cfg.sync;
    let rules = RoundRules {
        sync_steps: s.sync_steps,
        timeout_s: s.round_timeout_s,
        merge: (s.mode == Mode::Spes).then_some(MergeSchedule {
            every: s.merge_every,
            alpha0: s.merge_alpha,
            until: s.merge_until,
            top_k: s.merge_top_k,
        }),
    };
    let published_round = progress.round;
    let fresh = progress.file.is_empty();
    let initial = match (&eval, fresh) {
        (Some(e), true) => Some(e.lock().unwrap().score(&global, 0)?),
        _ => None,
    };
    progress.initial_val_loss = progress
        .initial_val_loss
        .or(initial.as_ref().map(|s| s.val_loss));
    let metrics = MetricsLog::open(
        &opts.out,
        (!fresh).then_some(published_round * s.sync_steps),
    )?;
    let (published, _) = watch::channel(published_round);
    let state = Arc::new(State {
        final_round: cfg.train.max_steps / s.sync_steps,
        coord: Mutex::new(Coordinator::new(
            layout,
            scope,
            rules,
            global,
            published_round,
        )),
        cfg: cfg.clone(),
        out: opts.out.clone(),
        published,
        started: Instant::now(),
        max_payload,
        io: Mutex::new(RoundIo::default()),
        metrics: Mutex::new(metrics),
        eval,
        progress: Mutex::new(progress),
    });
    state.reapply_pending()?;
    if fresh {
        let (g, _) = {
            let c = state.coord.lock().unwrap();
            let (g, r) = c.global();
            (
                g.iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect::<Named>(),
                r,
            )
        };
        state.publish(&g, 0)?;
        let (val_loss, expert_load, tasks) = match initial {
            Some(s) => (Some(s.val_loss), Some(s.expert_load), s.tasks),
            None => (None, None, None),
        };
        state.metrics.lock().unwrap().write(json!({
            "round": 0, "step": 0, "tokens": 0, "val_loss": val_loss,
            "expert_load": expert_load, "tasks": tasks,
        }))?;
    }

    // Closes rounds whose timeout passed; ends the server once the last round is out.
    let ticker_state = state.clone();
    let linger = opts.linger_s;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let s = ticker_state;
        let mut done_tx = Some(done_tx);
        let mut final_at: Option<f64> = None;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let st = s.clone();
            let closed = tokio::task::spawn_blocking(move || st.close_if_ready()).await;
            if let Ok(Err(e)) = closed {
                tracing::error!("closing a round failed: {e:#}");
            }
            if *s.published.borrow() >= s.final_round {
                let now = s.now();
                let at = *final_at.get_or_insert(now);
                let all = s.io.lock().unwrap().done.len() >= s.cfg.sync.nodes;
                if all || now - at >= linger {
                    if let Some(tx) = done_tx.take() {
                        let _ = tx.send(());
                    }
                    return;
                }
            }
        }
    });

    let mut builder = tonic::transport::Server::builder();
    if let Some((cert, key)) = &opts.tls {
        let identity = tonic::transport::Identity::from_pem(cert, key);
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .context("invalid TLS certificate or key")?;
    }
    let svc = SpesServer::with_interceptor(
        Service {
            state: state.clone(),
        },
        CheckToken {
            expected: opts.token.clone(),
        },
    );
    let stop = async move {
        tokio::select! {
            _ = shutdown => {},
            _ = done_rx => {},
        }
    };
    builder
        .add_service(svc)
        .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), stop)
        .await
        .context("gRPC server failed")?;
    let st = state.progress.lock().unwrap();
    let final_val_loss = std::fs::read_to_string(opts.out.join("metrics.jsonl"))
        .ok()
        .and_then(|t| {
            t.lines()
                .rev()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find_map(|v| v["val_loss"].as_f64())
        });
    Ok(ServerSummary {
        rounds: st.round,
        tokens: st.tokens,
        initial_val_loss: st.initial_val_loss,
        final_val_loss,
        wall_s: state.started.elapsed().as_secs_f64(),
    })
}

/// Binds `listen` and runs [`serve`] on a new runtime until done or Ctrl-C.
pub fn run(opts: ServerOptions, listen: SocketAddr) -> Result<ServerSummary> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        tracing::info!("spes server listening on {}", listener.local_addr()?);
        let ctrl_c = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        serve(opts, listener, ctrl_c).await
    })
}
