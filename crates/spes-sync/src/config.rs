//! The `[sync]` section of a run's config, in the vocabulary the coordinator and the replica
//! use: the TOML deserializes straight into these types (spes-train's `RunConfig` holds a
//! [`SyncConfig`]), and the rules a round follows are read off it by the methods below.

use crate::outer::{OuterRule, Source};
use serde::de::{self, IntoDeserializer, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// How the run is distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One process trains every parameter (`spes train`).
    Centralized,
    /// Nodes train the shared parameters and their own experts; the server averages the shared
    /// ones and takes each expert from its owner (docs/design/algorithm.md §2–§5).
    Spes,
    /// FedAvg/DiLoCo baseline: nodes train everything; the server averages everything.
    Diloco,
}

/// What travels between nodes and the server ([`crate::delta`]). The server always aggregates
/// in fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Wire {
    /// Whole fp32 tensors both ways.
    Fp32,
    /// bf16 deltas from the last published model both ways, applied to an fp32 copy that the
    /// server and every node keep bit-identical: half the bytes of fp32, and fp32 master
    /// weights are never rounded.
    Bf16Delta,
    /// SparseLoCo's form: each chunk of `sync.sparse_chunk` values of a delta sends its
    /// `sync.sparse_k` largest entries (an int16 index and a 2-bit code each, two bf16 levels
    /// per chunk: 0.036 bytes per value at the default 64 of 4096) and carries the rest over to
    /// later rounds (error feedback); the global model stays bit-identical everywhere.
    SparseDelta,
    /// Deltas in 8 bits per value plus a bf16 scale per 64 values (0.53× the bytes of
    /// `bf16_delta`), the rounding carried over to later rounds (error feedback); bit-identical.
    Int8Delta,
    /// As `int8_delta` with 4 bits per value (0.27× the bytes of `bf16_delta`).
    Int4Delta,
    /// As `int8_delta` with 2 bits per value, sending −1, 0 or +1 times a group's mean
    /// magnitude (0.14× the bytes of `bf16_delta`).
    Int2Delta,
    /// Each matrix's change as two factors of rank `sync.rank` (4-bit codes, a bf16 scale per
    /// 64 values), the rest carried over (error feedback): a round's change is close to low
    /// rank, so this carries most of it in 1/60 of its fp32 bytes and less; tensors that are
    /// not matrices, or too small to gain, travel whole in bf16. Bit-identical everywhere.
    LowrankDelta,
}

impl Wire {
    pub const ALL: [Wire; 7] = [
        Wire::Fp32,
        Wire::Bf16Delta,
        Wire::SparseDelta,
        Wire::Int8Delta,
        Wire::Int4Delta,
        Wire::Int2Delta,
        Wire::LowrankDelta,
    ];

    /// The wire `sync.wire` spells `name`.
    pub fn named(name: &str) -> Option<Wire> {
        Wire::ALL.into_iter().find(|w| w.name() == name)
    }

    /// The wire's name as `sync.wire` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Wire::Fp32 => "fp32",
            Wire::Bf16Delta => "bf16_delta",
            Wire::SparseDelta => "sparse_delta",
            Wire::Int8Delta => "int8_delta",
            Wire::Int4Delta => "int4_delta",
            Wire::Int2Delta => "int2_delta",
            Wire::LowrankDelta => "lowrank_delta",
        }
    }

    /// Bits per code of a quantized wire.
    pub fn quantized_bits(self) -> Option<u8> {
        match self {
            Wire::Int8Delta => Some(8),
            Wire::Int4Delta => Some(4),
            Wire::Int2Delta => Some(2),
            _ => None,
        }
    }

    /// Whether a round sends only part of each delta and carries the rest over.
    pub fn is_lossy(self) -> bool {
        matches!(self, Wire::SparseDelta | Wire::LowrankDelta) || self.quantized_bits().is_some()
    }

    /// Whether uploads and published rounds are deltas from the last global model.
    pub fn is_delta(self) -> bool {
        self != Wire::Fp32
    }
}

/// A `[sync]` key the config pins, or leaves to the server to choose each round from what the
/// run measures (`"adaptive"`; not the rules' `"auto"`, which is derived once at parse time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice<T> {
    Pinned(T),
    Adaptive,
}

impl<T> Choice<T> {
    /// The pinned value, if pinned.
    pub fn pinned(self) -> Option<T> {
        match self {
            Choice::Pinned(t) => Some(t),
            Choice::Adaptive => None,
        }
    }

    pub fn is_adaptive(&self) -> bool {
        matches!(self, Choice::Adaptive)
    }
}

impl<T> From<T> for Choice<T> {
    fn from(t: T) -> Self {
        Choice::Pinned(t)
    }
}

const ADAPTIVE: &str = "adaptive";

impl<T: Serialize> Serialize for Choice<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Choice::Pinned(t) => t.serialize(s),
            Choice::Adaptive => s.serialize_str(ADAPTIVE),
        }
    }
}

/// `sync.wire`: a wire's name or `"adaptive"`; any other word is refused with both lists.
impl<'de> Deserialize<'de> for Choice<Wire> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Words;
        impl Visitor<'_> for Words {
            type Value = Choice<Wire>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a wire's name or \"adaptive\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                if v == ADAPTIVE {
                    return Ok(Choice::Adaptive);
                }
                Wire::deserialize(v.into_deserializer())
                    .map(Choice::Pinned)
                    .map_err(|e: E| E::custom(format!("{e}, or `{ADAPTIVE}`")))
            }
        }
        d.deserialize_str(Words)
    }
}

/// `sync.overlap_steps`: a number of steps or `"adaptive"`.
impl<'de> Deserialize<'de> for Choice<u64> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Steps;
        impl Visitor<'_> for Steps {
            type Value = Choice<u64>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number of steps (0 or more) or \"adaptive\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Choice::Pinned(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u64::try_from(v)
                    .map(Choice::Pinned)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    ADAPTIVE => Ok(Choice::Adaptive),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(Steps)
    }
}

/// What may change from one round to the next: the wire a round's uploads and its published
/// delta travel in, and how far nodes train past their upload before they wait for it. A run
/// with both keys pinned has its config's every round (a restart may not change them: the
/// server refuses a changed config); an adaptive run's server chooses them and announces each
/// round's with the round before it.
#[derive(Clone, Copy, Debug, Eq, Serialize, Deserialize)]
pub struct RoundSettings {
    pub wire: Wire,
    /// `sync.overlap`.
    pub overlap: bool,
    /// `sync.overlap_steps` (0: the whole round).
    pub overlap_steps: u64,
}

/// Without overlap the steps do not matter: such settings are equal whatever they say.
impl PartialEq for RoundSettings {
    fn eq(&self, other: &Self) -> bool {
        let steps = |s: &Self| s.overlap.then_some(s.overlap_steps);
        self.wire == other.wire && self.overlap == other.overlap && steps(self) == steps(other)
    }
}

impl fmt::Display for RoundSettings {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let wire = self.wire.name();
        match (self.overlap && self.wire.is_delta(), self.overlap_steps) {
            (false, _) => write!(f, "{wire}, no overlap"),
            (true, 0) => write!(f, "{wire}, overlap through the round"),
            (true, 1) => write!(f, "{wire}, overlap 1 step"),
            (true, n) => write!(f, "{wire}, overlap {n} steps"),
        }
    }
}

/// What the merge warm-up compares to find each expert's most similar ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MergeSimilarity {
    /// The cosine of the experts' flattened gate matrices (the published algorithm).
    #[default]
    Experts,
    /// The cosine of their router rows: experts the router sends alike tokens to.
    Router,
}

/// Where a node keeps what a lossy wire has not sent yet (error feedback).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Feedback {
    /// In its weights: the node trains on from the global model plus its unsent change, and
    /// the next upload's change includes it.
    Weights,
    /// In a buffer beside them, as SparseLoCo does: every node trains from the global model
    /// exactly; the buffer, decayed by `sync.feedback_decay` each round, is added to the next
    /// change before it is compressed. The decayed buffer stands in for outer momentum.
    Buffer,
}

/// How the server combines the averaged (shared) parameters of a round's uploads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AggregateRule {
    /// The plain mean (cheapest: one model of running sums).
    Mean,
    /// Per element, drop the `sync.trim_fraction` largest and smallest values, average the rest.
    TrimmedMean,
    /// Per element, the median: for runs with nodes that may lie.
    Median,
}

/// How much each node trains in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoundBy {
    /// Every node trains `sync_steps` steps of `batch_size × grad_accum` rows: a node half as
    /// fast makes every other one wait half of each round.
    Steps,
    /// The round's tokens (`nodes × sync_steps` steps of `batch_size × grad_accum` rows, as
    /// with `steps`) are split among the members in proportion to the throughput each one
    /// measured in its last round ([`crate::budget`]), so all of them spend about the same time
    /// on their share. Every node still takes `sync_steps` optimizer steps (the learning-rate
    /// schedule follows steps, and so the run's global tokens); a faster node's steps are
    /// larger, cut into micro-batches of at most `batch_size` rows so its memory does not grow.
    Tokens,
}

/// How the server weighs the members' changes of the averaged (shared) tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AverageBy {
    /// `tokens` when the round is by tokens (and the rule a mean), else `node`: measured the
    /// better of the two there (docs/results/unlike-nodes.md).
    Auto,
    /// Every upload counts once: the plain mean.
    Node,
    /// Each upload counts by the rows it trained this round (`aggregate = "mean"` only).
    Tokens,
}

/// How the server splits the experts among the members (within each member's cap, the
/// experts its declared memory holds: `train.memory_gib`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OwnBy {
    /// `throughput` when the round is by tokens, else `equal`.
    Auto,
    /// ⌊E/N⌋ or ⌈E/N⌉ each: with rounds by steps every node gives its experts the same steps.
    Equal,
    /// In proportion to the rows each member trained per second in its last round, so a slow
    /// node, which trains fewer rows of a round by tokens, owns fewer experts and each expert
    /// gets about the same data. Moves experts only when a member is a whole expert or more
    /// from its exact share.
    Throughput,
}

/// `[sync]`: the decentralized run (ignored by `spes train`, which is centralized).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncConfig {
    pub mode: Mode,
    /// Number of nodes (peers `0..nodes`).
    pub nodes: usize,
    /// Local optimizer steps between synchronisations (H).
    pub sync_steps: u64,
    /// "steps" (default): every node trains `sync_steps` steps of the run's batch; "tokens":
    /// the round's tokens are split among the nodes by measured throughput ([`RoundBy`]).
    pub round_by: RoundBy,
    /// "auto" (default: "tokens" when `round_by = "tokens"`, else "node"), "node" (the plain
    /// mean) or "tokens" (weights by rows trained; [`AverageBy`]).
    pub average_by: AverageBy,
    /// "auto" (default: "throughput" when `round_by = "tokens"`, else "equal"), "equal" or
    /// "throughput": how the experts are split among the members, within their caps ([`OwnBy`]).
    pub own_by: OwnBy,
    /// Explicit expert ownership: `ownership[p]` lists node p's expert indices (the same in every
    /// layer). Empty: contiguous blocks, node p owns `p·E/N .. (p+1)·E/N`.
    pub ownership: Vec<Vec<usize>>,
    /// "bf16_delta" (default), "int8_delta", "int4_delta", "int2_delta", "sparse_delta",
    /// "lowrank_delta" or "fp32" (docs/design/wire-formats.md); "adaptive": the server chooses
    /// each round's among the delta wires ([`RoundSettings`]). Read a round's with
    /// [`SyncConfig::wire`].
    pub wire: Choice<Wire>,
    /// Sparse wire: values per chunk (at most 32768, so an index fits int16). Tensors of at
    /// most one chunk travel whole in bf16.
    pub sparse_chunk: i64,
    /// Sparse wire: entries each chunk sends per round.
    pub sparse_k: i64,
    /// Low-rank wire: the rank of each matrix's factors (at most its smaller side).
    pub rank: i64,
    /// Quantized wires: each round sends every `stride`-th value of each change, round r those
    /// at `r mod stride`, the rest carried over ([`crate::delta::Stride`]). 1: every value.
    pub stride: u64,
    /// Lossy wires: where a node keeps what it has not sent yet, "weights" or "buffer".
    pub feedback: Feedback,
    /// `feedback = "buffer"`: the factor β in [0, 1] the buffer is multiplied by each round
    /// before the round's change is added.
    pub feedback_decay: f64,
    /// Delta wire: a node does not download back its own experts on rounds without a merge
    /// (the server publishes them as the node sent them).
    pub skip_own_experts: bool,
    /// Keep training while a round is aggregated and downloaded, then apply the new global
    /// model while keeping the progress made since the upload. Applies to the delta wires;
    /// `wire = "fp32"` always waits ([`SyncConfig::overlaps`]).
    pub overlap: bool,
    /// With overlap: the most steps a node trains after its upload before it waits for the
    /// round ([`SyncConfig::overlap_cap`]); 0: the whole next round. Steps trained on the model
    /// before the round lands cost loss by their number: on the demo's recipe one cost
    /// 0.1–0.2 %, five of a 25-step round 1 % (docs/results/sync-cost.md#overlap-issue-25).
    /// "adaptive": the server chooses each round's, overlap off included.
    pub overlap_steps: Choice<u64>,
    /// Adaptive settings: the share of its round time the slowest member must train, as the
    /// planner predicts it on what the run measured; among the settings that reach it the
    /// server takes the one of least expected loss, then of fewest bytes
    /// (`crates/spes-net/src/choose.rs`).
    pub target_utilization: f64,
    /// Close a round this long after it opened with whoever uploaded (never with nobody).
    pub round_timeout_s: f64,
    /// A node is live while its newest heartbeat is younger than this; rounds do not wait for
    /// nodes that are not live. Nodes heartbeat every `lease_s / 4`.
    pub lease_s: f64,
    /// A node whose lease has been expired this long is declared gone at the next round's
    /// close: its experts go to the live nodes, which start fresh AdamW moments for them.
    pub evict_after_s: f64,
    /// A live member that shows no progress for this long (no step trained, no byte of a round
    /// moved, as its heartbeats report; at least `lease_s`) is not waited for: the round
    /// closes once the others are in, and the member uploads a later round
    /// ([`SyncConfig::stall_after_s`]).
    pub stall_s: f64,
    /// How the shared parameters are combined: "mean", "trimmed_mean" or "median".
    pub aggregate: AggregateRule,
    /// Fraction of the values trimmed at each end by `aggregate = "trimmed_mean"`.
    pub trim_fraction: f64,
    /// An upload is refused if a tensor's RMS change from the global model exceeds
    /// `max_update_factor · sync_steps · train.lr · train.node_lr_scale` (times
    /// `train.expert_lr_scale` when above 1). AdamW moves a weight by about its rate per step
    /// (RMS), so honest nodes stay far below the default; 0 disables the check.
    pub max_update_factor: f64,
    /// Checkpoint every this many rounds (0: by time only). The server writes its whole
    /// fp32 model and carried state (other rounds it keeps only their published delta); a
    /// node its AdamW moments and sync state (its weights are the server's). Both also
    /// checkpoint at the last round. Each role reads its own config here.
    pub checkpoint_every_rounds: u64,
    /// Also checkpoint when this many seconds passed since the last checkpoint (0: by rounds
    /// only). At least one of the two must be set.
    pub checkpoint_every_s: f64,
    /// Newest checkpoints kept (by each role); older ones are deleted. 0 keeps every one.
    pub keep_checkpoints: usize,
    /// Expert-merging warm-up (docs/design/algorithm.md §5): merge at sync steps
    /// `s % merge_every == 0` while `α_s = merge_alpha·(1 − min(s/merge_until, 1)) > 0`, each
    /// expert with its `merge_top_k` most similar experts of the layer. `merge_every = 0`
    /// disables merging.
    pub merge_every: u64,
    pub merge_alpha: f64,
    pub merge_until: u64,
    pub merge_top_k: usize,
    /// "experts" (default: gate matrices, as published) or "router" (router rows): what the
    /// merge compares ([`MergeSimilarity`]).
    pub merge_similarity: MergeSimilarity,
    /// The server's outer optimizer on each round's change of the averaged (shared) tensors,
    /// DiLoCo's `θ ← θ + lr·(Δ + μ·m)` with `m ← μ·m + Δ` ([`crate::outer`]): learning rate,
    /// momentum μ in [0, 1), and Nesterov (else heavy-ball `θ ← θ + lr·m`). lr 1 with μ 0 is
    /// the plain average of the published algorithm.
    pub outer_lr: f64,
    pub outer_momentum: f64,
    pub outer_nesterov: bool,
    /// The same for each expert's change, taken from its owner (SPES mode; DiLoCo averages
    /// experts under the `outer_*` rule). Anything but lr 1 with μ 0 makes every owner download
    /// its experts back, since the server changes them.
    pub expert_outer_lr: f64,
    pub expert_outer_momentum: f64,
    /// Before the outer rule, scale each averaged tensor's change back toward the RMS size of
    /// the nodes' own changes, by √(mean ‖Δᵢ‖² / ‖Δ̄‖²) clamped to [1, √n]
    /// ([`crate::outer::norm_preserving_scale`]): averaging cancels part of n nodes' noise and
    /// so moves less than a centralized step on the n-fold batch. Delta wires only.
    pub outer_norm_preserving: bool,
    /// SPES: after every this many rounds each expert passes to the next node (peer order), so
    /// every expert trains on every node's data; a node starts fresh AdamW moments for the
    /// experts it receives. 0: fixed ownership (the published algorithm).
    pub rotate_every_rounds: u64,
    /// Decayed load balancing (docs/design/algorithm.md §6): a node scales its own experts'
    /// counts by γ rising linearly from `decayed_lb_start` to 1 over the first
    /// `decayed_lb_fraction` of training.
    pub decayed_lb: bool,
    pub decayed_lb_start: f64,
    pub decayed_lb_fraction: f64,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            mode: Mode::Centralized,
            nodes: 4,
            sync_steps: 100,
            round_by: RoundBy::Steps,
            average_by: AverageBy::Auto,
            own_by: OwnBy::Auto,
            ownership: Vec::new(),
            wire: Choice::Pinned(Wire::Bf16Delta),
            sparse_chunk: 4096,
            sparse_k: 64,
            rank: 16,
            stride: 1,
            feedback: Feedback::Weights,
            feedback_decay: 0.95,
            skip_own_experts: true,
            overlap: true,
            overlap_steps: Choice::Pinned(0),
            target_utilization: 0.95,
            round_timeout_s: 600.0,
            lease_s: 30.0,
            evict_after_s: 300.0,
            stall_s: 60.0,
            aggregate: AggregateRule::Mean,
            trim_fraction: 0.25,
            max_update_factor: 10.0,
            checkpoint_every_rounds: 100,
            checkpoint_every_s: 1800.0,
            keep_checkpoints: 3,
            merge_every: 500,
            merge_alpha: 0.01,
            merge_until: 10_000,
            merge_top_k: 4,
            merge_similarity: MergeSimilarity::Experts,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            outer_nesterov: true,
            expert_outer_lr: 1.0,
            expert_outer_momentum: 0.0,
            outer_norm_preserving: false,
            rotate_every_rounds: 0,
            decayed_lb: false,
            decayed_lb_start: 0.7,
            decayed_lb_fraction: 0.2,
        }
    }
}

/// What an adaptive run's first rounds use until the server has measured enough to choose: int4
/// deltas with one step of overlap, the fewest bytes of the loss table's best class. Their loss
/// carries to the run's end while their time is three rounds': every demo whose first three
/// rounds ran another wire ended 0.02–0.31 % above int4 throughout, and over a home uplink they
/// trained 71–80 % of their time where later rounds train 98–99 % (docs/results/sync-cost.md).
pub const FIRST_ROUNDS: RoundSettings = RoundSettings {
    wire: Wire::Int4Delta,
    overlap: true,
    overlap_steps: 1,
};

/// The first rounds of an adaptive run with overlap pinned off: bf16 without overlap, the loss
/// table's best row without it (int4 without overlap was not measured, and a first setting
/// outside a run's candidates would leave its chooser without a prediction to start from).
pub const FIRST_ROUNDS_WITHOUT_OVERLAP: RoundSettings = RoundSettings {
    wire: Wire::Bf16Delta,
    overlap: false,
    overlap_steps: 0,
};

/// Declares the `[sync]` keys each role reads from its own config, once: the list the node's
/// config check skips and the copy that takes them from the node's own config.
macro_rules! per_role_keys {
    ($($key:ident),* $(,)?) => {
        impl SyncConfig {
            /// Keys each role reads from its own config (how often it checkpoints and how many
            /// it keeps): a node's may differ from the server's.
            pub const PER_ROLE: &'static [&'static str] = &[$(stringify!($key)),*];

            /// Takes the per-role keys from `mine`.
            pub fn take_per_role(&mut self, mine: &SyncConfig) {
                $(self.$key = mine.$key.clone();)*
            }
        }
    };
}

per_role_keys!(
    checkpoint_every_rounds,
    checkpoint_every_s,
    keep_checkpoints
);

impl SyncConfig {
    /// The wire of this config's round: the pinned one, or for an adaptive run that is not
    /// settled to a round yet ([`SyncConfig::for_round`]) the first rounds' ([`FIRST_ROUNDS`],
    /// or with overlap pinned off [`FIRST_ROUNDS_WITHOUT_OVERLAP`]).
    pub fn wire(&self) -> Wire {
        let first = if self.overlap {
            FIRST_ROUNDS
        } else {
            FIRST_ROUNDS_WITHOUT_OVERLAP
        };
        self.wire.pinned().unwrap_or(first.wire)
    }

    /// Whether the server chooses a round's wire or overlap ([`Choice::Adaptive`]).
    pub fn adaptive(&self) -> bool {
        self.wire.is_adaptive() || self.overlap_steps.is_adaptive()
    }

    /// The settings of this config's round: its pinned keys, and for a run's adaptive keys
    /// those of its first rounds ([`FIRST_ROUNDS`]). Without overlap the steps are 0, so equal
    /// settings compare equal.
    pub fn settings(&self) -> RoundSettings {
        match self.overlap_steps {
            Choice::Pinned(steps) => RoundSettings {
                wire: self.wire(),
                overlap: self.overlap,
                overlap_steps: if self.overlap { steps } else { 0 },
            },
            Choice::Adaptive if !self.overlap => RoundSettings {
                wire: self.wire(),
                overlap: false,
                overlap_steps: 0,
            },
            Choice::Adaptive => RoundSettings {
                wire: self.wire(),
                ..FIRST_ROUNDS
            },
        }
    }

    /// This run's config for a round of settings `s`: the changing keys pinned to them.
    pub fn for_round(&self, s: RoundSettings) -> SyncConfig {
        SyncConfig {
            wire: Choice::Pinned(s.wire),
            overlap: s.overlap,
            overlap_steps: Choice::Pinned(s.overlap_steps),
            ..self.clone()
        }
    }

    /// Whether nodes train on while a round is exchanged: `overlap` on a delta wire.
    pub fn overlaps(&self) -> bool {
        self.overlap && self.wire().is_delta()
    }

    /// How long a live member may show no progress before a round stops waiting for it:
    /// `stall_s`, but never less than a lease, since progress arrives with heartbeats.
    pub fn stall_after_s(&self) -> f64 {
        self.stall_s.max(self.lease_s)
    }

    /// With overlap, the most steps a node trains between its upload and applying the round
    /// (`overlap_steps`, 0 resolved to `sync_steps`).
    pub fn overlap_cap(&self) -> u64 {
        match self.settings().overlap_steps {
            0 => self.sync_steps,
            n => n,
        }
    }

    /// Whether the shared tensors' mean weighs each upload by the rows it trained
    /// (`average_by`, with `auto` resolved).
    pub fn weighs_by_tokens(&self) -> bool {
        self.aggregate == AggregateRule::Mean
            && match self.average_by {
                AverageBy::Tokens => true,
                AverageBy::Node => false,
                AverageBy::Auto => self.round_by == RoundBy::Tokens,
            }
    }

    /// Whether the experts are split by measured throughput (`own_by`, with `auto` resolved).
    pub fn owns_by_throughput(&self) -> bool {
        match self.own_by {
            OwnBy::Throughput => true,
            OwnBy::Equal => false,
            OwnBy::Auto => self.round_by == RoundBy::Tokens,
        }
    }

    /// Whether a node's weights carry more than the global model after a sync: steps trained
    /// since the upload (overlap) or what a lossy wire has not sent yet.
    pub fn keeps_progress(&self) -> bool {
        self.overlaps() || self.feeds_back_in_weights()
    }

    /// Whether what a lossy wire leaves out stays in the node's weights.
    pub fn feeds_back_in_weights(&self) -> bool {
        self.wire().is_lossy() && self.feedback == Feedback::Weights
    }

    /// Whether what a lossy wire leaves out stays in a buffer beside the weights.
    pub fn feeds_back_in_buffer(&self) -> bool {
        self.wire().is_lossy() && self.feedback == Feedback::Buffer
    }

    /// α of the expert-merging warm-up at sync step `s`, if `s` is a merge step with α > 0
    /// (SPES mode only).
    pub fn merge_alpha_at(&self, s: u64) -> Option<f64> {
        if self.mode != Mode::Spes
            || self.merge_every == 0
            || !s.is_multiple_of(self.merge_every)
            || self.merge_until == 0
        {
            return None;
        }
        let a = self.merge_alpha * (1.0 - (s as f64 / self.merge_until as f64).min(1.0));
        (a > 0.0).then_some(a)
    }

    /// The outer rule of a change from `source` (`sync.outer_*` or `sync.expert_outer_*`).
    pub fn outer_rule(&self, source: Source) -> OuterRule {
        let (lr, momentum) = match source {
            Source::Averaged => (self.outer_lr, self.outer_momentum),
            Source::Owned => (self.expert_outer_lr, self.expert_outer_momentum),
        };
        OuterRule {
            lr,
            momentum,
            nesterov: self.outer_nesterov,
        }
    }

    /// The largest RMS change an uploaded tensor may make in a round when the fastest tensors
    /// step at `peak_lr` (`None`: unchecked).
    pub fn max_update_rms(&self, peak_lr: f64) -> Option<f64> {
        (self.max_update_factor > 0.0)
            .then_some(self.max_update_factor * self.sync_steps as f64 * peak_lr)
    }

    /// The decayed load-balancing factor γ for a node's own experts at `step` of a
    /// `max_steps` run, if on (SPES mode).
    pub fn decayed_lb_gamma(&self, step: u64, max_steps: u64) -> Option<f64> {
        if !self.decayed_lb || self.mode != Mode::Spes {
            return None;
        }
        let ramp = (self.decayed_lb_fraction * max_steps as f64).max(1.0);
        Some(self.decayed_lb_start + (1.0 - self.decayed_lb_start) * (step as f64 / ramp).min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_settings_name_their_wire_as_the_config_does_and_ignore_steps_without_overlap() {
        for wire in Wire::ALL {
            assert_eq!(serde_json::to_value(wire).unwrap(), wire.name());
            assert_eq!(Wire::named(wire.name()), Some(wire));
        }
        let off = |steps| RoundSettings {
            wire: Wire::Bf16Delta,
            overlap: false,
            overlap_steps: steps,
        };
        assert_eq!(off(0), off(3));
        assert_eq!(off(3).to_string(), "bf16_delta, no overlap");
        let on = |steps| RoundSettings {
            overlap: true,
            ..off(steps)
        };
        assert_ne!(on(0), on(3));
        assert_eq!(on(0).to_string(), "bf16_delta, overlap through the round");
        let cfg = SyncConfig {
            wire: Choice::Adaptive,
            overlap_steps: Choice::Adaptive,
            ..SyncConfig::default()
        };
        assert!(cfg.adaptive());
        assert_eq!(cfg.settings(), FIRST_ROUNDS);
        let round = cfg.for_round(on(3));
        assert!(!round.adaptive());
        assert_eq!(round.settings(), on(3));
        assert_eq!(round.overlap_cap(), 3);
        assert_eq!(cfg.for_round(on(0)).overlap_cap(), cfg.sync_steps);
    }
}
