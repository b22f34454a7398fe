//! The server's math for one round (SPES.md §4–§5): validate each node's upload, average the
//! shared parameters over the nodes that uploaded (fp32), take each expert from its owner, then
//! on merge rounds mix each expert with its most similar experts of the same layer.
//!
//! Uploads are folded into running sums as they arrive, so the server holds one model's worth of
//! accumulators however many nodes there are.

use crate::delta::{split_wire_name, Compressed, WireForm};
use crate::ownership::Ownership;
use anyhow::{bail, Result};
use serde::Serialize;
use spes_model::{expert_tensor_name, MoeModel, Role, EXPERT_PARTS};
use std::collections::{BTreeSet, HashMap};
use tch::{Kind, Tensor};

/// Named tensors, in the model's parameter order.
pub type Named = Vec<(String, Tensor)>;

/// The model's parameter names, roles and shapes: what uploads are checked against.
#[derive(Clone, Debug)]
pub struct Layout {
    pub entries: Vec<(String, Role, Vec<i64>)>,
    pub n_layers: usize,
    pub n_experts: usize,
}

impl Layout {
    pub fn of(model: &MoeModel) -> Self {
        Layout {
            entries: model
                .params()
                .into_iter()
                .map(|p| (p.name, p.role, p.tensor.size()))
                .collect(),
            n_layers: model.cfg.n_layers,
            n_experts: model.cfg.n_experts,
        }
    }

    /// The tensors server shard `i` of `k` owns (`spes server --shard i/k`): whole layers (so a
    /// layer's experts merge on one shard) and whole other tensors, dealt largest first to the
    /// least loaded shard, so every shard and node computes the same split.
    pub fn shard(&self, i: usize, k: usize) -> Layout {
        let unit_of = |name: &str| -> String {
            name.strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .map_or(name.to_owned(), |l| format!("model.layers.{l}."))
        };
        let mut sizes: Vec<(String, i64)> = Vec::new();
        for (name, _, shape) in &self.entries {
            let unit = unit_of(name);
            let n: i64 = shape.iter().product();
            match sizes.iter_mut().find(|(u, _)| *u == unit) {
                Some((_, s)) => *s += n,
                None => sizes.push((unit, n)),
            }
        }
        sizes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut load = vec![0i64; k.max(1)];
        let mut mine = BTreeSet::new();
        for (unit, n) in sizes {
            let least = (0..load.len())
                .min_by_key(|&s| (load[s], s))
                .expect("k ≥ 1");
            load[least] += n;
            if least == i {
                mine.insert(unit);
            }
        }
        Layout {
            entries: self
                .entries
                .iter()
                .filter(|(n, _, _)| mine.contains(&unit_of(n)))
                .cloned()
                .collect(),
            n_layers: self.n_layers,
            n_experts: self.n_experts,
        }
    }

    /// Whether this layout holds a tensor of that name.
    pub fn holds(&self, name: &str) -> bool {
        self.entries.iter().any(|(n, _, _)| n == name)
    }
}

/// What each node uploads and how the server combines it, for one round's members.
#[derive(Clone, Debug, PartialEq)]
pub enum Scope {
    /// SPES: shared parameters (averaged) plus the node's own experts (taken as is).
    Spes(Ownership),
    /// DiLoCo/FedAvg: every parameter, all averaged.
    Diloco { members: BTreeSet<usize> },
}

impl Scope {
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

    /// The same rule over other members (SPES: ownership rebalanced, see [`Ownership::rebalance`]).
    pub fn with_members(&self, members: &BTreeSet<usize>) -> Result<Scope> {
        Ok(match self {
            Scope::Spes(o) => Scope::Spes(o.rebalance(members)?),
            Scope::Diloco { .. } => Scope::Diloco {
                members: members.clone(),
            },
        })
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

/// How the server combines the averaged (shared) parameters of a round's uploads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Combine {
    /// The plain mean, folded into running sums (one model of accumulators).
    Mean,
    /// Per element, drop the `⌊fraction·n⌋` largest and smallest values, average the rest.
    TrimmedMean { fraction: f64 },
    /// Per element, the median (the mean of the two middle values for even n).
    Median,
}

/// Accumulates the uploads of one round: whole values, or (delta wire) bf16 deltas.
pub struct Aggregator {
    scope: Scope,
    combine: Combine,
    sums: HashMap<String, Tensor>,
    /// Robust rules keep every upload of an averaged tensor until the round closes.
    kept: HashMap<String, Vec<Tensor>>,
    /// Tensors taken from their owner, as uploaded, with the owner.
    owned: HashMap<String, (usize, Tensor)>,
    owned_compressed: HashMap<String, (usize, Compressed)>,
    uploaded: BTreeSet<usize>,
    scratch: Scratch,
    /// With [`Aggregator::with_spread`]: per averaged tensor, the sum over uploads of the
    /// squared norm of each uploaded delta.
    spread: Option<HashMap<String, f64>>,
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

/// A delta-wire round's combined uploads, before merging.
pub struct Combined {
    /// Averaged tensors: the combined delta, fp32.
    pub averaged: HashMap<String, Tensor>,
    /// With [`Aggregator::with_spread`]: per averaged tensor, the mean squared norm of the
    /// uploaded deltas (empty otherwise).
    pub spread: HashMap<String, f64>,
    /// How many uploads were combined.
    pub uploads: usize,
    /// Tensors taken from their owner: the owner and its bf16 delta, as sent.
    pub owned: HashMap<String, (usize, Tensor)>,
    /// The same for compressed deltas.
    pub owned_compressed: HashMap<String, (usize, Compressed)>,
}

/// Checks an upload against the layout, the round's scope and (if given) the bound on how far
/// each tensor may move from the current global: RMS(upload − global) ≤ `max_rms` plus the
/// rounding of a bf16 wire copy. Says which tensor fails and why.
pub fn validate(
    layout: &Layout,
    scope: &Scope,
    peer: usize,
    upload: &Named,
    global: &Named,
    max_rms: Option<f64>,
) -> std::result::Result<(), String> {
    check_entries(layout, scope, peer, upload, |i, name, t| {
        if !matches!(t.kind(), Kind::Float | Kind::BFloat16) {
            return Err(format!(
                "tensor `{name}` is {:?}, expected f32 or bf16",
                t.kind()
            ));
        }
        if !all_finite(t) {
            return Err(format!("tensor `{name}` holds non-finite values"));
        }
        if let Some(bound) = max_rms {
            let current = &global[i].1;
            let change = rms(&(t - current));
            let allowed = bound + BF16_SLACK * rms(current);
            if change.is_nan() || change > allowed {
                return Err(too_far(name, change, allowed));
            }
        }
        Ok(())
    })
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

fn too_far(name: &str, change: f64, allowed: f64) -> String {
    format!(
        "tensor `{name}` moved by RMS {change:.3e} from the global model, more than the \
         {allowed:.3e} that sync.max_update_factor allows"
    )
}

/// [`validate`] for an upload of bf16 deltas: each must be bf16, finite, and within `max_rms`
/// (checked in one pass over the delta: its norm).
pub fn validate_delta(
    layout: &Layout,
    scope: &Scope,
    peer: usize,
    upload: &Named,
    max_rms: Option<f64>,
) -> std::result::Result<(), String> {
    check_entries(layout, scope, peer, upload, |_, name, d| {
        if d.kind() != Kind::BFloat16 {
            return Err(format!(
                "tensor `{name}` is {:?}, expected a bf16 delta (sync.wire = \"bf16_delta\")",
                d.kind()
            ));
        }
        let norm = d.norm().to_kind(Kind::Double).double_value(&[]);
        if !norm.is_finite() && !bool::try_from(d.isfinite().all()).unwrap_or(false) {
            return Err(format!("tensor `{name}` holds non-finite values"));
        }
        if let Some(bound) = max_rms {
            let change = norm / (d.numel().max(1) as f64).sqrt();
            if !change.is_finite() || change > bound {
                return Err(too_far(name, change, bound));
            }
        }
        Ok(())
    })
}

/// Checks that an upload holds exactly the tensors `peer` uploads under `scope`, once each and
/// of the layout's shapes; `check` judges each tensor's values.
fn check_entries(
    layout: &Layout,
    scope: &Scope,
    peer: usize,
    upload: &Named,
    mut check: impl FnMut(usize, &str, &Tensor) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let mut given: HashMap<&str, &Tensor> = HashMap::with_capacity(upload.len());
    for (name, t) in upload {
        if given.insert(name.as_str(), t).is_some() {
            return Err(format!("holds tensor `{name}` twice"));
        }
    }
    check_names(
        layout,
        scope,
        peer,
        |name| given.contains_key(name),
        given.keys().copied(),
    )?;
    for (i, (name, _, shape)) in layout.entries.iter().enumerate() {
        let Some(t) = given.get(name.as_str()) else {
            continue;
        };
        if t.size() != *shape {
            return Err(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                t.size()
            ));
        }
        check(i, name, t)?;
    }
    Ok(())
}

/// Checks that the tensors an upload names (`holds`, listed by `names`) are exactly those
/// `peer` uploads under `scope`.
fn check_names<'a>(
    layout: &Layout,
    scope: &Scope,
    peer: usize,
    holds: impl Fn(&str) -> bool,
    mut names: impl Iterator<Item = &'a str>,
) -> std::result::Result<(), String> {
    for (name, role, _) in &layout.entries {
        match (scope.uploads(peer, *role), holds(name)) {
            (false, true) => return Err(format!("holds `{name}`, which peer {peer} does not own")),
            (true, false) => return Err(format!("is missing tensor `{name}`")),
            _ => {}
        }
    }
    match names.find(|n| !layout.holds(n)) {
        Some(unknown) => Err(format!("holds unknown tensor `{unknown}`")),
        None => Ok(()),
    }
}

/// Relative rounding of a bf16 copy (8 significant bits), with room to spare.
const BF16_SLACK: f64 = 1.0 / 128.0;

impl Aggregator {
    pub fn new(scope: Scope, combine: Combine) -> Self {
        Aggregator {
            scope,
            combine,
            sums: HashMap::new(),
            kept: HashMap::new(),
            owned: HashMap::new(),
            owned_compressed: HashMap::new(),
            uploaded: BTreeSet::new(),
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

    fn add_spread(&mut self, name: &str, delta: &Tensor) {
        if let Some(spread) = &mut self.spread {
            let norm = delta.norm_scalaropt_dtype(2, Kind::Float).double_value(&[]);
            *spread.entry(name.to_owned()).or_default() += norm * norm;
        }
    }

    /// Peers whose upload was accepted this round.
    pub fn uploaded(&self) -> &BTreeSet<usize> {
        &self.uploaded
    }

    /// The round's scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// Folds in an upload that [`validate`] accepted. A peer's second upload is refused.
    /// Keeps none of the upload's storage (copies what it keeps), so an upload may view a
    /// memory-mapped file that goes away after this call.
    pub fn add(&mut self, layout: &Layout, peer: usize, upload: Named) -> Result<()> {
        if self.uploaded.contains(&peer) {
            bail!("peer {peer} already uploaded this round");
        }
        let mut given: HashMap<String, Tensor> = upload.into_iter().collect();
        tch::no_grad(|| {
            for (name, role, _) in &layout.entries {
                let Some(t) = given.remove(name) else {
                    continue;
                };
                if !self.scope.averaged(*role) {
                    self.owned.insert(name.clone(), (peer, t.copy()));
                    continue;
                }
                self.add_spread(name, &t);
                if self.combine == Combine::Mean {
                    match self.sums.get_mut(name) {
                        Some(sum) if t.kind() == Kind::Float => {
                            let _ = sum.g_add_(&t);
                        }
                        // Widening into a reused buffer, then an fp32 add, beats PyTorch's
                        // mixed-dtype add by about a quarter on CPU.
                        Some(sum) => {
                            let wide = self.scratch.widen(&t);
                            let _ = sum.g_add_(&wide);
                        }
                        None => {
                            self.sums.insert(name.clone(), own_f32(&t));
                        }
                    }
                } else {
                    self.kept.entry(name.clone()).or_default().push(own_f32(&t));
                }
            }
        });
        self.uploaded.insert(peer);
        Ok(())
    }

    /// The new global model: combined and owners' experts where uploaded, `previous` elsewhere.
    pub fn finish(self, layout: &Layout, previous: &Named) -> Named {
        let n = self.uploaded.len();
        let (mut sums, mut kept, mut owned) = (self.sums, self.kept, self.owned);
        let combine = self.combine;
        layout
            .entries
            .iter()
            .zip(previous)
            .map(|((name, _, _), (_, prev))| {
                let t = if let Some(sum) = sums.remove(name) {
                    sum / n as f64
                } else if let Some(all) = kept.remove(name) {
                    robust(&all, combine)
                } else if let Some((_, t)) = owned.remove(name) {
                    t.to_kind(Kind::Float)
                } else {
                    prev.shallow_clone()
                };
                (name.clone(), t)
            })
            .collect()
    }

    /// The delta wire's close: the combined delta of every averaged tensor that was uploaded,
    /// and the owners' deltas as sent.
    pub fn finish_deltas(self) -> Combined {
        let n = self.uploaded.len();
        let combine = self.combine;
        let spread = self
            .spread
            .unwrap_or_default()
            .into_iter()
            .map(|(name, sum)| (name, sum / n.max(1) as f64))
            .collect();
        let mut averaged: HashMap<String, Tensor> = self
            .sums
            .into_iter()
            .map(|(name, mut sum)| {
                let _ = sum.g_div_scalar_(n as f64);
                (name, sum)
            })
            .collect();
        averaged.extend(
            self.kept
                .into_iter()
                .map(|(name, all)| (name, robust(&all, combine))),
        );
        Combined {
            averaged,
            spread,
            uploads: n,
            owned: self.owned,
            owned_compressed: self.owned_compressed,
        }
    }

    /// Folds in compressed deltas that [`validate_compressed`] accepted; keeps none of their
    /// storage, as [`Aggregator::add`].
    pub fn add_compressed(
        &mut self,
        layout: &Layout,
        peer: usize,
        upload: Vec<(String, Compressed)>,
    ) -> Result<()> {
        if self.uploaded.contains(&peer) {
            bail!("peer {peer} already uploaded this round");
        }
        let mut given: HashMap<String, Compressed> = upload.into_iter().collect();
        tch::no_grad(|| {
            for (name, role, shape) in &layout.entries {
                let Some(c) = given.remove(name) else {
                    continue;
                };
                if !self.scope.averaged(*role) {
                    self.owned_compressed.insert(name.clone(), (peer, c.copy()));
                    continue;
                }
                let zeros = || Tensor::zeros(shape.as_slice(), (Kind::Float, c.device()));
                if self.spread.is_some() {
                    self.add_spread(name, &c.dense(&zeros()));
                }
                if self.combine == Combine::Mean {
                    let sum = self.sums.entry(name.clone()).or_insert_with(zeros);
                    c.apply_(sum);
                } else {
                    self.kept
                        .entry(name.clone())
                        .or_default()
                        .push(c.dense(&zeros()));
                }
            }
        });
        self.uploaded.insert(peer);
        Ok(())
    }
}

/// Checks an upload of compressed deltas as [`validate`] checks values: exactly the tensors
/// `peer` uploads, each as its two parts in `form`, with finite values within `max_rms` (RMS
/// over the whole tensor). Sparse: `name#idx` (int32) and `name#val` (bf16), exactly
/// `⌈density·n⌉` unique in-range indices. Quantized: `name#q` (uint8) and `name#scale` (bf16)
/// of the sizes `bits` implies, scales finite and ≥ 0. Returns the deltas by tensor name.
pub fn validate_compressed(
    layout: &Layout,
    scope: &Scope,
    peer: usize,
    upload: Named,
    form: WireForm,
    max_rms: Option<f64>,
) -> std::result::Result<Vec<(String, Compressed)>, String> {
    let (first, second) = form
        .parts()
        .expect("validate_compressed is called for lossy wires only");
    let mut parts: HashMap<String, (Option<Tensor>, Option<Tensor>)> = HashMap::new();
    for (wire, t) in upload {
        let place = match split_wire_name(&wire) {
            Some((name, part)) if part == first || part == second => {
                let slot = parts.entry(name.to_owned()).or_default();
                if part == first {
                    &mut slot.0
                } else {
                    &mut slot.1
                }
            }
            _ => {
                return Err(format!(
                    "holds `{wire}`, expected `<tensor>{}` and `<tensor>{}` pairs ({form:?})",
                    first.name(""),
                    second.name("")
                ))
            }
        };
        if place.replace(t).is_some() {
            return Err(format!("holds tensor `{wire}` twice"));
        }
    }
    check_names(
        layout,
        scope,
        peer,
        |name| parts.contains_key(name),
        parts.keys().map(String::as_str),
    )?;
    let mut out = Vec::with_capacity(parts.len());
    for (name, _, shape) in &layout.entries {
        let Some(pair) = parts.remove(name) else {
            continue;
        };
        let (Some(a), Some(b)) = pair else {
            return Err(format!(
                "tensor `{name}` lacks its {} or {} part",
                first.name(""),
                second.name("")
            ));
        };
        let numel: i64 = shape.iter().product();
        let c = Compressed::from_parts(form, numel, a, b)
            .map_err(|e| format!("tensor `{name}`: {e}"))?;
        let norm = c.norm().to_kind(Kind::Double).double_value(&[]);
        if !norm.is_finite() {
            return Err(format!("tensor `{name}` holds non-finite values"));
        }
        if let Some(bound) = max_rms {
            let change = norm / (numel.max(1) as f64).sqrt();
            if change > bound {
                return Err(too_far(name, change, bound));
            }
        }
        out.push((name.clone(), c));
    }
    Ok(out)
}

/// Trimmed mean or median of equally shaped tensors, per element.
fn robust(all: &[Tensor], combine: Combine) -> Tensor {
    let n = all.len();
    let trim = match combine {
        Combine::Mean => 0,
        Combine::TrimmedMean { fraction } => {
            ((fraction * n as f64).floor() as usize).min((n - 1) / 2)
        }
        Combine::Median => (n - 1) / 2,
    };
    tch::no_grad(|| {
        let (sorted, _) = Tensor::stack(all, 0).sort(0, false);
        sorted
            .narrow(0, trim as i64, (n - 2 * trim) as i64)
            .mean_dim(0, false, Kind::Float)
    })
}

/// The expert-merging warm-up schedule (SPES.md §5).
#[derive(Clone, Copy, Debug)]
pub struct MergeSchedule {
    /// Merge at sync steps that are multiples of this (M); 0 disables merging.
    pub every: u64,
    pub alpha0: f64,
    /// α reaches 0 at this step (T).
    pub until: u64,
    /// Neighbours per expert (K).
    pub top_k: usize,
}

impl MergeSchedule {
    /// α at sync step `s` if `s` is a merge step with α > 0.
    pub fn alpha(&self, s: u64) -> Option<f64> {
        if self.every == 0 || !s.is_multiple_of(self.every) || self.until == 0 {
            return None;
        }
        let a = self.alpha0 * (1.0 - (s as f64 / self.until as f64).min(1.0));
        (a > 0.0).then_some(a)
    }
}

/// One expert's merge: its layer, index, the neighbours it was mixed with, and α.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MergeEvent {
    pub layer: usize,
    pub expert: usize,
    pub neighbours: Vec<usize>,
    pub alpha: f64,
}

/// `ψ_i ← ψ_i + α·mean_{j∈N(i)}(ψ_j − ψ_i)` for every expert of every layer, where N(i) are the
/// `top_k` experts whose flattened gate matrices have the highest cosine similarity to i's.
/// All experts of a layer are updated from the pre-merge values.
pub fn merge_experts(
    global: &mut Named,
    layout: &Layout,
    top_k: usize,
    alpha: f64,
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
            let gate = stacked[0].view([e as i64, -1]);
            let unit = &gate / gate.norm_scalaropt_dim(2, [1], true).clamp_min(1e-12);
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
