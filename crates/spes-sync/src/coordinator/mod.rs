//! The server's round state machine, with no network and no clock of its own: joins, heartbeats,
//! uploads and the current time go in; published rounds and membership changes come out. gRPC
//! wraps it (spes-net's server).
//!
//! Membership is per round. A node is *live* while its lease (renewed by heartbeats, joins and
//! uploads) is younger than `lease_s`. A round closes when every live member that makes
//! progress uploaded ([`crate::hearing`]: a member whose heartbeats report no step and no byte
//! moved for `stall_s` is not waited for, and a server that heard nobody for a lease keeps
//! waiting for those live when it went deaf), or `timeout_s` after it opened, and never
//! without an upload. At the close, members whose lease
//! has been expired for `evict_after_s` are evicted and nodes that asked to join are admitted;
//! the next round's ownership is rebalanced over the new members ([`Scope::with_members`]).
//!
//! A node may declare a cap at join: the most experts its memory holds. The ownership never
//! gives a member more than its cap and, with `sync.own_by = "throughput"`, splits the experts
//! by the members' measured throughput ([`Claims`]). A member whose cap is below what it owns
//! in the open round sits that round out (it cannot train it; a round every live member sits out
//! closes with nothing trained) and owns within its cap from the next; experts no member has
//! room for stay as they are ([`crate::UNOWNED`]).

mod members;
mod next_model;

use members::Members;

use crate::budget::{self, Work};
use crate::config::{RoundBy, RoundSettings, SyncConfig};
use crate::delta::{self, RoundDelta, WirePart};
use crate::named::{Layout, Named};
use crate::outer::OuterState;
use crate::ownership::Claims;
use crate::round::{all_finite, validate, Aggregator, MergeEvent, Scope};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use tch::Kind;
use tch::Tensor;
use thiserror::Error;

/// Why the coordinator refused a call. The server maps each to one gRPC status whose details
/// carry the variant and its round, so nodes act on those, never on the text.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum RoundError {
    /// `fetch`: the newest published round, which the node loads to train the open one.
    #[error("round {round} is closed: load round {fetch} and continue")]
    Closed { round: u64, fetch: u64 },
    #[error("round {round} is not open yet: collecting round {open}")]
    NotOpen { round: u64, open: u64 },
    #[error("peer {peer} already uploaded round {round}")]
    Duplicate { peer: usize, round: u64 },
    #[error("peer {peer} is not a member of this run; start it with --join to add it")]
    NotMember { peer: usize },
    #[error(
        "peer {peer} is held by a live node (heartbeat {age_s:.1} s ago): stop that node, or wait \
         {wait_s:.0} s for its lease to expire"
    )]
    PeerTaken {
        peer: usize,
        age_s: f64,
        wait_s: f64,
    },
    #[error("peer {peer} is out of range: this run's peer ids are 0..{max}")]
    OutOfRange { peer: usize, max: usize },
    #[error("peer {peer} cannot join: {members} nodes already hold one of the {max} experts each")]
    RunFull {
        peer: usize,
        members: usize,
        max: usize,
    },
    #[error(
        "peer {peer} declares room for no expert: a member trains at least one; give the node \
         more memory (train.memory_gib) or a smaller micro-batch"
    )]
    NoRoom { peer: usize },
    #[error("upload of peer {peer} {reason}")]
    Invalid { peer: usize, reason: String },
}

/// Where a node stands after a join or heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Trains the open round.
    Member,
    /// Admitted as a member from round `from`: load round `from - 1`, then train.
    Joining { from: u64 },
}

/// What closing a round did.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RoundReport {
    pub round: u64,
    pub step: u64,
    /// Peers whose upload went into this round.
    pub peers: Vec<usize>,
    /// Members that did not upload before the round closed.
    pub missing: Vec<usize>,
    /// `owners[e]`: who trained expert e in this round (empty for DiLoCo).
    pub owners: Vec<usize>,
    /// This round's members.
    pub members: Vec<usize>,
    pub merge_alpha: Option<f64>,
    pub merges: Vec<MergeEvent>,
    /// Set when the aggregate was not finite and the previous model was kept instead.
    pub discarded: Option<String>,
    /// Members evicted at this close (their experts go to others from the next round).
    pub evicted: Vec<usize>,
    /// Nodes that are members from the next round on.
    pub joined: Vec<usize>,
    /// With `outer.norm_preserving`: the averaged changes' scale, mean over their values.
    pub outer_scale: Option<f64>,
    /// What each upload of this round trained and how much its change weighed in the average
    /// of the shared tensors, in peer order.
    #[serde(default)]
    pub work: Vec<PeerWork>,
    /// `sync.round_by = "tokens"`: the rows each member of the next round trains in it, by
    /// peer (empty: each its `sync_steps` steps of the batch).
    #[serde(default)]
    pub budget: BTreeMap<usize, u64>,
    /// The settings of the next round: its wire and overlap.
    pub settings: RoundSettings,
}

/// One upload's part of a round.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct PeerWork {
    pub peer: usize,
    #[serde(flatten)]
    pub work: Work,
    /// Its share of the average of the shared tensors (the shares sum to 1).
    pub weight: f64,
}

/// Where a coordinator starts: the model published last, its round (0: θ⁰), the peers
/// evicted so far and the caps nodes declared.
pub struct Start {
    pub global: Named,
    pub published: u64,
    pub gone: BTreeSet<usize>,
    pub caps: BTreeMap<usize, usize>,
}

/// Collects round `round()` on top of the model published at `round() - 1` (round 0 = θ⁰).
pub struct Coordinator {
    layout: Layout,
    /// The run's `[sync]` rules with the open round's settings.
    cfg: SyncConfig,
    /// The settings the open round's close announces for the round after it.
    next: RoundSettings,
    /// Largest RMS change of an uploaded tensor from the global model; `None`: unchecked.
    max_update_rms: Option<f64>,
    round: u64,
    global: Named,
    /// The open round's scope (who trains what) and its uploads so far.
    agg: Aggregator,
    opened_at: f64,
    /// Leases, joiners, the evicted, caps, who sits the open round out.
    members: Members,
    /// Delta mode: what the last closed round published.
    last_delta: Option<RoundDelta>,
    /// Lossy wires: what the published deltas have not carried yet, per tensor (fp32).
    residual: HashMap<String, Tensor>,
    /// The run's last round, which publishes every change whole with its residual
    /// ([`Coordinator::ending_at`]).
    last_round: Option<u64>,
    outer: OuterState,
    /// What each upload of the open round reported it trained.
    work: BTreeMap<usize, Work>,
    /// What each upload of the last closed round reported: what the next round's budget
    /// follows ([`Coordinator::budget`]).
    last_work: BTreeMap<usize, Work>,
    /// Rows one node trains in a round at the run's batch ([`Coordinator::with_round_rows`]).
    round_rows: Option<u64>,
}

/// A round's aggregator under `cfg`: it measures the uploads' spread when the outer step
/// needs it (norm-preserving scale, delta wires).
fn aggregator(cfg: &SyncConfig, scope: Scope) -> Aggregator {
    let spread = cfg.outer_norm_preserving && cfg.wire().is_delta();
    Aggregator::new(scope, cfg).with_spread(spread)
}

const MOMENTUM: &str = "momentum/";
const RESIDUAL: &str = "residual/";

/// The carried state ([`Coordinator::carried`]) after a round that sent changes whole (a
/// lossless wire): the same without residuals, which such a round flushes every one of.
pub fn after_lossless_round(carried: Named) -> Named {
    carried
        .into_iter()
        .filter(|(n, _)| !n.starts_with(RESIDUAL))
        .collect()
}

impl Coordinator {
    /// Starts after `start.published` rounds, with `scope` the open round's members, under the
    /// run's `[sync]` rules and the upload bound `max_update_rms`
    /// ([`SyncConfig::max_update_rms`]). Every member gets a fresh lease of unknown session, so a
    /// restarted server waits for its nodes to report instead of declaring them dead.
    pub fn new(
        layout: Layout,
        scope: Scope,
        cfg: SyncConfig,
        max_update_rms: Option<f64>,
        start: Start,
        now: f64,
    ) -> Self {
        let Start {
            global,
            published,
            gone,
            caps,
        } = start;
        Coordinator {
            members: Members::new(scope.members(), gone, caps, now),
            agg: aggregator(&cfg, scope),
            last_delta: None,
            residual: HashMap::new(),
            last_round: None,
            outer: OuterState::default(),
            work: BTreeMap::new(),
            last_work: BTreeMap::new(),
            round_rows: None,
            layout,
            next: cfg.settings(),
            cfg,
            max_update_rms,
            round: published + 1,
            global,
            opened_at: now,
        }
    }

    /// The model's layout (this server shard's part of it).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The run's `[sync]` rules, with the open round's settings.
    pub fn cfg(&self) -> &SyncConfig {
        &self.cfg
    }

    /// Sets what the open round's close announces for the round after it (the settings it
    /// started with unless set). Both ends' wires must be delta wires: a delta's base is the
    /// model every node holds, which the `fp32` wire does not keep.
    pub fn set_next(&mut self, settings: RoundSettings) -> Result<(), String> {
        if !(settings.wire.is_delta() && self.cfg.wire().is_delta()) {
            return Err(format!(
                "round {} on {} cannot be followed by a round on {}: only delta wires change between rounds",
                self.round,
                self.cfg.wire().name(),
                settings.wire.name()
            ));
        }
        self.next = settings;
        Ok(())
    }

    /// The round being collected.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The newest published model and its round.
    pub fn global(&self) -> (&Named, u64) {
        (&self.global, self.round - 1)
    }

    /// Peers whose upload of the open round was accepted.
    pub fn uploaded(&self) -> &BTreeSet<usize> {
        self.agg.uploaded()
    }

    /// Who trains what in the open round.
    pub fn scope(&self) -> &Scope {
        self.agg.scope()
    }

    /// Evicted peers (persisted, so a restart remembers them).
    pub fn gone(&self) -> &BTreeSet<usize> {
        self.members.gone()
    }

    /// The caps nodes declared at join (persisted, so a restart keeps them).
    pub fn caps(&self) -> &BTreeMap<usize, usize> {
        self.members.caps()
    }

    /// Members sitting the open round out until it closes (their cap is below what they own
    /// in it); the round does not wait for them.
    pub fn sitting_out(&self) -> &BTreeSet<usize> {
        self.members.sitting_out()
    }

    /// What `members` claim of the experts: their caps and, with `sync.own_by =
    /// "throughput"`, the rows per second each trained in the last closed round, as the
    /// round's budget counts them ([`budget::speeds`]).
    fn claims(&self, members: &BTreeSet<usize>) -> Claims {
        let cap = members
            .iter()
            .filter_map(|p| self.caps().get(p).map(|&c| (*p, c)))
            .collect();
        let members: Vec<usize> = members.iter().copied().collect();
        let speed = self
            .cfg
            .owns_by_throughput()
            .then(|| budget::speeds(&members, &self.last_work))
            .flatten();
        let weight = speed.map_or_else(BTreeMap::new, |s| members.into_iter().zip(s).collect());
        Claims { weight, cap }
    }

    /// What the server carries from round to round besides the model, for its restart point:
    /// the outer optimizer's momenta (`momentum/<name>`) and the lossy wires' residuals
    /// (`residual/<name>`), fp32.
    pub fn carried(&self) -> Named {
        let residual = crate::named::sorted(&self.residual)
            .into_iter()
            .map(|(n, t)| (format!("{RESIDUAL}{n}"), t));
        let momenta = self.outer.state().into_iter();
        momenta
            .map(|(n, t)| (format!("{MOMENTUM}{n}"), t))
            .chain(residual)
            .collect()
    }

    /// Restores what [`Coordinator::carried`] returned, or says which entry does not fit this
    /// layout (and restores nothing).
    pub fn restore_carried(&mut self, named: Named) -> Result<(), String> {
        let mut momenta = Vec::new();
        let mut residual = HashMap::new();
        for (key, t) in named {
            let (kind, name) = [MOMENTUM, RESIDUAL]
                .into_iter()
                .find_map(|p| key.strip_prefix(p).map(|n| (p, n.to_owned())))
                .ok_or_else(|| format!("`{key}` is neither {MOMENTUM}… nor {RESIDUAL}…"))?;
            let shape = self
                .layout
                .entries
                .iter()
                .find(|(n, _, _)| *n == name)
                .map(|(_, _, s)| s)
                .ok_or_else(|| format!("`{key}`: this server holds no tensor `{name}`"))?;
            if t.size() != *shape || t.kind() != Kind::Float {
                return Err(format!(
                    "`{key}` is {:?} {:?}, expected Float {shape:?}",
                    t.kind(),
                    t.size()
                ));
            }
            if kind == MOMENTUM {
                momenta.push((name, t));
            } else {
                residual.insert(name, t);
            }
        }
        self.outer.restore(momenta);
        self.residual = residual;
        Ok(())
    }

    /// Members of the open round whose lease is current.
    pub fn live_members(&self, now: f64) -> BTreeSet<usize> {
        self.scope()
            .members()
            .into_iter()
            .filter(|p| self.is_live(*p, now))
            .collect()
    }

    /// Seconds since each lease holder (member or not) last renewed its lease, expired ones
    /// included until they are evicted.
    pub fn lease_ages(&self, now: f64) -> BTreeMap<usize, f64> {
        self.members.lease_ages(now)
    }

    /// Whether `peer` holds a current lease, member or not.
    pub fn is_live(&self, peer: usize, now: f64) -> bool {
        self.members.is_live(peer, now, &self.cfg)
    }

    /// Takes or renews `peer`'s lease for process `session` and says where it stands. A member
    /// is refused only if another live process holds its id; an evicted peer, or any peer with
    /// `join`, is admitted from the next round (at once if no member is live and the open round
    /// has no upload, so a run whose nodes all died can restart with new ones). `cap`, when
    /// given, is the most experts the node can own: 0 is refused; a member owning more in the
    /// open round sits it out (admitted from the next, within its cap).
    pub fn join(
        &mut self,
        peer: usize,
        session: u64,
        join: bool,
        cap: Option<usize>,
        now: f64,
    ) -> Result<Standing, RoundError> {
        self.check_range(peer)?;
        if cap == Some(0) {
            return Err(RoundError::NoRoom { peer });
        }
        self.members.take_lease(peer, session, now, &self.cfg)?;
        self.members.declare_cap(peer, cap);
        let scope = self.agg.scope();
        if scope.members().contains(&peer) {
            return Ok(if self.members.trains_within_cap(scope, peer) {
                Standing::Member
            } else {
                Standing::Joining {
                    from: self.round + 1,
                }
            });
        }
        self.members.enlist(scope, peer, join)?;
        if self.uploaded().is_empty() && self.live_members(now).is_empty() {
            self.admit_joiners_now();
            return Ok(Standing::Member);
        }
        Ok(Standing::Joining {
            from: self.round + 1,
        })
    }

    fn check_range(&self, peer: usize) -> Result<(), RoundError> {
        let max = self.scope().max_members();
        if peer >= max {
            return Err(RoundError::OutOfRange { peer, max });
        }
        Ok(())
    }

    fn admit_joiners_now(&mut self) {
        let mut members = self.scope().members();
        members.extend(self.members.take_joiners());
        let scope = self
            .scope()
            .with_members(&members, &self.claims(&members))
            .expect("join() keeps members within the expert count");
        self.agg = aggregator(&self.cfg, scope);
    }

    /// The checks an upload's header allows, before its body is read: peer, round, membership,
    /// lease holder and duplicates. Renews the lease.
    pub fn check_upload(
        &mut self,
        peer: usize,
        session: u64,
        round: u64,
        now: f64,
    ) -> Result<(), RoundError> {
        self.check_range(peer)?;
        if round < self.round {
            return Err(RoundError::Closed {
                round,
                fetch: self.round - 1,
            });
        }
        if round > self.round {
            return Err(RoundError::NotOpen {
                round,
                open: self.round,
            });
        }
        if !self.scope().members().contains(&peer) {
            return Err(RoundError::NotMember { peer });
        }
        self.members.take_lease(peer, session, now, &self.cfg)?;
        if self.uploaded().contains(&peer) {
            return Err(RoundError::Duplicate { peer, round });
        }
        self.members.progressed(peer, now);
        Ok(())
    }

    /// `peer`'s heartbeat reported `activity`, a counter of the steps it trained and the
    /// payload chunks it moved: a changed value is progress ([`crate::hearing`]).
    pub fn report_activity(&mut self, peer: usize, activity: u64, now: f64) {
        self.members.report_activity(peer, activity, now);
    }

    /// Accepts `peer`'s upload for `round`, which says it trained `work`, or says why not; a
    /// rejection changes nothing. Keeps none of `tensors`' storage, so they may view a mapped
    /// file (see [`Aggregator::add`]).
    pub fn upload(
        &mut self,
        peer: usize,
        session: u64,
        round: u64,
        tensors: Named,
        work: Work,
        now: f64,
    ) -> Result<(), RoundError> {
        self.check_upload(peer, session, round, now)?;
        let invalid = |reason| RoundError::Invalid { peer, reason };
        let (handover, tensors): (Named, Named) = tensors
            .into_iter()
            .partition(|(n, _)| matches!(delta::split_wire_name(n), Some((_, WirePart::Handover))));
        let handover = self.check_handed(peer, handover)?;
        let layout = &self.layout;
        let deltas =
            delta::decode(tensors, &self.cfg, round, |n| layout.shape_of(n)).map_err(invalid)?;
        validate(
            layout,
            self.scope(),
            peer,
            &deltas,
            &self.global,
            self.max_update_rms,
        )
        .map_err(invalid)?;
        let weight = self.weight_of(&work);
        self.agg
            .add(&self.layout, peer, deltas, weight)
            .map_err(|e| invalid(e.to_string()))?;
        for (name, h) in handover {
            self.agg.add_handover(name, h);
        }
        self.work.insert(peer, work);
        Ok(())
    }

    /// The handed-over tensors of an upload (`<name>#handover`), checked: expert tensors of
    /// experts `peer` may hand over ([`Coordinator::check_handover`]), bf16 of their shape,
    /// finite and within the upload bound; as fp32 copies by tensor name.
    fn check_handed(&self, peer: usize, handed: Named) -> Result<Named, RoundError> {
        let invalid = |reason: String| RoundError::Invalid { peer, reason };
        let mut out = Vec::with_capacity(handed.len());
        for (wire, t) in handed {
            let name = delta::tensor_of(&wire).to_owned();
            let expert = self
                .layout
                .position(&name)
                .and_then(|i| match self.layout.entries[i].1 {
                    spes_model::Role::Expert { index, .. } => Some(index),
                    spes_model::Role::Shared => None,
                });
            let Some(e) = expert else {
                return Err(invalid(format!(
                    "hands over `{name}`, which is not an expert tensor"
                )));
            };
            self.check_handover(peer, &[e])?;
            let shape = self.layout.shape_of(&name).expect("a known tensor");
            if t.kind() != Kind::BFloat16 || t.size() != shape {
                return Err(invalid(format!(
                    "hands over `{name}` as {:?} {:?}, expected bf16 {shape:?}",
                    t.kind(),
                    t.size()
                )));
            }
            let h = t.to_kind(Kind::Float);
            let rms = h.norm().double_value(&[]) / (h.numel().max(1) as f64).sqrt();
            if !rms.is_finite() || self.max_update_rms.is_some_and(|b| rms > b) {
                return Err(invalid(format!(
                    "hands over `{name}` moved by RMS {rms:.3e}, more than sync.max_update_factor allows or not finite"
                )));
            }
            out.push((name, h));
        }
        Ok(out)
    }

    /// The weight of an upload that reports `work` in the average of the shared tensors, by
    /// `sync.average_by`: its rows (the run's rows per round when it reports none), or 1.
    fn weight_of(&self, work: &Work) -> f64 {
        match (self.cfg.weighs_by_tokens(), work.rows) {
            (false, _) => 1.0,
            (true, 0) => self.round_rows.unwrap_or(1) as f64,
            (true, rows) => rows as f64,
        }
    }

    /// Delta mode: what the last closed round published (`None` before any close).
    pub fn delta(&self) -> Option<&RoundDelta> {
        self.last_delta.as_ref()
    }

    /// When the open round closes by timeout (if anyone uploaded by then), as of `now`: the
    /// server's own silences since the round opened do not count.
    pub fn deadline(&self, now: f64) -> f64 {
        self.opened_at + self.cfg.round_timeout_s + self.members.silent_since_open(now, &self.cfg)
    }

    /// Whether the round can close: someone uploaded, and every member it waits for did
    /// ([`Coordinator::stalled`] ones it does not) or the timeout passed; or every live member sits it out (their caps are below what they own
    /// in it), when it closes with nothing trained so the next round splits under the caps.
    pub fn ready(&self, now: f64) -> bool {
        let uploaded = self.uploaded();
        let sitting_out = self.members.sitting_out();
        if uploaded.is_empty() {
            // Closing with nothing trained is for members that cannot train the round, not for
            // members that are slow to show it.
            let mut training = self.members.presumed_live(self.scope(), now, &self.cfg);
            training.retain(|p| !sitting_out.contains(p));
            return training.is_empty() && !sitting_out.is_empty();
        }
        let waited = self
            .members
            .waited(self.scope(), self.opened_at, now, &self.cfg);
        waited.is_subset(uploaded) || now >= self.deadline(now)
    }

    /// Live members of the open round that have not uploaded it and whose progress stalled:
    /// what the round does not wait for although their leases are current.
    pub fn stalled(&self, now: f64) -> BTreeSet<usize> {
        let mut stalled = self
            .members
            .stalled(self.scope(), self.opened_at, now, &self.cfg);
        stalled.retain(|p| !self.uploaded().contains(p));
        stalled
    }

    /// Aggregates (keeping the previous model if the result is not finite), merges on merge
    /// rounds, publishes, evicts and admits members, and opens the next round at `now`.
    pub fn close(&mut self, now: f64) -> RoundReport {
        let scope = self.scope().clone();
        let agg = std::mem::replace(&mut self.agg, aggregator(&self.cfg, scope.clone()));
        let peers: Vec<usize> = agg.uploaded().iter().copied().collect();
        let members = scope.members();
        let missing = members
            .iter()
            .filter(|p| !peers.contains(p))
            .copied()
            .collect();
        let step = self.round * self.cfg.sync_steps;
        // A round every member sat out trained nothing: nothing to merge either.
        let merge_alpha = self.cfg.merge_alpha_at(step).filter(|_| !peers.is_empty());
        let kept = self.publish(agg.finish(), merge_alpha);
        // Never for the server's own silence: a member it presumes live stays.
        let turnover = self.members.turnover(&scope, now, &self.cfg);
        self.last_work = std::mem::take(&mut self.work);
        self.members.open_next(scope.owners(), now, &self.cfg);
        let next_scope = self.next_scope(&scope, &turnover.next);
        let next_members: Vec<usize> = next_scope.members().into_iter().collect();
        if next_scope != scope {
            self.agg = aggregator(&self.cfg, next_scope);
        }
        let report = RoundReport {
            round: self.round,
            step,
            peers,
            missing,
            owners: scope.owners(),
            members: members.into_iter().collect(),
            merge_alpha: kept.merge_alpha,
            merges: kept.merges,
            discarded: kept.discarded,
            evicted: turnover.evicted,
            joined: turnover.joined,
            outer_scale: kept.outer_scale,
            work: self.shares(),
            budget: next_members
                .iter()
                .copied()
                .zip(self.budget(&next_members))
                .collect(),
            settings: self.next,
        };
        self.cfg = self.cfg.for_round(self.next);
        self.round += 1;
        self.opened_at = now;
        report
    }

    /// The next round's scope after one of `scope`: rebalanced over `next` members when they
    /// changed or a member's claim no longer fits, rotated every `sync.rotate_every_rounds`.
    fn next_scope(&self, scope: &Scope, next: &BTreeSet<usize>) -> Scope {
        let claims = self.claims(next);
        let mut next_scope = if *next != scope.members() || scope.strays_from(&claims) {
            scope
                .with_members(next, &claims)
                .expect("members stay within 1..=experts, each with room for one")
        } else {
            scope.clone()
        };
        let every = self.cfg.rotate_every_rounds;
        if every > 0 && self.round.is_multiple_of(every) {
            next_scope = next_scope.rotated();
        }
        next_scope
    }

    /// Each upload of the round just closed: what it trained and its share of the average.
    fn shares(&self) -> Vec<PeerWork> {
        let total: f64 = self.last_work.values().map(|w| self.weight_of(w)).sum();
        self.last_work
            .iter()
            .map(|(&peer, w)| PeerWork {
                peer,
                work: *w,
                weight: self.weight_of(w) / total,
            })
            .collect()
    }
}

impl Coordinator {
    /// The run ends with round `last`: on a lossy wire that round publishes every change whole
    /// in bf16, residual included, as the nodes upload it, so the final model holds all that
    /// was trained.
    pub fn ending_at(mut self, last: u64) -> Self {
        self.last_round = Some(last);
        self
    }

    /// `sync.round_by = "tokens"`: the rows each of `members` trains in the next round, in
    /// their order, split by the throughput the last closed round measured
    /// ([`budget::split`]); empty for a round by steps. The server recomputes it when the
    /// members change between rounds.
    pub fn budget(&self, members: &[usize]) -> Vec<u64> {
        match (self.cfg.round_by, self.round_rows) {
            (RoundBy::Tokens, Some(rows)) => {
                let total = rows * members.len() as u64;
                budget::split(total, self.cfg.sync_steps, members, &self.last_work)
            }
            _ => Vec::new(),
        }
    }

    /// The round before the open one had these owners (`owners[e]`, as its published record
    /// says): a restarted server checks handovers against them.
    pub fn after_owners(mut self, owners: Vec<usize>) -> Self {
        self.members.set_previous_owners(owners);
        self
    }

    /// Whether `peer` may hand over what it trained and had not sent of `experts` in its
    /// upload of the open round: each one an expert it does not own now and, when the owners
    /// of the round before are known, owned then. Delta wires only.
    pub fn check_handover(&self, peer: usize, experts: &[usize]) -> Result<(), RoundError> {
        if experts.is_empty() {
            return Ok(());
        }
        let invalid = |reason: String| RoundError::Invalid { peer, reason };
        if !matches!(self.scope(), Scope::Spes(_)) {
            return Err(invalid(format!(
                "hands over experts {experts:?}, but in DiLoCo every member trains every expert"
            )));
        }
        if !self.cfg.wire().is_delta() {
            return Err(invalid(format!(
                "hands over experts {experts:?}, but sync.wire = {:?} sends values",
                self.cfg.wire()
            )));
        }
        let owners = self.scope().owners();
        for &e in experts {
            if e >= self.layout.n_experts {
                return Err(invalid(format!(
                    "hands over expert {e}; the model has {}",
                    self.layout.n_experts
                )));
            }
            if owners.get(e) == Some(&peer) {
                return Err(invalid(format!("hands over expert {e}, which it owns")));
            }
            if self
                .members
                .previous_owners()
                .get(e)
                .is_some_and(|&o| o != peer)
            {
                return Err(invalid(format!(
                    "hands over expert {e}, which it did not own in round {}",
                    self.round - 1
                )));
            }
        }
        Ok(())
    }

    /// A node trains `rows` rows in a round at the run's batch (`sync_steps × batch_size ×
    /// grad_accum`): the unit of a round by tokens and the weight of an upload that reports
    /// none.
    pub fn with_round_rows(mut self, rows: u64) -> Self {
        self.round_rows = Some(rows);
        self
    }
}

/// The name of the first tensor holding a NaN or infinity.
fn first_non_finite(named: &Named) -> Option<String> {
    named
        .iter()
        .filter(|(_, t)| matches!(t.kind(), Kind::Float | Kind::BFloat16))
        .find(|(_, t)| !all_finite(t))
        .map(|(n, _)| n.clone())
}
