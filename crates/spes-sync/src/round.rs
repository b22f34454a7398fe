//! The server's math for one round (docs/design/algorithm.md §4–§5): check each node's upload,
//! average the shared parameters over the nodes that uploaded (fp32), take each expert from its
//! owner, then on merge rounds mix each expert with its most similar experts of the same layer.
//!
//! Uploads are folded into running sums as they arrive, so the server holds one model's worth of
//! accumulators however many nodes there are.

use crate::config::{AggregateRule, MergeSimilarity, Mode, SyncConfig};
use crate::delta::{Delta, Deltas};
use crate::named::{Layout, Named};
use crate::ownership::{Claims, Ownership};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use spes_model::{expert_tensor_name, router_tensor_name, Role, EXPERT_PARTS};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use tch::{Kind, Tensor};

/// What each node uploads and how the server combines it, for one round's members.
#[derive(Clone, Debug, PartialEq)]
pub enum Scope {
    /// SPES: shared parameters (averaged) plus the node's own experts (taken as is).
    Spes(Ownership),
    /// DiLoCo/FedAvg: every parameter, all averaged.
    Diloco { members: BTreeSet<usize> },
}

impl Scope {
    /// What nodes upload and how the server combines it at the start of a run of `cfg` with
    /// `n_experts` experts a layer: the initial members are peers `0..cfg.nodes`.
    pub fn of(cfg: &SyncConfig, n_experts: usize) -> anyhow::Result<Scope> {
        Ok(match cfg.mode {
            Mode::Spes => Scope::Spes(Ownership::resolve(&cfg.ownership, n_experts, cfg.nodes)?),
            Mode::Diloco => Scope::Diloco {
                members: (0..cfg.nodes).collect(),
            },
            Mode::Centralized => anyhow::bail!(
                "sync.mode = \"centralized\" trains with `spes train`; set sync.mode = \"spes\" or \"diloco\""
            ),
        })
    }

    /// The peers that train and upload in this round.
    pub fn members(&self) -> BTreeSet<usize> {
        match self {
            Scope::Spes(o) => o.members(),
            Scope::Diloco { members } => members.clone(),
        }
    }

    /// Whether member `peer` uploads (and trains) a parameter of this role.
    pub fn uploads(&self, peer: usize, role: Role) -> bool {
        match self {
            Scope::Spes(o) => o.trains(peer, role),
            Scope::Diloco { .. } => true,
        }
    }

    /// Whether the server averages this parameter over nodes (else: takes the owner's copy).
    pub fn averaged(&self, role: Role) -> bool {
        matches!((self, role), (Scope::Diloco { .. }, _) | (_, Role::Shared))
    }

    /// `owners()[e]`: the member owning expert e (empty in DiLoCo mode, where all train all).
    pub fn owners(&self) -> Vec<usize> {
        match self {
            Scope::Spes(o) => o.owners().to_vec(),
            Scope::Diloco { .. } => Vec::new(),
        }
    }

    /// The scope that [`Scope::owners`] and [`Scope::members`] describe (as sent or persisted):
    /// SPES when there are owners, else DiLoCo over `members`.
    pub fn from_lists(owners: &[usize], members: &[usize]) -> Result<Scope> {
        Ok(if owners.is_empty() {
            Scope::Diloco {
                members: members.iter().copied().collect(),
            }
        } else {
            Scope::Spes(Ownership::from_owners(owners.to_vec())?)
        })
    }

    /// The same rule over other members, or the same under other claims (SPES: ownership
    /// rebalanced, see [`Ownership::rebalance`]).
    pub fn with_members(&self, members: &BTreeSet<usize>, claims: &Claims) -> Result<Scope> {
        Ok(match self {
            Scope::Spes(o) => Scope::Spes(o.rebalance(members, claims)?),
            Scope::Diloco { .. } => Scope::Diloco {
                members: members.clone(),
            },
        })
    }

    /// SPES: whether the ownership strays from what `claims` ask ([`Ownership::strays_from`]).
    pub fn strays_from(&self, claims: &Claims) -> bool {
        match self {
            Scope::Spes(o) => o.strays_from(claims),
            Scope::Diloco { .. } => false,
        }
    }

    /// SPES: every expert passes to the next member ([`Ownership::rotated`]); DiLoCo: the same.
    pub fn rotated(&self) -> Scope {
        match self {
            Scope::Spes(o) => Scope::Spes(o.rotated()),
            Scope::Diloco { .. } => self.clone(),
        }
    }

    /// The most members a run can have: SPES needs an expert per member.
    pub fn max_members(&self) -> usize {
        match self {
            Scope::Spes(o) => o.owners().len(),
            Scope::Diloco { .. } => MAX_DILOCO_MEMBERS,
        }
    }
}

/// Peer ids of a DiLoCo run are below this.
pub const MAX_DILOCO_MEMBERS: usize = 1024;

/// Accumulates the uploads of one round, in the run's wire form: values (fp32 wire) or
/// changes (delta wires).
pub struct Aggregator {
    scope: Scope,
    /// `sync.aggregate` and `sync.trim_fraction`.
    rule: AggregateRule,
    trim_fraction: f64,
    /// Each averaged tensor's running sum: fp32, or fp64 where its terms would round
    /// differently in another order ([`Delta::sum_kind`]).
    sums: HashMap<String, Tensor>,
    /// Robust rules keep every upload of an averaged tensor until the round closes.
    kept: HashMap<String, Vec<Tensor>>,
    /// Tensors taken from their owner, as uploaded, with the owner.
    owned: HashMap<String, (usize, Delta)>,
    /// Expert tensors' changes handed over by their previous owner (fp32).
    handover: HashMap<String, Tensor>,
    uploaded: BTreeSet<usize>,
    /// Weighing by tokens ([`SyncConfig::weighs_by_tokens`]): the sum of the weights the averaged tensors' sums hold
    /// (`None`: every upload counts once, the sums are plain).
    weights: Option<f64>,
    scratch: Scratch,
    /// With [`Aggregator::with_spread`]: per averaged tensor, the squared norm of each peer's
    /// uploaded delta, summed in peer order at the end so the result is the same in any order
    /// of arrival.
    spread: Option<HashMap<String, BTreeMap<usize, f64>>>,
}

/// An fp32 buffer reused across the tensors of a round.
#[derive(Default)]
struct Scratch(Option<Tensor>);

impl Scratch {
    /// `t` as fp32 in the buffer (grown as needed), shaped like `t`.
    fn widen(&mut self, t: &Tensor) -> Tensor {
        let n = t.numel() as i64;
        let buf = match self.0.take() {
            Some(b) if b.numel() as i64 >= n && b.device() == t.device() => b,
            _ => Tensor::empty([n], (Kind::Float, t.device())),
        };
        let mut view = buf.narrow(0, 0, n).view(t.size().as_slice());
        view.copy_(t);
        self.0 = Some(buf);
        view
    }
}

/// A round's combined uploads, before the outer step and merging.
pub struct Combined {
    /// Averaged tensors: the combined value (fp32 wire) or change (delta wires), fp32.
    pub averaged: HashMap<String, Tensor>,
    /// With [`Aggregator::with_spread`]: per averaged tensor, the mean squared norm of the
    /// uploaded deltas (empty otherwise).
    pub spread: HashMap<String, f64>,
    /// How many uploads were combined.
    pub uploads: usize,
    /// Tensors taken from their owner: the owner and its delta, as sent.
    pub owned: HashMap<String, (usize, Delta)>,
    /// Expert tensors' changes handed over by their previous owner (fp32), added to their
    /// new owner's.
    pub handover: HashMap<String, Tensor>,
}

/// Checks a decoded upload ([`crate::delta::decode`]) against the round's scope and the bound
/// on how far each tensor may move in a round: exactly the tensors `peer` uploads, with finite
/// values, and RMS change ≤ `max_rms` (a value is measured from the current `global`, with the
/// rounding of a bf16 copy allowed; a delta by its own norm). Says which tensor fails and why.
pub fn validate(
    layout: &Layout,
    scope: &Scope,
    peer: usize,
    upload: &Deltas,
    global: &Named,
    max_rms: Option<f64>,
) -> std::result::Result<(), String> {
    let given: HashMap<&str, &Delta> = upload.iter().map(|(n, d)| (n.as_str(), d)).collect();
    for (name, role, _) in &layout.entries {
        match (
            scope.uploads(peer, *role),
            given.contains_key(name.as_str()),
        ) {
            (false, true) => return Err(format!("holds `{name}`, which peer {peer} does not own")),
            (true, false) => return Err(format!("is missing tensor `{name}`")),
            _ => {}
        }
    }
    for (name, d) in upload {
        let numel = layout
            .shape_of(name)
            .map_or(1, |s| s.iter().product::<i64>());
        let (change, allowed) = match d {
            Delta::Value(t) => {
                if !all_finite(t) {
                    return Err(format!("tensor `{name}` holds non-finite values"));
                }
                let Some(bound) = max_rms else { continue };
                let i = layout
                    .position(name)
                    .expect("validated names are in the layout");
                let current = &global[i].1;
                (rms(&(t - current)), bound + BF16_SLACK * rms(current))
            }
            d => {
                let norm = d.norm().to_kind(Kind::Double).double_value(&[]);
                let finite = match d {
                    Delta::Dense(t) => norm.is_finite() || all_finite(t),
                    _ => norm.is_finite(),
                };
                if !finite {
                    return Err(format!("tensor `{name}` holds non-finite values"));
                }
                let Some(bound) = max_rms else { continue };
                (norm / (numel.max(1) as f64).sqrt(), bound)
            }
        };
        if change.is_nan() || change > allowed {
            return Err(format!(
                "tensor `{name}` moved by RMS {change:.3e} from the global model, more than the \
                 {allowed:.3e} that sync.max_update_factor allows"
            ));
        }
    }
    Ok(())
}

/// `t` as fp32 in storage of its own (a copy even when it already is fp32).
fn own_f32(t: &Tensor) -> Tensor {
    t.to_dtype(Kind::Float, false, true)
}

/// Whether every value of `t` is finite. A finite sum proves it at a twentieth of the cost of
/// `isfinite().all()` (0.7 against 16.6 ms for 6 M values here); only a sum that is not (a NaN,
/// an infinity, or an overflow) needs the exact check.
pub(crate) fn all_finite(t: &Tensor) -> bool {
    t.sum(t.kind()).double_value(&[]).is_finite()
        || bool::try_from(t.isfinite().all()).unwrap_or(false)
}

fn rms(x: &Tensor) -> f64 {
    // PyTorch's norm accumulates pairwise in fp32; a float64 mean costs ten times more.
    x.norm().double_value(&[]) / (x.numel().max(1) as f64).sqrt()
}

/// Relative rounding of a bf16 copy (8 significant bits), with room to spare.
const BF16_SLACK: f64 = 1.0 / 128.0;

impl Aggregator {
    /// An empty round of `scope`, combining shared tensors as `cfg.aggregate` says.
    pub fn new(scope: Scope, cfg: &SyncConfig) -> Self {
        Aggregator {
            scope,
            rule: cfg.aggregate,
            trim_fraction: cfg.trim_fraction,
            sums: HashMap::new(),
            kept: HashMap::new(),
            owned: HashMap::new(),
            handover: HashMap::new(),
            uploaded: BTreeSet::new(),
            weights: cfg.weighs_by_tokens().then_some(0.0),
            scratch: Scratch::default(),
            spread: None,
        }
    }

    /// Also measures how far apart the uploaded deltas of each averaged tensor are
    /// ([`Combined::spread`]), for the outer step's norm-preserving scale.
    pub fn with_spread(mut self, on: bool) -> Self {
        self.spread = on.then(HashMap::new);
        self
    }

    /// Peers whose upload was accepted this round.
    pub fn uploaded(&self) -> &BTreeSet<usize> {
        &self.uploaded
    }

    /// The round's scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// Folds in an upload that [`validate`] accepted, of `weight` (its rows, when the round
    /// averages by tokens; ignored otherwise). A peer's second upload is refused.
    /// Keeps none of the upload's storage (copies what it keeps), so an upload may view a
    /// memory-mapped file that goes away after this call.
    pub fn add(&mut self, layout: &Layout, peer: usize, upload: Deltas, weight: f64) -> Result<()> {
        if self.uploaded.contains(&peer) {
            bail!("peer {peer} already uploaded this round");
        }
        if self.weights.is_some() && !(weight > 0.0 && weight.is_finite()) {
            bail!(
                "peer {peer}'s upload weighs {weight}; a round by tokens needs a positive weight"
            );
        }
        tch::no_grad(|| {
            for (name, d) in upload {
                let Some(i) = layout.position(&name) else {
                    continue;
                };
                let (_, role, shape) = &layout.entries[i];
                if !self.scope.averaged(*role) {
                    self.owned.insert(name, (peer, d.copy()));
                    continue;
                }
                let zeros = || Tensor::zeros(shape.as_slice(), (Kind::Float, d.device()));
                if let Some(spread) = &mut self.spread {
                    let norm = match &d {
                        Delta::Value(t) | Delta::Dense(t) => t.shallow_clone(),
                        compressed => compressed.folded_f32(&zeros()),
                    }
                    .norm_scalaropt_dtype(2, Kind::Float)
                    .double_value(&[]);
                    spread
                        .entry(name.clone())
                        .or_default()
                        .insert(peer, norm * norm);
                }
                if self.rule != AggregateRule::Mean {
                    let all = self.kept.entry(name).or_default();
                    all.push(match &d {
                        Delta::Value(t) | Delta::Dense(t) => own_f32(t),
                        compressed => compressed.folded_f32(&zeros()),
                    });
                    continue;
                }
                if self.weights.is_some() {
                    let scaled = match &d {
                        Delta::Value(t) | Delta::Dense(t) => t.to_kind(Kind::Float) * weight,
                        compressed => compressed.folded_f32(&zeros()) * weight,
                    };
                    // Weighted terms have full significands: fp64 keeps their sum exact, so
                    // the same in any order of arrival.
                    let scaled = scaled.to_kind(Kind::Double);
                    match self.sums.get_mut(&name) {
                        Some(sum) => {
                            let _ = sum.g_add_(&scaled);
                        }
                        None => {
                            self.sums.insert(name, scaled);
                        }
                    }
                    continue;
                }
                match (self.sums.get_mut(&name), &d) {
                    (Some(sum), Delta::Value(t) | Delta::Dense(t)) if t.kind() == Kind::Float => {
                        let _ = sum.g_add_(t);
                    }
                    // Widening into a reused buffer, then an fp32 add, beats PyTorch's
                    // mixed-dtype add by about a quarter on CPU.
                    (Some(sum), Delta::Value(t) | Delta::Dense(t)) => {
                        let wide = self.scratch.widen(t);
                        let _ = sum.g_add_(&wide);
                    }
                    (Some(sum), compressed) => compressed.fold_into(sum),
                    (None, Delta::Value(t) | Delta::Dense(t)) => {
                        self.sums.insert(name, own_f32(t));
                    }
                    (None, compressed) => {
                        let mut sum =
                            Tensor::zeros(shape.as_slice(), (compressed.sum_kind(), d.device()));
                        compressed.fold_into(&mut sum);
                        self.sums.insert(name, sum);
                    }
                }
            }
        });
        self.uploaded.insert(peer);
        if let Some(w) = &mut self.weights {
            *w += weight;
        }
        Ok(())
    }

    /// Adds an expert tensor's change its previous owner handed over (fp32, its own storage).
    pub fn add_handover(&mut self, name: String, change: Tensor) {
        match self.handover.get_mut(&name) {
            Some(sum) => {
                let _ = sum.g_add_(&change);
            }
            None => {
                self.handover.insert(name, change);
            }
        }
    }

    /// The round's combined uploads: each averaged tensor that was uploaded, combined, and the
    /// owners' tensors as sent.
    pub fn finish(self) -> Combined {
        let n = self.uploaded.len();
        let divisor = self.weights.unwrap_or(n as f64);
        let (rule, trim) = (self.rule, self.trim_fraction);
        let spread = self
            .spread
            .unwrap_or_default()
            .into_iter()
            .map(|(name, per_peer)| (name, per_peer.values().sum::<f64>() / n.max(1) as f64))
            .collect();
        let mut averaged: HashMap<String, Tensor> = self
            .sums
            .into_iter()
            .map(|(name, mut sum)| {
                let _ = sum.g_div_scalar_(divisor);
                (name, sum.to_kind(Kind::Float))
            })
            .collect();
        averaged.extend(
            self.kept
                .into_iter()
                .map(|(name, all)| (name, robust(&all, rule, trim))),
        );
        Combined {
            averaged,
            spread,
            uploads: n,
            owned: self.owned,
            handover: self.handover,
        }
    }
}

/// Trimmed mean or median of equally shaped tensors, per element.
fn robust(all: &[Tensor], rule: AggregateRule, trim_fraction: f64) -> Tensor {
    let n = all.len();
    let trim = match rule {
        AggregateRule::Mean => 0,
        AggregateRule::TrimmedMean => {
            ((trim_fraction * n as f64).floor() as usize).min((n - 1) / 2)
        }
        AggregateRule::Median => (n - 1) / 2,
    };
    tch::no_grad(|| {
        let (sorted, _) = Tensor::stack(all, 0).sort(0, false);
        sorted
            .narrow(0, trim as i64, (n - 2 * trim) as i64)
            .mean_dim(0, false, Kind::Float)
    })
}

/// One expert's merge: its layer, index, the neighbours it was mixed with, and α.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MergeEvent {
    pub layer: usize,
    pub expert: usize,
    pub neighbours: Vec<usize>,
    pub alpha: f64,
}

/// `ψ_i ← ψ_i + α·mean_{j∈N(i)}(ψ_j − ψ_i)` for every expert of every layer, where N(i) are the
/// `top_k` experts whose flattened gate matrices (or router rows, by `similarity`) have the
/// highest cosine similarity to i's. All experts of a layer are updated from the pre-merge
/// values.
pub fn merge_experts(
    global: &mut Named,
    layout: &Layout,
    top_k: usize,
    alpha: f64,
    similarity: MergeSimilarity,
) -> Vec<MergeEvent> {
    let e = layout.n_experts;
    let k = top_k.min(e.saturating_sub(1));
    if k == 0 {
        return Vec::new();
    }
    let index: HashMap<String, usize> = global
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.clone(), i))
        .collect();
    let mut events = Vec::new();
    tch::no_grad(|| {
        for layer in 0..layout.n_layers {
            // A server shard holds whole layers; the others are merged elsewhere.
            if !index.contains_key(&expert_tensor_name(layer, 0, EXPERT_PARTS[0])) {
                continue;
            }
            let stacked: Vec<Tensor> = EXPERT_PARTS
                .iter()
                .map(|part| {
                    let ts: Vec<Tensor> = (0..e)
                        .map(|i| {
                            global[index[&expert_tensor_name(layer, i, part)]]
                                .1
                                .to_kind(Kind::Float)
                        })
                        .collect();
                    Tensor::stack(&ts, 0)
                })
                .collect();
            let view = match similarity {
                MergeSimilarity::Experts => stacked[0].view([e as i64, -1]),
                // A shard holds whole layers, router included.
                MergeSimilarity::Router => global[index[&router_tensor_name(layer)]]
                    .1
                    .to_kind(Kind::Float),
            };
            let unit = &view / view.norm_scalaropt_dim(2, [1], true).clamp_min(1e-12);
            let mut sim = unit.matmul(&unit.tr());
            let _ = sim.fill_diagonal_(f64::NEG_INFINITY, false);
            let (_, nbr) = sim.topk(k as i64, 1, true, true);
            let neighbours: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&nbr).expect("int64 matrix");
            for (part, p) in EXPERT_PARTS.iter().zip(&stacked) {
                let mut grouped = p.size();
                grouped.insert(1, k as i64);
                grouped[0] = e as i64;
                let mean = p
                    .index_select(0, &nbr.view([-1]))
                    .view(grouped.as_slice())
                    .mean_dim(1, false, Kind::Float);
                let merged = p + (mean - p) * alpha;
                for i in 0..e {
                    let slot = index[&expert_tensor_name(layer, i, part)];
                    global[slot].1 = merged.get(i as i64).contiguous();
                }
            }
            for (i, n) in neighbours.into_iter().enumerate() {
                events.push(MergeEvent {
                    layer,
                    expert: i,
                    neighbours: n.into_iter().map(|j| j as usize).collect(),
                    alpha,
                });
            }
        }
    });
    events
}
