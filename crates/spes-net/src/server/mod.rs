//! `spes server`: a gRPC shell around the spes-sync [`Coordinator`]. `store` keeps its state on
//! disk and restarts into it (docs/design/server-state.md); `closer` closes, publishes and
//! scores rounds on their own threads; `service` is the gRPC handlers, which check every
//! upload's header before reading its body. [`serve`] wires them together.
//!
//! With `--shard i/k` the server owns only `Layout::shard(i, k)` and does not score.

mod closer;
mod mirror;
mod progress;
mod service;
mod status;
mod store;

use crate::auth::CheckCredential;
use crate::choose::Chooser;
use crate::proto::spes_server::SpesServer;
use crate::settings::{self, Choices};
use crate::view::http::{Endpoints, HttpOptions};
use crate::view::{History, Watch};
use crate::{payload, refusal};
use anyhow::{Context, Result};
use closer::{run_closer, run_scorer, shallow, Evaluator, RoundIo, ScoreJob, Settle};
use mirror::Mirror;
use progress::Progress;
use serde::Serialize;
use service::Service;
use spes_data::ValWindows;
use spes_model::Role;
use spes_sync::delta::WirePart;
use spes_sync::{Coordinator, Layout, RoundSettings, Scope, Standing, Start};
use spes_train::config::Partition;
use spes_train::metrics::{MetricsLog, RoundRecord};
use spes_train::RunConfig;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use store::{Publication, Store, Stored};
use tch::Device;
use tokio::sync::watch;
use tonic::Status;

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
    /// The operator's HTTP listener (live page, `/api/run`, `/metrics`), already bound.
    pub http: Option<(std::net::TcpListener, HttpOptions)>,
    /// The object store the run's state is kept in besides `out` (`--store`), checked already.
    pub store: Option<spes_store::RunStore>,
    /// An adaptive run's choices to take instead of choosing (`--replay-choices`, read and
    /// checked already): a rerun reproduces the run they were recorded in.
    pub replay: Option<Choices>,
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
    /// How long a presigned URL of the store a fetch hands out stays valid.
    pub url_lifetime: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_concurrent_uploads: 4,
            slot_wait: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_wait: Duration::from_secs(60),
            url_lifetime: Duration::from_secs(600),
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

/// What the handlers, the round closer and the scorer share. Lock order: `coord` → `progress`
/// → `io` → `watch`, each held for memory work only (no file is written under `coord`;
/// `progress` writes `server.json` under its own writer lock, with none of these held);
/// `served` alone.
struct State {
    cfg: RunConfig,
    store: Store,
    limits: Limits,
    layout: Layout,
    coord: Mutex<Coordinator>,
    clock: Instant,
    published: watch::Sender<u64>,
    progress: Progress,
    io: Mutex<RoundIo>,
    upload_slots: tokio::sync::Semaphore,
    /// Wakes the round closer after an accepted upload.
    wake: mpsc::SyncSender<()>,
    final_round: u64,
    shard: (usize, usize),
    /// The newest round's whole model, written when a fetch first asks for it.
    served: Mutex<Option<Served>>,
    /// Of the server's data's tokenizer (hex), for nodes to check theirs; empty without data.
    tokenizer_xxh3: String,
    /// What the operator's view shows beyond the coordinator's state.
    watch: Mutex<Watch>,
    /// How the next rounds' settings are decided: the closer's, read by the operator's view.
    settle: Mutex<Settle>,
}

/// The newest round's whole model as written for fetches, and whether it is in the store.
struct Served {
    round: u64,
    stored: Stored,
    in_store: InStore,
}

#[derive(Clone, Copy, PartialEq)]
enum InStore {
    No,
    Putting,
    Yes,
}

impl State {
    /// Whether round `round` is published with its whole model, `since_full_s` after the last
    /// one was: every round of the fp32 wire, every `sync.checkpoint_every_rounds`, once
    /// `sync.checkpoint_every_s` passed, and the last.
    fn full_round(&self, round: u64, since_full_s: f64) -> bool {
        let s = &self.cfg.sync;
        !s.wire().is_delta()
            || (s.checkpoint_every_rounds > 0 && round.is_multiple_of(s.checkpoint_every_rounds))
            || (s.checkpoint_every_s > 0.0 && since_full_s >= s.checkpoint_every_s)
            || round >= self.final_round
    }

    /// The whole model of published round `round`, as a stored file: its checkpoint, or, for
    /// the newest round, a file written now from memory (once; a joiner or a node that fell
    /// behind asks for it).
    fn whole_model(&self, round: u64) -> Option<Stored> {
        let stored = (self.progress.read().0.fulls.iter())
            .find(|f| f.round == round)
            .map(|f| f.model.clone());
        if stored.is_some() {
            return stored;
        }
        let mut served = self.served.lock().unwrap();
        if let Some(s) = served.as_ref().filter(|s| s.round == round) {
            return Some(s.stored.clone());
        }
        let global = {
            let coord = self.coord.lock().unwrap();
            let (global, newest) = coord.global();
            (newest == round).then(|| closer::shallow(global))?
        };
        let file = format!("global/round-{round:06}.model.safetensors");
        let stored = match self.store.write_local(&file, &global, tch::Kind::Float) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("cannot write round {round}'s model for a fetch: {e:#}");
                return None;
            }
        };
        let new = Served {
            round,
            stored: stored.clone(),
            in_store: InStore::No,
        };
        let old = served.replace(new);
        drop(served);
        if let Some(old) = old {
            let _ = std::fs::remove_file(self.store.out.join(&old.stored.file));
            if let (InStore::Yes, Some(m)) = (old.in_store, &self.store.mirror) {
                m.delete(&old.stored.file);
            }
        }
        Some(stored)
    }

    /// A presigned URL of `file` (relative to `--out`) in the store, for a fetch; `None`
    /// without a store that presigns, or when the store fails (the fetch streams the file).
    fn link(&self, file: &str) -> Option<String> {
        let m = self.store.mirror.as_ref().filter(|m| m.presigns())?;
        // The whole model written for fetches goes to the store when first linked, by that
        // fetch, outside the lock; fetches meanwhile stream it.
        let to_put = {
            let mut served = self.served.lock().unwrap();
            match served.as_mut().filter(|s| s.stored.file == file) {
                Some(s) if s.in_store == InStore::Putting => return None,
                Some(s) if s.in_store == InStore::No => {
                    s.in_store = InStore::Putting;
                    true
                }
                _ => false,
            }
        };
        if to_put {
            let put = m.put(&self.store.out, file);
            let mut served = self.served.lock().unwrap();
            let ours = served.as_mut().filter(|s| s.stored.file == file);
            match (put, ours) {
                (Ok(()), Some(s)) => s.in_store = InStore::Yes,
                (Err(e), ours) => {
                    if let Some(s) = ours {
                        s.in_store = InStore::No;
                    }
                    tracing::warn!("cannot put {file} in the store for a fetch: {e:#}");
                    return None;
                }
                // Replaced meanwhile by a newer round's model: this one is not kept.
                (Ok(()), None) => {
                    drop(served);
                    m.delete(file);
                    return None;
                }
            }
        }
        m.presign(file, self.limits.url_lifetime)
    }

    fn now(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }

    /// Refuses a node too old to follow settings that change between rounds, in a run whose
    /// settings do.
    fn check_protocol(&self, peer: usize, protocol: u32) -> Result<(), Status> {
        if protocol >= settings::PROTOCOL || !self.cfg.sync.adaptive() {
            return Ok(());
        }
        Err(self.reject(
            peer as u32,
            0,
            refusal::status(
                tonic::Code::FailedPrecondition,
                crate::proto::refusal::Kind::TooOld,
                0,
                format!(
                    "this run's wire or overlap changes between rounds (sync.wire or sync.overlap_steps = \"adaptive\"); node {peer} speaks protocol {protocol}, which does not follow them: upgrade its spes"
                ),
            ),
        ))
    }

    fn reject(&self, peer: u32, round: u64, status: Status) -> Status {
        tracing::warn!(
            "rejected a call of peer {peer} for round {round}: {}",
            status.message()
        );
        let text = format!("peer {peer} round {round}: {}", status.message());
        self.io.lock().unwrap().rejected.push(text.clone());
        let reason = match refusal::kind(&status) {
            Some(kind) => kind.as_str_name().to_lowercase(),
            None => format!("{:?}", status.code()).to_lowercase(),
        };
        let peer = (peer != u32::MAX).then_some(peer as usize);
        self.watch
            .lock()
            .unwrap()
            .refused(peer, round, &reason, text);
        status
    }

    /// Joins or renews `peer`'s lease; returns its standing, the open round's scope and
    /// settings and the newest published round. If that changed who trains the open round (a node
    /// admitted at once because none was live), the newest round's record of who trains next
    /// is updated, so fetches and a restarted server see it.
    /// With `data.partition = "disjoint"`, a join first claims the data parts the node
    /// declares (`parts`, `None` for a heartbeat), refused while another live node reads one.
    /// A cap the node declares (`max_experts`) is kept with the restart point. What a join
    /// changes of the restart point is durable before it returns, written after the
    /// coordinator's lock is released.
    fn join(
        &self,
        peer: usize,
        session: u64,
        join: bool,
        parts: Option<&[String]>,
        max_experts: Option<usize>,
    ) -> Result<(Standing, Scope, u64, RoundSettings), Status> {
        let disjoint = self.cfg.data.partition == Partition::Disjoint;
        let (standing, scope, published, settings, (changed, version)) = {
            let mut coord = self.coord.lock().unwrap();
            let now = self.now();
            let claimed = match parts.filter(|_| disjoint) {
                Some(parts) => {
                    let mut book = self.progress.read().0.data_parts.clone();
                    book.claim(peer, parts, |q| coord.is_live(q, now))
                        .map_err(|e| refusal::of_part_error(&e))?;
                    Some(book)
                }
                None => None,
            };
            let before = coord.scope().clone();
            let standing = coord
                .join(peer, session, join, max_experts, now)
                .map_err(|e| refusal::of_round_error(&e))?;
            let scope = coord.scope().clone();
            let published = coord.global().1;
            let settings = coord.cfg().settings();
            let coord = &*coord;
            // The restart point follows in memory, in the coordinator's order.
            let change = self.progress.change(|st| {
                let mut changed = Vec::new();
                if let Some(book) = claimed.filter(|b| *b != st.data_parts) {
                    st.data_parts = book;
                    changed.push(format!("the data parts node {peer} reads"));
                }
                if let Some(k) = max_experts.filter(|_| &st.caps != coord.caps()) {
                    st.caps = coord.caps().clone();
                    tracing::info!("node {peer} has room for {k} experts per layer");
                    changed.push(format!("the cap of node {peer}"));
                }
                if scope != before {
                    if let Some(newest) = st.rounds.last_mut().filter(|r| r.round == published) {
                        newest.owners = scope.owners();
                        newest.members = scope.members().into_iter().collect();
                        newest.budget = coord.budget(&newest.members);
                        changed.push("the new members".to_owned());
                    }
                }
                let any = !changed.is_empty();
                (changed, any)
            });
            (standing, scope, published, settings, change)
        };
        if let Some(v) = version {
            if let Err(e) = self.progress.commit(v) {
                mirror::exit_if_fenced(&e);
                tracing::error!("cannot record {}: {e:#}", changed.join(", "));
            }
            crate::fault::point("joined", published + 1);
        }
        Ok((standing, scope, published, settings))
    }

    /// After a restart: folds in the open round's uploads that were acknowledged before.
    fn reapply_pending(&self) -> Result<()> {
        let open = self.coord.lock().unwrap().round();
        // Outside the coordinator's lock: it may call the store.
        self.store.remove_pending(|r| r != open);
        let mut coord = self.coord.lock().unwrap();
        for peer in coord.scope().members() {
            let path = self.store.pending_path(open, peer);
            if path.exists() {
                let now = self.now();
                // An upload kept by an older server has no record of its work: unweighed.
                let work = std::fs::read(self.store.pending_work_path(open, peer))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or_default();
                let fold = |named| coord.upload(peer, 0, open, named, work, now);
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

    /// The exact payload size an upload of `peer` must announce for `round`, the open one of
    /// `sync` (its settings), when it hands over what it trained of `handover` (experts,
    /// checked by the coordinator).
    fn expected_upload_bytes(
        &self,
        sync: &spes_sync::SyncConfig,
        scope: &Scope,
        peer: usize,
        round: u64,
        handover: &[usize],
    ) -> u64 {
        let last = round >= self.final_round;
        let handed =
            |role: &Role| matches!(role, Role::Expert { index, .. } if handover.contains(index));
        let mut entries: Vec<(String, Vec<i64>, tch::Kind)> = self
            .layout
            .entries
            .iter()
            .filter(|(_, role, _)| scope.uploads(peer, *role))
            .flat_map(|(n, _, s)| spes_sync::delta::wire_entries(sync, n, s, round, last))
            .collect();
        entries.extend(
            self.layout
                .entries
                .iter()
                .filter(|(_, role, _)| handed(role))
                .map(|(n, _, s)| (WirePart::Handover.name(n), s.clone(), tch::Kind::BFloat16)),
        );
        payload::expected_size(
            entries
                .iter()
                .map(|(n, s, k)| (n.as_str(), s.as_slice(), *k)),
        )
    }
}

/// What a server starts with: its shared state, the scorer's evaluator and metrics log, what
/// wakes the closer, and the restart point's model and whether it is a fresh run.
struct Started {
    state: Arc<State>,
    eval: Option<Evaluator>,
    metrics: MetricsLog,
    wake: mpsc::Receiver<()>,
    /// The newest published round's whole model.
    global: spes_sync::Named,
    fresh: bool,
    /// The newest round `metrics.jsonl` holds, if any.
    logged: Option<Logged>,
}

/// Opens the run's state under `opts.out` (or starts a fresh run): the restart point, the
/// coordinator resumed on it, the evaluator and the metrics log.
/// The run's settings as this server resumes them must be those its state was made with: a
/// key that changed since (an edited config, or a rule of a newer spes that derives another
/// value) is refused by name. The settings are kept in `<out>/run-settings.toml`.
fn check_run_settings(out: &std::path::Path, cfg: &RunConfig, fresh: bool) -> Result<()> {
    let file = out.join("run-settings.toml");
    if let Some(change) = RunConfig::keep_settings(&file, &cfg.run_settings()?, !fresh)? {
        anyhow::bail!(
            "the run's settings changed since the server's state in {} was made: {change}; \
             start the server with the run's config (set the key back: {} holds them all), \
             or with a new --out",
            out.display(),
            file.display()
        );
    }
    Ok(())
}

fn start(opts: &ServerOptions, mirror: Option<Arc<Mirror>>) -> Result<Started> {
    let cfg = opts.cfg.clone();
    let opened = store::open(opts, mirror.as_deref())?;
    check_run_settings(&opts.out, &cfg, opened.fresh)?;
    let layout = opened.layout.clone();
    // Who owned what in the round before the open one, from the round published before the
    // newest (each published round names the next one's owners): handovers are checked on it.
    let previous_owners = opened
        .progress
        .rounds
        .iter()
        .rev()
        .nth(1)
        .map(|r| r.owners.clone())
        .unwrap_or_default();
    let (scope, published_round, gone) = match opened.progress.rounds.last() {
        Some(newest) => (
            Scope::from_lists(&newest.owners, &newest.members)?,
            newest.round,
            opened.progress.gone.iter().copied().collect(),
        ),
        None => (
            Scope::of(&cfg.sync, cfg.model.n_experts)?,
            0,
            BTreeSet::new(),
        ),
    };
    // What the rounds' settings follow: a recorded run's choices, this run's own so far (a
    // restarted adaptive server), or the config.
    let adaptive = cfg.sync.adaptive();
    if opts.replay.is_some() && !adaptive {
        anyhow::bail!("--replay-choices replays an adaptive run's choices, but this config pins sync.wire and sync.overlap_steps");
    }
    // The open round's settings: as the newest round announced them, or the first round's.
    let open = published_round + 1;
    // A choice is announced the round after it is made: one from after round `open + 1` was
    // made after rounds a rollback dropped.
    let mut own = opened.progress.choices.clone();
    own.choices.retain(|c| c.from_round <= open + 1);
    let schedule = opts.replay.as_ref().unwrap_or(&own);
    let settings_of = |round: u64| schedule.at(round, &cfg.sync);
    let open_settings = match opened.progress.rounds.last() {
        Some(newest) => newest.settings.unwrap_or_else(|| cfg.sync.settings()),
        None => settings_of(open),
    };
    // Nodes compare their data's tokenizer with the server's, when the server has data.
    let tokenizer_xxh3 = spes_data::Manifest::load(cfg.data.primary())
        .map(|m| m.tokenizer_xxh3)
        .unwrap_or_default();
    let eval = evaluator(opts, opened.model)?;
    let role = match opts.shard {
        (_, 1) => "server".to_owned(),
        (i, k) => format!("server-shard-{i}-of-{k}"),
    };
    let metrics = MetricsLog::open(
        &opts.out,
        (!opened.fresh).then_some(published_round * cfg.sync.sync_steps),
    )?
    .with_tensorboard(cfg.train.tensorboard.as_deref(), &role)?;
    // The log as kept after a crash: the restart point, and the operator's history.
    let logged_rounds: Vec<RoundRecord> =
        spes_train::metrics::read(&opts.out.join("metrics.jsonl"));
    let logged = last_logged_round(&logged_rounds);
    let history = History::of(&logged_rounds);
    let (published, _) = watch::channel(published_round);
    let (wake_tx, wake) = mpsc::sync_channel(1);
    let clock = Instant::now();
    let mut progress = opened.progress;
    if progress.initial_val_loss.is_none() {
        progress.initial_val_loss = logged.as_ref().and_then(|l| l.initial_val_loss);
    }
    // The fastest-moving tensors bound the check: experts step at lr · expert_lr_scale.
    let peak_lr = cfg.train.node_lr() * cfg.train.expert_lr_scale.max(1.0);
    let mut coord = Coordinator::new(
        layout.clone(),
        scope.clone(),
        cfg.sync.for_round(open_settings),
        cfg.sync.max_update_rms(peak_lr),
        Start {
            global: shallow(&opened.global),
            published: published_round,
            gone,
            caps: progress.caps.clone(),
        },
        0.0,
    )
    .ending_at(cfg.train.max_steps / cfg.sync.sync_steps)
    .with_round_rows(cfg.rows_per_round())
    .after_owners(previous_owners);
    coord
        .restore_carried(opened.carried)
        .map_err(|e| anyhow::anyhow!("round {published_round}'s carried state: {e}"))?;
    if adaptive {
        coord
            .set_next(settings_of(open + 1))
            .map_err(|e| anyhow::anyhow!("round {}: {e}", open + 1))?;
    }
    let settle = match (&opts.replay, adaptive) {
        (Some(c), _) => Settle::Replay(c.clone()),
        (None, false) => Settle::Pinned,
        (None, true) => {
            if opts.shard.1 > 1 {
                anyhow::bail!("sync.wire or sync.overlap_steps = \"adaptive\" needs one server: shards would measure and choose apart (pin both keys, or replay a run's choices with --replay-choices)");
            }
            let last = own.choices.last();
            let chooser = Chooser::new(
                cfg.sync.target_utilization,
                spes_sync::loss_table::candidates(&cfg.sync),
                settings_of(open + 1),
                last.map_or(1, |c| c.from_round),
                last.is_some(),
            );
            Settle::Adaptive {
                chooser,
                choices: own.clone(),
            }
        }
    };
    let state = Arc::new(State {
        final_round: cfg.train.max_steps / cfg.sync.sync_steps,
        coord: Mutex::new(coord),
        layout,
        limits: opts.limits,
        cfg: cfg.clone(),
        store: Store {
            out: opts.out.clone(),
            keep: cfg.sync.keep_checkpoints,
            mirror: mirror.clone(),
        },
        served: Mutex::new(None),
        published,
        clock,
        progress: Progress::new(progress, opts.out.clone(), mirror),
        io: Mutex::new(RoundIo::default()),
        upload_slots: tokio::sync::Semaphore::new(opts.limits.max_concurrent_uploads.max(1)),
        wake: wake_tx,
        shard: opts.shard,
        tokenizer_xxh3,
        watch: Mutex::new(Watch {
            history,
            val_loss: logged.as_ref().and_then(|l| l.val_loss),
            ..Watch::default()
        }),
        settle: Mutex::new(settle),
    });
    Ok(Started {
        state,
        eval,
        metrics,
        wake,
        global: opened.global,
        fresh: opened.fresh,
        logged,
    })
}

/// The scorer's evaluator of published rounds on the run's validation windows; none for a
/// server shard (it holds part of the model) or without validation data.
fn evaluator(opts: &ServerOptions, model: spes_model::MoeModel) -> Result<Option<Evaluator>> {
    let cfg = &opts.cfg;
    Ok(
        match ValWindows::open_mixture(&cfg.data.sources(), cfg.train.seq_len) {
            // A shard holds part of the model; score with `spes eval` on a node's checkpoint.
            Ok(_) if opts.shard.1 > 1 => None,
            Ok(val) => Some(Evaluator {
                model,
                val,
                batch: cfg.train.batch_size,
                max_batches: cfg.train.eval_batches,
                device: opts.device,
                tasks: spes_train::task_hook::TaskHook::load(cfg, opts.device)?,
            }),
            Err(e) => {
                tracing::warn!("no validation loss on the server: {e:#}");
                None
            }
        },
    )
}

/// Round 0 of a fresh run, published and sent to be scored; or, after a crash between
/// publishing a round and logging it, that round sent to be scored and logged again.
fn first_publication(
    state: &State,
    global: spes_sync::Named,
    fresh: bool,
    logged: Option<&Logged>,
    score_tx: &mpsc::Sender<ScoreJob>,
) -> Result<()> {
    let cfg = &state.cfg;
    let (published_round, scope, settings) = {
        let coord = state.coord.lock().unwrap();
        (
            coord.global().1,
            coord.scope().clone(),
            coord.cfg().settings(),
        )
    };
    if fresh {
        let record = RoundRecord {
            members: scope.members().into_iter().collect(),
            owners: scope.owners(),
            ..RoundRecord::default()
        };
        state.store.publish(
            &state.progress,
            &Publication {
                round: 0,
                global: &global,
                next: &scope,
                budget: &BTreeMap::new(),
                settings,
                tokens: 0,
                gone: &BTreeSet::new(),
                record: record.clone(),
                delta: None,
                carried: Vec::new(),
                full: true,
            },
        )?;
        let _ = score_tx.send(ScoreJob {
            step: 0,
            global,
            record,
        });
    } else if logged.is_none_or(|l| l.round < published_round) {
        // Crashed after publishing, before logging: log the round again from the restart point.
        let record = state.progress.read().0.record.clone();
        if let Some(record) = record.filter(|r| r.round == published_round) {
            let _ = score_tx.send(ScoreJob {
                step: published_round * cfg.sync.sync_steps,
                global,
                record,
            });
        }
    }
    Ok(())
}

/// The gRPC service with its credential check, behind TLS when `opts.tls` is given.
fn grpc(opts: &ServerOptions, state: &Arc<State>) -> Result<tonic::transport::server::Router> {
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
    Ok(builder.add_service(svc))
}

/// The operator's HTTP listener, if `opts.http` asks for one, serving until `stopped`.
fn http(
    listener: Option<(std::net::TcpListener, HttpOptions)>,
    state: &Arc<State>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> Result<Option<tokio::task::JoinHandle<Result<()>>>> {
    Ok(match listener {
        Some((listener, http_opts)) => {
            http_opts.check(listener.local_addr()?)?;
            let endpoints = Endpoints {
                metrics: {
                    let s = state.clone();
                    Box::new(move || crate::view::prom::render(&s.view()))
                },
                run_json: {
                    let s = state.clone();
                    Some(Box::new(move || {
                        serde_json::to_string(&s.view()).unwrap_or_default()
                    }))
                },
            };
            tracing::info!(
                "live run page on http{}://{}/",
                if http_opts.tls.is_some() { "s" } else { "" },
                listener.local_addr()?
            );
            let stopped = async {
                let _ = stopped.await;
            };
            Some(tokio::spawn(crate::view::http::serve(
                listener, http_opts, endpoints, stopped,
            )))
        }
        None => None,
    })
}

/// Runs a server on an already bound listener until the last round is published and fetched
/// (or `linger_s` passed), or until `shutdown` resolves: the state opened ([`start`]), the
/// closer and scorer threads, the gRPC service and the HTTP listener; then their ends.
pub async fn serve(
    mut opts: ServerOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<ServerSummary> {
    let Started {
        state,
        eval,
        metrics,
        wake,
        global,
        fresh,
        logged,
    } = {
        let mirror = opts.store.take().map(|s| Arc::new(Mirror::new(s)));
        start(&opts, mirror)?
    };
    let (score_tx, score_rx) = mpsc::channel();
    first_publication(&state, global, fresh, logged.as_ref(), &score_tx)?;
    state.reapply_pending()?;
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let closer = {
        let (s, stop) = (state.clone(), stop.clone());
        let linger = opts.linger_s;
        let score_tx = score_tx.clone();
        std::thread::spawn(move || run_closer(s, wake, score_tx, stop, done_tx, linger))
    };
    drop(score_tx);
    let scorer = {
        let s = state.clone();
        std::thread::spawn(move || run_scorer(s, eval, score_rx, metrics))
    };
    let router = grpc(&opts, &state)?;
    let (http_stop, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let http = http(opts.http, &state, http_stopped)?;
    let stop_serving = async move {
        tokio::select! {
            _ = shutdown => {},
            _ = done_rx => {},
        }
    };
    let served = router
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            stop_serving,
        )
        .await
        .context("gRPC server failed");
    stop.store(true, Ordering::Relaxed);
    let _ = http_stop.send(());
    if let Some(http) = http {
        match http.await {
            Ok(Err(e)) => tracing::error!("the HTTP listener failed: {e:#}"),
            Err(e) => tracing::error!("the HTTP listener panicked: {e}"),
            Ok(Ok(())) => {}
        }
    }
    let _ = tokio::task::spawn_blocking(move || {
        let _ = closer.join();
        let _ = scorer.join();
    })
    .await;
    served?;
    let final_val_loss = state.watch.lock().unwrap().val_loss;
    let st = &state.progress.read().0;
    let newest = st.newest();
    Ok(ServerSummary {
        rounds: newest.round,
        tokens: newest.tokens,
        initial_val_loss: st.initial_val_loss,
        final_val_loss,
        wall_s: state.clock.elapsed().as_secs_f64(),
    })
}

/// The newest round logged in `metrics.jsonl`, its validation loss, and round 0's.
struct Logged {
    round: u64,
    val_loss: Option<f64>,
    initial_val_loss: Option<f64>,
}

fn last_logged_round(lines: &[RoundRecord]) -> Option<Logged> {
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

#[cfg(test)]
mod tests;
