//! The server's round state machine, with no network and no clock of its own: joins, heartbeats,
//! uploads and the current time go in; published rounds and membership changes come out. gRPC
//! wraps it (spes-net's server).
//!
//! Membership is per round. A node is *live* while its lease (renewed by heartbeats, joins and
//! uploads) is younger than `lease_s`. A round closes when every live member uploaded, or
//! `timeout_s` after it opened, and never without an upload. At the close, members whose lease
//! has been expired for `evict_after_s` are evicted and nodes that asked to join are admitted;
//! the next round's ownership is rebalanced over the new members ([`Scope::with_members`]).

use crate::delta::{self, RoundDelta, WireForm};
use crate::outer::{norm_preserving_scale, OuterRules, OuterState, Source};
use crate::round::{
    all_finite, merge_experts, validate, validate_compressed, validate_delta, Aggregator, Combine,
    Combined, Layout, MergeEvent, MergeSchedule, Named, Scope,
};
use serde::Serialize;
use std::collections::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use tch::Kind;
use tch::Tensor;
use thiserror::Error;

/// When rounds close, who stays a member, and what happens at closing.
#[derive(Clone, Copy, Debug)]
pub struct RoundRules {
    /// Local steps per round (H): round r ends at sync step r·H.
    pub sync_steps: u64,
    /// Seconds after a round opened (its predecessor was published) to close it with whoever
    /// uploaded.
    pub timeout_s: f64,
    /// A node is live while its newest heartbeat is younger than this.
    pub lease_s: f64,
    /// A member whose lease has been expired this long is evicted at the next close.
    pub evict_after_s: f64,
    /// Expert merging; `None` for DiLoCo.
    pub merge: Option<MergeSchedule>,
    /// How averaged (shared) parameters are combined.
    pub combine: Combine,
    /// Largest RMS change of an uploaded tensor from the global model; `None`: unchecked.
    pub max_update_rms: Option<f64>,
    /// What uploads and published rounds carry ([`crate::delta`]).
    pub wire: WireForm,
    /// The outer optimizer applied to each round's change ([`crate::outer`]).
    pub outer: OuterRules,
    /// Rotate expert ownership ([`Scope::rotated`]) after every this many rounds; 0: never.
    pub rotate_every: u64,
}

/// Why the coordinator refused a call. The server maps each to one gRPC status whose details
/// carry the variant and its round, so nodes act on those, never on the text.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum RoundError {
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
#[derive(Clone, Debug, Serialize)]
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
}

#[derive(Clone, Copy, Debug)]
struct Lease {
    /// Process instance holding the peer id; 0 = not known yet (after a server restart).
    session: u64,
    renewed: f64,
}

/// Collects round `round()` on top of the model published at `round() - 1` (round 0 = θ⁰).
pub struct Coordinator {
    layout: Layout,
    rules: RoundRules,
    round: u64,
    global: Named,
    agg: Aggregator,
    opened_at: f64,
    leases: BTreeMap<usize, Lease>,
    joining: BTreeSet<usize>,
    /// Evicted peers; one that comes back is admitted again like a joiner.
    gone: BTreeSet<usize>,
    /// Delta mode: what the last closed round published.
    last_delta: Option<RoundDelta>,
    /// Lossy wires: what the published deltas have not carried yet, per tensor (fp32).
    residual: HashMap<String, Tensor>,
    outer: OuterState,
}

/// What a close computes before it is accepted.
struct Closing {
    global: Named,
    merges: Vec<MergeEvent>,
    /// Delta wire: what the round publishes.
    published: Option<RoundDelta>,
    /// The outer optimizer's new momenta, kept only if the round is.
    momenta: Named,
    /// [`RoundReport::outer_scale`].
    outer_scale: Option<f64>,
}

/// A round's aggregator under `rules`: it measures the uploads' spread when the outer step
/// needs it (norm-preserving scale, delta wires).
fn aggregator(rules: &RoundRules, scope: Scope) -> Aggregator {
    let spread = rules.outer.norm_preserving && rules.wire != WireForm::Values;
    Aggregator::new(scope, rules.combine).with_spread(spread)
}

const MOMENTUM: &str = "momentum/";
const RESIDUAL: &str = "residual/";

impl Coordinator {
    /// Starts after `published` rounds, with `global` the model published last and `scope` the
    /// open round's members. Every member gets a fresh lease of unknown session, so a restarted
    /// server waits for its nodes to report instead of declaring them dead.
    pub fn new(
        layout: Layout,
        scope: Scope,
        rules: RoundRules,
        global: Named,
        published: u64,
        gone: BTreeSet<usize>,
        now: f64,
    ) -> Self {
        let leases = scope
            .members()
            .into_iter()
            .map(|p| {
                (
                    p,
                    Lease {
                        session: 0,
                        renewed: now,
                    },
                )
            })
            .collect();
        Coordinator {
            agg: aggregator(&rules, scope),
            last_delta: None,
            residual: HashMap::new(),
            outer: OuterState::default(),
            layout,
            rules,
            round: published + 1,
            global,
            opened_at: now,
            leases,
            joining: BTreeSet::new(),
            gone,
        }
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
        &self.gone
    }

    /// What the server carries from round to round besides the model, for its restart point:
    /// the outer optimizer's momenta (`momentum/<name>`) and the lossy wires' residuals
    /// (`residual/<name>`), fp32.
    pub fn carried(&self) -> Named {
        let mut residual: Named = self
            .residual
            .iter()
            .map(|(n, t)| (format!("{RESIDUAL}{n}"), t.shallow_clone()))
            .collect();
        residual.sort_by(|a, b| a.0.cmp(&b.0));
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

    fn is_live(&self, peer: usize, now: f64) -> bool {
        self.leases
            .get(&peer)
            .is_some_and(|l| now - l.renewed < self.rules.lease_s)
    }

    /// Takes or renews `peer`'s lease for process `session` and says where it stands. A member
    /// is refused only if another live process holds its id; an evicted peer, or any peer with
    /// `join`, is admitted from the next round (at once if no member is live and the open round
    /// has no upload, so a run whose nodes all died can restart with new ones).
    pub fn join(
        &mut self,
        peer: usize,
        session: u64,
        join: bool,
        now: f64,
    ) -> Result<Standing, RoundError> {
        self.check_range(peer)?;
        self.take_lease(peer, session, now)?;
        if self.scope().members().contains(&peer) {
            return Ok(Standing::Member);
        }
        if !(join || self.joining.contains(&peer) || self.gone.contains(&peer)) {
            self.leases.remove(&peer);
            return Err(RoundError::NotMember { peer });
        }
        let members = self.scope().members().len();
        let max = self.scope().max_members();
        if !self.joining.contains(&peer) && members + self.joining.len() >= max {
            self.leases.remove(&peer);
            return Err(RoundError::RunFull { peer, members, max });
        }
        self.joining.insert(peer);
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

    fn take_lease(&mut self, peer: usize, session: u64, now: f64) -> Result<(), RoundError> {
        if let Some(l) = self.leases.get(&peer) {
            let age_s = now - l.renewed;
            let other = l.session != 0 && l.session != session;
            if other && age_s < self.rules.lease_s {
                return Err(RoundError::PeerTaken {
                    peer,
                    age_s,
                    wait_s: self.rules.lease_s - age_s,
                });
            }
        }
        self.leases.insert(
            peer,
            Lease {
                session,
                renewed: now,
            },
        );
        Ok(())
    }

    fn admit_joiners_now(&mut self) {
        let mut members = self.scope().members();
        members.extend(std::mem::take(&mut self.joining));
        for p in &members {
            self.gone.remove(p);
        }
        let scope = self
            .scope()
            .with_members(&members)
            .expect("join() keeps members within the expert count");
        self.agg = aggregator(&self.rules, scope);
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
                fetch: round,
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
        self.take_lease(peer, session, now)?;
        if self.uploaded().contains(&peer) {
            return Err(RoundError::Duplicate { peer, round });
        }
        Ok(())
    }

    /// Accepts `peer`'s upload for `round`, or says why not; a rejection changes nothing.
    /// Keeps none of `tensors`' storage, so they may view a mapped file (see [`Aggregator::add`]).
    pub fn upload(
        &mut self,
        peer: usize,
        session: u64,
        round: u64,
        tensors: Named,
        now: f64,
    ) -> Result<(), RoundError> {
        self.check_upload(peer, session, round, now)?;
        let invalid = |reason| RoundError::Invalid { peer, reason };
        let (layout, scope, bound) = (&self.layout, self.scope(), self.rules.max_update_rms);
        match self.rules.wire {
            WireForm::Values => validate(layout, scope, peer, &tensors, &self.global, bound),
            WireForm::Bf16Delta => validate_delta(layout, scope, peer, &tensors, bound),
            form @ (WireForm::Sparse { .. } | WireForm::Quantized { .. }) => {
                let deltas = validate_compressed(layout, scope, peer, tensors, form, bound)
                    .map_err(invalid)?;
                return self
                    .agg
                    .add_compressed(&self.layout, peer, deltas)
                    .map_err(|e| invalid(e.to_string()));
            }
        }
        .map_err(invalid)?;
        self.agg
            .add(&self.layout, peer, tensors)
            .map_err(|e| invalid(e.to_string()))
    }

    /// Delta mode: what the last closed round published (`None` before any close).
    pub fn delta(&self) -> Option<&RoundDelta> {
        self.last_delta.as_ref()
    }

    /// When the open round closes by timeout (if anyone uploaded by then).
    pub fn deadline(&self) -> f64 {
        self.opened_at + self.rules.timeout_s
    }

    /// Whether the round can close: someone uploaded, and every live member did or the
    /// timeout passed.
    pub fn ready(&self, now: f64) -> bool {
        let uploaded = self.uploaded();
        !uploaded.is_empty()
            && (self.live_members(now).is_subset(uploaded) || now >= self.deadline())
    }

    /// Aggregates (keeping the previous model if the result is not finite), merges on merge
    /// rounds, publishes, evicts and admits members, and opens the next round at `now`.
    pub fn close(&mut self, now: f64) -> RoundReport {
        let scope = self.scope().clone();
        let agg = std::mem::replace(&mut self.agg, aggregator(&self.rules, scope.clone()));
        let peers: Vec<usize> = agg.uploaded().iter().copied().collect();
        let members = scope.members();
        let missing = members
            .iter()
            .filter(|p| !peers.contains(p))
            .copied()
            .collect();
        let step = self.round * self.rules.sync_steps;
        let mut merge_alpha = self.rules.merge.and_then(|m| m.alpha(step));
        let Closing {
            global,
            mut merges,
            published,
            momenta,
            outer_scale,
        } = if self.rules.wire != WireForm::Values {
            self.close_deltas(agg.finish_deltas(), merge_alpha)
        } else {
            let mut global = agg.finish(&self.layout, &self.global);
            let momenta = self.outer_values(&mut global, &scope);
            let merges = match (merge_alpha, self.rules.merge) {
                (Some(a), Some(m)) => merge_experts(&mut global, &self.layout, m.top_k, a),
                _ => Vec::new(),
            };
            Closing {
                global,
                merges,
                published: None,
                momenta,
                outer_scale: None,
            }
        };
        // The published delta decides the model (base + delta, base finite): check it alone.
        let changed = published.as_ref().map_or(&global, |p| &p.delta);
        let discarded = first_non_finite(changed).map(|name| {
            format!("the aggregate of `{name}` is not finite; the previous model was kept")
        });
        if discarded.is_some() {
            merge_alpha = None;
            merges.clear();
            self.last_delta = (self.rules.wire != WireForm::Values).then(RoundDelta::default);
        } else {
            self.global = global;
            self.last_delta = published;
            self.outer.commit(momenta);
        }

        let expired = |p: &usize| {
            self.leases
                .get(p)
                .is_none_or(|l| now - l.renewed >= self.rules.lease_s + self.rules.evict_after_s)
        };
        let mut evicted: Vec<usize> = members.iter().filter(|p| expired(p)).copied().collect();
        if evicted.len() == members.len() {
            // Nobody would be left to adopt the experts: keep everyone until a node returns.
            evicted.clear();
        }
        let staying: BTreeSet<usize> = members
            .iter()
            .filter(|p| !evicted.contains(p))
            .copied()
            .collect();
        let room = scope.max_members().saturating_sub(staying.len());
        let joined: Vec<usize> = self.joining.iter().take(room).copied().collect();
        let mut next = staying;
        next.extend(&joined);
        for p in &joined {
            self.joining.remove(p);
            self.gone.remove(p);
        }
        for p in &evicted {
            self.gone.insert(*p);
            self.leases.remove(p);
        }
        let mut next_scope = if next != members {
            scope
                .with_members(&next)
                .expect("members stay within 1..=experts")
        } else {
            scope.clone()
        };
        let every = self.rules.rotate_every;
        if every > 0 && self.round.is_multiple_of(every) {
            next_scope = next_scope.rotated();
        }
        if next_scope != scope {
            self.agg = aggregator(&self.rules, next_scope);
        }
        let report = RoundReport {
            round: self.round,
            step,
            peers,
            missing,
            owners: scope.owners(),
            members: members.into_iter().collect(),
            merge_alpha,
            merges,
            discarded,
            evicted,
            joined,
            outer_scale,
        };
        self.round += 1;
        self.opened_at = now;
        report
    }
}

/// The name of the first tensor holding a NaN or infinity.
impl Coordinator {
    /// The delta wire's next global model, merges and published delta. Without a merge, each
    /// owned expert's delta is its owner's upload verbatim. Every other changed tensor's delta
    /// is its change encoded for the wire: the combined delta, or, on merge rounds, the merged
    /// value minus the base. Either way the model is the base plus the published delta, computed
    /// as every node computes it.
    fn close_deltas(&mut self, combined: Combined, merge_alpha: Option<f64>) -> Closing {
        let Combined {
            mut averaged,
            spread,
            uploads,
            mut owned,
            mut owned_compressed,
        } = combined;
        // Σ scale·numel and Σ numel over the averaged changes, for the report.
        let mut scaled = (0.0, 0.0);
        let merge = merge_alpha.zip(self.rules.merge);
        // An owner's expert is published as sent unless the server changes it.
        let verbatim = merge.is_none() && self.rules.outer.owned.is_average();
        let mut out = RoundDelta::default();
        let mut momenta = Vec::new();
        // The next model, starting from the base, and each tensor's fp32 change still to encode.
        let mut next: Named = Vec::with_capacity(self.global.len());
        let mut changes: Vec<Option<Tensor>> = Vec::with_capacity(self.global.len());
        for (name, base) in &self.global {
            let mut value = base.shallow_clone();
            let mut change = averaged.remove(name).map(|c| (Source::Averaged, c));
            if let Some((peer, d)) = owned.remove(name) {
                if verbatim {
                    value = delta::apply(base, &d);
                    out.verbatim.entry(peer).or_default().push(name.clone());
                    out.delta.push((name.clone(), d));
                } else {
                    change = Some((Source::Owned, d.to_kind(Kind::Float)));
                }
            } else if let Some((peer, c)) = owned_compressed.remove(name) {
                if verbatim {
                    value = base.copy();
                    c.apply_(&mut value);
                    let wire = c.into_wire(name);
                    let names = wire.iter().map(|(n, _)| n.clone());
                    out.verbatim.entry(peer).or_default().extend(names);
                    out.delta.extend(wire);
                } else {
                    change = Some((Source::Owned, c.dense(base)));
                }
            }
            let change = change.map(|(source, mut c)| {
                if let (Source::Averaged, Some(&mean_sq)) = (source, spread.get(name)) {
                    let norm = c.norm_scalaropt_dtype(2, Kind::Float).double_value(&[]);
                    let scale = norm_preserving_scale(mean_sq, norm * norm, uploads);
                    if scale != 1.0 {
                        c *= scale;
                    }
                    scaled.0 += scale * c.numel() as f64;
                    scaled.1 += c.numel() as f64;
                }
                let rule = self.rules.outer.of(source);
                if rule.is_average() {
                    return c;
                }
                let step = self.outer.step(name, rule, c);
                momenta.extend(step.momentum.map(|m| (name.clone(), m)));
                step.change
            });
            next.push((name.clone(), value));
            changes.push(change);
        }
        let merges = match merge {
            Some((alpha, m)) => {
                let mut values: Named = next
                    .iter()
                    .zip(&changes)
                    .map(|((n, b), c)| {
                        (
                            n.clone(),
                            c.as_ref().map_or_else(|| b.shallow_clone(), |c| b + c),
                        )
                    })
                    .collect();
                let merges = merge_experts(&mut values, &self.layout, m.top_k, alpha);
                // The merge replaces every expert it touches: its change is now from the base.
                for (((_, value), change), (_, base)) in
                    values.iter().zip(&mut changes).zip(&self.global)
                {
                    if value.data_ptr() != base.data_ptr() {
                        *change = Some(value - base);
                    }
                }
                merges
            }
            None => Vec::new(),
        };
        for (((name, value), change), (_, base)) in next.iter_mut().zip(changes).zip(&self.global) {
            let Some(change) = change else {
                continue;
            };
            *value = match self.rules.wire {
                form if form.is_lossy() => {
                    let mut v = change;
                    if let Some(r) = self.residual.get(name) {
                        v += r;
                    }
                    let c = delta::compress(&v, form);
                    let mut value = base.copy();
                    c.apply_(&mut value);
                    self.residual.insert(name.clone(), c.subtract_from(&v));
                    out.delta.extend(c.into_wire(name));
                    value
                }
                _ => {
                    let (d, value) = delta::encode_into(base, change);
                    out.delta.push((name.clone(), d));
                    value
                }
            };
        }
        Closing {
            global: next,
            merges,
            published: Some(out),
            momenta,
            outer_scale: (scaled.1 > 0.0).then(|| scaled.0 / scaled.1),
        }
    }

    /// The fp32 wire's outer step: every tensor the round changed becomes the base plus its
    /// outer step; returns the new momenta.
    fn outer_values(&self, global: &mut Named, scope: &Scope) -> Named {
        let mut momenta = Vec::new();
        for (((name, role, _), (_, value)), (_, base)) in
            self.layout.entries.iter().zip(global).zip(&self.global)
        {
            let source = if scope.averaged(*role) {
                Source::Averaged
            } else {
                Source::Owned
            };
            let rule = self.rules.outer.of(source);
            if rule.is_average() || value.data_ptr() == base.data_ptr() {
                continue;
            }
            let step = self.outer.step(name, rule, &*value - base);
            *value = base + step.change;
            momenta.extend(step.momentum.map(|m| (name.clone(), m)));
        }
        momenta
    }
}

fn first_non_finite(named: &Named) -> Option<String> {
    named
        .iter()
        .filter(|(_, t)| matches!(t.kind(), Kind::Float | Kind::BFloat16))
        .find(|(_, t)| !all_finite(t))
        .map(|(n, _)| n.clone())
}
