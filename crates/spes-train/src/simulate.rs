//! A whole decentralized run in one process, without a network or files: the server's
//! [`Coordinator`] and every node's [`Replica`] and [`Trainer`], stepped in turn on one device.
//! The state machines and the wire are the ones `spes server` and `spes node` run, so a
//! simulated run computes what a loopback run computes (up to the order in which uploads are
//! folded, which a real server takes as they arrive) and costs only the training: use it to try
//! a recipe, a wire or an overlap on one machine before renting many.
//!
//! Overlap is simulated with a fixed delay: a round's result reaches every node
//! `delay_steps` steps after its upload (a real node applies it at the first step boundary
//! after it arrives), or after `sync.overlap_steps` if that is sooner (a real node waits for
//! the round there), so runs are reproducible and the cost of the delay can be measured by
//! itself.

use crate::config::RunConfig;
use crate::oracle::{self, Oracle};
use crate::trainer::{every_window_loss, validation_stats, Trainer};
use anyhow::{bail, Context, Result};
use spes_data::ValWindows;
use spes_model::MoeModel;
use spes_sync::{Coordinator, Follow, Layout, Named, Published, Replica, Start, Work};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::Device;

/// How to simulate.
#[derive(Clone, Debug, Default)]
pub struct SimOptions {
    /// With `sync.overlap`: the steps each node trains between a round's upload and applying
    /// its result (at most `sync_steps`, the whole round: it lands just before the next upload;
    /// the last round is always waited for).
    pub delay_steps: u64,
    /// Score the global model every this many steps (0: `train.eval_every`, else only at the
    /// end).
    pub eval_every: u64,
    /// Write every node's change of these rounds (fp32, what it uploads before the wire
    /// compresses it) to `<dir>/round-<r>-node-<p>.safetensors`, to study what a wire keeps
    /// (scripts/wire_study.py).
    pub dump_changes: Option<(PathBuf, Vec<u64>)>,
    /// Statistics every node takes from the union of all nodes' batches (a measuring tool:
    /// [`crate::oracle`]).
    pub oracle: Oracle,
}

/// One simulated node: its replica, its trainer, and what it sent and received.
struct SimNode {
    replica: Replica,
    trainer: Trainer,
    bytes_up: u64,
    bytes_down: u64,
}

/// What a simulated run measured.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// `(step, validation loss of the global model)` at every scored round.
    pub curve: Vec<(u64, f64)>,
    /// Validation loss of the final global model.
    pub final_val_loss: f64,
    /// The final global model's loss on every window of the validation split, 16 windows a
    /// batch: the score `spes experiment` gives a run.
    pub final_all_windows: f64,
    /// Wire bytes per node and round, up plus down (tensors only, no framing), mean over nodes
    /// and every round but the last (which a lossy wire sends whole).
    pub bytes_per_round: f64,
    pub wall_s: f64,
}

/// Every tensor of `model` by name, sharing its storage.
fn weights(model: &MoeModel) -> Named {
    model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach()))
        .collect()
}

fn bytes(named: &Named) -> u64 {
    named
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// Runs `cfg` (a decentralized config with steps-based rounds) from θ⁰ to `train.max_steps`
/// and returns what each round measured.
pub fn simulate(cfg: &RunConfig, device: Device, opts: &SimOptions) -> Result<SimResult> {
    // Without links there is nothing to choose by: an adaptive run's keys take the first
    // rounds' settings throughout.
    let sync = &cfg.sync.for_round(cfg.sync.settings());
    if cfg.sync.adaptive() {
        tracing::info!(
            "sync.wire / sync.overlap_steps = \"adaptive\": spes simulate has no links to choose by, so every round runs the first rounds' settings ({}); pin both keys to try others",
            sync.settings()
        );
    }
    let h = sync.sync_steps;
    if h == 0 || !cfg.train.max_steps.is_multiple_of(h) {
        bail!(
            "train.max_steps ({}) must be a positive multiple of sync.sync_steps ({h})",
            cfg.train.max_steps
        );
    }
    if opts.delay_steps > 0 && !sync.overlaps() {
        bail!(
            "a delay of {} steps needs sync.overlap = true on a delta wire",
            opts.delay_steps
        );
    }
    if opts.delay_steps > h {
        bail!(
            "the delay ({} steps) must be at most a round (sync.sync_steps = {h}): the round is applied before the next upload",
            opts.delay_steps
        );
    }
    let delay = opts.delay_steps.min(sync.overlap_cap());
    let started = Instant::now();
    let model0 = MoeModel::seeded(&cfg.model, device, cfg.train.seed)?;
    let layout = Layout::of(&model0);
    let scope = spes_sync::Scope::of(sync, cfg.model.n_experts)?;
    let rounds = cfg.train.max_steps / h;
    let peak_lr = cfg.train.node_lr() * cfg.train.expert_lr_scale.max(1.0);
    let global0 = weights(&model0);
    let mut coord = Coordinator::new(
        layout.clone(),
        scope.clone(),
        sync.clone(),
        sync.max_update_rms(peak_lr),
        Start {
            global: global0.iter().map(|(n, t)| (n.clone(), t.copy())).collect(),
            published: 0,
            gone: BTreeSet::new(),
            caps: Default::default(),
        },
        0.0,
    )
    .ending_at(rounds)
    .with_round_rows(cfg.rows_per_round());
    let members: Vec<usize> = scope.members().into_iter().collect();
    let owners = scope.owners();
    let mut nodes = Vec::with_capacity(members.len());
    for &peer in &members {
        let node_cfg = RunConfig::for_node(cfg.clone(), cfg, peer)?;
        let model = MoeModel::seeded(&node_cfg.model, device, node_cfg.train.seed)?;
        model.load(&global0, "θ⁰")?;
        let mut trainer = Trainer::with_model(node_cfg, device, model, |_| false, 0)?;
        let mut replica = Replica::new(peer, sync.clone(), layout.clone());
        let w = weights(&trainer.model);
        replica.hold(0, &w);
        follow(&mut replica, &mut trainer, &owners, &members)?;
        nodes.push(SimNode {
            replica,
            trainer,
            bytes_up: 0,
            bytes_down: 0,
        });
    }
    drop(model0);
    let scorer = MoeModel::seeded(&cfg.model, device, cfg.train.seed)?;
    let val = ValWindows::open_mixture(&cfg.data.sources(), cfg.train.seq_len)
        .context("the validation split scores the global model")?;
    let eval_every = match opts.eval_every {
        0 => cfg.train.eval_every,
        e => e,
    };
    let score = |global: &Named| -> Result<f64> {
        scorer.load(global, "the global model")?;
        let t = &cfg.train;
        Ok(validation_stats(&scorer, &val, t.batch_size, t.eval_batches, device).0)
    };
    let mut curve = Vec::new();
    let mut before_last = 0u64;
    let mut now = 0.0;
    // The round whose result is in flight (overlap): every node applies it after `delay` steps.
    let mut in_flight: Option<u64> = None;
    for round in 1..=rounds {
        let last = round == rounds;
        if last {
            before_last = nodes.iter().map(|n| n.bytes_up + n.bytes_down).sum();
        }
        let works = train_round(&mut nodes, &coord, in_flight, delay, h, cfg, opts.oracle)?;
        for (node, work) in nodes.iter_mut().zip(works) {
            let w = weights(&node.trainer.model);
            let dump = opts.dump_changes.as_ref();
            if let Some((dir, _)) = dump.filter(|(_, at)| at.contains(&round)) {
                let peer = node.replica.peer();
                node.dump_change(
                    &w,
                    &dir.join(format!("round-{round}-node-{peer}.safetensors")),
                )?;
            }
            let wire = node.replica.upload(&w, round, last)?;
            node.bytes_up += bytes(&wire);
            now += 1e-3;
            coord
                .upload(node.replica.peer(), 1, round, wire, work, now)
                .map_err(|e| anyhow::anyhow!("round {round}: {e}"))?;
        }
        if !coord.ready(now) {
            bail!("round {round}: the coordinator is not ready after every upload");
        }
        coord.close(now);
        in_flight = Some(round);
        if delay == 0 || last {
            for node in nodes.iter_mut() {
                node.receive(&coord, round, false)?;
            }
            in_flight = None;
        }
        let step = round * h;
        if last || (eval_every > 0 && step.is_multiple_of(eval_every)) {
            let loss = score(coord.global().0)?;
            tracing::info!(
                "round {round}/{rounds} (step {step}): global validation loss {loss:.4}, {:.0} s",
                started.elapsed().as_secs_f64()
            );
            curve.push((step, loss));
        }
    }
    let final_val_loss = curve.last().expect("the last round is scored").1;
    scorer.load(coord.global().0, "the global model")?;
    let final_all_windows = every_window_loss(&scorer, &val, device);
    let counted = (rounds.saturating_sub(1).max(1) * nodes.len() as u64) as f64;
    let bytes_per_round = before_last as f64 / counted;
    Ok(SimResult {
        curve,
        final_val_loss,
        final_all_windows,
        bytes_per_round,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// Every node's steps of one round, step by step across the nodes: at step `delay` each
/// applies the round in flight, if any; with an oracle every step is taken in lockstep
/// ([`oracle::lockstep`]). Returns each node's work.
fn train_round(
    nodes: &mut [SimNode],
    coord: &Coordinator,
    in_flight: Option<u64>,
    delay: u64,
    h: u64,
    cfg: &RunConfig,
    oracle: Oracle,
) -> Result<Vec<Work>> {
    let mut works = vec![Work::default(); nodes.len()];
    for node in nodes.iter_mut() {
        node.replica.start_round();
    }
    for k in 0..h {
        if let Some(r) = in_flight.filter(|_| k == delay) {
            for node in nodes.iter_mut() {
                node.receive(coord, r, true)?;
            }
        }
        let rows: Vec<u64> = nodes
            .iter()
            .map(|n| {
                n.replica
                    .step_rows(k, cfg.rows_per_round() * n.trainer.ranks() as u64)
            })
            .collect();
        let stats = if oracle.any() {
            if rows.iter().any(|&r| r != rows[0]) {
                bail!("an oracle needs every node to train the same rows a step: {rows:?}");
            }
            let mut trainers: Vec<&mut Trainer> =
                nodes.iter_mut().map(|n| &mut n.trainer).collect();
            oracle::lockstep(&mut trainers, rows[0] as usize, oracle)?
        } else {
            nodes
                .iter_mut()
                .zip(&rows)
                .map(|(n, &r)| n.trainer.train_rows(r as usize))
                .collect::<Result<Vec<_>>>()?
        };
        for ((node, s), (work, &r)) in nodes.iter().zip(stats).zip(works.iter_mut().zip(&rows)) {
            if !s.losses.loss.is_finite() {
                bail!(
                    "node {}: loss became {} at step {}",
                    node.replica.peer(),
                    s.losses.loss,
                    node.trainer.step
                );
            }
            work.rows += r;
            work.compute_s += s.seconds;
        }
    }
    // A delay of the whole round: the round lands just before the next upload.
    if let Some(r) = in_flight.filter(|_| delay == h) {
        for node in nodes.iter_mut() {
            node.receive(coord, r, true)?;
        }
    }
    Ok(works)
}

impl SimNode {
    /// Writes the change of every tensor this node trains from its base.
    fn dump_change(&self, weights: &Named, path: &Path) -> Result<()> {
        let change: Named = weights
            .iter()
            .filter_map(|(n, t)| Some((n.clone(), t - self.replica.base_of(n)?)))
            .collect();
        tch::Tensor::write_safetensors(&change, path)
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Fetches round `round` as a node would after its upload (without its own experts the
    /// server published as sent, or whole on the fp32 wire), applies it and follows its
    /// ownership.
    fn receive(&mut self, coord: &Coordinator, round: u64, trained_since: bool) -> Result<()> {
        let w = weights(&self.trainer.model);
        match coord.delta() {
            Some(delta) => {
                let peer = self.replica.peer();
                let plan = self.replica.fetch_plan(Some(round), true);
                let (tensors, skipped_own) = delta.for_peer(peer, plan.skip_own);
                self.bytes_down += bytes(&tensors);
                self.replica.apply(
                    Published {
                        round,
                        tensors,
                        skipped_own,
                        after_upload: true,
                        trained_since_upload: trained_since,
                    },
                    &w,
                )?;
            }
            None => {
                let (global, _) = coord.global();
                self.bytes_down += bytes(global);
                self.trainer.model.load(global, "the published model")?;
                let copy = global.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
                self.replica.take_base(round, copy, &w)?;
            }
        }
        self.trainer.model.refresh_resident();
        let scope = coord.scope();
        let owners = scope.owners();
        let members: Vec<usize> = scope.members().into_iter().collect();
        follow(&mut self.replica, &mut self.trainer, &owners, &members)
    }
}

/// Gives the replica's ownership of the next round to the trainer.
fn follow(
    replica: &mut Replica,
    trainer: &mut Trainer,
    owners: &[usize],
    members: &[usize],
) -> Result<()> {
    let w = weights(&trainer.model);
    let untrained = trainer.opt.param_names().next().is_none();
    match replica.follow(owners, members, &w) {
        Follow::NotMember => bail!("node {} left the run", replica.peer()),
        Follow::Member { changed, reset, .. } => {
            if changed || untrained {
                trainer.set_trainable(|role| replica.trains(role))?;
            }
            if reset {
                trainer.model.refresh_resident();
            }
            Ok(())
        }
    }
}
