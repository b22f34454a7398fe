//! The run configuration: TOML sections `[model]`, `[data]`, `[train]`, with `--set` overrides.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_model::ModelConfig;
use std::path::{Path, PathBuf};

/// A whole run. `model` is fully resolved (a preset plus any overridden fields).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    #[serde(default)]
    pub sync: SyncConfig,
}

/// How the run is distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One process trains every parameter (`spes train`).
    Centralized,
    /// Nodes train the shared parameters and their own experts; the server averages the shared
    /// ones and takes each expert from its owner (SPES.md §2–§5).
    Spes,
    /// FedAvg/DiLoCo baseline: nodes train everything; the server averages everything.
    Diloco,
}

/// What travels between nodes and the server. The server always aggregates in fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Wire {
    /// Whole fp32 tensors both ways.
    Fp32,
    /// bf16 deltas from the last published model both ways, applied to an fp32 copy that the
    /// server and every node keep bit-identical (spes-sync's `delta` module): half the bytes
    /// of fp32, and fp32 master weights are never rounded.
    Bf16Delta,
    /// Each round sends only the `sync.sparse_density` largest entries of each tensor's delta
    /// (6 bytes each) and carries the rest over to later rounds (error feedback); the global
    /// model stays bit-identical everywhere. For slow links (README: sync cost).
    SparseDelta,
    /// Deltas in 8 bits per value plus a bf16 scale per 64 values (0.53× the bytes of
    /// `bf16_delta`), the rounding carried over to later rounds (error feedback); bit-identical.
    Int8Delta,
    /// As `int8_delta` with 4 bits per value (0.27× the bytes of `bf16_delta`).
    Int4Delta,
    /// As `int8_delta` with 2 bits per value, sending −1, 0 or +1 times a group's mean
    /// magnitude (0.14× the bytes of `bf16_delta`).
    Int2Delta,
}

impl Wire {
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
        self == Wire::SparseDelta || self.quantized_bits().is_some()
    }
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

/// `[sync]`: the decentralized run (ignored by `spes train`, which is centralized).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncConfig {
    pub mode: Mode,
    /// Number of nodes (peers `0..nodes`).
    pub nodes: usize,
    /// Local optimizer steps between synchronisations (H).
    pub sync_steps: u64,
    /// Explicit expert ownership: `ownership[p]` lists node p's expert indices (the same in every
    /// layer). Empty: contiguous blocks, node p owns `p·E/N .. (p+1)·E/N`.
    pub ownership: Vec<Vec<usize>>,
    /// "bf16_delta" (default), "int8_delta", "int4_delta", "int2_delta", "sparse_delta" or
    /// "fp32" (README: sync cost).
    pub wire: Wire,
    /// Sparse wire: the fraction of each tensor's entries a round sends, in (0, 0.3].
    pub sparse_density: f64,
    /// Delta wire: a node does not download back its own experts on rounds without a merge
    /// (the server publishes them as the node sent them).
    pub skip_own_experts: bool,
    /// Keep training while a round is aggregated and downloaded, then apply the new global
    /// model while keeping the progress made since the upload. Applies to the delta wires;
    /// `wire = "fp32"` always waits ([`SyncConfig::overlaps`]).
    pub overlap: bool,
    /// Close a round this long after it opened with whoever uploaded (never with nobody).
    pub round_timeout_s: f64,
    /// A node is live while its newest heartbeat is younger than this; rounds do not wait for
    /// nodes that are not live. Nodes heartbeat every `lease_s / 4`.
    pub lease_s: f64,
    /// A node whose lease has been expired this long is declared gone at the next round's
    /// close: its experts go to the live nodes, which start fresh AdamW moments for them.
    pub evict_after_s: f64,
    /// How the shared parameters are combined: "mean", "trimmed_mean" or "median".
    pub aggregate: AggregateRule,
    /// Fraction of the values trimmed at each end by `aggregate = "trimmed_mean"`.
    pub trim_fraction: f64,
    /// An upload is refused if a tensor's RMS change from the global model exceeds
    /// `max_update_factor · sync_steps · train.lr` (times `train.expert_lr_scale` when above
    /// 1). AdamW moves a weight by about `lr` per step (RMS), so honest nodes stay far below
    /// the default; 0 disables the check.
    pub max_update_factor: f64,
    /// Checkpoint the global model every this many rounds (and at the final round).
    pub checkpoint_every_rounds: u64,
    /// Newest server checkpoints kept; older ones are deleted. 0 keeps every one.
    pub keep_checkpoints: usize,
    /// Expert-merging warm-up (SPES.md §5): merge at sync steps `s % merge_every == 0` while
    /// `α_s = merge_alpha·(1 − min(s/merge_until, 1)) > 0`, each expert with its
    /// `merge_top_k` most similar experts of the layer. `merge_every = 0` disables merging.
    pub merge_every: u64,
    pub merge_alpha: f64,
    pub merge_until: u64,
    pub merge_top_k: usize,
    /// The server's outer optimizer on each round's change of the averaged (shared) tensors,
    /// DiLoCo's `θ ← θ + lr·(Δ + μ·m)` with `m ← μ·m + Δ` (spes-sync's `outer`): learning rate,
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
    /// the nodes' own changes, by √(mean ‖Δᵢ‖² / ‖Δ̄‖²) clamped to [1, √n] (spes-sync's
    /// `outer::norm_preserving_scale`): averaging cancels part of n nodes' noise and so moves
    /// less than a centralized step on the n-fold batch. Delta wires only.
    pub outer_norm_preserving: bool,
    /// SPES: after every this many rounds each expert passes to the next node (peer order), so
    /// every expert trains on every node's data; a node starts fresh AdamW moments for the
    /// experts it receives. 0: fixed ownership (the published algorithm).
    pub rotate_every_rounds: u64,
    /// Decayed load balancing (SPES.md §6): a node scales its own experts' counts by γ rising
    /// linearly from `decayed_lb_start` to 1 over the first `decayed_lb_fraction` of training.
    pub decayed_lb: bool,
    pub decayed_lb_start: f64,
    pub decayed_lb_fraction: f64,
}

impl SyncConfig {
    /// Whether nodes train on while a round is exchanged: `overlap` on a delta wire.
    pub fn overlaps(&self) -> bool {
        self.overlap && self.wire != Wire::Fp32
    }
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            mode: Mode::Centralized,
            nodes: 4,
            sync_steps: 100,
            ownership: Vec::new(),
            wire: Wire::Bf16Delta,
            sparse_density: 0.03,
            skip_own_experts: true,
            overlap: true,
            round_timeout_s: 600.0,
            lease_s: 30.0,
            evict_after_s: 300.0,
            aggregate: AggregateRule::Mean,
            trim_fraction: 0.25,
            max_update_factor: 10.0,
            checkpoint_every_rounds: 1,
            keep_checkpoints: 3,
            merge_every: 500,
            merge_alpha: 0.01,
            merge_until: 10_000,
            merge_top_k: 4,
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

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A `spes tokenize` output directory.
    pub path: PathBuf,
}

/// Numeric precision of the forward/backward pass; master weights are always fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 on CUDA, fp32 on CPU.
    Auto,
    Fp32,
    Bf16,
}

/// How MoE layers run their experts (spes-model's `MoeKernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeKernelChoice {
    /// Grouped on CUDA, the loop on CPU (where `_grouped_mm` is slower than the loop).
    Auto,
    Loop,
    Grouped,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub max_steps: u64,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Tokens per training sequence; at most `model.context_length`.
    pub seq_len: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Expert matrices step at `lr · expert_lr_scale`: in SPES an owned expert's update is its
    /// owner's alone, while shared parameters average every node's, so the two may want
    /// different rates.
    pub expert_lr_scale: f64,
    pub warmup_steps: u64,
    /// The step at which the cosine decay reaches the floor, after which the rate stays there;
    /// 0: `max_steps`. Larger than `max_steps`, a run ends before the decay does (the SPES 9B
    /// run's schedule), so it can be continued on the same curve.
    pub t_max: u64,
    /// Warm-up starts from, and cosine decay ends at, this fraction of the peak.
    pub lr_floor: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub grad_clip: f64,
    pub z_loss_weight: f64,
    pub lb_loss_weight: f64,
    pub router_z_loss_weight: f64,
    pub precision: Precision,
    /// Keep only each block's input through the forward pass and recompute the block during
    /// backward: activation memory of one block instead of all, for ~1/3 more compute.
    pub activation_checkpointing: bool,
    /// Data parallel: average each block's gradients over the ranks while the blocks below are
    /// still in backward (the model's staged backward), instead of all of them after it.
    pub overlap_grad_reduce: bool,
    /// How MoE layers run their experts: `auto`, `loop` or `grouped`.
    pub moe_kernel: MoeKernelChoice,
    /// Keep experts this process does not train as bf16 copies on the device, their exact
    /// fp32 values in host memory: half the device memory for them. Unset: on for CUDA.
    pub frozen_experts_bf16: Option<bool>,
    pub seed: u64,
    pub log_every: u64,
    pub eval_every: u64,
    /// Validation batches per evaluation (of `batch_size` windows each).
    pub eval_batches: usize,
    pub checkpoint_every: u64,
    /// Newest checkpoints kept; older ones are deleted.
    pub keep_checkpoints: usize,
    /// Ranked-classification task directories (`requests.jsonl.gz`) scored during training.
    pub eval_tasks: Vec<PathBuf>,
    /// Score `eval_tasks` every this many steps (server: at rounds ending on such steps); 0: never.
    pub eval_tasks_every: u64,
    /// Documents per task scored by that hook.
    pub eval_task_docs: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            max_steps: 1000,
            batch_size: 8,
            grad_accum: 1,
            seq_len: 256,
            lr: 5e-4,
            expert_lr_scale: 1.0,
            warmup_steps: 100,
            t_max: 0,
            lr_floor: 0.1,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            z_loss_weight: 1e-4,
            lb_loss_weight: 0.01,
            router_z_loss_weight: 0.001,
            precision: Precision::Auto,
            activation_checkpointing: false,
            overlap_grad_reduce: true,
            moe_kernel: MoeKernelChoice::Auto,
            frozen_experts_bf16: None,
            seed: 0,
            log_every: 10,
            eval_every: 100,
            eval_batches: 20,
            checkpoint_every: 500,
            keep_checkpoints: 2,
            eval_tasks: Vec::new(),
            eval_tasks_every: 0,
            eval_task_docs: 200,
        }
    }
}

impl RunConfig {
    /// Reads a TOML file and applies `section.key=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Self::parse(&text, overrides).with_context(|| format!("config {}", path.display()))
    }

    /// Parses TOML text and applies overrides. `[model] preset = "tiny"` fills unset model keys.
    pub fn parse(text: &str, overrides: &[String]) -> Result<Self> {
        let mut doc: toml::Table = toml::from_str(text)?;
        for o in overrides {
            apply_override(&mut doc, o)?;
        }
        resolve_preset(&mut doc)?;
        let cfg: RunConfig = serde_path_to_error::deserialize(toml::Value::Table(doc))
            .map_err(|e| anyhow::anyhow!("key `{}`: {}", e.path(), e.inner()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let t = &self.train;
        if t.seq_len == 0 || t.seq_len > self.model.context_length {
            bail!(
                "train.seq_len ({}) must be in 1..=model.context_length ({})",
                t.seq_len,
                self.model.context_length
            );
        }
        for (key, v) in [
            ("train.batch_size", t.batch_size),
            ("train.grad_accum", t.grad_accum),
            ("train.eval_batches", t.eval_batches),
        ] {
            if v == 0 {
                bail!("{key} must be > 0");
            }
        }
        for (key, v) in [
            ("train.max_steps", t.max_steps),
            ("train.log_every", t.log_every),
            ("train.eval_every", t.eval_every),
            ("train.checkpoint_every", t.checkpoint_every),
        ] {
            if v == 0 {
                bail!("{key} must be > 0");
            }
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            bail!("train.lr must be a positive number, got {}", t.lr);
        }
        if t.t_max != 0 && t.t_max <= t.warmup_steps {
            bail!(
                "train.t_max ({}) must be 0 (use train.max_steps) or more than train.warmup_steps ({})",
                t.t_max,
                t.warmup_steps
            );
        }
        if !(t.expert_lr_scale > 0.0 && t.expert_lr_scale.is_finite()) {
            bail!(
                "train.expert_lr_scale must be a positive number, got {}",
                t.expert_lr_scale
            );
        }
        if !(0.0..=1.0).contains(&t.lr_floor) {
            bail!("train.lr_floor must be in [0, 1], got {}", t.lr_floor);
        }
        let s = &self.sync;
        if s.mode != Mode::Centralized {
            if s.nodes == 0 || s.sync_steps == 0 || s.checkpoint_every_rounds == 0 {
                bail!("sync.nodes, sync.sync_steps and sync.checkpoint_every_rounds must be > 0");
            }
            if s.mode == Mode::Spes && s.nodes > self.model.n_experts {
                bail!(
                    "sync.nodes ({}) exceeds model.n_experts ({}): every SPES node must own an expert",
                    s.nodes,
                    self.model.n_experts
                );
            }
            if !t.max_steps.is_multiple_of(s.sync_steps) {
                bail!(
                    "train.max_steps ({}) must be a multiple of sync.sync_steps ({}) so every node ends on a round",
                    t.max_steps,
                    s.sync_steps
                );
            }
            for (key, v) in [
                ("sync.round_timeout_s", s.round_timeout_s),
                ("sync.lease_s", s.lease_s),
            ] {
                if !(v > 0.0 && v.is_finite()) {
                    bail!("{key} must be a positive number of seconds, got {v}");
                }
            }
            if !(s.evict_after_s >= 0.0 && s.evict_after_s.is_finite()) {
                bail!(
                    "sync.evict_after_s must be ≥ 0 seconds, got {}",
                    s.evict_after_s
                );
            }
            if !(0.0..0.5).contains(&s.trim_fraction) {
                bail!(
                    "sync.trim_fraction must be in [0, 0.5), got {}",
                    s.trim_fraction
                );
            }
            if !(s.max_update_factor >= 0.0 && s.max_update_factor.is_finite()) {
                bail!(
                    "sync.max_update_factor must be ≥ 0 (0 disables the check), got {}",
                    s.max_update_factor
                );
            }
            for (key, lr, momentum) in [
                ("sync.outer", s.outer_lr, s.outer_momentum),
                (
                    "sync.expert_outer",
                    s.expert_outer_lr,
                    s.expert_outer_momentum,
                ),
            ] {
                if !(lr > 0.0 && lr.is_finite()) {
                    bail!("{key}_lr must be a positive number, got {lr}");
                }
                if !(0.0..1.0).contains(&momentum) {
                    bail!("{key}_momentum must be in [0, 1), got {momentum}");
                }
            }
            if s.outer_norm_preserving && s.wire == Wire::Fp32 {
                bail!("sync.outer_norm_preserving needs a delta wire (sync.wire = \"bf16_delta\" or a compressed one), not \"fp32\"");
            }
            if !(s.sparse_density > 0.0 && s.sparse_density <= 0.3) {
                bail!(
                    "sync.sparse_density must be in (0, 0.3], got {}",
                    s.sparse_density
                );
            }
        }
        Ok(())
    }

    /// Tokens consumed by one optimizer step.
    pub fn tokens_per_step(&self) -> u64 {
        (self.train.batch_size * self.train.grad_accum * self.train.seq_len) as u64
    }
}

/// Applies one `section.key=value`; the value is TOML (`40`, `1e-3`, `true`, `"x"`) or a bare string.
fn apply_override(doc: &mut toml::Table, o: &str) -> Result<()> {
    let (key, raw) = o
        .split_once('=')
        .with_context(|| format!("--set `{o}`: expected section.key=value"))?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        bail!("--set `{o}`: expected section.key=value");
    }
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()));
    let mut table = doc;
    for part in &parts[..parts.len() - 1] {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .with_context(|| format!("--set `{o}`: `{part}` is not a section"))?;
    }
    table.insert(parts[parts.len() - 1].to_owned(), value);
    Ok(())
}

/// Replaces `[model] preset = "..."` by the preset's fields, keeping explicitly given keys.
fn resolve_preset(doc: &mut toml::Table) -> Result<()> {
    let Some(model) = doc.get_mut("model").and_then(|m| m.as_table_mut()) else {
        bail!("missing section [model]");
    };
    let Some(preset) = model.remove("preset") else {
        return Ok(());
    };
    let name = preset
        .as_str()
        .context("key `model.preset`: expected a string")?;
    let base = ModelConfig::preset(name).context("key `model.preset`")?;
    let toml::Value::Table(mut full) = toml::Value::try_from(&base)? else {
        unreachable!("a struct serialises to a table")
    };
    for (k, v) in std::mem::take(model) {
        full.insert(k, v);
    }
    *model = full;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[model]\npreset = \"tiny\"\n[data]\npath = \"d\"\n[train]\nmax_steps = 5\n";

    #[test]
    fn preset_defaults_and_overrides() {
        let c = RunConfig::parse(BASE, &[]).unwrap();
        assert_eq!(c.model, ModelConfig::preset("tiny").unwrap());
        assert_eq!(c.train.max_steps, 5);
        assert_eq!(c.train.batch_size, TrainConfig::default().batch_size);
        let c = RunConfig::parse(
            BASE,
            &[
                "train.max_steps=40".into(),
                "data.path=/x/y".into(),
                "model.n_experts=8".into(),
                "train.lr=1e-3".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.train.max_steps, 40);
        assert_eq!(c.data.path, PathBuf::from("/x/y"));
        assert_eq!(c.model.n_experts, 8);
        assert_eq!(c.train.lr, 1e-3);
        let c = RunConfig::parse(BASE, &["model.preset=1b".into()]).unwrap();
        assert_eq!(c.model.d_model, 768);
        let spes: [String; 2] = ["sync.mode=spes".into(), "sync.ownership=[[0,1],[2]]".into()];
        let err = RunConfig::parse(BASE, &spes).unwrap_err().to_string();
        assert!(err.contains("multiple of sync.sync_steps"), "{err}");
        let c = RunConfig::parse(
            BASE,
            &[spes[0].clone(), spes[1].clone(), "sync.sync_steps=5".into()],
        )
        .unwrap();
        assert_eq!(c.sync.mode, Mode::Spes);
        assert_eq!(c.sync.ownership, vec![vec![0, 1], vec![2]]);
    }

    #[test]
    fn errors_name_the_key_and_expected_type() {
        let err = RunConfig::parse(BASE, &["train.max_steps=lots".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.max_steps") && err.contains("u64"),
            "{err}"
        );
        let err = RunConfig::parse(BASE, &["train.max_stepz=3".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_stepz"), "{err}");
        let err = RunConfig::parse(BASE, &["model.top_k=99".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.top_k"), "{err}");
        let err = RunConfig::parse(BASE, &["sync.mode=ring".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sync.mode") && err.contains("spes"), "{err}");
        let err = RunConfig::parse(BASE, &["oops".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("section.key=value"), "{err}");
        let err = RunConfig::parse(BASE, &["train.seq_len=100000".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.seq_len"), "{err}");
        let spes = |key: &str| {
            let o = [
                "sync.mode=spes".into(),
                "sync.sync_steps=5".into(),
                key.into(),
            ];
            RunConfig::parse(BASE, &o).map_err(|e| e.to_string())
        };
        let err = spes("sync.outer_momentum=1.0").unwrap_err();
        assert!(
            err.contains("sync.outer_momentum must be in [0, 1)"),
            "{err}"
        );
        let err = spes("sync.outer_norm_preserving=true")
            .and_then(|_| {
                let o = [
                    "sync.mode=spes".into(),
                    "sync.sync_steps=5".into(),
                    "sync.wire=fp32".into(),
                    "sync.outer_norm_preserving=true".into(),
                ];
                RunConfig::parse(BASE, &o).map_err(|e| e.to_string())
            })
            .unwrap_err();
        assert!(
            err.contains("sync.outer_norm_preserving needs a delta wire"),
            "{err}"
        );
        let err = spes("sync.expert_outer_lr=0").unwrap_err();
        assert!(
            err.contains("sync.expert_outer_lr must be a positive"),
            "{err}"
        );
        let err = spes("train.expert_lr_scale=-0.5").unwrap_err();
        assert!(
            err.contains("train.expert_lr_scale must be a positive number, got -0.5"),
            "{err}"
        );
        assert_eq!(
            spes("sync.outer_momentum=0.9").unwrap().sync.outer_momentum,
            0.9
        );
    }
}
