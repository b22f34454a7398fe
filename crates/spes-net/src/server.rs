//! `spes server`: a gRPC shell around the spes-sync [`Coordinator`], in three parts.
//! [`open_state`] loads the restart point (falling back to the previous round if the newest file is
//! corrupt) or creates θ⁰. The round closer, a thread, closes rounds when every live node
//! uploaded or the round timed out, publishes each model durably (retrying on failure), then
//! announces it; scoring runs on another thread, after the announcement. [`serve`] sets up tonic
//! and the handlers, which check every upload's header before reading its body.
//!
//! With `--shard i/k` the server owns only `Layout::shard(i, k)` and does not score.
//!
//! On disk under `--out`: `global/round-NNNNNN.safetensors` (the newest two rounds' fp32 models)
//! with, on the delta wires, `round-NNNNNN.delta.safetensors` and one `.own-P.safetensors` per
//! owner whose experts the round published verbatim (what fetches stream),
//! `server.json` (the restart point: kept rounds with checksums and ownership, token count,
//! evicted peers), `checkpoints/round-NNNNNN.safetensors` every `sync.checkpoint_every_rounds`
//! (the newest `sync.keep_checkpoints`), `incoming/` (uploads being received), `pending/`
//! (accepted uploads of the open round, re-applied after a restart) and `metrics.jsonl`. Every
//! file is written to a temp name, fsynced and renamed, and its directory fsynced.

use crate::auth::{authorize, check_peer, AuthedPeer, CheckCredential};
use crate::proto::refusal::Kind;
use crate::proto::spes_server::{Spes, SpesServer};
use crate::proto::{
    Chunk, DoneReply, DoneRequest, FetchRequest, HeartbeatReply, JoinReply, JoinRequest,
    PayloadHeader, UploadReply,
};
use crate::{fault, payload, refusal};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use spes_data::shard::write_atomic;
use spes_data::ValWindows;
use spes_model::MoeModel;
use spes_sync::{Coordinator, Layout, Named, RoundDelta, RoundReport, Scope, Standing, Start};
use spes_train::metrics::{MergeRecord, MetricsLog, RoundClose, RoundRecord};
use spes_train::RunConfig;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Device;
use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

/// How to run a server.
pub struct ServerOptions {
    pub cfg: RunConfig,
    pub out: PathBuf,
    /// The run secret that node credentials derive from; `None` only when the operator
    /// disabled auth explicitly.
    pub secret: Option<String>,
    /// PEM certificate chain and private key, to serve TLS.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    /// Initial weights (a safetensors file with this model's tensor names) instead of a fresh init.
    pub init: Option<PathBuf>,
    /// Device for scoring the published model.
    pub device: Device,
    /// After the last round, keep serving until every node said it is done or this long passed.
    pub linger_s: f64,
    pub limits: Limits,
    /// This process is shard `.0` of `.1` (`--shard i/k`): it owns `Layout::shard(i, k)`.
    pub shard: (usize, usize),
}

/// What one client may cost the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Uploads received at once; more wait up to `slot_wait`, then are refused (retryable).
    pub max_concurrent_uploads: usize,
    pub slot_wait: Duration,
    /// A stream that sends nothing this long is cut.
    pub idle_timeout: Duration,
    /// The longest a fetch may wait for a round to be published.
    pub max_wait: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_concurrent_uploads: 4,
            slot_wait: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_wait: Duration::from_secs(60),
        }
    }
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

/// A published round as the restart point records it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct PublishedRound {
    round: u64,
    file: String,
    bytes: u64,
    xxh3: String,
    /// Training tokens of the run up to this round.
    tokens: u64,
    /// Who trains what in the round after this one (`owners` empty in DiLoCo mode).
    owners: Vec<usize>,
    members: Vec<usize>,
    /// Delta wire: the round's bf16 deltas from the round before, as files a fetch streams.
    #[serde(default)]
    parts: Vec<DeltaPart>,
    /// What the coordinator carries into the next round (outer momenta, lossy residuals).
    #[serde(default)]
    carried: Option<CarriedFile>,
}

/// The file of a round's carried state.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct CarriedFile {
    file: String,
    xxh3: String,
}

/// One file of a round's published delta.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DeltaPart {
    file: String,
    bytes: u64,
    xxh3: String,
    /// The peer whose own upload (its experts) this part holds verbatim; `None`: the rest.
    own: Option<usize>,
}

fn hex_of(x: u64) -> String {
    format!("{x:016x}")
}

fn parse_hex(x: &str) -> u64 {
    u64::from_str_radix(x, 16).unwrap_or_default()
}

/// The restart point, rewritten atomically after each published round.
#[derive(Serialize, Deserialize)]
struct ServerState {
    format_version: u32,
    /// The kept published rounds, oldest first.
    rounds: Vec<PublishedRound>,
    initial_val_loss: Option<f64>,
    gone: Vec<usize>,
    /// The newest round's metrics line without its scores, to write again after a crash.
    record: Option<RoundRecord>,
}

const STATE_FILE: &str = "server.json";
const FORMAT_VERSION: u32 = 2;

impl ServerState {
    fn newest(&self) -> &PublishedRound {
        self.rounds.last().expect("round 0 is always published")
    }

    /// Writes `<out>/server.json` atomically.
    fn save(&self, out: &Path) -> Result<()> {
        write_atomic(
            &out.join(STATE_FILE),
            serde_json::to_string_pretty(self)?.as_bytes(),
        )
    }
}

/// Scores published models: validation loss, expert load, and tasks when due.
struct Evaluator {
    model: MoeModel,
    val: ValWindows,
    batch: usize,
    max_batches: usize,
    device: Device,
    tasks: Option<spes_train::task_hook::TaskHook>,
}

impl Evaluator {
    /// Adds `val_loss`, `expert_load` and `tasks` to a round's record.
    fn score(&self, global: &Named, step: u64, record: &mut RoundRecord) -> Result<()> {
        self.model.load(global, "published model")?;
        let (val_loss, expert_load) = spes_train::validation_stats(
            &self.model,
            &self.val,
            self.batch,
            self.max_batches,
            self.device,
        );
        record.val_loss = Some(val_loss);
        record.expert_load = Some(expert_load);
        if let Some(t) = self.tasks.as_ref().filter(|t| t.due(step)) {
            record.tasks = Some(t.score(&self.model)?);
        }
        Ok(())
    }
}

/// A published round waiting to be scored and logged.
struct ScoreJob {
    step: u64,
    global: Named,
    record: RoundRecord,
}

/// Traffic and events since the last round line.
#[derive(Default)]
struct RoundIo {
    bytes_in: u64,
    bytes_out: u64,
    rejected: Vec<String>,
    /// Nodes that said they finished (kept across rounds).
    done: BTreeSet<usize>,
}

struct State {
    cfg: RunConfig,
    out: PathBuf,
    limits: Limits,
    layout: Layout,
    coord: Mutex<Coordinator>,
    clock: Instant,
    published: watch::Sender<u64>,
    progress: Mutex<ServerState>,
    io: Mutex<RoundIo>,
    upload_slots: tokio::sync::Semaphore,
    /// Wakes the round closer after an accepted upload.
    wake: mpsc::SyncSender<()>,
    final_round: u64,
    last_val_loss: Mutex<Option<f64>>,
    shard: (usize, usize),
}

/// A closed round to publish, with what the restart point records about it.
struct Publication<'a> {
    round: u64,
    global: &'a Named,
    next: &'a Scope,
    tokens: u64,
    gone: &'a BTreeSet<usize>,
    record: RoundRecord,
    /// Delta wire: what the round publishes (none for round 0).
    delta: Option<&'a RoundDelta>,
    /// [`Coordinator::carried`] after the round.
    carried: Named,
}

impl State {
    fn now(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }

    fn round_path(&self, round: u64) -> PathBuf {
        round_path(&self.out, round)
    }

    /// Writes the round durably and the restart point after it; prunes old rounds and the
    /// round's pending uploads. Safe to retry after a failure.
    fn publish(&self, p: &Publication) -> Result<()> {
        let path = self.round_path(p.round);
        let parts = match p.delta {
            Some(d) => self.write_delta(p.round, d)?,
            None => Vec::new(),
        };
        // The whole fp32 model: the restart point, and what a node without round − 1 fetches.
        let (bytes, xxh3) = payload::write(&path, p.global, tch::Kind::Float)?;
        let carried = if p.carried.is_empty() {
            None
        } else {
            let file = format!("round-{:06}.carried.safetensors", p.round);
            let (_, x) = payload::write(
                &self.out.join("global").join(&file),
                &p.carried,
                tch::Kind::Float,
            )?;
            Some(CarriedFile {
                file,
                xxh3: hex_of(x),
            })
        };
        fault::point("publish", p.round);
        let every = self.cfg.sync.checkpoint_every_rounds;
        if p.round.is_multiple_of(every) || p.round == self.final_round {
            let ck = self
                .out
                .join("checkpoints")
                .join(format!("round-{:06}.safetensors", p.round));
            copy_verified(&path, &ck, xxh3)?;
            prune_checkpoints(
                &self.out.join("checkpoints"),
                self.cfg.sync.keep_checkpoints,
            )?;
        }
        let entry = PublishedRound {
            round: p.round,
            file: path.file_name().unwrap().to_string_lossy().to_string(),
            bytes,
            xxh3: hex_of(xxh3),
            tokens: p.tokens,
            owners: p.next.owners(),
            members: p.next.members().into_iter().collect(),
            parts,
            carried,
        };
        {
            let mut st = self.progress.lock().unwrap();
            st.rounds.retain(|r| r.round < p.round);
            st.rounds.push(entry);
            let excess = st.rounds.len().saturating_sub(2);
            st.rounds.drain(..excess);
            st.gone = p.gone.iter().copied().collect();
            st.record = Some(p.record.clone());
            st.save(&self.out)?;
        }
        if p.round >= 2 {
            remove_round_files(&self.out, p.round - 2);
        }
        remove_pending(&self.out, |r| r <= p.round);
        Ok(())
    }

    /// Writes a round's delta as one part per peer whose experts it publishes verbatim, and
    /// one part with everything else.
    fn write_delta(&self, round: u64, d: &RoundDelta) -> Result<Vec<DeltaPart>> {
        let own_of: std::collections::HashMap<&str, usize> = d
            .verbatim
            .iter()
            .flat_map(|(&p, names)| names.iter().map(move |n| (n.as_str(), p)))
            .collect();
        let mut groups: Vec<(Option<usize>, Named)> = vec![(None, Vec::new())];
        groups.extend(d.verbatim.keys().map(|&p| (Some(p), Vec::new())));
        for (name, t) in &d.delta {
            let own = own_of.get(name.as_str()).copied();
            let g = groups
                .iter_mut()
                .find(|(o, _)| *o == own)
                .expect("a group per owner");
            g.1.push((name.clone(), t.shallow_clone()));
        }
        groups
            .into_iter()
            .map(|(own, named)| {
                let file = match own {
                    None => format!("round-{round:06}.delta.safetensors"),
                    Some(p) => format!("round-{round:06}.own-{p}.safetensors"),
                };
                let (bytes, xxh3) = payload::write(
                    &self.out.join("global").join(&file),
                    &named,
                    tch::Kind::BFloat16,
                )?;
                Ok(DeltaPart {
                    file,
                    bytes,
                    xxh3: hex_of(xxh3),
                    own,
                })
            })
            .collect()
    }

    fn reject(&self, peer: u32, round: u64, status: Status) -> Status {
        tracing::warn!(
            "rejected a call of peer {peer} for round {round}: {}",
            status.message()
        );
        self.io
            .lock()
            .unwrap()
            .rejected
            .push(format!("peer {peer} round {round}: {}", status.message()));
        status
    }

    /// Joins or renews `peer`'s lease. If that admitted it into the open round at once (no
    /// node was live), the newest round's record of who trains next is updated and persisted,
    /// so fetches and a restarted server see the new members.
    fn join(
        &self,
        peer: usize,
        session: u64,
        join: bool,
    ) -> Result<(Standing, Scope, u64), Status> {
        let mut coord = self.coord.lock().unwrap();
        let before = coord.scope().members();
        let standing = coord
            .join(peer, session, join, self.now())
            .map_err(|e| refusal::of_round_error(&e))?;
        let scope = coord.scope().clone();
        let published = coord.global().1;
        if scope.members() != before {
            let mut st = self.progress.lock().unwrap();
            if let Some(newest) = st.rounds.last_mut().filter(|r| r.round == published) {
                newest.owners = scope.owners();
                newest.members = scope.members().into_iter().collect();
                if let Err(e) = st.save(&self.out) {
                    tracing::error!("cannot record the new members: {e:#}");
                }
            }
        }
        Ok((standing, scope, published))
    }

    /// The kept published round `round`, if still on disk.
    fn published_round(&self, round: u64) -> Option<PublishedRound> {
        let st = self.progress.lock().unwrap();
        st.rounds.iter().find(|r| r.round == round).cloned()
    }

    fn pending_path(&self, round: u64, peer: usize) -> PathBuf {
        self.out
            .join("pending")
            .join(format!("round-{round:06}-peer-{peer}.safetensors"))
    }

    /// After a restart: folds in the open round's uploads that were acknowledged before.
    fn reapply_pending(&self) -> Result<()> {
        let mut coord = self.coord.lock().unwrap();
        let open = coord.round();
        remove_pending(&self.out, |r| r != open);
        for peer in coord.scope().members() {
            let path = self.pending_path(open, peer);
            if path.exists() {
                let now = self.now();
                let fold = |named| coord.upload(peer, 0, open, named, now);
                // Safety: as in `accept`.
                match unsafe { payload::with_mapped(&path, fold) }? {
                    Ok(()) => tracing::info!(
                        "re-applied the acknowledged upload of peer {peer} for round {open}"
                    ),
                    Err(e) => tracing::warn!("dropped a pending upload of peer {peer}: {e}"),
                }
            }
        }
        Ok(())
    }

    /// The exact payload size an upload of `peer` must announce in the open round.
    fn expected_upload_bytes(&self, scope: &Scope, peer: usize) -> u64 {
        let entries: Vec<(String, Vec<i64>, tch::Kind)> = self
            .layout
            .entries
            .iter()
            .filter(|(_, role, _)| scope.uploads(peer, *role))
            .flat_map(|(n, _, s)| spes_sync::delta::wire_entries(&self.cfg.sync, n, s))
            .collect();
        payload::expected_size(
            entries
                .iter()
                .map(|(n, s, k)| (n.as_str(), s.as_slice(), *k)),
        )
    }
}

fn round_path(out: &Path, round: u64) -> PathBuf {
    out.join("global")
        .join(format!("round-{round:06}.safetensors"))
}

/// Removes a round's model and delta files.
fn remove_round_files(out: &Path, round: u64) {
    let prefix = format!("round-{round:06}.");
    let Ok(entries) = std::fs::read_dir(out.join("global")) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Removes pending uploads whose round matches `drop`.
fn remove_pending(out: &Path, drop: impl Fn(u64) -> bool) {
    let Ok(entries) = std::fs::read_dir(out.join("pending")) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let round = name
            .strip_prefix("round-")
            .and_then(|r| r.get(..6))
            .and_then(|r| r.parse::<u64>().ok());
        if round.is_none_or(&drop) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Deletes all but the newest `keep` `round-NNNNNN.safetensors` in `dir` (0: keeps all).
fn prune_checkpoints(dir: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let mut rounds: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| {
            let path = e.ok()?.path();
            let name = path.file_name()?.to_str()?;
            let round = name
                .strip_prefix("round-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()?;
            Some((round, path))
        })
        .collect();
    rounds.sort();
    for (_, path) in rounds.iter().rev().skip(keep) {
        std::fs::remove_file(path).with_context(|| format!("cannot delete {}", path.display()))?;
    }
    Ok(())
}

/// Copies `from` to `to` through a temp file, checks the copy's checksum, fsyncs, renames.
fn copy_verified(from: &Path, to: &Path, xxh3: u64) -> Result<()> {
    let mut tmp = to.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::copy(from, &tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::File::open(&tmp)?.sync_all()?;
    let (_, got) = payload::digest(&tmp)?;
    if got != xxh3 {
        let _ = std::fs::remove_file(&tmp);
        anyhow::bail!(
            "the copy {} does not match {}",
            tmp.display(),
            from.display()
        );
    }
    std::fs::rename(&tmp, to).with_context(|| format!("cannot write {}", to.display()))?;
    spes_data::shard::sync_dir(to)?;
    Ok(())
}

struct Service {
    state: Arc<State>,
}

fn standing_from(standing: Standing) -> u64 {
    match standing {
        Standing::Member => 0,
        Standing::Joining { from } => from,
    }
}

#[tonic::async_trait]
impl Spes for Service {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let s = &self.state;
        let peer = authorize(&req, req.get_ref().peer)?;
        let r = req.get_ref();
        let (standing, scope, published_round) = s.join(peer, r.session, r.join)?;
        let owned = (0..s.cfg.model.n_experts)
            .filter(|&e| {
                standing == Standing::Member
                    && scope.uploads(peer, spes_model::Role::Expert { layer: 0, index: e })
            })
            .map(|e| e as u32)
            .collect();
        match standing {
            Standing::Member => tracing::info!("node {peer} joined"),
            Standing::Joining { from } => {
                tracing::info!("node {peer} joins the run from round {from}")
            }
        }
        Ok(Response::new(JoinReply {
            config_toml: toml::to_string(&s.cfg).map_err(|e| Status::internal(e.to_string()))?,
            peers: scope.members().len() as u32,
            owned_experts: owned,
            published_round,
            lease_ms: (s.cfg.sync.lease_s * 1000.0) as u64,
            member_from: standing_from(standing),
            shard: s.shard.0 as u32,
            shards: s.shard.1 as u32,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<JoinRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let s = &self.state;
        let peer = authorize(&req, req.get_ref().peer)?;
        let (standing, _, published_round) = s.join(peer, req.get_ref().session, false)?;
        Ok(Response::new(HeartbeatReply {
            published_round,
            member_from: standing_from(standing),
        }))
    }

    type FetchStream = ReceiverStream<Result<Chunk, Status>>;

    async fn fetch(
        &self,
        req: Request<FetchRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let s = self.state.clone();
        let peer = authorize(&req, req.get_ref().peer)?;
        let r = req.into_inner();
        let mut rx = s.published.subscribe();
        let round = if r.newest {
            *rx.borrow()
        } else {
            let wait = Duration::from_millis(r.wait_ms as u64).min(s.limits.max_wait);
            match tokio::time::timeout(wait, rx.wait_for(|&p| p >= r.round)).await {
                Ok(Ok(_)) => r.round,
                _ => {
                    return Err(refusal::status(
                        Code::Unavailable,
                        Kind::Retry,
                        r.round,
                        format!("round {} is not published yet", r.round),
                    ))
                }
            }
        };
        let Some(meta) = s.published_round(round) else {
            return Err(Status::not_found(format!(
                "round {round} is no longer kept; the newest is {}",
                *s.published.borrow()
            )));
        };
        // A delta only for a node that holds the round before it, exactly.
        let as_delta = r.have_previous && round == r.round && !meta.parts.is_empty();
        let skip = |p: &DeltaPart| r.skip_own && p.own == Some(peer);
        let (files, parts, skipped_own): (Vec<_>, Vec<_>, _) = if as_delta {
            let sent: Vec<&DeltaPart> = meta.parts.iter().filter(|p| !skip(p)).collect();
            (
                sent.iter()
                    .map(|p| s.out.join("global").join(&p.file))
                    .collect(),
                sent.iter()
                    .map(|p| payload::part(p.bytes, parse_hex(&p.xxh3)))
                    .collect(),
                meta.parts.iter().any(skip),
            )
        } else {
            (
                vec![s.round_path(round)],
                vec![payload::part(meta.bytes, parse_hex(&meta.xxh3))],
                false,
            )
        };
        let header = PayloadHeader {
            peer: peer as u32,
            round,
            total_bytes: parts.iter().map(|p| p.bytes).sum(),
            parts,
            session: 0,
            owners: meta.owners.iter().map(|&o| o as u32).collect(),
            members: meta.members.iter().map(|&m| m as u32).collect(),
            delta: as_delta,
            skipped_own,
        };
        s.io.lock().unwrap().bytes_out += header.total_bytes;
        Ok(Response::new(payload::send(files, header, |_| {})))
    }

    async fn done(&self, req: Request<DoneRequest>) -> Result<Response<DoneReply>, Status> {
        let s = &self.state;
        let peer = authorize(&req, req.get_ref().peer)?;
        s.io.lock().unwrap().done.insert(peer);
        tracing::info!("node {peer} finished");
        Ok(Response::new(DoneReply {}))
    }

    async fn upload(
        &self,
        req: Request<Streaming<Chunk>>,
    ) -> Result<Response<UploadReply>, Status> {
        let s = self.state.clone();
        let idle = s.limits.idle_timeout;
        let authed = req.extensions().get::<AuthedPeer>().copied();
        let mut stream = req.into_inner();
        let mut claimed = (u32::MAX, 0);
        let result = async {
            let header = payload::read_header(&mut stream, idle).await?;
            claimed = (header.peer, header.round);
            let peer = check_peer(authed, header.peer)?;
            // Everything the header allows is checked before any data is read.
            let expected = {
                let mut coord = s.coord.lock().unwrap();
                coord
                    .check_upload(peer, header.session, header.round, s.now())
                    .map_err(|e| refusal::of_round_error(&e))?;
                s.expected_upload_bytes(coord.scope(), peer)
            };
            if header.total_bytes != expected {
                return Err(refusal::status(
                    Code::InvalidArgument,
                    Kind::Invalid,
                    0,
                    format!(
                        "upload announces {} bytes; peer {peer}'s tensors take exactly {expected}",
                        header.total_bytes
                    ),
                ));
            }
            let _slot = tokio::time::timeout(s.limits.slot_wait, s.upload_slots.acquire())
                .await
                .map_err(|_| {
                    refusal::status(
                        Code::ResourceExhausted,
                        Kind::Retry,
                        0,
                        "every upload slot is busy; try again",
                    )
                })?
                .map_err(|_| Status::unavailable("the server is stopping"))?;
            let part = s.out.join("incoming").join(format!(
                "round-{:06}-peer-{peer}-{:016x}.part",
                header.round,
                rand::random::<u64>()
            ));
            if let Err(e) = payload::receive_body(&mut stream, &part, &header, idle).await {
                let _ = std::fs::remove_file(&part);
                return Err(e);
            }
            s.io.lock().unwrap().bytes_in += header.total_bytes;
            let state = s.clone();
            let round = header.round;
            tokio::task::spawn_blocking(move || state.accept(peer, &header, &part))
                .await
                .map_err(|e| Status::internal(e.to_string()))??;
            let _ = s.wake.try_send(());
            Ok(UploadReply { round })
        }
        .await;
        result
            .map(Response::new)
            .map_err(|e| s.reject(claimed.0, claimed.1, e))
    }
}

impl State {
    /// Parses a received upload, folds it into the open round and keeps its file in
    /// `pending/` until the round is published, so an acknowledged upload survives a crash.
    fn accept(&self, peer: usize, header: &PayloadHeader, part: &Path) -> Result<(), Status> {
        let accepted = (|| {
            let mut coord = self.coord.lock().unwrap();
            let now = self.now();
            let fold = |named| coord.upload(peer, header.session, header.round, named, now);
            // Safety: `Coordinator::upload` keeps none of an upload's storage, and `part` is
            // this call's own file.
            unsafe { payload::with_mapped(part, fold) }
                .map_err(|e| {
                    refusal::status(Code::InvalidArgument, Kind::Invalid, 0, format!("{e:#}"))
                })?
                .map_err(|e| refusal::of_round_error(&e))?;
            let kept = self.pending_path(header.round, peer);
            std::fs::rename(part, &kept)
                .and_then(|_| spes_data::shard::sync_dir(&kept))
                .map_err(|e| Status::internal(format!("cannot keep the upload: {e}")))
        })();
        let _ = std::fs::remove_file(part);
        accepted
    }
}

/// What [`open_state`] found or made.
struct Opened {
    model: MoeModel,
    /// The tensors this server (shard) owns.
    layout: Layout,
    global: Named,
    /// The newest round's [`Coordinator::carried`].
    carried: Named,
    progress: ServerState,
    fresh: bool,
}

/// Loads the newest intact published round (falling back to the previous one if the newest
/// file is corrupt), or creates θ⁰ (fresh init from the seed, or `init`) as round 0.
fn open_state(opts: &ServerOptions) -> Result<Opened> {
    for dir in ["global", "checkpoints", "incoming", "pending"] {
        let d = opts.out.join(dir);
        std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    for stale in std::fs::read_dir(opts.out.join("incoming"))? {
        let _ = std::fs::remove_file(stale?.path());
    }
    let model = {
        let _rng = crate::INIT_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(opts.cfg.train.seed as i64);
        MoeModel::new(&opts.cfg.model, opts.device)?
    };
    let (i, k) = opts.shard;
    let layout = Layout::of(&model).shard(i, k);
    let state_path = opts.out.join(STATE_FILE);
    if state_path.exists() {
        let text = std::fs::read_to_string(&state_path)?;
        let mut st: ServerState = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is corrupt or from an older spes (expected format_version {FORMAT_VERSION})",
                state_path.display()
            )
        })?;
        while let Some(newest) = st.rounds.last().cloned() {
            let path = opts.out.join("global").join(&newest.file);
            let loaded = intact(&path, &newest.xxh3)
                .then(|| payload::read(&path).and_then(|named| in_layout(&layout, named, &path)))
                .and_then(Result::ok);
            let carried = match &newest.carried {
                None => Some(Vec::new()),
                Some(c) => {
                    let path = opts.out.join("global").join(&c.file);
                    intact(&path, &c.xxh3)
                        .then(|| payload::read(&path).ok())
                        .flatten()
                }
            };
            if let (Some(global), Some(carried)) = (loaded, carried) {
                tracing::info!(
                    "resuming after round {} from {}",
                    newest.round,
                    path.display()
                );
                return Ok(Opened {
                    model,
                    layout,
                    global,
                    carried,
                    progress: st,
                    fresh: false,
                });
            }
            st.rounds.pop();
            st.record = None;
            tracing::error!(
                "{} or its carried state is missing or corrupt; falling back to the round before it",
                path.display()
            );
            st.save(&opts.out)?;
        }
        anyhow::bail!(
            "{}: no published round is intact; move --out aside to start over",
            state_path.display()
        );
    }
    if let Some(init) = &opts.init {
        let named = tch::Tensor::read_safetensors(init)
            .with_context(|| format!("cannot read initial weights {}", init.display()))?;
        model.load(&named, &init.display().to_string())?;
    }
    let global = snapshot(&model)
        .into_iter()
        .filter(|(n, _)| layout.holds(n))
        .collect();
    let st = ServerState {
        format_version: FORMAT_VERSION,
        rounds: Vec::new(),
        initial_val_loss: None,
        gone: Vec::new(),
        record: None,
    };
    Ok(Opened {
        model,
        layout,
        global,
        carried: Vec::new(),
        progress: st,
        fresh: true,
    })
}

/// Whether the file at `path` exists and has checksum `xxh3` (hex).
fn intact(path: &Path, xxh3: &str) -> bool {
    payload::digest(path)
        .ok()
        .is_some_and(|(_, x)| hex_of(x) == xxh3)
}

/// `named` in `layout`'s order, if it holds exactly the layout's tensors with their shapes.
fn in_layout(layout: &Layout, named: Named, path: &Path) -> Result<Named> {
    let mut by_name: std::collections::HashMap<String, tch::Tensor> = named.into_iter().collect();
    let out = layout
        .entries
        .iter()
        .map(|(name, _, shape)| match by_name.remove(name) {
            Some(t) if t.size() == *shape => Ok((name.clone(), t.to_kind(tch::Kind::Float))),
            _ => anyhow::bail!("{}: `{name}` is missing or misshapen", path.display()),
        })
        .collect::<Result<Named>>()?;
    if let Some(extra) = by_name.keys().next() {
        anyhow::bail!("{}: unexpected tensor `{extra}`", path.display());
    }
    Ok(out)
}

fn snapshot(model: &MoeModel) -> Named {
    model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect()
}

fn shallow(named: &Named) -> Named {
    named
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect()
}

/// The metrics line of a closed round, before scoring.
fn round_record(
    r: &RoundReport,
    tokens: u64,
    io: RoundIo,
    aggregation_s: f64,
    round_s: f64,
) -> RoundRecord {
    RoundRecord {
        round: r.round,
        step: r.step,
        tokens,
        members: r.members.clone(),
        owners: r.owners.clone(),
        close: Some(RoundClose {
            peers: r.peers.clone(),
            missing: r.missing.clone(),
            evicted: r.evicted.clone(),
            joined: r.joined.clone(),
            discarded: r.discarded.clone(),
            bytes_in: io.bytes_in,
            bytes_out: io.bytes_out,
            aggregation_s,
            round_s,
            merge_alpha: r.merge_alpha,
            merges: r
                .merges
                .iter()
                .map(|m| MergeRecord {
                    layer: m.layer,
                    expert: m.expert,
                    neighbours: m.neighbours.clone(),
                })
                .collect(),
            rejected: io.rejected,
            outer_scale: r.outer_scale,
        }),
        ..RoundRecord::default()
    }
}

/// The round closer: closes ready rounds, publishes them (retrying until it works), announces
/// them and hands them to the scorer; says every minute when no node is alive; signals `done`
/// once the last round is out and every member said it finished (or `linger_s` passed).
fn run_closer(
    s: Arc<State>,
    wake: mpsc::Receiver<()>,
    scorer: mpsc::Sender<ScoreJob>,
    stop: Arc<AtomicBool>,
    done: tokio::sync::oneshot::Sender<()>,
    linger_s: f64,
) {
    let mut final_at: Option<f64> = None;
    let mut opened_at = s.now();
    let mut last_alone_warning = f64::NEG_INFINITY;
    while !stop.load(Ordering::Relaxed) {
        let _ = wake.recv_timeout(Duration::from_millis(100));
        let now = s.now();
        let closed = {
            let mut coord = s.coord.lock().unwrap();
            if coord.live_members(now).is_empty() && now - last_alone_warning >= 60.0 {
                last_alone_warning = now;
                tracing::warn!(
                    "no node is alive: round {} stays open, state kept; waiting for nodes to (re)join",
                    coord.round()
                );
            }
            if coord.ready(now) {
                let t0 = Instant::now();
                let report = coord.close(now);
                let global = shallow(coord.global().0);
                let delta = coord.delta().map(|d| RoundDelta {
                    delta: shallow(&d.delta),
                    verbatim: d.verbatim.clone(),
                });
                Some((
                    report,
                    global,
                    delta,
                    coord.carried(),
                    coord.scope().clone(),
                    coord.gone().clone(),
                    t0.elapsed().as_secs_f64(),
                ))
            } else {
                None
            }
        };
        if let Some((report, global, delta, carried, next, gone, aggregation_s)) = closed {
            let tokens = s.progress.lock().unwrap().newest().tokens
                + report.peers.len() as u64 * s.cfg.sync.sync_steps * s.cfg.tokens_per_step();
            let io = {
                let mut io = s.io.lock().unwrap();
                let done = io.done.clone();
                let taken = std::mem::take(&mut *io);
                io.done = done;
                taken
            };
            let record = round_record(&report, tokens, io, aggregation_s, now - opened_at);
            let publication = Publication {
                round: report.round,
                global: &global,
                next: &next,
                tokens,
                gone: &gone,
                record: record.clone(),
                delta: delta.as_ref(),
                carried,
            };
            let mut pause = Duration::from_millis(500);
            while let Err(e) = s.publish(&publication) {
                tracing::error!(
                    "publishing round {} failed, retrying in {:.1} s: {e:#}",
                    report.round,
                    pause.as_secs_f64()
                );
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(30));
                if stop.load(Ordering::Relaxed) {
                    return;
                }
            }
            s.published.send_replace(report.round);
            opened_at = s.now();
            tracing::info!(
                "round {} published: peers {:?}{}{}{}",
                report.round,
                report.peers,
                report
                    .merge_alpha
                    .map(|a| format!(", merged {} experts with α {a:.4}", report.merges.len()))
                    .unwrap_or_default(),
                if report.evicted.is_empty() {
                    String::new()
                } else {
                    format!(", evicted {:?}", report.evicted)
                },
                if report.joined.is_empty() {
                    String::new()
                } else {
                    format!(", admitted {:?}", report.joined)
                },
            );
            let _ = scorer.send(ScoreJob {
                step: report.step,
                global,
                record,
            });
        }
        if *s.published.borrow() >= s.final_round {
            let now = s.now();
            let at = *final_at.get_or_insert(now);
            let members = s.coord.lock().unwrap().scope().members();
            let all = members.is_subset(&s.io.lock().unwrap().done);
            if all || now - at >= linger_s {
                let _ = done.send(());
                return;
            }
        }
    }
}

/// Scores and logs published rounds in order, on its own thread.
fn run_scorer(
    s: Arc<State>,
    eval: Option<Evaluator>,
    jobs: mpsc::Receiver<ScoreJob>,
    mut metrics: MetricsLog,
) {
    for mut job in jobs {
        if let Some(e) = &eval {
            if let Err(err) = e.score(&job.global, job.step, &mut job.record) {
                tracing::error!("scoring round {} failed: {err:#}", job.record.round);
            }
        }
        if let Some(v) = job.record.val_loss {
            *s.last_val_loss.lock().unwrap() = Some(v);
            if job.record.round == 0 {
                s.progress.lock().unwrap().initial_val_loss = Some(v);
            }
        }
        if let Err(e) = metrics.write(&job.record) {
            tracing::error!("cannot write metrics.jsonl: {e:#}");
        }
    }
}

/// Runs a server on an already bound listener until the last round is published and fetched
/// (or `linger_s` passed), or until `shutdown` resolves.
pub async fn serve(
    opts: ServerOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<ServerSummary> {
    let cfg = opts.cfg.clone();
    let opened = open_state(&opts)?;
    let layout = opened.layout.clone();
    let (scope, published_round, gone) = match opened.progress.rounds.last() {
        Some(newest) => (
            Scope::from_lists(&newest.owners, &newest.members)?,
            newest.round,
            opened.progress.gone.iter().copied().collect(),
        ),
        None => (cfg.sync.scope(cfg.model.n_experts)?, 0, BTreeSet::new()),
    };
    let eval = match ValWindows::open(&cfg.data.path, cfg.train.seq_len) {
        // A shard holds part of the model; score with `spes eval` on a node's checkpoint.
        Ok(_) if opts.shard.1 > 1 => None,
        Ok(val) => Some(Evaluator {
            model: opened.model,
            val,
            batch: cfg.train.batch_size,
            max_batches: cfg.train.eval_batches,
            device: opts.device,
            tasks: spes_train::task_hook::TaskHook::load(&cfg, opts.device)?,
        }),
        Err(e) => {
            tracing::warn!("no validation loss on the server: {e:#}");
            None
        }
    };
    let metrics = MetricsLog::open(
        &opts.out,
        (!opened.fresh).then_some(published_round * cfg.sync.sync_steps),
    )?;
    let logged = last_logged_round(&opts.out);
    let (published, _) = watch::channel(published_round);
    let (wake_tx, wake_rx) = mpsc::sync_channel(1);
    let clock = Instant::now();
    let mut progress = opened.progress;
    if progress.initial_val_loss.is_none() {
        progress.initial_val_loss = logged.as_ref().and_then(|l| l.initial_val_loss);
    }
    // The fastest-moving tensors bound the check: experts step at lr · expert_lr_scale.
    let peak_lr = cfg.train.lr * cfg.train.expert_lr_scale.max(1.0);
    let mut coord = Coordinator::new(
        layout.clone(),
        scope.clone(),
        cfg.sync.clone(),
        cfg.sync.max_update_rms(peak_lr),
        Start {
            global: shallow(&opened.global),
            published: published_round,
            gone,
        },
        0.0,
    );
    coord
        .restore_carried(opened.carried)
        .map_err(|e| anyhow::anyhow!("round {published_round}'s carried state: {e}"))?;
    let state = Arc::new(State {
        final_round: cfg.train.max_steps / cfg.sync.sync_steps,
        coord: Mutex::new(coord),
        layout,
        limits: opts.limits,
        cfg: cfg.clone(),
        out: opts.out.clone(),
        published,
        clock,
        progress: Mutex::new(progress),
        io: Mutex::new(RoundIo::default()),
        upload_slots: tokio::sync::Semaphore::new(opts.limits.max_concurrent_uploads.max(1)),
        wake: wake_tx,
        last_val_loss: Mutex::new(logged.as_ref().and_then(|l| l.val_loss)),
        shard: opts.shard,
    });
    let (score_tx, score_rx) = mpsc::channel();
    if opened.fresh {
        let record = RoundRecord {
            members: scope.members().into_iter().collect(),
            owners: scope.owners(),
            ..RoundRecord::default()
        };
        state.publish(&Publication {
            round: 0,
            global: &opened.global,
            next: &scope,
            tokens: 0,
            gone: &BTreeSet::new(),
            record: record.clone(),
            delta: None,
            carried: Vec::new(),
        })?;
        let _ = score_tx.send(ScoreJob {
            step: 0,
            global: opened.global,
            record,
        });
    } else if logged.as_ref().is_none_or(|l| l.round < published_round) {
        // Crashed after publishing, before logging: log the round again from the restart point.
        let record = state.progress.lock().unwrap().record.clone();
        if let Some(record) = record.filter(|r| r.round == published_round) {
            let _ = score_tx.send(ScoreJob {
                step: published_round * cfg.sync.sync_steps,
                global: opened.global,
                record,
            });
        }
    }
    state.reapply_pending()?;

    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let closer = {
        let (s, stop) = (state.clone(), stop.clone());
        let linger = opts.linger_s;
        let score_tx = score_tx.clone();
        std::thread::spawn(move || run_closer(s, wake_rx, score_tx, stop, done_tx, linger))
    };
    drop(score_tx);
    let scorer = {
        let s = state.clone();
        std::thread::spawn(move || run_scorer(s, eval, score_rx, metrics))
    };

    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_keepalive(Some(Duration::from_secs(30)));
    if let Some((cert, key)) = &opts.tls {
        let identity = tonic::transport::Identity::from_pem(cert, key);
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .context("invalid TLS certificate or key")?;
    }
    let svc = tonic::service::interceptor::InterceptedService::new(
        SpesServer::new(Service {
            state: state.clone(),
        })
        .max_decoding_message_size(payload::MAX_MESSAGE_BYTES),
        CheckCredential {
            secret: opts.secret.clone(),
        },
    );
    let stop_serving = async move {
        tokio::select! {
            _ = shutdown => {},
            _ = done_rx => {},
        }
    };
    let served = builder
        .add_service(svc)
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            stop_serving,
        )
        .await
        .context("gRPC server failed");
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || {
        let _ = closer.join();
        let _ = scorer.join();
    })
    .await;
    served?;
    let final_val_loss = *state.last_val_loss.lock().unwrap();
    let st = state.progress.lock().unwrap();
    let newest = st.newest();
    let summary = ServerSummary {
        rounds: newest.round,
        tokens: newest.tokens,
        initial_val_loss: st.initial_val_loss,
        final_val_loss,
        wall_s: state.clock.elapsed().as_secs_f64(),
    };
    Ok(summary)
}

/// The newest round logged in `metrics.jsonl`, its validation loss, and round 0's.
struct Logged {
    round: u64,
    val_loss: Option<f64>,
    initial_val_loss: Option<f64>,
}

fn last_logged_round(out: &Path) -> Option<Logged> {
    let lines: Vec<RoundRecord> = spes_train::metrics::read(&out.join("metrics.jsonl"));
    let last = lines.last()?;
    Some(Logged {
        round: last.round,
        val_loss: lines.iter().rev().find_map(|r| r.val_loss),
        initial_val_loss: lines.iter().find(|r| r.round == 0).and_then(|r| r.val_loss),
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
