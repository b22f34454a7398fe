//! The server's round state machine, with no network and no clock of its own: uploads and the
//! current time go in, published rounds come out. gRPC wraps it (spes-net's server).

use crate::round::{merge_experts, Aggregator, Layout, MergeEvent, MergeSchedule, Named, Scope};
use anyhow::{bail, Result};
use serde::Serialize;

/// When rounds close and what happens at closing.
#[derive(Clone, Copy, Debug)]
pub struct RoundRules {
    /// Local steps per round (H): round r ends at sync step r·H.
    pub sync_steps: u64,
    /// Seconds after a round's first accepted upload to close it with whoever uploaded.
    pub timeout_s: f64,
    /// Expert merging; `None` for DiLoCo.
    pub merge: Option<MergeSchedule>,
}

/// What closing a round did.
#[derive(Clone, Debug, Serialize)]
pub struct RoundReport {
    pub round: u64,
    pub step: u64,
    pub peers: Vec<usize>,
    /// Peers that did not upload before the round closed.
    pub missing: Vec<usize>,
    pub merge_alpha: Option<f64>,
    pub merges: Vec<MergeEvent>,
}

/// Collects round `round()` on top of the model published at `round() - 1` (round 0 = θ⁰).
pub struct Coordinator {
    layout: Layout,
    scope: Scope,
    rules: RoundRules,
    round: u64,
    global: Named,
    agg: Aggregator,
    opened_at: Option<f64>,
}

impl Coordinator {
    /// Starts after `published` rounds, with `global` the model published last.
    pub fn new(
        layout: Layout,
        scope: Scope,
        rules: RoundRules,
        global: Named,
        published: u64,
    ) -> Self {
        Coordinator {
            agg: Aggregator::new(scope.clone()),
            layout,
            scope,
            rules,
            round: published + 1,
            global,
            opened_at: None,
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
    pub fn uploaded(&self) -> &std::collections::BTreeSet<usize> {
        self.agg.uploaded()
    }

    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// Accepts peer `peer`'s upload for `round`, or says why not; a rejection changes nothing.
    pub fn upload(&mut self, peer: usize, round: u64, tensors: Named, now: f64) -> Result<()> {
        if round < self.round {
            bail!(
                "round {round} is closed (collecting round {}): fetch round {} and continue",
                self.round,
                self.round - 1
            );
        }
        if round > self.round {
            bail!(
                "round {round} is not open yet: collecting round {}",
                self.round
            );
        }
        self.agg.add(&self.layout, peer, tensors)?;
        self.opened_at.get_or_insert(now);
        Ok(())
    }

    /// When the open round will be closed by timeout, if any upload arrived.
    pub fn deadline(&self) -> Option<f64> {
        self.opened_at.map(|t| t + self.rules.timeout_s)
    }

    /// Whether the round can close: every peer uploaded, or the timeout passed.
    pub fn ready(&self, now: f64) -> bool {
        self.agg.uploaded().len() == self.scope.peers() || self.deadline().is_some_and(|d| now >= d)
    }

    /// Aggregates, merges on merge rounds, publishes, and opens the next round.
    pub fn close(&mut self) -> RoundReport {
        let agg = std::mem::replace(&mut self.agg, Aggregator::new(self.scope.clone()));
        let peers: Vec<usize> = agg.uploaded().iter().copied().collect();
        let missing = (0..self.scope.peers())
            .filter(|p| !peers.contains(p))
            .collect();
        self.global = agg.finish(&self.layout, &self.global);
        let step = self.round * self.rules.sync_steps;
        let merge_alpha = self.rules.merge.and_then(|m| m.alpha(step));
        let merges = match (merge_alpha, self.rules.merge) {
            (Some(a), Some(m)) => merge_experts(&mut self.global, &self.layout, m.top_k, a),
            _ => Vec::new(),
        };
        let report = RoundReport {
            round: self.round,
            step,
            peers,
            missing,
            merge_alpha,
            merges,
        };
        self.round += 1;
        self.opened_at = None;
        report
    }
}
