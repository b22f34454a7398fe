//! `spes node`: trains the shared parameters and its own experts (all others frozen: no
//! gradient, no optimizer state), and every `sync_steps` uploads exactly those tensors, then
//! applies the round's aggregate and goes on with its AdamW state and LR schedule. With
//! `sync.overlap` the upload and download run on another thread while training goes on. It
//! checkpoints after each round (recording the round its weights hold), so a restarted node
//! resumes where it was.
//!
//! This module is the driver: the SPES state and math are spes-sync's [`Replica`] (what to
//! upload, what to fetch, how a round becomes the weights, whose experts to train), the calls
//! to the server are `transport`'s, the node's identity is `session`'s, and what it shows and
//! records is `meter`'s. Refusals are decided on their typed kind ([`crate::refusal`]): a
//! closed round names the round to load, and the node loads exactly it.

mod connect;
mod exchange;
mod membership;
mod meter;
mod saved;
mod session;
mod streak;
mod transport;
mod virtual_peer;

use crate::dial::explain;
use crate::fault;
use anyhow::{bail, Result};
use meter::Meter;
use session::{DataClaim, Session};
use spes_model::MoeModel;
use spes_sync::{Named, Replica, Work};
use spes_train::data_parallel::DataParallel;
use spes_train::{checkpoint, RunConfig, Trainer};
use std::path::PathBuf;
use std::time::Instant;
use tch::Device;
use transport::Link;

pub use connect::{run_settings, SettingsSource};
pub use spes_train::metrics::NodeSummary;
pub use virtual_peer::VirtualPeer;

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
    /// This peer's credential (`spes auth credential`); `None` for a server run with `--no-auth`.
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
    /// Serve the node's own `/metrics` here (a bound loopback listener).
    pub metrics_listener: Option<std::net::TcpListener>,
}

/// An upload and fetch running on another thread (overlap): when its upload's encoding
/// started, and how long that took (training stood still for it).
struct Pending {
    thread: std::thread::JoinHandle<exchange::Done>,
    started: Instant,
    encode: std::time::Duration,
    round: u64,
}

/// A connected node and its local trainer.
pub struct Node {
    session: Session,
    link: Link,
    pub trainer: Trainer,
    replica: Replica,
    /// Overlap: the upload and fetch running while training goes on.
    pending: Option<Pending>,
    meter: Meter,
    /// The checkpoint being written while training goes on.
    checkpointing: Option<std::thread::JoinHandle<Result<PathBuf>>>,
    /// When the last checkpoint was taken (or the node started).
    last_checkpoint: Instant,
    /// What the round being trained has trained so far: its upload reports it.
    work: Work,
    /// Refusals of one kind in a row: a node that keeps being refused backs off and rejoins.
    refusals: streak::Streak,
}

impl Drop for Node {
    fn drop(&mut self) {
        // A checkpoint is renamed into place whole or not at all; finishing it keeps the work.
        if let Err(e) = self.finish_checkpoint() {
            tracing::warn!("{e:#}");
        }
    }
}

impl Node {
    /// Connects, joins, and brings a fresh or resumed trainer to the newest published model
    /// (or, for a node joining a running run, to the round it becomes a member from).
    pub fn connect(opts: NodeOptions) -> Result<Node> {
        let session = Session::open(&opts)?;
        let mut link = Link::open(&opts, &session.rt, session.id)?;
        let claim = DataClaim::of(&opts.cfg)?;
        link.data_parts = claim.parts.clone();
        let ranks = opts.data_parallel.as_ref().map_or(1, DataParallel::world);
        link.max_experts = spes_train::memory_plan::node_cap(&opts.cfg, opts.device, ranks)?;
        if let Some(k) = link.max_experts {
            tracing::info!(
                "node {}: train.memory_gib = {} GiB holds {k} experts per layer",
                opts.peer,
                opts.cfg.train.memory_gib
            );
        }
        let reply = link.join(opts.join).map_err(|e| explain(e, &opts.server))?;
        let cfg = session.config(&opts.cfg, &reply.config_toml)?;
        claim.check(&cfg, &reply.tokenizer_xxh3)?;
        let resumed = checkpoint::latest(&opts.out.join("checkpoints"))?;
        let mut trainer = match &resumed {
            Some(dir) => Trainer::resume_as_saved(cfg.clone(), opts.device, dir)?,
            None => {
                // The server's θ⁰ replaces it at the first pull; seeded so it never draws
                // from the generator while another role in the process seeds a model.
                let model = MoeModel::seeded(&cfg.model, opts.device, cfg.train.seed)?;
                Trainer::with_model(cfg.clone(), opts.device, model, |_| false, 0)?
            }
        };
        if let Some(dp) = opts.data_parallel {
            trainer.lead(dp)?;
        }
        let meter = Meter::open(
            &opts.out,
            cfg.train.tensorboard.as_deref(),
            opts.peer,
            cfg.train.max_steps,
            opts.progress,
            resumed.as_ref().map(|_| trainer.step),
        )?;
        let layout = spes_sync::Layout::of(&trainer.model);
        link.set_layout(&layout);
        session.start_heartbeat(
            &link,
            reply.lease_ms,
            meter.report.clone(),
            meter.synced.clone(),
        );
        if let Some(listener) = opts.metrics_listener {
            session.serve_metrics(listener, meter.report.clone())?;
        }
        let saved = resumed.as_deref().map(saved::read).transpose()?;
        let mut node = Node {
            replica: Replica::new(opts.peer, cfg.sync.clone(), layout),
            session,
            link,
            trainer,
            pending: None,
            meter,
            checkpointing: None,
            last_checkpoint: Instant::now(),
            work: Work::default(),
            refusals: streak::Streak::default(),
        };
        node.enter(&reply, saved)?;
        Ok(node)
    }

    fn peer(&self) -> usize {
        self.session.peer
    }

    /// Every tensor of the model by name, sharing the model's storage.
    fn weights(&self) -> Named {
        self.trainer
            .model
            .params()
            .into_iter()
            .map(|p| (p.name, p.tensor.detach()))
            .collect()
    }

    /// The tensors this node trains and uploads, in the model's order (sharing storage).
    pub fn upload_tensors(&self) -> Named {
        self.trainer
            .model
            .params()
            .into_iter()
            .filter(|p| self.replica.trains(p.role))
            .map(|p| (p.name, p.tensor.detach()))
            .collect()
    }

    /// Trains until the next sync step and returns the tensors to upload. Each step trains the
    /// rows the replica gives it: the run's batch, or with `sync.round_by = "tokens"` this
    /// node's share of the round spread over its steps.
    pub fn train_round(&mut self) -> Result<Named> {
        let cfg = &self.trainer.cfg;
        let (h, log_every, max_steps) = (
            cfg.sync.sync_steps,
            cfg.train.log_every,
            cfg.train.max_steps,
        );
        let ranks = self.trainer.ranks() as u64;
        let nominal = cfg.rows_per_round() * ranks;
        loop {
            let scale = self
                .replica
                .lb_scale(self.trainer.step, max_steps, self.trainer.device);
            if scale.is_some() {
                self.trainer.model.set_lb_count_scale(scale);
            }
            if self.trainer.step.is_multiple_of(h) {
                self.replica.start_round();
            }
            let rows = self.replica.step_rows(self.trainer.step % h, nominal);
            let per_rank = rows.div_ceil(ranks).max(1);
            let s = self.trainer.train_rows(per_rank as usize)?;
            self.work.rows += per_rank * ranks;
            self.work.compute_s += s.seconds;
            self.link
                .activity
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let step = self.trainer.step;
            if !s.losses.loss.is_finite() {
                bail!(
                    "node {}: loss became {} at step {step}",
                    self.peer(),
                    s.losses.loss
                );
            }
            self.meter.count(&s, step);
            fault::point("train", step);
            if step.is_multiple_of(log_every) || step.is_multiple_of(h) {
                self.trainer.check_ranks_in_sync()?;
                let tokens = self.trainer.tokens;
                self.meter.log_step(&s, step, tokens, step.div_ceil(h))?;
            }
            // The round in flight is applied once it is in, and waited for once this node has
            // trained `sync.overlap_steps` steps past its upload.
            let cap = self.replica.cfg().overlap_cap();
            if self
                .pending
                .as_ref()
                .is_some_and(|p| p.thread.is_finished() || self.trainer.step >= p.round * h + cap)
            {
                self.settle_pending()?;
            }
            if self.trainer.step.is_multiple_of(h) {
                // The previous round must be in before this one's delta is taken from it.
                if self.pending.is_some() {
                    self.settle_pending()?;
                }
                // A settle may have loaded a round instead (its upload was refused, or the node
                // joined again): the step then ends that round, which is closed, so the node
                // trains the next one; unless it was the run's last.
                if !self.holds_round_of_step() || self.trainer.step >= max_steps {
                    return Ok(self.upload_tensors());
                }
            }
        }
    }

    /// Trains and syncs until `max_steps`, tells the server, then writes `<out>/summary.json`.
    pub fn run(mut self) -> Result<NodeSummary> {
        let max = self.trainer.cfg.train.max_steps;
        while self.trainer.step < max {
            let upload = self.train_round()?;
            if self.holds_round_of_step() {
                // It loaded the run's last round while it was away: nothing left to upload.
                continue;
            }
            // The last round is always waited for, so every node ends on the final model.
            if self.replica.cfg().overlaps() && self.trainer.step < max {
                self.start_sync(&upload)?;
            } else {
                self.sync(&upload)?;
            }
        }
        // Every rank of this node must end on the final model too.
        self.trainer.check_ranks_in_sync()?;
        self.finish_checkpoint()?;
        self.trainer.release_followers()?;
        self.meter.finish();
        self.link.done();
        let summary = self.summary();
        spes_data::shard::write_atomic(
            &self.session.out.join("summary.json"),
            serde_json::to_string_pretty(&summary)?.as_bytes(),
        )?;
        Ok(summary)
    }

    /// Whether the node holds the round its step ends (it loaded that round rather than
    /// trained it): a round already closed, which it must not upload.
    fn holds_round_of_step(&self) -> bool {
        let h = self.trainer.cfg.sync.sync_steps;
        self.trainer.step.is_multiple_of(h)
            && self.replica.base_round() == Some(self.trainer.step / h)
    }

    /// Waits for the checkpoint being written, if any.
    fn finish_checkpoint(&mut self) -> Result<()> {
        match self.checkpointing.take() {
            Some(writing) => writing
                .join()
                .map_err(|_| {
                    anyhow::anyhow!("node {}: the checkpoint writer panicked", self.peer())
                })?
                .map(drop),
            None => Ok(()),
        }
    }

    /// What the node did so far.
    pub fn summary(&self) -> NodeSummary {
        NodeSummary {
            peer: self.peer(),
            steps: self.trainer.step,
            tokens: self.trainer.tokens,
            bytes_up: self.meter.bytes_up,
            bytes_down: self.meter.bytes_down,
            trainable_params: self
                .trainer
                .model
                .trainable_params()
                .iter()
                .map(|p| p.tensor.numel() as u64)
                .sum(),
            optimizer_state_bytes: self.trainer.opt.state_bytes(),
            peak_rss_mb: spes_train::process::peak_rss_mb(std::process::id()),
            wall_s: self.meter.started.elapsed().as_secs_f64(),
        }
    }
}
