//! How busy the members were under each setting a run ran, against what the planner predicted
//! for it while it ran. The planner is close for the setting that runs, whose costs it
//! measures, and further off for the others, which borrow those costs; an adaptive run
//! corrects each candidate's prediction by what that setting lived, once it ran a few rounds,
//! so a setting the planner overrates is not taken again and again.
//!
//! What a node lived comes from its own report (compute and idle seconds of a sync), which the
//! server cannot check: a correction is bounded ([`MAX_CORRECTION`]).

use spes_sync::RoundSettings;
use spes_train::metrics::NodeRound;
use std::collections::{BTreeMap, BTreeSet};

/// Rounds a setting must have lived, reported by some member, before its correction counts.
pub const MIN_LIVED_ROUNDS: usize = 3;

/// The most a correction moves a prediction, either way.
pub const MAX_CORRECTION: f64 = 0.15;

/// Rounds whose settings and prediction are kept for the reports still to come.
const KEEP_ROUNDS: u64 = 16;

/// What each setting predicted and lived, as the rounds' reports come in.
#[derive(Clone, Debug, Default)]
pub struct Lived {
    /// Per recent round: its settings and the planner's prediction for them then.
    rounds: BTreeMap<u64, (RoundSettings, f64)>,
    /// Per setting that ran, what its rounds predicted and lived.
    tallies: Vec<(RoundSettings, Tally)>,
    /// The reports counted, by peer and round (a report repeats until the next).
    counted: BTreeSet<(usize, u64)>,
}

/// One setting's rounds: each node's compute and idle seconds, and the prediction of each
/// round counted.
#[derive(Clone, Debug, Default)]
struct Tally {
    nodes: BTreeMap<usize, (f64, f64)>,
    predicted: BTreeMap<u64, f64>,
}

impl Tally {
    /// The least busy node's share of its time trained, minus the rounds' mean prediction.
    fn error(&self) -> Option<f64> {
        if self.predicted.len() < MIN_LIVED_ROUNDS {
            return None;
        }
        let lived = self
            .nodes
            .values()
            .filter(|(c, i)| c + i > 0.0)
            .map(|(c, i)| c / (c + i))
            .min_by(f64::total_cmp)?;
        let predicted = self.predicted.values().sum::<f64>() / self.predicted.len() as f64;
        Some(lived - predicted)
    }
}

impl Lived {
    /// Round `round` ran `settings`, for which the planner predicted `utilization` (the
    /// slowest member's share of its round trained) when it closed.
    pub fn predicted(&mut self, round: u64, settings: RoundSettings, utilization: f64) {
        if utilization.is_finite() {
            self.rounds.insert(round, (settings, utilization));
        }
        let oldest = round.saturating_sub(KEEP_ROUNDS);
        self.rounds.retain(|&r, _| r >= oldest);
        self.counted.retain(|&(_, r)| r >= oldest);
    }

    /// Takes in the nodes' reports of their syncs, each for the round its sync loaded.
    pub fn observe(&mut self, reports: &[NodeRound]) {
        for r in reports {
            let fine = [r.compute_s, r.idle_s]
                .iter()
                .all(|v| v.is_finite() && *v >= 0.0);
            let Some(&(settings, utilization)) = self.rounds.get(&r.round) else {
                continue;
            };
            if !fine || !self.counted.insert((r.peer, r.round)) {
                continue;
            }
            let at = match self.tallies.iter().position(|(s, _)| *s == settings) {
                Some(i) => i,
                None => {
                    self.tallies.push((settings, Tally::default()));
                    self.tallies.len() - 1
                }
            };
            let tally = &mut self.tallies[at].1;
            let node = tally.nodes.entry(r.peer).or_default();
            // Idle beyond the sync it is part of is not believed.
            *node = (
                node.0 + r.compute_s,
                node.1 + r.idle_s.min(r.sync_s.max(0.0)),
            );
            tally.predicted.insert(r.round, utilization);
        }
    }

    /// How far the members' lived utilization under `settings` was from its prediction,
    /// bounded, once it ran [`MIN_LIVED_ROUNDS`] rounds.
    pub fn correction(&self, settings: RoundSettings) -> Option<f64> {
        let (_, tally) = self.tallies.iter().find(|(s, _)| *s == settings)?;
        Some(tally.error()?.clamp(-MAX_CORRECTION, MAX_CORRECTION))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spes_sync::Wire;

    fn settings(wire: Wire, overlap_steps: u64) -> RoundSettings {
        RoundSettings {
            wire,
            overlap: true,
            overlap_steps,
        }
    }

    fn report(peer: usize, round: u64, compute_s: f64, idle_s: f64) -> NodeRound {
        NodeRound {
            peer,
            round,
            compute_s,
            sync_s: 5.0,
            idle_s,
            ..NodeRound::default()
        }
    }

    #[test]
    fn a_setting_is_corrected_by_what_its_least_busy_node_lived() {
        let one_step = settings(Wire::LowrankDelta, 1);
        let through = settings(Wire::Int4Delta, 0);
        let mut lived = Lived::default();
        for round in 1..=4 {
            lived.predicted(round, one_step, 0.97);
            // Node 1 trains 8 s of every 9: 88.9 %, where 97 % was predicted.
            let reports = [report(0, round, 9.0, 0.0), report(1, round, 8.0, 1.0)];
            lived.observe(&reports);
            // A report repeats until the next one: it counts once.
            lived.observe(&reports);
            if round < MIN_LIVED_ROUNDS as u64 {
                assert_eq!(lived.correction(one_step), None, "round {round}");
            }
        }
        let c = lived.correction(one_step).unwrap();
        assert!((c - (8.0 / 9.0 - 0.97)).abs() < 1e-9, "{c}");
        // A setting that did not run is not corrected.
        assert_eq!(lived.correction(through), None);
        // Reports of a round with no prediction kept count for nothing.
        lived.observe(&[report(1, 99, 0.0, 100.0)]);
        assert!((lived.correction(one_step).unwrap() - c).abs() < 1e-12);
    }

    #[test]
    fn a_correction_is_bounded_and_idle_beyond_its_sync_is_not_believed() {
        let s = settings(Wire::Int4Delta, 0);
        let mut lived = Lived::default();
        for round in 1..=3 {
            lived.predicted(round, s, 0.95);
            // Idle of 50 s in a 5 s sync is read as 5 s: 50 %, and the correction stops at
            // the bound.
            lived.observe(&[report(0, round, 5.0, 50.0)]);
        }
        assert_eq!(lived.correction(s), Some(-MAX_CORRECTION));
    }
}
