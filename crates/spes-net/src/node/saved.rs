//! What a node checkpoints, when, and how it reads it back. A node's weights after a sync are
//! the server's published model (plus, on lossy wires or with overlap, what it has not sent
//! yet), so a mid-run checkpoint leaves the model out: it holds the AdamW moments, the step,
//! token count and data position (`spes_train::checkpoint`), and the replica's own state —
//! the round it builds on, the experts it owns and that remainder. The last round's checkpoint
//! holds the model too, for `spes eval` and `spes export-hf`. Checkpoints are taken every
//! `sync.checkpoint_every_rounds` rounds and whenever `sync.checkpoint_every_s` passed since the
//! last one; the newest `sync.keep_checkpoints` are kept.

use super::Node;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use spes_sync::ReplicaState;
use spes_train::checkpoint;
use std::path::Path;
use std::time::Instant;

/// The round whose global model the weights were loaded from (checkpoints with a model).
const LOADED_ROUND: &str = "loaded-round";
/// The replica's state besides its remainder.
const REPLICA_FILE: &str = "replica.json";
/// The replica's remainder (what the weights carry beyond the base), when there is one.
const REMAINDER_FILE: &str = "remainder.safetensors";
/// The replica's unsent change (`sync.feedback = "buffer"`), when there is one.
const FEEDBACK_FILE: &str = "feedback.safetensors";
/// What the replica hands over of experts it lost (its next upload's), when there is some.
const HANDOVER_FILE: &str = "handover.safetensors";

#[derive(Serialize, Deserialize)]
struct ReplicaFile {
    base_round: u64,
    owned: Vec<bool>,
}

/// What a resumed node found in its newest checkpoint.
pub(super) struct Saved {
    /// The checkpoint holds the weights (the last round's, or one of an older spes).
    pub has_model: bool,
    /// With weights: the round they were loaded from, if it says.
    pub loaded: Option<u64>,
    /// Without weights: the replica's state, to rebuild them on the server's model.
    pub replica: Option<ReplicaState>,
}

/// Reads the node-side files of the checkpoint in `dir`.
pub(super) fn read(dir: &Path) -> Result<Saved> {
    let state = checkpoint::read_state(dir)?;
    let has_model = state.files.contains_key(checkpoint::MODEL_FILE);
    let loaded = std::fs::read_to_string(dir.join(LOADED_ROUND))
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok());
    let replica = match std::fs::read_to_string(dir.join(REPLICA_FILE)) {
        Ok(text) if !has_model => {
            let r: ReplicaFile = serde_json::from_str(&text)
                .with_context(|| format!("{} is corrupt", dir.join(REPLICA_FILE).display()))?;
            let remainder =
                checkpoint::read_tensors(dir, &state, REMAINDER_FILE)?.unwrap_or_default();
            let feedback =
                checkpoint::read_tensors(dir, &state, FEEDBACK_FILE)?.unwrap_or_default();
            let handover =
                checkpoint::read_tensors(dir, &state, HANDOVER_FILE)?.unwrap_or_default();
            Some(ReplicaState {
                base_round: r.base_round,
                owned: r.owned,
                remainder,
                feedback,
                handover,
            })
        }
        _ => None,
    };
    Ok(Saved {
        has_model,
        loaded,
        replica,
    })
}

impl Node {
    /// Whether the sync that brought the weights to round `loaded` checkpoints.
    fn checkpoint_due(&self, loaded: u64) -> bool {
        let s = &self.trainer.cfg.sync;
        let last = self.trainer.step >= self.trainer.cfg.train.max_steps;
        let by_rounds =
            s.checkpoint_every_rounds > 0 && loaded.is_multiple_of(s.checkpoint_every_rounds);
        let by_time = s.checkpoint_every_s > 0.0
            && self.last_checkpoint.elapsed().as_secs_f64() >= s.checkpoint_every_s;
        last || by_rounds || by_time
    }

    /// Checkpoints the node after the sync to round `loaded` when due, on a thread while the
    /// next round trains (the checkpoint before must be done, so at most one copy of the state
    /// is in flight).
    pub(super) fn checkpoint(&mut self, loaded: u64) -> Result<()> {
        if !self.checkpoint_due(loaded) {
            return Ok(());
        }
        self.finish_checkpoint()?;
        let last = self.trainer.step >= self.trainer.cfg.train.max_steps;
        let keep = self.trainer.cfg.sync.keep_checkpoints;
        let root = self.session.out.join("checkpoints");
        let mut snapshot = self
            .trainer
            .snapshot(&root, last, if keep == 0 { usize::MAX } else { keep })?
            .context("rank 0 holds the node's checkpoint")?;
        if last {
            snapshot = snapshot.with_file(LOADED_ROUND, loaded.to_string().into_bytes());
        } else {
            let weights = self.weights();
            let state = self
                .replica
                .state(&weights)
                .context("a node that synced holds a round")?;
            let file = ReplicaFile {
                base_round: state.base_round,
                owned: state.owned,
            };
            snapshot = snapshot.with_file(REPLICA_FILE, serde_json::to_vec_pretty(&file)?);
            if !state.remainder.is_empty() {
                snapshot = snapshot.with_tensors(REMAINDER_FILE, &state.remainder);
            }
            if !state.feedback.is_empty() {
                snapshot = snapshot.with_tensors(FEEDBACK_FILE, &state.feedback);
            }
            if !state.handover.is_empty() {
                snapshot = snapshot.with_tensors(HANDOVER_FILE, &state.handover);
            }
        }
        self.checkpointing = Some(std::thread::spawn(move || snapshot.write()));
        self.last_checkpoint = Instant::now();
        Ok(())
    }
}
