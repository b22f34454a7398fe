//! The node's half of SPES, the mirror of the server's [`crate::Coordinator`]: what a node
//! knows of the protocol, with no network, no files and no clock of its own. Tensors go in and
//! come out; the node (spes-net) moves them and the trainer makes them.
//!
//! A replica holds the node's sync state: the last global round it holds exactly (its *base*,
//! the fp32 values of the tensors it trains, on the delta wires), the deltas it sent in its last
//! upload, and which experts it owns. It does:
//! - the upload: trained tensors → wire tensors ([`Replica::upload`]), remembering what was
//!   sent; taken at the step boundary and encoded elsewhere when the node trains on
//!   ([`Replica::take_upload`]);
//! - the fetch plan: what to ask the server for ([`Replica::fetch_plan`]);
//! - the apply: a published delta → new weights ([`Replica::apply`]), keeping what the weights
//!   hold beyond the upload (steps trained since, with overlap; what a lossy wire did not
//!   send) on top of the new global model;
//! - following ownership ([`Replica::follow`]): which experts to train, and the base's
//!   bookkeeping when that changes: what it trained of an expert it loses and has not sent is
//!   handed over in its next upload ([`Replica::handing_over`]), not dropped;
//! - the decayed load-balancing scale of the node's own experts ([`Replica::lb_scale`]);
//! - with `sync.round_by = "tokens"`, the rows the server gave it for the next round
//!   ([`Replica::follow_budget`], [`Replica::step_rows`]);
//! - its state alone, for checkpoints that need not hold the whole model
//!   ([`Replica::state`], [`Replica::restore`]).
//!
//! Weights are the model's tensors by name (`Named`, sharing the model's storage): the replica
//! changes them in place and never keeps them.

use crate::budget;
use crate::config::{Mode, RoundBy, RoundSettings, SyncConfig};
use crate::delta::{self, Delta, WirePart};
use crate::named::{Layout, Named};
use spes_model::Role;
use std::collections::{HashMap, HashSet};
use tch::{Device, Kind, Tensor};
use thiserror::Error;

/// Why a replica could not do what was asked. The node maps these to what it tells the user.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ReplicaError {
    #[error("round {round} from the server is a delta, but this node holds {held}")]
    NotHeld { round: u64, held: String },
    #[error("round {round} from the server {reason}")]
    Malformed { round: u64, reason: String },
    #[error("round {round} from the server lacks `{name}`")]
    Missing { round: u64, name: String },
    #[error("no base copy of trained `{name}`: this node holds no global round yet")]
    NoBase { name: String },
    #[error("round {round}: no uploaded delta of `{name}` was kept to carry progress over")]
    NotSent { round: u64, name: String },
    #[error("saved replica state does not fit this model: {0}")]
    State(String),
}

type Result<T> = std::result::Result<T, ReplicaError>;

/// What to ask the server for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FetchPlan {
    /// `None`: the newest round.
    pub round: Option<u64>,
    /// This node holds the round before, exactly: a delta will do.
    pub have_previous: bool,
    /// Leave out this node's own experts that the round published as it sent them.
    pub skip_own: bool,
}

/// A published round's delta as fetched.
pub struct Published {
    pub round: u64,
    /// Its wire tensors.
    pub tensors: Named,
    /// The server left out this node's own experts (published as it sent them).
    pub skipped_own: bool,
    /// This node's upload went into this round.
    pub after_upload: bool,
    /// The node trained steps since its upload (overlap). Read by [`Replica::apply`];
    /// [`Replica::finish`] is told it instead, since a round prepared ahead is finished later.
    pub trained_since_upload: bool,
}

/// What applying a round did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The weights kept progress beyond the round (else they are the round, exactly).
    pub kept_progress: bool,
}

/// A replica's view for preparing a round ([`Replica::preparer`]): it shares the base's,
/// the sent deltas' and the frozen weights' storage, and reads them only. Until the round it
/// prepares is finished, nothing may change the replica or those weights but training its own
/// tensors: no upload, apply, `hold`, `take_base`, `follow` or `restore` (the node settles the
/// round before any of them). An upload encoded after the preparer was made is told to it with
/// [`Preparer::with_upload`] and to the replica with [`Replica::sent`] before the finish.
pub struct Preparer {
    cfg: SyncConfig,
    layout: Layout,
    held: Option<u64>,
    base_round: Option<u64>,
    base: HashMap<String, Tensor>,
    sent: HashMap<String, Delta>,
    /// Expand what was sent (fp32) where progress may be kept.
    expand_sent: bool,
    /// Tensors whose progress comes from the feedback buffer's changes instead.
    buffered: HashSet<String>,
    /// The weights of tensors without a base (experts this node does not train), when `ahead`.
    frozen: Named,
    ahead: bool,
}

/// A published round decoded and checked, with (when prepared ahead) each tensor's value after
/// it and the fp32 form of what this node sent: what [`Replica::finish`] applies.
pub struct Prepared {
    round: u64,
    after_upload: bool,
    deltas: HashMap<String, Delta>,
    /// Each tensor's value after the round: a trained tensor's new base, another's new weight.
    after: HashMap<String, Tensor>,
    /// `f32(sent)` per trained tensor whose progress is kept by subtracting it.
    sent: HashMap<String, Tensor>,
}

impl Preparer {
    /// Takes what the upload this round follows left, when that upload was encoded after the
    /// preparer was made ([`Replica::take_upload`] ahead).
    pub fn with_upload(&mut self, sent: &Sent) {
        let Some(s) = &sent.0 else {
            return;
        };
        self.sent = s.sent.iter().map(|(n, d)| (n.clone(), d.share())).collect();
        if let Some(b) = &s.buffer {
            self.buffered = b.changes.keys().cloned().collect();
        }
        self.expand_sent = self.ahead && !s.flushed && self.cfg.keeps_progress();
    }

    /// Decodes and checks `published` (it must follow the round the replica holds) and, when
    /// prepared ahead, forms what the round does to every tensor, each value by the same fp32
    /// operations in the same order as [`Replica::finish`] would in place, so the bits agree.
    pub fn prepare(self, published: Published) -> Result<Prepared> {
        let round = published.round;
        if self.base_round.is_none_or(|b| b + 1 != round) {
            return Err(ReplicaError::NotHeld {
                round,
                held: self
                    .held
                    .map_or("no round".into(), |r| format!("round {r}")),
            });
        }
        let layout = &self.layout;
        let deltas = delta::decode(published.tensors, &self.cfg, round, |n| layout.shape_of(n))
            .map_err(|reason| ReplicaError::Malformed { round, reason })?;
        let mut deltas: HashMap<String, Delta> = deltas.into_iter().collect();
        if published.skipped_own {
            for (name, d) in &self.sent {
                let expert = layout
                    .position(name)
                    .is_some_and(|i| matches!(layout.entries[i].1, Role::Expert { .. }));
                if expert {
                    deltas.entry(name.clone()).or_insert_with(|| d.share());
                }
            }
        }
        let mut after = HashMap::new();
        let mut sent = HashMap::new();
        if self.ahead {
            tch::no_grad(|| {
                let values = self
                    .base
                    .iter()
                    .chain(self.frozen.iter().map(|(n, t)| (n, t)));
                for (name, t) in values {
                    if let Some(d) = deltas.get(name) {
                        let mut v = t.copy();
                        d.apply_(&mut v);
                        after.insert(name.clone(), v);
                    }
                }
                if self.expand_sent && published.after_upload {
                    for (name, b) in &self.base {
                        match self.sent.get(name) {
                            Some(d) if d.subtracts_as_dense() && !self.buffered.contains(name) => {
                                sent.insert(name.clone(), d.to_f32(b));
                            }
                            _ => {}
                        }
                    }
                }
            });
        }
        // A tensor with its value formed needs its delta no more.
        deltas.retain(|name, _| !after.contains_key(name));
        Ok(Prepared {
            round,
            after_upload: published.after_upload,
            deltas,
            after,
            sent,
        })
    }
}

/// A round's upload taken from the weights ([`Replica::take_upload`]), not yet encoded.
pub struct Uploader {
    cfg: SyncConfig,
    round: u64,
    last: bool,
    /// Each trained tensor in order, and whether it is an expert's.
    tensors: Vec<(String, Taken, bool)>,
    /// `sync.feedback = "buffer"`: what earlier uploads did not send, per trained tensor.
    feedback: HashMap<String, Tensor>,
    /// What this upload hands over of experts the node lost, by name in order.
    handover: Named,
}

/// A trained tensor as an upload took it.
enum Taken {
    /// Its change from the base, copied (encoded ahead).
    Change(Tensor),
    /// The weight and base themselves (encoded in place, before the node trains on).
    Weights { theta: Tensor, base: Tensor },
    /// Its value (the fp32 wire).
    Value(Tensor),
}

/// What an encoded upload leaves the replica for the next apply ([`Replica::sent`]): nothing
/// on the fp32 wire.
pub struct Sent(Option<SentState>);

struct SentState {
    sent: HashMap<String, Delta>,
    flushed: bool,
    /// `Some` when the upload used a feedback buffer.
    buffer: Option<Buffer>,
}

/// A feedback buffer after an upload: what is still unsent, and each tensor's change at the
/// upload (kept when progress may be kept).
struct Buffer {
    feedback: HashMap<String, Tensor>,
    changes: HashMap<String, Tensor>,
}

impl Uploader {
    /// Encodes the upload: its wire tensors, and what the replica must be told back.
    pub fn encode(self) -> (Named, Sent) {
        let cfg = &self.cfg;
        let mut wire = Vec::new();
        let mut sent = HashMap::new();
        let mut feedback = HashMap::new();
        let mut changes = HashMap::new();
        let keep_all = cfg.keeps_progress();
        let buffer = cfg.feeds_back_in_buffer();
        // A buffer earlier lossy rounds left goes out whole with a lossless wire's first upload.
        let buffered = buffer || !self.feedback.is_empty();
        for (name, taken, expert) in self.tensors {
            let change = match taken {
                Taken::Value(t) => {
                    wire.push((name, t));
                    continue;
                }
                Taken::Change(c) => c,
                Taken::Weights { theta, base } => tch::no_grad(|| &theta - &base),
            };
            // SparseLoCo: e ← β·e + Δ; send C(e); e ← e − C(e).
            let owed = match self.feedback.get(&name) {
                Some(e) => tch::no_grad(|| e * cfg.feedback_decay + &change),
                None => change.shallow_clone(),
            };
            let d = if self.last {
                Delta::whole(&owed)
            } else {
                Delta::of_change(&owed, cfg, self.round)
            };
            if buffer && !self.last {
                feedback.insert(name.clone(), d.subtract_from(&owed));
            }
            if buffered && keep_all {
                changes.insert(name.clone(), change);
            }
            wire.extend(d.share().into_wire(&name));
            if keep_all || expert {
                sent.insert(name, d);
            }
        }
        for (name, h) in &self.handover {
            wire.extend(Delta::whole(h).into_wire(&WirePart::Handover.name(name)));
        }
        if !cfg.wire().is_delta() {
            return (wire, Sent(None));
        }
        let state = SentState {
            sent,
            flushed: self.last,
            buffer: buffered.then_some(Buffer { feedback, changes }),
        };
        (wire, Sent(Some(state)))
    }
}

/// What following a round's ownership changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Follow {
    /// This node is not a member of the next round: it must ask to join again.
    NotMember,
    Member {
        /// The experts it owns changed: the trainer must train the new set.
        changed: bool,
        /// Weights of dropped experts went back to the global value (progress discarded): the
        /// trainer must republish its weights.
        reset: bool,
        /// The experts it owns, ascending.
        experts: Vec<usize>,
    },
}

/// A replica's state on its own: enough, with the global model of `base_round`, to rebuild the
/// node's weights (for checkpoints that do not hold the whole model).
pub struct ReplicaState {
    /// The global round the weights are built on.
    pub base_round: u64,
    /// `owned[e]`: this node trains expert e.
    pub owned: Vec<bool>,
    /// Trained tensors' weights minus the base (fp32), where they differ: steps since the
    /// upload, what a lossy wire has not sent. Empty when the weights are the round exactly.
    pub remainder: Named,
    /// `sync.feedback = "buffer"`: what this node has not sent yet, per trained tensor (fp32),
    /// by name.
    pub feedback: Named,
    /// What it trained of experts it no longer owns and has not sent, to hand over in the
    /// upload of round `base_round + 1` (fp32), by name.
    pub handover: Named,
}

/// The last global round a node holds exactly: the fp32 values of the tensors it trains.
struct Base {
    round: u64,
    values: HashMap<String, Tensor>,
}

/// The node's half of the protocol ([module docs](self)).
pub struct Replica {
    peer: usize,
    cfg: SyncConfig,
    layout: Layout,
    /// `owned[e]`: this node trains expert e (every expert in DiLoCo).
    owned: Vec<bool>,
    /// The last global round the weights were brought to exactly (any wire).
    held: Option<u64>,
    /// Delta wires: the base, round `held`'s values. `None` before the first round is held,
    /// and on the fp32 wire.
    base: Option<Base>,
    /// Delta wires: the deltas of the last upload that the next apply needs (own experts, or
    /// every trained tensor when progress is kept), by name.
    sent: HashMap<String, Delta>,
    /// `sync.feedback = "buffer"`: what this node has not sent yet, per trained tensor.
    feedback: HashMap<String, Tensor>,
    /// The last upload was the run's last round, sent whole: its round is the final model,
    /// with nothing left to carry.
    flushed: bool,
    /// `sync.feedback = "buffer"` with overlap: each trained tensor's change at the last
    /// upload, before the buffer was added, so steps trained since can be kept.
    changes: HashMap<String, Tensor>,
    /// `sync.round_by = "tokens"`: the rows the server gave this node for the round it trains
    /// (`None`: the run's batch, until a round says otherwise).
    rows: Option<u64>,
    /// The rows the newest published round gave it, taken up when a round starts, so every
    /// round trains one budget whole (with overlap a round arrives mid-round).
    next_rows: Option<u64>,
    /// What it trained of experts it lost at the last ownership change and has not sent
    /// (fp32), by tensor name: handed over in the upload of round `handover_round` alone.
    handover: HashMap<String, Tensor>,
    handover_round: Option<u64>,
    /// The weights hold the base round by applying its delta to the round before (progress
    /// kept), rather than by loading a whole model: only then is a handover owed.
    consecutive: bool,
    /// The last apply kept progress on top of the base: the weights carry more than it even
    /// when the next round's settings would not (a lossless round after lossy ones).
    carries: bool,
}

impl Replica {
    /// The replica of peer `peer` of a run with these `[sync]` rules and this model layout. It
    /// owns no expert and holds no round until told ([`Replica::follow`], [`Replica::hold`]).
    pub fn new(peer: usize, cfg: SyncConfig, layout: Layout) -> Replica {
        Replica {
            peer,
            owned: vec![false; layout.n_experts],
            cfg,
            layout,
            held: None,
            base: None,
            sent: HashMap::new(),
            feedback: HashMap::new(),
            changes: HashMap::new(),
            flushed: false,
            rows: None,
            next_rows: None,
            handover: HashMap::new(),
            handover_round: None,
            consecutive: false,
            carries: false,
        }
    }

    /// Whether the weights may carry more than the base: the last apply kept progress (whatever
    /// the next round's settings), or this round's settings keep it.
    fn weights_carry(&self) -> bool {
        self.carries || self.cfg.keeps_progress()
    }

    /// The `[sync]` rules of the round this node trains, with its settings.
    pub fn cfg(&self) -> &SyncConfig {
        &self.cfg
    }

    /// Takes the settings a published round announces for the next one, at the round
    /// boundary: after applying that round and before training on. What lossy rounds left
    /// unsent stays with the node (in its weights, or its buffer, which the next upload
    /// flushes whole when the new wire is lossless).
    pub fn follow_settings(&mut self, settings: RoundSettings) {
        self.cfg = self.cfg.for_round(settings);
    }

    /// The peer id.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// `owned()[e]`: this node trains expert e.
    pub fn owned(&self) -> &[bool] {
        &self.owned
    }

    /// Whether this node trains (and uploads) a parameter of this role.
    pub fn trains(&self, role: Role) -> bool {
        trains(&self.owned, role)
    }

    /// The global round the weights build on, once one is held.
    pub fn base_round(&self) -> Option<u64> {
        self.held
    }

    /// The base value of trained tensor `name`: round [`Replica::base_round`]'s, exactly.
    pub fn base_of(&self, name: &str) -> Option<&Tensor> {
        self.base.as_ref()?.values.get(name)
    }

    /// The weights hold round `round` exactly (a whole model was loaded into them, or they were
    /// saved right after loading it): the trained ones become the base.
    pub fn hold(&mut self, round: u64, weights: &Named) {
        self.sent.clear();
        self.handover.clear();
        self.consecutive = false;
        self.carries = false;
        self.held = Some(round);
        self.base = self.cfg.wire().is_delta().then(|| Base {
            round,
            values: self
                .trained(weights)
                .map(|(n, t)| (n.clone(), tch::no_grad(|| t.detach().copy())))
                .collect(),
        });
    }

    /// Takes round `round`'s whole model as the base, keeping the weights (which hold
    /// progress made since that round).
    pub fn take_base(&mut self, round: u64, model: Named, weights: &Named) -> Result<()> {
        let mut model: HashMap<String, Tensor> = model.into_iter().collect();
        let mut values = HashMap::new();
        for (name, w) in self.trained(weights) {
            let t = model.remove(name).ok_or_else(|| ReplicaError::Missing {
                round,
                name: name.clone(),
            })?;
            values.insert(name.clone(), t.to_device(w.device()).to_kind(Kind::Float));
        }
        self.sent.clear();
        self.handover.clear();
        self.consecutive = false;
        self.carries = true;
        self.held = Some(round);
        self.base = Some(Base { round, values });
        Ok(())
    }

    /// The trained tensors of `weights`, in order.
    fn trained<'a>(&'a self, weights: &'a Named) -> impl Iterator<Item = &'a (String, Tensor)> {
        weights.iter().filter(|(n, _)| {
            self.layout
                .position(n)
                .is_some_and(|i| self.trains(self.layout.entries[i].1))
        })
    }

    fn is_expert(&self, name: &str) -> bool {
        self.layout
            .position(name)
            .is_some_and(|i| matches!(self.layout.entries[i].1, Role::Expert { .. }))
    }

    /// The upload of the round that ends now: the trained tensors of `weights` in the wire
    /// form of `sync.wire` for round `round` — whole fp32 tensors, or each one's change from the
    /// base — as wire tensors (store their floats as [`delta::payload_kind`]). The run's `last`
    /// round sends every change whole in bf16 on a lossy wire too, so the final model holds all
    /// that was trained. Remembers what the next [`Replica::apply`] needs of it.
    /// [`Replica::take_upload`], [`Uploader::encode`] and [`Replica::sent`], in place.
    pub fn upload(&mut self, weights: &Named, round: u64, last: bool) -> Result<Named> {
        let (wire, sent) = self.take_upload(weights, round, last, false)?.encode();
        self.sent(sent);
        Ok(wire)
    }

    /// Takes the upload of the round that ends now from `weights` ([`Replica::upload`]), to be
    /// encoded by [`Uploader::encode`] (on another thread, while the node trains on, when
    /// `ahead`: each trained tensor's change is copied now) and
    /// told back with [`Replica::sent`] before anything else reads or changes the replica.
    pub fn take_upload(
        &mut self,
        weights: &Named,
        round: u64,
        last: bool,
        ahead: bool,
    ) -> Result<Uploader> {
        let cfg = self.cfg.clone();
        if !self.cfg.wire().is_delta() {
            // The fp32 wire sends values and leaves the replica as it is. It has no overlap
            // (`SyncConfig::overlaps`), so its values are encoded before training goes on.
            let tensors = self
                .trained(weights)
                .map(|(n, t)| (n.clone(), Taken::Value(t.detach()), false))
                .collect();
            return Ok(Uploader {
                cfg,
                round,
                last,
                tensors,
                feedback: HashMap::new(),
                handover: Vec::new(),
            });
        }
        let mut tensors = Vec::new();
        for (name, t) in self.trained(weights) {
            let b = self
                .base
                .as_ref()
                .and_then(|b| b.values.get(name))
                .ok_or_else(|| ReplicaError::NoBase { name: name.clone() })?;
            let taken = if ahead {
                Taken::Change(tch::no_grad(|| t - b))
            } else {
                Taken::Weights {
                    theta: t.shallow_clone(),
                    base: b.shallow_clone(),
                }
            };
            tensors.push((name.clone(), taken, self.is_expert(name)));
        }
        let handover = if self.handover_round == Some(round) {
            crate::named::sorted(&self.handover)
        } else {
            // Owed to another round's upload, which did not happen (the node resynced).
            self.handover.clear();
            self.handover_round = None;
            Vec::new()
        };
        // In flight until told back: nothing may read what the last upload left.
        self.sent.clear();
        Ok(Uploader {
            cfg,
            round,
            last,
            tensors,
            feedback: std::mem::take(&mut self.feedback),
            handover,
        })
    }

    /// Takes back what an upload taken by [`Replica::take_upload`] left for the next apply.
    pub fn sent(&mut self, sent: Sent) {
        let Some(sent) = sent.0 else {
            return;
        };
        self.sent = sent.sent;
        self.flushed = sent.flushed;
        if let Some(buffer) = sent.buffer {
            self.feedback = buffer.feedback;
            self.changes = buffer.changes;
        }
    }

    /// The experts whose unsent change the upload of round `round` hands over (ascending): the
    /// experts this node lost at the ownership change before that round, where it had trained
    /// more than it sent. The upload carries their tensors whole in bf16 as `<name>#handover`,
    /// and the server adds them to the expert's change, so its new owner gets them in the next
    /// round's model.
    pub fn handing_over(&self, round: u64) -> Vec<usize> {
        if self.handover_round != Some(round) {
            return Vec::new();
        }
        self.handing_over_experts()
    }

    /// Fills the handover with zeros for every tensor of a handed expert that owes nothing
    /// (e.g. a layer whose router sent the expert no token): the server sizes an upload by
    /// every tensor of each expert it names.
    fn whole_experts_in_handover(&mut self) {
        let Some(device) = self.handover.values().next().map(Tensor::device) else {
            return;
        };
        let handed = self.handing_over_experts();
        for (name, role, shape) in &self.layout.entries {
            if matches!(role, Role::Expert { index, .. } if handed.contains(index)) {
                self.handover
                    .entry(name.clone())
                    .or_insert_with(|| Tensor::zeros(shape.as_slice(), (Kind::Float, device)));
            }
        }
    }

    /// The experts of the tensors held for a handover, ascending.
    fn handing_over_experts(&self) -> Vec<usize> {
        let mut experts: Vec<usize> = self
            .handover
            .keys()
            .filter_map(|n| match self.layout.entries[self.layout.position(n)?].1 {
                Role::Expert { index, .. } => Some(index),
                Role::Shared => None,
            })
            .collect();
        experts.sort_unstable();
        experts.dedup();
        experts
    }

    /// How to fetch round `round` (`None`: the newest): as a delta if this node holds the round
    /// before exactly, then without its own experts if this node's upload went into it (the
    /// server published them as sent).
    pub fn fetch_plan(&self, round: Option<u64>, after_upload: bool) -> FetchPlan {
        let have_previous = round.is_some_and(|r| self.base_round().is_some_and(|b| b + 1 == r));
        FetchPlan {
            round,
            have_previous,
            skip_own: have_previous && after_upload && self.cfg.skip_own_experts,
        }
    }

    /// Applies a published delta to the base and the weights: every tensor becomes the base
    /// plus the delta (bit-identical to the server's model, see [`crate::delta`]). When this
    /// node's upload went into the round and its weights carry more than it sent (a lossy wire,
    /// or steps trained since, with overlap), that progress is kept on top:
    /// `θ ← global + (θ_now − base_before − sent)`. [`Replica::preparer`] then
    /// [`Replica::finish`], in place (no tensor beyond the deltas).
    pub fn apply(&mut self, published: Published, weights: &Named) -> Result<Applied> {
        let trained_since = published.trained_since_upload;
        let prepared = self.preparer(weights, false).prepare(published)?;
        self.finish(prepared, weights, trained_since)
    }

    /// What [`Preparer::prepare`] needs of this replica and `weights`, detached (sharing their
    /// storage), so that a round can be prepared on another thread while the node trains on.
    /// `ahead`: form each tensor's value after the round and the fp32 form of what was sent
    /// there, so [`Replica::finish`] is left a few element-wise passes; this costs about two
    /// copies of the model while the round is in flight (the node does it on CPU, where
    /// decoding is what takes the time).
    pub fn preparer(&self, weights: &Named, ahead: bool) -> Preparer {
        let base: HashMap<String, Tensor> = self.base.as_ref().map_or_else(HashMap::new, |b| {
            b.values
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect()
        });
        // Steps trained since the upload are known only when the round is applied: the sent
        // deltas are expanded whenever progress may be kept.
        let may_keep = !self.flushed && self.cfg.keeps_progress();
        let frozen = if ahead {
            weights
                .iter()
                .filter(|(n, _)| !base.contains_key(n))
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect()
        } else {
            Vec::new()
        };
        Preparer {
            cfg: self.cfg.clone(),
            layout: self.layout.clone(),
            held: self.held,
            base_round: self.base.as_ref().map(|b| b.round),
            base,
            sent: self
                .sent
                .iter()
                .map(|(n, d)| (n.clone(), d.share()))
                .collect(),
            expand_sent: ahead && may_keep,
            buffered: self.changes.keys().cloned().collect(),
            frozen,
            ahead,
        }
    }

    /// Applies a prepared round ([`Replica::apply`] does both halves), keeping progress when
    /// the node's upload went into it and its weights carry more than it sent
    /// (`trained_since_upload`: it trained steps since that upload, with overlap).
    pub fn finish(
        &mut self,
        mut prepared: Prepared,
        weights: &Named,
        trained_since_upload: bool,
    ) -> Result<Applied> {
        let round = prepared.round;
        let held = self.base_round();
        let base = self
            .base
            .as_mut()
            .filter(|b| b.round + 1 == round)
            .ok_or_else(|| ReplicaError::NotHeld {
                round,
                held: held.map_or("no round".into(), |r| format!("round {r}")),
            })?;
        // After the last round the weights are the final model: a flushed upload leaves only
        // its bf16 rounding, which no later round would carry.
        let keep_progress = prepared.after_upload
            && !std::mem::take(&mut self.flushed)
            && (self.cfg.feeds_back_in_weights() || self.cfg.overlaps() && trained_since_upload);
        let changes = std::mem::take(&mut self.changes);
        let deltas = &prepared.deltas;
        tch::no_grad(|| -> Result<()> {
            for (name, w) in weights {
                let d = deltas.get(name);
                let after = prepared.after.remove(name);
                let mut theta = w.shallow_clone();
                match base.values.get_mut(name) {
                    Some(b) => {
                        let not_sent = || ReplicaError::NotSent {
                            round,
                            name: name.clone(),
                        };
                        let progress = match (keep_progress, changes.get(name)) {
                            (false, _) => None,
                            // A buffer holds what was not sent: keep only steps trained since.
                            (true, Some(change)) => Some(&theta - &*b - change),
                            (true, None) => match prepared.sent.get(name) {
                                Some(sent) => Some(&theta - &*b - sent),
                                None => {
                                    let sent = self.sent.get(name).ok_or_else(not_sent)?;
                                    Some(sent.subtract_from(&(&theta - &*b)))
                                }
                            },
                        };
                        // A value formed ahead took its delta's place.
                        if let Some(a) = after {
                            *b = a;
                        } else if let Some(d) = d {
                            d.apply_(b);
                        }
                        theta.copy_(b);
                        if let Some(p) = progress {
                            let _ = theta.g_add_(&p);
                        }
                    }
                    None => {
                        if let Some(a) = after {
                            theta.copy_(&a);
                        } else if let Some(d) = d {
                            d.apply_(&mut theta);
                        }
                    }
                }
            }
            Ok(())
        })?;
        base.round = round;
        self.held = Some(round);
        self.sent.clear();
        self.consecutive = true;
        self.carries = keep_progress;
        if self.handover_round.is_some_and(|r| r <= round) {
            self.handover.clear();
            self.handover_round = None;
        }
        Ok(Applied {
            kept_progress: keep_progress,
        })
    }

    /// Follows the ownership a published round announces for the next one (`owners[e]`: the
    /// peer training expert e; empty in DiLoCo, where every member trains every expert). A
    /// newly owned expert holds the global value, which becomes its base; a dropped one leaves
    /// the base, and when the weights carry progress it goes back to the global value (that
    /// progress is its new owner's to make).
    pub fn follow(&mut self, owners: &[usize], members: &[usize], weights: &Named) -> Follow {
        if !members.contains(&self.peer) {
            return Follow::NotMember;
        }
        let owned: Vec<bool> = (0..self.owned.len())
            .map(|e| match owners.get(e) {
                Some(&o) => o == self.peer,
                None => self.cfg.mode == Mode::Diloco,
            })
            .collect();
        let changed = owned != self.owned;
        let mut reset = false;
        if changed {
            let before = std::mem::replace(&mut self.owned, owned);
            let keeps_progress = self.weights_carry();
            let next_round = self.held.map(|r| r + 1);
            if let Some(base) = &mut self.base {
                for (name, w) in weights {
                    let Some(i) = self.layout.position(name) else {
                        continue;
                    };
                    let role = self.layout.entries[i].1;
                    match (trains(&before, role), trains(&self.owned, role)) {
                        (false, true) => {
                            base.values
                                .insert(name.clone(), tch::no_grad(|| w.detach().copy()));
                        }
                        (true, false) => {
                            let buffered = self.feedback.remove(name);
                            if let Some(b) = base.values.remove(name) {
                                // What it trained and has not sent goes to the new owner.
                                let owed = tch::no_grad(|| {
                                    let trained = keeps_progress.then(|| w - &b);
                                    match (trained, buffered) {
                                        (Some(t), Some(e)) => Some(t + e),
                                        (t, e) => t.or(e),
                                    }
                                });
                                let owed = owed.filter(|o| {
                                    self.consecutive && o.abs().max().double_value(&[]) > 0.0
                                });
                                if let (Some(o), Some(r)) = (owed, next_round) {
                                    self.handover.insert(name.clone(), o);
                                    self.handover_round = Some(r);
                                }
                                if keeps_progress {
                                    tch::no_grad(|| w.shallow_clone().copy_(&b));
                                    reset = true;
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            self.whole_experts_in_handover();
        }
        Follow::Member {
            changed,
            reset,
            experts: (0..self.owned.len()).filter(|&e| self.owned[e]).collect(),
        }
    }

    /// Follows the rows a published round gives each member of the next one (`budget`, in the
    /// order of `members`; empty when the round is by steps, or from a server that sent none):
    /// this node's share, when the run is by tokens, from the next round it starts
    /// ([`Replica::start_round`]). Otherwise the node trains the run's batch.
    pub fn follow_budget(&mut self, members: &[usize], budget: &[u64]) {
        self.next_rows = None;
        if self.cfg.round_by != RoundBy::Tokens || budget.len() != members.len() {
            return;
        }
        self.next_rows = members
            .iter()
            .position(|&p| p == self.peer)
            .map(|i| budget[i])
            .filter(|&rows| rows > 0);
    }

    /// A round's first step is next: it trains the newest budget followed.
    pub fn start_round(&mut self) {
        self.rows = self.next_rows;
    }

    /// The rows this node trains in the round: its budget, or `nominal` (the run's
    /// `sync_steps × batch_size × grad_accum`) without one.
    pub fn round_rows(&self, nominal: u64) -> u64 {
        self.rows.unwrap_or(nominal)
    }

    /// The rows of step `k` (0-based within the round) of a round of `nominal` rows at the
    /// run's batch: its budget spread evenly over the round's `sync_steps` steps, at least one.
    pub fn step_rows(&self, k: u64, nominal: u64) -> u64 {
        let steps = self.cfg.sync_steps.max(1);
        budget::step_rows(self.round_rows(nominal).max(steps), steps, k % steps)
    }

    /// Decayed load balancing (docs/design/algorithm.md §6): the per-expert multiplier `[E]` of
    /// the load-balancing counts at `step` of a `max_steps` run, γ for this node's own experts
    /// and 1 for the others; `None` when off.
    pub fn lb_scale(&self, step: u64, max_steps: u64, device: Device) -> Option<Tensor> {
        let gamma = self.cfg.decayed_lb_gamma(step, max_steps)?;
        let scale: Vec<f32> = self
            .owned
            .iter()
            .map(|&own| if own { gamma as f32 } else { 1.0 })
            .collect();
        Some(Tensor::from_slice(&scale).to_device(device))
    }

    /// The replica's state with the weights it describes, once a round is held: the base round,
    /// ownership, and what the trained weights carry beyond the base.
    pub fn state(&self, weights: &Named) -> Option<ReplicaState> {
        let round = self.held?;
        let remainder = match &self.base {
            Some(base) if self.weights_carry() => tch::no_grad(|| {
                self.trained(weights)
                    .filter_map(|(n, t)| {
                        let r = t - base.values.get(n)?;
                        Some((n.clone(), r))
                    })
                    .collect()
            }),
            _ => Vec::new(),
        };
        let feedback = crate::named::sorted(&self.feedback);
        let handover = match self.handover_round {
            Some(r) if r == round + 1 => crate::named::sorted(&self.handover),
            _ => Vec::new(),
        };
        Some(ReplicaState {
            base_round: round,
            owned: self.owned.clone(),
            remainder,
            feedback,
            handover,
        })
    }

    /// Restores a saved state on top of `global`, the whole model of `state.base_round`: the
    /// weights become that model plus the saved remainder, and that model the base.
    pub fn restore(&mut self, state: ReplicaState, global: Named, weights: &Named) -> Result<()> {
        if state.owned.len() != self.owned.len() {
            return Err(ReplicaError::State(format!(
                "it owns {} experts' flags, the model has {}",
                state.owned.len(),
                self.owned.len()
            )));
        }
        let mut global: HashMap<String, Tensor> = global.into_iter().collect();
        let mut remainder: HashMap<String, Tensor> = state.remainder.into_iter().collect();
        let carried = !remainder.is_empty();
        self.owned = state.owned;
        let round = state.base_round;
        tch::no_grad(|| -> Result<()> {
            for (name, w) in weights {
                let g = global.remove(name).ok_or_else(|| ReplicaError::Missing {
                    round,
                    name: name.clone(),
                })?;
                w.shallow_clone().copy_(&g);
            }
            Ok(())
        })?;
        self.hold(round, weights);
        tch::no_grad(|| -> Result<()> {
            for (name, w) in self.trained(weights) {
                if let Some(r) = remainder.remove(name) {
                    if r.size() != w.size() {
                        return Err(ReplicaError::State(format!(
                            "remainder of `{name}` has shape {:?}, expected {:?}",
                            r.size(),
                            w.size()
                        )));
                    }
                    let _ = w.shallow_clone().g_add_(&r.to_device(w.device()));
                }
            }
            Ok(())
        })?;
        if let Some(name) = remainder.keys().next() {
            return Err(ReplicaError::State(format!(
                "it has a remainder of `{name}`, which this node does not train"
            )));
        }
        self.carries = carried;
        let mut feedback = HashMap::new();
        for (name, e) in state.feedback {
            let w = self
                .trained(weights)
                .find(|(n, _)| *n == name)
                .map(|(_, w)| w)
                .ok_or_else(|| {
                    ReplicaError::State(format!(
                        "it has unsent feedback of `{name}`, which this node does not train"
                    ))
                })?;
            if e.size() != w.size() {
                return Err(ReplicaError::State(format!(
                    "feedback of `{name}` has shape {:?}, expected {:?}",
                    e.size(),
                    w.size()
                )));
            }
            feedback.insert(name, e.to_device(w.device()).to_kind(Kind::Float));
        }
        self.feedback = feedback;
        for (name, h) in &state.handover {
            let i = self.layout.position(name).ok_or_else(|| {
                ReplicaError::State(format!("it hands over `{name}`, which the model lacks"))
            })?;
            let (_, role, shape) = &self.layout.entries[i];
            if !matches!(role, Role::Expert { .. }) || h.size() != *shape {
                return Err(ReplicaError::State(format!(
                    "it hands over `{name}` of shape {:?}: not an expert tensor of shape {shape:?}",
                    h.size()
                )));
            }
        }
        self.handover = state
            .handover
            .into_iter()
            .map(|(n, h)| (n, h.to_kind(Kind::Float)))
            .collect();
        self.handover_round = (!self.handover.is_empty()).then_some(round + 1);
        self.consecutive = true;
        Ok(())
    }
}

/// Whether a node owning the experts marked in `owned` trains a parameter of this role.
fn trains(owned: &[bool], role: Role) -> bool {
    match role {
        Role::Shared => true,
        Role::Expert { index, .. } => owned[index],
    }
}
