//! What spes records, as types: one line of `metrics.jsonl` per logged step ([`StepRecord`],
//! `spes train` and every node), per node sync ([`SyncRecord`]) and per closed round on the
//! server ([`RoundRecord`]), plus the demo's `summary.json` ([`DemoSummary`]). Trainer, node and
//! server write these types, and the report, the experiment harness and the demo read them
//! back, so a field is added in one place.

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use spes_sync::RoundSettings;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One logged training step (or an evaluation between steps, which has no losses).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    /// The step's losses and rates; absent on an evaluation-only line.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub losses: Option<StepLosses>,
    /// Training tokens so far.
    pub tokens: u64,
    /// Measured over the steps since the last logged one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Training tokens drawn from each `[data]` source so far (mixtures only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_tokens: Vec<u64>,
    /// The sync round the step belongs to (nodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Tasks>,
}

/// What one optimizer step's loss was made of, and its rate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepLosses {
    pub loss: f64,
    pub ce: f64,
    pub z_loss: f64,
    pub lb_loss: f64,
    pub router_z_loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
}

/// Ranked-classification scores by task name.
pub type Tasks = BTreeMap<String, TaskScore>;

/// One task's scores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskScore {
    pub acc_raw: f64,
    pub acc_per_char: f64,
    pub docs: usize,
}

/// The tag of a sync line (`"event": "sync"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Event {
    Sync,
}

/// A node's sync: what it sent and received, and what the round cost its training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncRecord {
    pub event: Event,
    pub step: u64,
    /// The global round the node's weights now build on.
    pub round: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// Payload bytes the node read since its previous sync (its first model included): from
    /// the run's store through presigned URLs, and streamed by the server.
    #[serde(default)]
    pub bytes_down_store: u64,
    #[serde(default)]
    pub bytes_down_server: u64,
    /// From the upload to the loaded model.
    pub sync_s: f64,
    /// Training stood still for it (with overlap, the upload's encoding and the wait for the
    /// result), the node's checkpoint included.
    pub idle_s: f64,
    /// The round's training steps.
    pub compute_s: f64,
    /// Bytes the node wrote to disk since its previous sync (its own I/O counters).
    #[serde(default)]
    pub bytes_written: u64,
    /// Its upload, from the first byte to the server's acknowledgement (retries and staging
    /// in the store included); its download, from the round's header to the last byte (not
    /// the wait for the round); decoding and applying it (on CPU with overlap, mostly on the
    /// exchange's thread while training ran on). 0 where the round's own exchange did not
    /// happen (a refusal, or the newest model taken instead).
    #[serde(default)]
    pub up_s: f64,
    #[serde(default)]
    pub down_s: f64,
    #[serde(default)]
    pub apply_s: f64,
}

impl SyncRecord {
    /// The share of the round the node trained: compute / (compute + idle). The one
    /// definition of utilization (1 − idle share) the report, the benchmarks and the planner
    /// use.
    pub fn utilization(&self) -> f64 {
        utilization(self.compute_s, self.idle_s)
    }
}

/// compute / (compute + idle); 1 for an empty round.
pub fn utilization(compute_s: f64, idle_s: f64) -> f64 {
    let total = compute_s + idle_s;
    if total > 0.0 {
        compute_s / total
    } else {
        1.0
    }
}

/// One node's part of a round as the node measured it: the [`SyncRecord`] numbers the
/// server keeps per round (its timeline) and the live page draws.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeRound {
    /// Whose part it is (set by the server, which knows who reported it).
    #[serde(default)]
    pub peer: usize,
    /// The global round the node's weights build on after this sync.
    pub round: u64,
    pub compute_s: f64,
    pub sync_s: f64,
    pub idle_s: f64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// [`SyncRecord::up_s`], [`SyncRecord::down_s`], [`SyncRecord::apply_s`].
    #[serde(default)]
    pub up_s: f64,
    #[serde(default)]
    pub down_s: f64,
    #[serde(default)]
    pub apply_s: f64,
}

impl From<&SyncRecord> for NodeRound {
    fn from(s: &SyncRecord) -> Self {
        NodeRound {
            peer: 0,
            round: s.round,
            compute_s: s.compute_s,
            sync_s: s.sync_s,
            idle_s: s.idle_s,
            bytes_up: s.bytes_up,
            bytes_down: s.bytes_down,
            up_s: s.up_s,
            down_s: s.down_s,
            apply_s: s.apply_s,
        }
    }
}

/// What a node tells the server about itself with each heartbeat, so an operator sees nodes
/// behind NAT that nothing can scrape: its newest logged step and its newest sync. Small and
/// fixed in size; the server checks it as untrusted input.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub step: u64,
    /// Training tokens so far.
    pub tokens: u64,
    pub tokens_per_s: f64,
    #[serde(flatten)]
    pub losses: StepLosses,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<NodeRound>,
}

/// A line of a node's `metrics.jsonl`: a sync or a step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NodeLine {
    Sync(SyncRecord),
    Step(StepRecord),
}

/// A node line as `--progress json` prints it, with who printed it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgressLine {
    #[serde(flatten)]
    pub line: NodeLine,
    pub peer: usize,
    pub max_steps: u64,
}

/// A published round on the server: who took part, what it moved and cost, and (once scored)
/// the global model's validation loss and expert load.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    pub round: u64,
    pub step: u64,
    /// Training tokens of the run up to this round.
    pub tokens: u64,
    /// Who trains in the next round.
    pub members: Vec<usize>,
    /// `owners[e]`: who trains expert e in the next round (empty for DiLoCo).
    pub owners: Vec<usize>,
    /// `data.partition = "disjoint"`: the data parts each of the round's members read.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub data_parts: std::collections::BTreeMap<usize, Vec<String>>,
    /// How the round closed; absent for round 0 (θ⁰).
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub close: Option<RoundClose>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// `expert_load[layer][expert]`: share of top-k assignments on validation tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<Vec<f64>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Tasks>,
}

/// How a round closed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundClose {
    /// Peers whose upload went into the round.
    pub peers: Vec<usize>,
    /// Members that did not upload before it closed.
    pub missing: Vec<usize>,
    pub evicted: Vec<usize>,
    pub joined: Vec<usize>,
    /// Why the aggregate was discarded (the previous model kept), if it was.
    pub discarded: Option<String>,
    pub bytes_in: u64,
    /// Bytes the server sent nodes: fetch headers, and payloads the store did not send.
    pub bytes_out: u64,
    /// With a store (`--store`): bytes the server put in it since the previous round was
    /// published (its deltas, whole models, uploads kept, manifests).
    #[serde(default)]
    pub store_bytes_out: u64,
    /// Fetches answered with a presigned URL of the store, fetches the store failed for a
    /// node (served by the server instead), and uploads read from the store, where their
    /// nodes put them.
    #[serde(default)]
    pub store_links: u64,
    #[serde(default)]
    pub store_fallbacks: u64,
    #[serde(default)]
    pub store_staged: u64,
    pub aggregation_s: f64,
    /// Its durable write after the close (the delta, whole models, the state file).
    #[serde(default)]
    pub publish_s: f64,
    pub round_s: f64,
    pub merge_alpha: Option<f64>,
    pub merges: Vec<MergeRecord>,
    /// Refused calls since the previous round, each as the server logged it.
    pub rejected: Vec<String>,
    /// The norm-preserving outer scale, mean over the averaged values.
    pub outer_scale: Option<f64>,
    /// Bytes the server wrote to disk since the previous round was published (its own I/O
    /// counters): this round's delta, uploads kept, whole models, logs.
    #[serde(default)]
    pub bytes_written: u64,
    /// Each member's newest sync as it reported it by the close (the run's timeline), by
    /// peer. A list, not a map by peer: a map's integer keys do not read back through the
    /// flattening that puts these fields into [`RoundRecord`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeRound>,
    /// What each upload reported it trained, and its weight in the average of the shared
    /// tensors (`sync.average_by`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub work: Vec<spes_sync::PeerWork>,
    /// `sync.round_by = "tokens"`: the rows each member of the next round trains in it, by
    /// peer.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "by_peer"
    )]
    pub budget: BTreeMap<usize, u64>,
    /// Each upload that went into the round as the server timed it, by peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uploads: Vec<UploadTiming>,
    /// What the planner predicts for every wire option on the links the rounds so far
    /// measured, once they measured every figure it needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned: Option<Planned>,
    /// The round's wire and overlap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<RoundSettings>,
    /// Adaptive settings: what every candidate would give after this round, and what the
    /// server took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<SettingsChoice>,
}

/// An adaptive run's look at its candidate settings after a round.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SettingsChoice {
    pub candidates: Vec<Candidate>,
    /// What it took; `None`: it kept the settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chose: Option<Chosen>,
}

/// One choice of an adaptive run: the settings it runs from round `from_round` on, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Chosen {
    pub from_round: u64,
    pub settings: RoundSettings,
    /// The figures and predictions it was chosen on, in words (empty in a file written by
    /// hand).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// One candidate setting: the share of its round the slowest member would train, and its
/// expected loss over the best setting's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub settings: RoundSettings,
    pub utilization: f64,
    pub loss_ratio: f64,
}

/// The planner fed what a run measured: the slowest member's link and speed and the server's
/// fold, with the apply and fold of the run's own wire as measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Planned {
    pub up_mbit_s: f64,
    pub down_mbit_s: f64,
    /// Seconds an exchange costs beyond its bytes (round trips, handshakes).
    pub latency_s: f64,
    pub step_s: f64,
    /// Seconds the slowest member's steps of a round take beyond the fastest's.
    pub skew_s: f64,
    /// The part of `skew_s` that is pace: the slowest member's mean beyond the fastest's.
    #[serde(default)]
    pub pace_s: f64,
    /// The measured apply, fold and close over what the planner's rates give them.
    pub apply_scale: f64,
    pub fold_scale: f64,
    pub close_scale: f64,
    /// Every option the planner knows, the run's own first.
    pub options: Vec<PlannedOption>,
}

/// One wire option's predicted round.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlannedOption {
    /// Its label (`spes plan sync`'s: `lowrank+overlap`, `int4+overlap`, ...).
    pub wire: String,
    /// Bytes a node sends and receives per round.
    pub up_bytes: f64,
    pub down_bytes: f64,
    pub round_s: f64,
    /// The share of the round the node that waits most trains.
    pub utilization: f64,
}

/// One upload as the server timed it: its own measure of the node's uplink and of its fold.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UploadTiming {
    pub peer: usize,
    pub bytes: u64,
    /// From its header's arrival to its last byte on the server, less any wait for an upload
    /// slot: about its bytes over the node's uplink rate (a small upload's bytes may arrive
    /// with its header, so it reads faster); `None` when the node staged it in the run's store
    /// (the node's own `up_s` times that).
    pub receive_s: Option<f64>,
    /// Decoding, checking and adding it into the round.
    pub fold_s: f64,
}

/// One expert's merge in a round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MergeRecord {
    pub layer: usize,
    pub expert: usize,
    pub neighbours: Vec<usize>,
}

/// What a finished node reports (`<out>/summary.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeSummary {
    pub peer: usize,
    pub steps: u64,
    pub tokens: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub trainable_params: u64,
    pub optimizer_state_bytes: u64,
    pub peak_rss_mb: f64,
    pub wall_s: f64,
}

/// The demo's `summary.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DemoSummary {
    pub initial_val_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    pub tokens: Option<u64>,
    pub rounds: Option<u64>,
    pub wall_s: f64,
    pub nodes: Vec<NodeSummary>,
    /// What each round cost, as the report's sync plot draws it.
    #[serde(default)]
    pub round_costs: Vec<RoundCost>,
}

/// What one round cost the nodes (means over those that synced it) and the server.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundCost {
    pub round: u64,
    pub nodes: usize,
    pub compute_s: f64,
    /// From a node's upload to its loaded model.
    pub sync_s: f64,
    /// Training standing still for the sync (with overlap, only the wait for the result).
    pub idle_s: f64,
    pub bytes_up: f64,
    pub bytes_down: f64,
    /// Bytes the node wrote to its disk since its previous sync.
    pub bytes_written: f64,
    /// The server's aggregation of the round and what it wrote for it.
    #[serde(default)]
    pub server_aggregation_s: Option<f64>,
    #[serde(default)]
    pub server_bytes_written: Option<u64>,
}

/// The lines of a `metrics.jsonl` that are `T`s, its rotated files' first, oldest first (a
/// missing file has none).
pub fn read<T: DeserializeOwned>(path: &Path) -> Vec<T> {
    let mut files: Vec<PathBuf> = (1..=KEEP_ROTATED).rev().map(|i| rotated(path, i)).collect();
    files.push(path.to_owned());
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect::<Vec<T>>()
        })
        .collect()
}

/// A log is rotated once it holds this many bytes...
pub const ROTATE_BYTES: u64 = 64 << 20;
/// ...into `metrics.1.jsonl` (the newest) to `metrics.3.jsonl`; older lines are dropped.
pub const KEEP_ROTATED: usize = 3;

/// The `i`-th rotated file of the log at `path` (`metrics.jsonl` → `metrics.<i>.jsonl`).
fn rotated(path: &Path, i: usize) -> PathBuf {
    path.with_extension(format!("{i}.jsonl"))
}

/// The scalar curves a record adds to TensorBoard, at its step.
pub trait Curves {
    fn step(&self) -> u64;
    fn scalars(&self) -> Vec<(&'static str, f64)>;
}

impl Curves for StepRecord {
    fn step(&self) -> u64 {
        self.step
    }
    fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut v = Vec::new();
        if let Some(l) = &self.losses {
            v.extend([
                ("train/loss", l.loss),
                ("train/ce", l.ce),
                ("train/z_loss", l.z_loss),
                ("train/lb_loss", l.lb_loss),
                ("train/router_z_loss", l.router_z_loss),
                ("train/grad_norm", l.grad_norm),
                ("train/lr", l.lr),
            ]);
        }
        v.extend(self.tokens_per_s.map(|t| ("train/tokens_per_s", t)));
        v.extend(self.val_loss.map(|l| ("val/loss", l)));
        v
    }
}

impl Curves for SyncRecord {
    fn step(&self) -> u64 {
        self.step
    }
    fn scalars(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("sync/seconds", self.sync_s),
            ("sync/idle_s", self.idle_s),
            ("sync/compute_s", self.compute_s),
            ("sync/utilization", self.utilization()),
            ("sync/bytes_up", self.bytes_up as f64),
            ("sync/bytes_down", self.bytes_down as f64),
        ]
    }
}

impl Curves for RoundRecord {
    fn step(&self) -> u64 {
        self.step
    }
    fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut v = vec![
            ("round/round", self.round as f64),
            ("round/members", self.members.len() as f64),
        ];
        v.extend(self.val_loss.map(|l| ("val/loss", l)));
        if let Some(c) = &self.close {
            v.extend([
                ("round/seconds", c.round_s),
                ("round/aggregation_s", c.aggregation_s),
                ("round/bytes_in", c.bytes_in as f64),
                ("round/bytes_out", c.bytes_out as f64),
                ("round/missing", c.missing.len() as f64),
            ]);
        }
        v
    }
}

/// Appends records as JSON lines to `<out>/metrics.jsonl`, rotating it at [`ROTATE_BYTES`] so
/// a run of any length keeps at most `(1 + KEEP_ROTATED) · ROTATE_BYTES` of metrics.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    bytes: u64,
    rotate_at: u64,
    tensorboard: Option<crate::tensorboard::EventWriter>,
}

/// A line's `step`, all a log needs to cut it after a crash.
#[derive(Deserialize)]
struct StepOf {
    step: u64,
}

impl MetricsLog {
    /// Opens the log, dropping entries after `keep_through_step` (left by a crashed run).
    pub fn open(out: &Path, keep_through_step: Option<u64>) -> Result<Self> {
        let path = out.join("metrics.jsonl");
        let kept: String = match (keep_through_step, std::fs::read_to_string(&path)) {
            (Some(step), Ok(text)) => text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<StepOf>(l)
                        .ok()
                        .is_some_and(|s| s.step <= step)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            _ => String::new(),
        };
        spes_data::shard::write_atomic(&path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(MetricsLog {
            path,
            file,
            bytes: kept.len() as u64,
            rotate_at: ROTATE_BYTES,
            tensorboard: None,
        })
    }

    /// Also writes every record's curves as TensorBoard events under `<dir>/<role>/`.
    pub fn with_tensorboard(mut self, dir: Option<&Path>, role: &str) -> Result<Self> {
        if let Some(dir) = dir {
            self.tensorboard = Some(crate::tensorboard::EventWriter::create(dir, role)?);
        }
        Ok(self)
    }

    /// Appends one record (and its curves, with TensorBoard on).
    pub fn write<T: Serialize + Curves>(&mut self, record: &T) -> Result<()> {
        if let Some(tb) = &mut self.tensorboard {
            tb.scalars(record.step(), &record.scalars())?;
        }
        let line = format!("{}\n", serde_json::to_string(record)?);
        if self.bytes + line.len() as u64 > self.rotate_at && self.bytes > 0 {
            self.rotate()?;
        }
        self.file.write_all(line.as_bytes())?;
        self.bytes += line.len() as u64;
        Ok(())
    }

    /// Moves `metrics.jsonl` to `metrics.1.jsonl` (and so on up) and starts it afresh.
    fn rotate(&mut self) -> Result<()> {
        for i in (1..KEEP_ROTATED).rev() {
            let from = rotated(&self.path, i);
            if from.exists() {
                std::fs::rename(&from, rotated(&self.path, i + 1))?;
            }
        }
        std::fs::rename(&self.path, rotated(&self.path, 1))?;
        self.file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("cannot open {}", self.path.display()))?;
        self.bytes = 0;
        Ok(())
    }
}

/// A map by peer as JSON writes it (string keys). Inside a flattened record (`RoundRecord`'s
/// `close`) serde buffers the fields and hands the keys over as strings, which an integer-keyed
/// map refuses, and the whole flattened part would read back as absent.
fn by_peer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<usize, u64>, D::Error> {
    BTreeMap::<String, u64>::deserialize(d)?
        .into_iter()
        .map(|(k, v)| {
            let peer = k
                .parse()
                .map_err(|_| serde::de::Error::custom(format!("`{k}` is not a peer id")))?;
            Ok((peer, v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_by_tokens_reads_back_with_how_it_closed() {
        let record = RoundRecord {
            round: 3,
            close: Some(RoundClose {
                joined: vec![4],
                budget: BTreeMap::from([(0, 20), (4, 12)]),
                ..RoundClose::default()
            }),
            ..RoundRecord::default()
        };
        let line = serde_json::to_string(&record).unwrap();
        let back: RoundRecord = serde_json::from_str(&line).unwrap();
        let close = back.close.expect("the close reads back");
        assert_eq!(close.joined, vec![4]);
        assert_eq!(close.budget, BTreeMap::from([(0, 20), (4, 12)]));
    }

    #[test]
    fn a_log_rotates_and_reads_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        log.rotate_at = 1000;
        // Lines of one length (3-digit steps): `per_file` fill a file, so 4 · per_file fill
        // the current file and the 3 rotated ones.
        let line = |step| StepRecord {
            step,
            ..Default::default()
        };
        let len = serde_json::to_string(&line(100)).unwrap().len() as u64 + 1;
        let per_file = 1000 / len;
        let n = per_file * 4;
        for step in 100..100 + n {
            log.write(&line(step)).unwrap();
        }
        let path = dir.path().join("metrics.jsonl");
        assert!(rotated(&path, 3).exists() && !rotated(&path, 4).exists());
        let steps: Vec<u64> = read::<StepRecord>(&path).iter().map(|r| r.step).collect();
        assert_eq!(
            steps,
            (100..100 + n).collect::<Vec<_>>(),
            "every line, in order"
        );
        for _ in 0..per_file {
            log.write(&line(999)).unwrap();
        }
        let kept = read::<StepRecord>(&path);
        assert_eq!(kept.len() as u64, n, "the oldest file was dropped");
        assert!(std::fs::metadata(&path).unwrap().len() <= 1000);
    }

    #[test]
    fn records_read_back_as_written_and_keep_todays_keys() {
        let step = StepRecord {
            step: 10,
            losses: Some(StepLosses {
                loss: 2.5,
                ..Default::default()
            }),
            tokens: 40,
            tokens_per_s: Some(99.0),
            round: Some(2),
            ..Default::default()
        };
        let text = serde_json::to_string(&step).unwrap();
        assert!(
            text.contains("\"loss\":2.5") && text.contains("\"round\":2"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<StepRecord>(&text).unwrap(), step);
        // An evaluation line has no losses, and reads back without them.
        let eval: StepRecord =
            serde_json::from_str(r#"{"step":0,"tokens":0,"val_loss":5.5}"#).unwrap();
        assert_eq!((eval.losses, eval.val_loss), (None, Some(5.5)));
        let sync = SyncRecord {
            event: Event::Sync,
            step: 5,
            round: 1,
            bytes_up: 7,
            bytes_down: 8,
            bytes_down_store: 8,
            bytes_down_server: 0,
            sync_s: 0.5,
            idle_s: 1.0,
            compute_s: 3.0,
            bytes_written: 9,
            up_s: 0.1,
            down_s: 0.2,
            apply_s: 0.05,
        };
        let text = serde_json::to_string(&sync).unwrap();
        assert!(text.contains("\"event\":\"sync\""), "{text}");
        assert_eq!(sync.utilization(), 0.75);
        // A node's lines tell syncs from steps.
        let lines: Vec<NodeLine> = [text, serde_json::to_string(&step).unwrap()]
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines, vec![NodeLine::Sync(sync), NodeLine::Step(step)]);
        // Round 0 has no close; a closed round writes its nulls as today.
        let zero: RoundRecord =
            serde_json::from_str(r#"{"round":0,"step":0,"tokens":0,"members":[0],"owners":[0,0]}"#)
                .unwrap();
        assert!(zero.close.is_none());
        let closed = RoundRecord {
            round: 1,
            close: Some(RoundClose::default()),
            ..Default::default()
        };
        let timed = RoundRecord {
            round: 2,
            close: Some(RoundClose {
                nodes: vec![NodeRound {
                    peer: 3,
                    round: 1,
                    idle_s: 0.5,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let text = serde_json::to_string(&timed).unwrap();
        assert_eq!(
            serde_json::from_str::<RoundRecord>(&text).unwrap(),
            timed,
            "{text}"
        );
        let text = serde_json::to_string(&closed).unwrap();
        assert!(text.contains("\"merge_alpha\":null") && text.contains("\"discarded\":null"));
        assert_eq!(serde_json::from_str::<RoundRecord>(&text).unwrap(), closed);
    }
}
