//! The run configuration: TOML sections `[model]`, `[data]`, `[train]` and `[sync]` (whose
//! types live in spes-sync, which reads them), with `--set` overrides.

pub mod rules;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_model::ModelConfig;
pub use spes_sync::config::{AggregateRule, AverageBy, Mode, OwnBy, RoundBy, SyncConfig, Wire};
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
    /// The values rules derived when this config was parsed ([`rules`]).
    #[serde(skip)]
    pub derived: Vec<rules::Derived>,
}

/// `[data]`: where training windows come from. Node-local: every node names its own copy.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A `spes tokenize` or `spes data import` output directory; or leave it out and give
    /// `sources`.
    #[serde(default, skip_serializing_if = "path_is_empty")]
    pub path: PathBuf,
    /// A weighted mixture of tokenized directories: `[{ path = "...", weight = 0.6 }, ...]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<spes_data::Source>,
    /// How a decentralized run's nodes share the corpus. The same on every node and the server.
    #[serde(default)]
    pub partition: Partition,
    /// The draws of the seeded stream this trainer reads: a node of an interleaved run its
    /// own, set by [`RunConfig::for_node`] (and serialized, so its other ranks read it too);
    /// never written by hand.
    #[serde(default, skip_serializing_if = "spes_data::Share::is_whole")]
    pub share: spes_data::Share,
}

/// How a decentralized run's nodes share the corpus.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Partition {
    /// Every node reads the whole corpus in its own seeded order (the published recipe).
    #[default]
    Shuffle,
    /// Every node reads one seeded order of the whole corpus, node p of n taking every n-th
    /// window from the p-th: together they read each window once an epoch, as the centralized
    /// run of n × the batch does, where shuffled nodes read some windows twice and miss others.
    Interleave,
    /// Every node reads only the parts its data directory holds (`spes tokenize --part p/N`),
    /// and no part is read by two live nodes: the server refuses a second reader.
    Disjoint,
}

fn path_is_empty(p: &Path) -> bool {
    p.as_os_str().is_empty()
}

impl DataConfig {
    /// The sources drawn from: `path` alone, or the mixture.
    pub fn sources(&self) -> Vec<spes_data::Source> {
        if self.sources.is_empty() {
            vec![spes_data::Source {
                path: self.path.clone(),
                weight: 1.0,
            }]
        } else {
            self.sources.clone()
        }
    }

    /// The directory whose tokenizer and manifest stand for the run's (the first source).
    pub fn primary(&self) -> &Path {
        self.sources.first().map_or(&self.path, |s| &s.path)
    }

    fn validate(&self) -> Result<()> {
        match (path_is_empty(&self.path), self.sources.is_empty()) {
            (true, true) => bail!("[data]: set `path` (a tokenized directory) or `sources`"),
            (false, false) => bail!("[data]: set `path` or `sources`, not both"),
            _ => {}
        }
        if !self.share.is_whole() {
            bail!("[data] share: a node takes its share from data.partition = \"interleave\"; leave `share` out");
        }
        spes_data::loader::check_weights(&self.sources)
    }
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

/// What a node's AdamW second moment is fed for the tensors every node trains and the server
/// averages (docs/results/quality.md#oracles-which-statistic-of-a-nodes-batch-costs-the-gap-2026-12-06).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecondMoment {
    /// The square of the node's own gradient, as in PyTorch's AdamW.
    Own,
    /// An estimate of the second moment of every node's batch together: the node's own less
    /// its share of the noise, which the two halves of its batch measure.
    UnionEstimate,
}

/// How MoE layers run their experts (spes-model's `MoeKernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeKernelChoice {
    /// Grouped in bf16 on SM 9.x GPUs (H100, H200), the loop elsewhere (the CPU, fp32, other
    /// cards: [`crate::moe_kernel`]).
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
    /// Peak learning rate of a centralized run: one AdamW step on every node's rows together.
    pub lr: f64,
    /// SPES and DiLoCo nodes step at `lr · node_lr_scale` (default "auto": √nodes, since an
    /// average of n nodes' steps moves about 1/√n as far as one step on their rows together;
    /// [`rules`]).
    pub node_lr_scale: f64,
    /// Expert matrices step at `lr · node_lr_scale · expert_lr_scale`: in SPES an owned
    /// expert's update is its owner's alone, while shared parameters average every node's
    /// (default "auto": 1 / `node_lr_scale` in SPES, experts at the centralized rate).
    pub expert_lr_scale: f64,
    /// Linear warm-up steps (default "auto": a tenth of the schedule).
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
    /// `own`, or `union_estimate`: in SPES and DiLoCo, each averaged tensor's step divides by
    /// an estimate of the second moment of the nodes' batches together, so the averaged steps
    /// keep the centralized step's length (one rank's backward runs in two halves of its
    /// rows; two fp32 values more per averaged tensor: a noise average and a copy of a
    /// gradient). Default "auto": `union_estimate` where it applies ([`rules`]).
    pub second_moment: SecondMoment,
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
    /// Also write TensorBoard event files of this role's curves under `<dir>/<role>/`
    /// (`train`, `node-<peer>`, `server`): `tensorboard --logdir <dir>` shows them side by side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<PathBuf>,
    /// Measurement aid: each step takes this many times as long (the rest asleep, its CPU
    /// free), so one machine can stand in for nodes of unlike speed. 1: off.
    #[serde(skip_serializing_if = "is_one")]
    pub slowdown: f64,
    /// A node's own micro-batch: sequences per forward and backward pass, what its memory
    /// holds (0: `batch_size`). A step keeps its rows (`batch_size × grad_accum`, or its share
    /// of a round by tokens); only how they are cut changes.
    #[serde(skip_serializing_if = "is_zero")]
    pub micro_batch: usize,
    /// A node's memory budget per rank in GiB (0: none): it owns at most the experts whose
    /// state fits in it, as `spes plan memory` counts them, and tells the server at join; the
    /// server gives it no more ([`spes_sync::Claims`]). A budget too small for one expert is
    /// refused at start with what would fit.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub memory_gib: f64,
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

fn is_one(v: &f64) -> bool {
    *v == 1.0
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

impl TrainConfig {
    /// The nodes' peak rate for the shared parameters: `lr · node_lr_scale`.
    pub fn node_lr(&self) -> f64 {
        self.lr * self.node_lr_scale
    }

    /// Sequences per forward and backward pass: `micro_batch`, or `batch_size` when unset.
    pub fn micro_rows(&self) -> usize {
        if self.micro_batch > 0 {
            self.micro_batch
        } else {
            self.batch_size
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            max_steps: 1000,
            batch_size: 8,
            grad_accum: 1,
            seq_len: 256,
            lr: 5e-4,
            node_lr_scale: 1.0,
            expert_lr_scale: 1.0,
            warmup_steps: 100,
            t_max: 0,
            lr_floor: 0.1,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            second_moment: SecondMoment::Own,
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
            tensorboard: None,
            slowdown: 1.0,
            micro_batch: 0,
            memory_gib: 0.0,
        }
    }
}

/// Whether `section.key` is each role's own: node-local `[train]` keys and per-role `[sync]`
/// keys, which a node neither receives nor must match.
fn is_node_own(section: &str, key: &str) -> bool {
    match section {
        "train" => TrainConfig::NODE_LOCAL.contains(&key),
        "sync" => SyncConfig::PER_ROLE.contains(&key),
        _ => false,
    }
}

/// Declares the `[train]` keys a node sets for itself, once: the list the config check skips
/// and the copy that takes them from the node's own config are both made from it.
macro_rules! node_local_train_keys {
    ($($key:ident),* $(,)?) => {
        impl TrainConfig {
            /// `[train]` keys that may differ between a node and the server: how a node logs,
            /// evaluates, checkpoints and computes is its own affair.
            pub const NODE_LOCAL: &'static [&'static str] = &[$(stringify!($key)),*];

            /// Takes the node-local keys from `mine`.
            fn take_node_local(&mut self, mine: &TrainConfig) {
                $(self.$key = mine.$key.clone();)*
            }
        }
    };
}

node_local_train_keys!(
    log_every,
    eval_every,
    eval_batches,
    eval_tasks,
    eval_tasks_every,
    eval_task_docs,
    checkpoint_every,
    keep_checkpoints,
    activation_checkpointing,
    moe_kernel,
    frozen_experts_bf16,
    tensorboard,
    slowdown,
    micro_batch,
    memory_gib,
);

impl RunConfig {
    /// The config node `peer` runs with: the server's, with the node's own `[data]`,
    /// node-local `[train]` keys ([`TrainConfig::NODE_LOCAL`]) and per-role `[sync]` keys
    /// ([`SyncConfig::PER_ROLE`]), and a seed of its own. Refuses a
    /// node config whose other `[model]`, `[sync]` or `[train]` keys differ from the server's
    /// (the per-role `[sync]` keys excepted), naming the key.
    pub fn for_node(server: RunConfig, local: &RunConfig, peer: usize) -> Result<RunConfig> {
        let (l, s) = (
            toml::Value::try_from(local)?,
            toml::Value::try_from(&server)?,
        );
        for section in ["model", "sync", "train"] {
            let Some(table) = s.get(section).and_then(|t| t.as_table()) else {
                continue;
            };
            let own = match section {
                "train" => TrainConfig::NODE_LOCAL,
                "sync" => SyncConfig::PER_ROLE,
                _ => &[],
            };
            for (key, sv) in table {
                if own.contains(&key.as_str()) {
                    continue;
                }
                let lv = l.get(section).and_then(|t| t.get(key));
                if lv != Some(sv) {
                    let shown = lv
                        .map(|v| v.to_string())
                        .unwrap_or_else(|| "nothing".into());
                    bail!("config key `{section}.{key}` differs: this node has {shown}, the server has {sv}");
                }
            }
        }
        if local.data.partition != server.data.partition {
            bail!(
                "config key `data.partition` differs: this node has {:?}, the server has {:?}",
                local.data.partition,
                server.data.partition
            );
        }
        let mut cfg = server;
        cfg.data = local.data.clone();
        cfg.train.take_node_local(&local.train);
        cfg.sync.take_per_role(&local.sync);
        // Shuffled copies of one corpus need an order per node; interleaved nodes share one
        // order and each read their own draws of it; disjoint parts are each the node's own
        // already, and are seeded by their identity so any holder reads one order.
        match cfg.data.partition {
            Partition::Shuffle => cfg.train.seed += 1000 * peer as u64,
            Partition::Interleave => {
                let of = cfg.sync.nodes as u64;
                if peer as u64 >= of {
                    bail!("data.partition = \"interleave\" shares the corpus among sync.nodes = {of} nodes, but this is node {peer}");
                }
                cfg.data.share = spes_data::Share {
                    index: peer as u64,
                    of,
                };
            }
            Partition::Disjoint => {}
        }
        Ok(cfg)
    }

    /// The run's settings a server sends to a node that has no config of its own: the keys
    /// every node must share ([`RunConfig::for_node`] checks the same ones) and nothing that
    /// names a file: `[model]`, `[train]` but its node-local keys, `[sync]` but its per-role
    /// keys, and `data.partition`.
    pub fn run_settings(&self) -> Result<String> {
        let mut all = toml::Table::try_from(self)?;
        let mut out = toml::Table::new();
        for section in ["model", "train", "sync"] {
            if let Some(toml::Value::Table(mut t)) = all.remove(section) {
                t.retain(|k, _| !is_node_own(section, k));
                out.insert(section.into(), t.into());
            }
        }
        let mut data = toml::Table::new();
        data.insert(
            "partition".into(),
            toml::Value::try_from(self.data.partition)?,
        );
        out.insert("data".into(), data.into());
        Ok(toml::to_string(&out)?)
    }

    /// A node's config from the settings its server sent ([`RunConfig::run_settings`]) and its
    /// own `section.key=value` overrides (its data and node-local keys). The settings are
    /// untrusted: a key that is not a run setting (a path, a node's own key, an unknown one) is
    /// refused by name, and the result is validated as a local config is.
    pub fn from_run_settings(settings: &str, overrides: &[String]) -> Result<Self> {
        let doc: toml::Table =
            toml::from_str(settings).context("the server's run settings are not TOML")?;
        for (section, value) in &doc {
            let keys = value.as_table().with_context(|| {
                format!("the server's run settings: `{section}` is not a section")
            })?;
            for key in keys.keys() {
                let run_key = match section.as_str() {
                    "model" | "train" | "sync" => !is_node_own(section, key),
                    "data" => key == "partition",
                    _ => false,
                };
                if !run_key {
                    bail!(
                        "the server sent `{section}.{key}`, which is not a run setting (a path, \
                         or a key each node sets for itself): refusing the run's settings"
                    );
                }
            }
        }
        Self::parse(&toml::to_string(&doc)?, overrides)
            .context("the server's run settings with this node's --set")
    }

    /// Keeps run `settings` ([`RunConfig::run_settings`]) in `file`; when `resuming`, first
    /// returns the settings that changed since `file` was written ([`RunConfig::changed_setting`])
    /// instead, keeping `file` as it was. A role resumes only with the settings it started with.
    pub fn keep_settings(file: &Path, settings: &str, resuming: bool) -> Result<Option<String>> {
        if let (true, Ok(before)) = (resuming, std::fs::read_to_string(file)) {
            if let Some(change) = Self::changed_setting(&before, settings)? {
                return Ok(Some(change));
            }
        }
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        spes_data::shard::write_atomic(file, settings.as_bytes())?;
        Ok(None)
    }

    /// The run settings that differ between two [`RunConfig::run_settings`] texts, each as
    /// "`section.key` was A, is now B" (joined by "; "); `None` when they agree. The server's liveness timing
    /// (`sync.lease_s`, `evict_after_s`, `stall_s`, `round_timeout_s`) may change between
    /// restarts, and a key `before` lacks (a newer server's) is not a change of the run.
    pub fn changed_setting(before: &str, now: &str) -> Result<Option<String>> {
        const TIMING: [&str; 4] = ["lease_s", "evict_after_s", "stall_s", "round_timeout_s"];
        let (a, b): (toml::Table, toml::Table) = (toml::from_str(before)?, toml::from_str(now)?);
        let keys = |t: &toml::Table| -> Vec<(String, String)> {
            t.iter()
                .flat_map(|(s, v)| {
                    let keys: Vec<String> = v
                        .as_table()
                        .map(|t| t.keys().cloned().collect())
                        .unwrap_or_default();
                    keys.into_iter().map(move |k| (s.clone(), k))
                })
                .collect()
        };
        let mut all = keys(&a);
        all.retain(|(s, k)| !(s == "sync" && TIMING.contains(&k.as_str())));
        let get = |t: &toml::Table, s: &str, k: &str| t.get(s).and_then(|v| v.get(k)).cloned();
        let shown = |v: Option<toml::Value>| v.map_or("nothing".into(), |v| v.to_string());
        let changes: Vec<String> = all
            .into_iter()
            .filter_map(|(s, k)| {
                let (x, y) = (get(&a, &s, &k), get(&b, &s, &k));
                (x != y).then(|| format!("`{s}.{k}` was {}, is now {}", shown(x), shown(y)))
            })
            .collect();
        Ok((!changes.is_empty()).then(|| changes.join("; ")))
    }

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
        let derived = rules::resolve(&mut doc)?;
        let mut cfg: RunConfig = serde_path_to_error::deserialize(toml::Value::Table(doc))
            .map_err(|e| anyhow::anyhow!("key `{}`: {}", e.path(), e.inner()))?;
        cfg.derived = derived;
        spes_sync::loss_table::settle(&mut cfg.sync);
        cfg.validate()?;
        Ok(cfg)
    }

    /// The resolved config as TOML, headed by a comment naming each value a rule derived.
    pub fn to_toml(&self) -> Result<String> {
        let mut text = String::new();
        if !self.derived.is_empty() {
            text += "# derived by rule (docs/guides/configuration.md#rules):\n";
            for d in &self.derived {
                text += &format!("# {d}\n");
            }
        }
        Ok(text + &toml::to_string(self)?)
    }

    fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.model.check_alignment()?;
        self.data.validate()?;
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
        if t.second_moment == SecondMoment::UnionEstimate {
            if self.sync.mode == Mode::Centralized {
                bail!("train.second_moment = \"union_estimate\" estimates for the nodes of a decentralized run; a centralized run has only its own batch (use \"own\")");
            }
            if t.batch_size * t.grad_accum < 2 {
                bail!("train.second_moment = \"union_estimate\" splits a step's rows in two halves: it needs train.batch_size × train.grad_accum ≥ 2");
            }
        }
        if t.t_max != 0 && t.t_max <= t.warmup_steps {
            bail!(
                "train.t_max ({}) must be 0 (use train.max_steps) or more than train.warmup_steps ({})",
                t.t_max,
                t.warmup_steps
            );
        }
        if !(t.node_lr_scale > 0.0 && t.node_lr_scale.is_finite()) {
            bail!(
                "train.node_lr_scale must be a positive number or \"auto\", got {}",
                t.node_lr_scale
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
        if !(t.slowdown >= 1.0 && t.slowdown.is_finite()) {
            bail!(
                "train.slowdown must be a number ≥ 1 (1: off), got {}",
                t.slowdown
            );
        }
        if !(t.memory_gib >= 0.0 && t.memory_gib.is_finite()) {
            bail!(
                "train.memory_gib must be a number of GiB ≥ 0 (0: no budget), got {}",
                t.memory_gib
            );
        }
        let s = &self.sync;
        if s.mode != Mode::Centralized {
            if s.nodes == 0 || s.sync_steps == 0 {
                bail!("sync.nodes and sync.sync_steps must be > 0");
            }
            if !(s.checkpoint_every_s >= 0.0 && s.checkpoint_every_s.is_finite()) {
                bail!(
                    "sync.checkpoint_every_s must be ≥ 0 seconds, got {}",
                    s.checkpoint_every_s
                );
            }
            if s.checkpoint_every_rounds == 0 && s.checkpoint_every_s == 0.0 {
                bail!("sync.checkpoint_every_rounds and sync.checkpoint_every_s are both 0: set one, or a restarted server would replay every round's delta since round 0");
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
                ("sync.stall_s", s.stall_s),
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
            if s.outer_norm_preserving && s.wire() == Wire::Fp32 {
                bail!("sync.outer_norm_preserving needs a delta wire (sync.wire = \"bf16_delta\" or a compressed one), not \"fp32\"");
            }
            if s.stride == 0 {
                bail!("sync.stride must be at least 1, got 0");
            }
            if s.adaptive() && s.stride > 1 {
                bail!(
                    "sync.stride = {} needs a pinned quantized wire; the settings an adaptive run chooses among send every value each round",
                    s.stride
                );
            }
            if s.stride > 1 && s.wire().quantized_bits().is_none() {
                bail!(
                    "sync.stride = {} needs a quantized wire (sync.wire = \"int8_delta\", \"int4_delta\" or \"int2_delta\"), not {:?}",
                    s.stride,
                    s.wire()
                );
            }
            if !(s.target_utilization > 0.0 && s.target_utilization <= 1.0) {
                bail!(
                    "sync.target_utilization must be a share in (0, 1], got {}",
                    s.target_utilization
                );
            }
            if !(0.0..=1.0).contains(&s.feedback_decay) {
                bail!(
                    "sync.feedback_decay must be in [0, 1], got {}",
                    s.feedback_decay
                );
            }
            if s.average_by == AverageBy::Tokens && s.aggregate != AggregateRule::Mean {
                bail!(
                    "sync.average_by = \"tokens\" weighs a mean; it needs sync.aggregate = \"mean\", not {:?}",
                    s.aggregate
                );
            }
            if !(16..=32768).contains(&s.sparse_chunk) {
                bail!(
                    "sync.sparse_chunk must be in 16..=32768 (an index within a chunk is int16), got {}",
                    s.sparse_chunk
                );
            }
            if !(1..=s.sparse_chunk / 4).contains(&s.sparse_k) {
                bail!(
                    "sync.sparse_k must be in 1..={} (a quarter of sync.sparse_chunk), got {}",
                    s.sparse_chunk / 4,
                    s.sparse_k
                );
            }
            if !(1..=1024).contains(&s.rank) {
                bail!("sync.rank must be in 1..=1024, got {}", s.rank);
            }
        }
        Ok(())
    }

    /// Tokens consumed by one optimizer step.
    pub fn tokens_per_step(&self) -> u64 {
        (self.train.batch_size * self.train.grad_accum * self.train.seq_len) as u64
    }

    /// Rows (sequences) one single-rank node trains in a round at the run's batch:
    /// `sync_steps × batch_size × grad_accum`, the unit of a round by tokens.
    pub fn rows_per_round(&self) -> u64 {
        self.sync.sync_steps * (self.train.batch_size * self.train.grad_accum) as u64
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
        // The grouped kernel's alignment, held on every device.
        let err = RunConfig::parse(BASE, &["model.d_model=100".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.d_model (100) must be a multiple of 8"),
            "{err}"
        );
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
    fn adaptive_settings_parse_and_contradictions_are_refused_by_name() {
        use spes_sync::Choice;
        let spes = |more: &[&str]| {
            let mut sets: Vec<String> = vec!["sync.mode=spes".into(), "sync.sync_steps=5".into()];
            sets.extend(more.iter().map(|s| s.to_string()));
            RunConfig::parse(BASE, &sets)
        };
        let c = spes(&["sync.wire=adaptive", "sync.overlap_steps=adaptive"]).unwrap();
        assert!(c.sync.wire.is_adaptive() && c.sync.overlap_steps.is_adaptive());
        assert_eq!(c.sync.settings(), spes_sync::FIRST_ROUNDS);
        // The resolved config says "adaptive" again: nodes read it from the server.
        let again = RunConfig::parse(&toml::to_string(&c).unwrap(), &[]).unwrap();
        assert_eq!(again.sync, c.sync);
        let c = spes(&["sync.wire=int4_delta", "sync.overlap_steps=3"]).unwrap();
        assert_eq!(c.sync.wire, Choice::Pinned(Wire::Int4Delta));
        assert_eq!(c.sync.overlap_cap(), 3);
        let err = format!("{:#}", spes(&["sync.wire=int3_delta"]).unwrap_err());
        assert!(
            err.contains("int3_delta") && err.contains("lowrank_delta") && err.contains("adaptive"),
            "{err}"
        );
        let err = format!("{:#}", spes(&["sync.overlap_steps=\"some\""]).unwrap_err());
        assert!(err.contains("adaptive"), "{err}");
        // One key pinned over an adaptive config narrows the choice; where it leaves one
        // measured setting or none, the run is pinned.
        let c = spes(&[
            "sync.wire=adaptive",
            "sync.overlap_steps=adaptive",
            "sync.overlap=false",
        ])
        .unwrap();
        assert!(c.sync.wire.is_adaptive());
        assert!(!c.sync.settings().overlap);
        let c = spes(&[
            "sync.wire=bf16_delta",
            "sync.overlap_steps=adaptive",
            "sync.overlap=false",
        ])
        .unwrap();
        assert!(!c.sync.adaptive());
        assert_eq!(c.sync.settings().to_string(), "bf16_delta, no overlap");
        let c = spes(&[
            "sync.wire=int2_delta",
            "sync.overlap_steps=adaptive",
            "sync.stride=4",
        ])
        .unwrap();
        assert!(!c.sync.adaptive());
        assert_eq!(c.sync.settings().to_string(), "int2_delta, overlap 1 step");
        let err = spes(&["sync.wire=adaptive", "sync.stride=3"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sync.stride = 3"), "{err}");
        let err = spes(&["sync.target_utilization=1.5"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sync.target_utilization"), "{err}");
    }

    #[test]
    fn a_node_keeps_its_local_keys_and_must_match_the_server_elsewhere() {
        let spes = ["sync.mode=spes".to_string(), "sync.sync_steps=5".into()];
        let server = RunConfig::parse(BASE, &spes).unwrap();
        let mut o = spes.to_vec();
        o.extend([
            "train.log_every=3".into(),
            "sync.keep_checkpoints=9".into(),
            "data.path=mine".into(),
        ]);
        let local = RunConfig::parse(BASE, &o).unwrap();
        let cfg = RunConfig::for_node(server.clone(), &local, 2).unwrap();
        assert_eq!(cfg.train.log_every, 3);
        assert_eq!(cfg.data.path, PathBuf::from("mine"));
        assert_eq!(cfg.train.seed, server.train.seed + 2000);
        assert_eq!(cfg.sync.keep_checkpoints, 9, "the node's own");
        o.push("train.lr=1e-2".into());
        let local = RunConfig::parse(BASE, &o).unwrap();
        let e = RunConfig::for_node(server, &local, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`train.lr` differs"), "{e}");
        assert!(
            e.contains("this node has 0.01") && e.contains("the server has 0.0005"),
            "both values named: {e}"
        );
        // Every declared key is a key of the config.
        let train = toml::Value::try_from(TrainConfig::default()).unwrap();
        let sync = toml::Value::try_from(SyncConfig::default()).unwrap();
        // (Optional keys are absent while unset.)
        for k in TrainConfig::NODE_LOCAL {
            let optional = [
                "frozen_experts_bf16",
                "tensorboard",
                "slowdown",
                "micro_batch",
                "memory_gib",
            ]
            .contains(k);
            assert!(train.get(k).is_some() || optional, "{k}");
        }
        for k in SyncConfig::PER_ROLE {
            assert!(sync.get(k).is_some(), "{k}");
        }
    }

    #[test]
    fn a_node_without_a_config_runs_the_servers_settings_with_its_own_keys() {
        let o = [
            "sync.mode=spes".to_string(),
            "sync.sync_steps=5".into(),
            "train.eval_tasks=[\"/srv/tasks\"]".into(),
            "train.tensorboard=/srv/tb".into(),
        ];
        let server = RunConfig::parse(BASE, &o).unwrap();
        let settings = server.run_settings().unwrap();
        for path in ["/srv", "\"d\""] {
            assert!(!settings.contains(path), "{path} in {settings}");
        }
        let mine = ["data.path=mine".to_string(), "train.log_every=3".into()];
        let local = RunConfig::from_run_settings(&settings, &mine).unwrap();
        // What the join then builds equals what a node with the server's config file gets.
        let via_settings = RunConfig::for_node(server.clone(), &local, 1).unwrap();
        // (The node's file names no files of the server's: those keys are node-local.)
        let mut file = o[..2].to_vec();
        file.extend(mine);
        let via_file =
            RunConfig::for_node(server, &RunConfig::parse(BASE, &file).unwrap(), 1).unwrap();
        assert_eq!(
            toml::to_string(&via_settings).unwrap(),
            toml::to_string(&via_file).unwrap()
        );
        assert_eq!(via_settings.data.path, PathBuf::from("mine"));
        let settings_with = |set: &str| {
            let mut again = o[..2].to_vec();
            again.push(set.into());
            RunConfig::parse(BASE, &again)
                .unwrap()
                .run_settings()
                .unwrap()
        };
        assert_eq!(
            RunConfig::changed_setting(&settings, &settings_with("train.lr=0.01")).unwrap(),
            Some("`train.lr` was 0.0005, is now 0.01".into())
        );
        let timing = settings_with("sync.lease_s=7");
        assert_eq!(
            RunConfig::changed_setting(&settings, &timing).unwrap(),
            None
        );
        assert_eq!(
            RunConfig::changed_setting(&settings, &settings).unwrap(),
            None
        );
        assert!(via_settings.train.eval_tasks.is_empty());
        assert_eq!(via_settings.train.tensorboard, None);
    }

    #[test]
    fn settings_that_name_a_path_or_an_unknown_key_are_refused_by_name() {
        let good = RunConfig::parse(BASE, &[]).unwrap().run_settings().unwrap();
        for (extra, key) in [
            ("[data]\npath = \"/etc\"\n", "data.path"),
            ("[train]\ntensorboard = \"/tmp/x\"\n", "train.tensorboard"),
            ("[train]\neval_tasks = [\"/etc\"]\n", "train.eval_tasks"),
            ("[init]\npath = \"/etc/passwd\"\n", "init.path"),
        ] {
            let mut doc: toml::Table = toml::from_str(&good).unwrap();
            let add: toml::Table = toml::from_str(extra).unwrap();
            for (section, t) in add {
                let entry = doc
                    .entry(section)
                    .or_insert_with(|| toml::Table::new().into());
                entry
                    .as_table_mut()
                    .unwrap()
                    .extend(t.as_table().unwrap().clone());
            }
            let e = RunConfig::from_run_settings(&toml::to_string(&doc).unwrap(), &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{key}`")), "{key}: {e}");
        }
        let unknown = good.replace("[sync]\n", "[sync]\nexfiltrate = true\n");
        let e = format!(
            "{:#}",
            RunConfig::from_run_settings(&unknown, &[]).unwrap_err()
        );
        assert!(e.contains("exfiltrate"), "{e}");
    }

    #[test]
    fn interleaved_nodes_read_their_share_of_one_order() {
        let o = [
            "sync.mode=spes".to_string(),
            "sync.nodes=4".into(),
            "sync.sync_steps=5".into(),
            "data.partition=interleave".into(),
        ];
        let server = RunConfig::parse(BASE, &o).unwrap();
        assert_eq!(server.data.share, spes_data::Share::WHOLE);
        let node = RunConfig::for_node(server.clone(), &server, 3).unwrap();
        assert_eq!(node.train.seed, server.train.seed, "one order for all");
        assert_eq!(node.data.share, spes_data::Share { index: 3, of: 4 });
        let e = RunConfig::for_node(server.clone(), &server, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sync.nodes = 4") && e.contains("node 4"), "{e}");
        // A node's other ranks get its config as JSON from rank 0 (lead.rs): the share travels.
        let sent: RunConfig = serde_json::from_str(&serde_json::to_string(&node).unwrap()).unwrap();
        assert_eq!(sent.data.share, node.data.share);
        assert!(!toml::to_string(&server).unwrap().contains("share"));
        let mut written = o.to_vec();
        written.push("data.share={index=1,of=4}".into());
        let e = RunConfig::parse(BASE, &written).unwrap_err().to_string();
        assert!(e.contains("[data] share"), "{e}");
    }

    #[test]
    fn a_slowdown_and_a_micro_batch_are_node_local() {
        let slow = RunConfig::parse(BASE, &["train.slowdown=2.5".into()]).unwrap();
        assert_eq!(slow.train.slowdown, 2.5);
        for bad in ["0.5", "nan", "inf"] {
            let e = RunConfig::parse(BASE, &[format!("train.slowdown={bad}")])
                .unwrap_err()
                .to_string();
            assert!(e.contains("train.slowdown must be a number ≥ 1"), "{e}");
        }
        let server = RunConfig::parse(BASE, &[]).unwrap();
        let node = RunConfig::for_node(server.clone(), &slow, 1).unwrap();
        assert_eq!(node.train.slowdown, 2.5, "a node's own");
        let small = RunConfig::parse(BASE, &["train.micro_batch=2".into()]).unwrap();
        let node = RunConfig::for_node(server.clone(), &small, 1).unwrap();
        assert_eq!(node.train.micro_rows(), 2, "a node's own micro-batch");
        let card = RunConfig::parse(BASE, &["train.memory_gib=24".into()]).unwrap();
        let node = RunConfig::for_node(server.clone(), &card, 1).unwrap();
        assert_eq!(node.train.memory_gib, 24.0, "a node's own memory budget");
        let e = RunConfig::parse(BASE, &["train.memory_gib=-1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.memory_gib must be"), "{e}");
        assert!(!toml::to_string(&RunConfig::parse(BASE, &[]).unwrap())
            .unwrap()
            .contains("slowdown"));
    }

    #[test]
    fn rounds_by_tokens_are_checked_by_key() {
        let spes = |extra: &[&str]| {
            let mut sets = vec!["sync.mode=spes".to_string(), "sync.sync_steps=5".into()];
            sets.extend(extra.iter().map(|s| s.to_string()));
            RunConfig::parse(BASE, &sets)
        };
        let c = spes(&["sync.round_by=tokens", "sync.average_by=tokens"]).unwrap();
        assert_eq!(
            (c.sync.round_by, c.sync.average_by),
            (RoundBy::Tokens, AverageBy::Tokens)
        );
        let e = spes(&["sync.average_by=tokens", "sync.aggregate=median"]).unwrap_err();
        assert!(e.to_string().contains("sync.aggregate = \"mean\""), "{e}");
        let e = spes(&["sync.round_by=time"]).unwrap_err().to_string();
        assert!(e.contains("sync.round_by") && e.contains("tokens"), "{e}");
        let d = spes(&[]).unwrap();
        assert_eq!(
            (d.sync.round_by, d.sync.average_by),
            (RoundBy::Steps, AverageBy::Auto)
        );
        assert!(!d.sync.weighs_by_tokens(), "by steps: the plain mean");
        let auto = spes(&["sync.round_by=tokens"]).unwrap();
        assert!(auto.sync.weighs_by_tokens(), "by tokens: weighed by rows");
        let plain = spes(&["sync.round_by=tokens", "sync.average_by=node"]).unwrap();
        assert!(!plain.sync.weighs_by_tokens());
        let robust = spes(&["sync.round_by=tokens", "sync.aggregate=median"]).unwrap();
        assert!(!robust.sync.weighs_by_tokens(), "a median has no weights");
        assert!(auto.sync.owns_by_throughput() && !d.sync.owns_by_throughput());
        let equal = spes(&["sync.round_by=tokens", "sync.own_by=equal"]).unwrap();
        assert!(!equal.sync.owns_by_throughput());
        let e = spes(&["sync.own_by=memory"]).unwrap_err().to_string();
        assert!(e.contains("sync.own_by") && e.contains("throughput"), "{e}");
    }

    #[test]
    fn data_is_one_path_or_a_weighted_mixture() {
        let mix = "[model]\npreset = \"tiny\"\n[data]\nsources = [{ path = \"web\", weight = 0.75 }, { path = \"code\", weight = 0.25 }]\n[train]\nmax_steps = 5\n";
        let c = RunConfig::parse(mix, &[]).unwrap();
        let s = c.data.sources();
        assert_eq!((s.len(), s[1].weight), (2, 0.25));
        assert_eq!(c.data.primary(), Path::new("web"));
        assert_eq!(
            RunConfig::parse(BASE, &[]).unwrap().data.sources()[0].path,
            Path::new("d")
        );
        let both = RunConfig::parse(mix, &["data.path=d".into()]).unwrap_err();
        assert!(format!("{both:#}").contains("not both"), "{both:#}");
        let bad = mix.replace("0.25", "-1");
        let err = RunConfig::parse(&bad, &[]).unwrap_err();
        assert!(
            format!("{err:#}").contains("source code: weight"),
            "{err:#}"
        );
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
