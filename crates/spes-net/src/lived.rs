//! How busy the members were under each setting an adaptive run chose, against the prediction
//! it was chosen on. The planner's figures for the settings not running borrow the running
//! one's costs: a setting chosen on a prediction its rounds then fall short of is predicted that
//! much lower while another runs, so it is not taken again and again.
//!
//! The running setting's costs are measured, but the planner's model of them leaves things
//! out (on loopback a one-step overlap lived 3–5 points above its prediction, so the run left a
//! setting that kept its target). What it lived in its last [`RECENT_ROUNDS`] rounds since it
//! started stands for its prediction: a window, not the whole tally, so a link that degrades
//! still moves the run; the median of the window's rounds, once all of them were reported, so
//! two rounds' stalls do not count (in a run's first rounds, while the row split settles, two
//! of four rounds stalled and the lower median of those four moved a loopback run off a setting
//! that lived 97 %).
//!
//! What a node lived comes from its own report (compute and idle seconds of a sync), which the
//! server cannot check. A report counts only for a round the node uploaded to, its seconds only
//! within the server's own round time, and a round's figure is the lower median of the nodes'
//! (the least busy's with fewer than three), so one node alone cannot move it past what the
//! others lived (with fewer than three, only down); a running setting's round counts once three
//! of its uploaders reported (all, with fewer). Either figure stays within [`MAX_CORRECTION`] of
//! the planner's.
//!
//! A setting's tally is forgotten [`FORGET_ROUNDS`] rounds after its last round, so a run
//! retries it once its links may have changed; each more time in a row it falls short of its
//! prediction it is remembered twice as long (up to 960 rounds), so a setting the planner keeps
//! overrating costs a long run a few rounds ever more rarely, not every 65.

use spes_sync::RoundSettings;
use spes_train::metrics::NodeRound;
use std::collections::{BTreeMap, BTreeSet};

/// Rounds a setting must have lived, reported by its members, before what it lived counts.
pub const MIN_LIVED_ROUNDS: usize = 3;

/// The most what a setting lived moves its prediction, either way.
pub const MAX_CORRECTION: f64 = 0.15;

/// The running setting's last rounds that stand for its prediction.
pub const RECENT_ROUNDS: usize = 5;

/// Rounds whose settings are kept for the reports still to come.
const KEEP_ROUNDS: u64 = 16;

/// Rounds after its last that a setting's tally is forgotten (links and speeds change), if it
/// lived up to its prediction or fell short the first time; each more time in a row it fell
/// short, twice as many (a tally of too few rounds to tell keeps the count before it).
const FORGET_ROUNDS: u64 = 60;

/// The most times [`FORGET_ROUNDS`] doubles (60 · 2⁴ = 960 rounds).
const MAX_DOUBLINGS: u32 = 4;

/// What the recent rounds and each chosen setting lived, as the rounds' reports come in.
#[derive(Clone, Debug, Default)]
pub struct Lived {
    /// Per recent round: its settings, its time on the server's clock, who uploaded to it and
    /// what they reported.
    rounds: BTreeMap<u64, Ran>,
    /// Per setting chosen on a prediction: that prediction and what its rounds lived.
    tallies: Vec<(RoundSettings, Tally)>,
    /// Per setting: how many of its tallies in a row ended short of their prediction.
    /// Forgetting lets a run retry a setting once its links may have changed; one that keeps
    /// falling short is retried ever more rarely instead of every [`FORGET_ROUNDS`] rounds.
    short: Vec<(RoundSettings, u32)>,
    /// The reports counted, by peer and round (a report repeats until the next).
    counted: BTreeSet<(usize, u64)>,
}

/// A closed round as the server saw it, and its members' compute and idle seconds reported.
#[derive(Clone, Debug)]
struct Ran {
    settings: RoundSettings,
    round_s: f64,
    uploaders: BTreeSet<usize>,
    nodes: BTreeMap<usize, (f64, f64)>,
}

/// One chosen setting: the predicted utilization it was chosen on, each node's compute and
/// idle seconds in its rounds since, and which rounds were counted.
#[derive(Clone, Debug, Default)]
struct Tally {
    expected: f64,
    nodes: BTreeMap<usize, (f64, f64)>,
    rounds: BTreeSet<u64>,
    /// Its setting's tallies in a row that ended short before this one.
    short_before: u32,
}

impl Tally {
    /// Its setting's tallies in a row short of their prediction, this one included (at most
    /// one more than the doublings): one more if it lived further below its prediction than
    /// the chooser's margin, none if it did not, as before if it lived too few rounds to tell.
    fn short_in_a_row(&self) -> u32 {
        match self.error() {
            Some(e) if e < -crate::choose::MARGIN => (self.short_before + 1).min(MAX_DOUBLINGS + 1),
            Some(_) => 0,
            None => self.short_before,
        }
    }

    /// Whether it is still remembered after round `round` closed.
    fn kept(&self, round: u64) -> bool {
        let last = self.rounds.last().copied().unwrap_or(round);
        let doublings = self.short_in_a_row().saturating_sub(1).min(MAX_DOUBLINGS);
        round.saturating_sub(last) <= FORGET_ROUNDS << doublings
    }

    /// What the members lived minus the prediction the setting was chosen on.
    fn error(&self) -> Option<f64> {
        if self.rounds.len() < MIN_LIVED_ROUNDS {
            return None;
        }
        Some(share_trained(&self.nodes)? - self.expected)
    }
}

/// The members' lower median share of their time trained (the least busy one's with fewer than
/// three), from each node's compute and idle seconds.
fn share_trained(nodes: &BTreeMap<usize, (f64, f64)>) -> Option<f64> {
    lower_median(
        nodes
            .values()
            .filter(|(c, i)| c + i > 0.0)
            .map(|(c, i)| c / (c + i))
            .collect(),
    )
}

/// The lower median of `values`, or the least of fewer than three: one figure alone cannot
/// raise it.
fn lower_median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let at = if values.len() >= 3 {
        (values.len() - 1) / 2
    } else {
        0
    };
    values.get(at).copied()
}

impl Lived {
    /// The chooser took `settings`, predicted at `utilization`: its tally starts over.
    pub fn chosen(&mut self, settings: RoundSettings, utilization: f64) {
        self.end_tallies(|s, _| s == settings);
        if utilization.is_finite() {
            let tally = Tally {
                expected: utilization,
                short_before: self.short_of(settings),
                ..Tally::default()
            };
            self.tallies.push((settings, tally));
        }
    }

    /// Ends the tallies `end` picks, keeping whether they fell short for the next ones.
    fn end_tallies(&mut self, end: impl Fn(RoundSettings, &Tally) -> bool) {
        let (ended, kept) = std::mem::take(&mut self.tallies)
            .into_iter()
            .partition(|(s, t)| end(*s, t));
        self.tallies = kept;
        for (settings, tally) in ended {
            self.short.retain(|(s, _)| *s != settings);
            let short = tally.short_in_a_row();
            if short > 0 {
                self.short.push((settings, short));
            }
        }
    }

    /// How many of `settings`' tallies in a row ended short.
    fn short_of(&self, settings: RoundSettings) -> u32 {
        self.short
            .iter()
            .find(|(s, _)| *s == settings)
            .map_or(0, |(_, b)| *b)
    }

    /// Round `round` closed: it ran `settings`, took `round_s` seconds from its opening to its
    /// close on the server's clock, and `uploaders` uploaded to it.
    pub fn closed(
        &mut self,
        round: u64,
        settings: RoundSettings,
        round_s: f64,
        uploaders: &[usize],
    ) {
        let ran = Ran {
            settings,
            round_s,
            uploaders: uploaders.iter().copied().collect(),
            nodes: BTreeMap::new(),
        };
        self.rounds.insert(round, ran);
        let oldest = round.saturating_sub(KEEP_ROUNDS);
        self.rounds.retain(|&r, _| r >= oldest);
        self.counted.retain(|&(_, r)| r >= oldest);
        self.end_tallies(|_, t| !t.kept(round));
    }

    /// Takes in the nodes' reports of their syncs, each for the round its sync loaded.
    pub fn observe(&mut self, reports: &[NodeRound]) {
        for r in reports {
            let Some(ran) = self.rounds.get_mut(&r.round) else {
                continue;
            };
            let fine = [r.compute_s, r.idle_s]
                .iter()
                .all(|v| v.is_finite() && *v >= 0.0);
            if !fine || !ran.uploaders.contains(&r.peer) || ran.round_s <= 0.0 {
                continue;
            }
            if !self.counted.insert((r.peer, r.round)) {
                continue;
            }
            // A node's seconds of a round fit in the round's time on the server's clock.
            let seconds = (r.compute_s.min(ran.round_s), r.idle_s.min(ran.round_s));
            ran.nodes.insert(r.peer, seconds);
            if let Some((_, tally)) = self.tallies.iter_mut().find(|(s, _)| *s == ran.settings) {
                let node = tally.nodes.entry(r.peer).or_default();
                *node = (node.0 + seconds.0, node.1 + seconds.1);
                tally.rounds.insert(r.round);
            }
        }
    }

    /// What stands for the prediction of `settings`, planned at `planned`, once it lived enough
    /// rounds: for the `running` setting what its last rounds lived ([`Lived::recent`]), for
    /// another its plan corrected by what it lived when it last ran ([`Lived::correction`]).
    pub fn predicted(&self, settings: RoundSettings, planned: f64, running: bool) -> Option<f64> {
        if running {
            self.recent(settings, planned)
        } else {
            Some(planned + self.correction(settings)?)
        }
    }

    /// How far what the members lived under `settings` fell short of (or beyond) the
    /// prediction it was chosen on, bounded, once it ran [`MIN_LIVED_ROUNDS`] rounds: what to
    /// add to its prediction while another setting runs.
    fn correction(&self, settings: RoundSettings) -> Option<f64> {
        let (_, tally) = self.tallies.iter().find(|(s, _)| *s == settings)?;
        Some(tally.error()?.clamp(-MAX_CORRECTION, MAX_CORRECTION))
    }

    /// What the members lived under `settings` in its last [`RECENT_ROUNDS`] rounds since it
    /// last started (the median of the rounds'), once that many were reported: the running
    /// setting's prediction, given its `planned` one, within [`MAX_CORRECTION`] of that.
    fn recent(&self, settings: RoundSettings, planned: f64) -> Option<f64> {
        if !planned.is_finite() {
            return None;
        }
        let shares: Vec<f64> = self
            .rounds
            .values()
            .rev()
            .take_while(|ran| ran.settings == settings)
            .filter_map(Ran::lived)
            .take(RECENT_ROUNDS)
            .collect();
        if shares.len() < RECENT_ROUNDS {
            return None;
        }
        // The median of the whole window, so that two rounds' stalls (a merge in the close, the
        // row split settling) do not move the run while a link that stays worse does.
        let lived = lower_median(shares)?;
        Some(lived.clamp(planned - MAX_CORRECTION, planned + MAX_CORRECTION))
    }
}

impl Ran {
    /// What the round's members lived, once three of its uploaders reported (all of them, with
    /// fewer): a round that one report alone stands for could be moved by that node.
    fn lived(&self) -> Option<f64> {
        let quorum = self.uploaders.len().min(3);
        if self.nodes.len() < quorum.max(1) {
            return None;
        }
        share_trained(&self.nodes)
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

    /// Four nodes train 9 s of every 10 but one, which trains `slow` s of them.
    fn rounds(lived: &mut Lived, s: RoundSettings, from: u64, to: u64, slow: f64) {
        for round in from..=to {
            lived.closed(round, s, 10.0, &[0, 1, 2, 3]);
            let mut reports: Vec<NodeRound> = (0..3).map(|p| report(p, round, 9.0, 1.0)).collect();
            reports.push(report(3, round, slow, 10.0 - slow));
            lived.observe(&reports);
            // A report repeats until the next one: it counts once.
            lived.observe(&reports);
        }
    }

    #[test]
    fn a_chosen_setting_is_corrected_by_what_its_members_lived() {
        let one_step = settings(Wire::LowrankDelta, 1);
        let through = settings(Wire::Int4Delta, 0);
        let mut lived = Lived::default();
        // The first rounds' setting was not chosen on a prediction: nothing to correct.
        rounds(&mut lived, one_step, 1, 3, 9.0);
        assert_eq!(lived.correction(one_step), None);
        lived.chosen(one_step, 0.97);
        rounds(&mut lived, one_step, 4, 5, 9.0);
        assert_eq!(lived.correction(one_step), None, "two rounds are too few");
        rounds(&mut lived, one_step, 6, 9, 9.0);
        // The nodes trained 90 % where 97 % was predicted.
        let c = lived.correction(one_step).unwrap();
        assert!((c - (0.9 - 0.97)).abs() < 1e-9, "{c}");
        // A setting not chosen is not corrected, and chosen again it starts over.
        assert_eq!(lived.correction(through), None);
        lived.chosen(one_step, 0.9);
        assert_eq!(lived.correction(one_step), None);
    }

    #[test]
    fn the_running_setting_is_predicted_by_its_last_rounds_within_the_bound() {
        let one_step = settings(Wire::Int4Delta, 1);
        let through = settings(Wire::Int4Delta, 0);
        let mut lived = Lived::default();
        let every = |lived: &mut Lived, s: RoundSettings, round: u64, compute_s: f64| {
            lived.closed(round, s, 10.0, &[0, 1, 2, 3]);
            let reports: Vec<NodeRound> = (0..4)
                .map(|p| report(p, round, compute_s, 10.0 - compute_s))
                .collect();
            lived.observe(&reports);
        };
        // Not chosen on a prediction, the first rounds' setting still has rounds that stand,
        // once a whole window of them was reported; two stalled rounds of it do not count.
        rounds(&mut lived, one_step, 1, 1, 9.0);
        every(&mut lived, one_step, 2, 4.0);
        rounds(&mut lived, one_step, 3, 3, 9.0);
        every(&mut lived, one_step, 4, 4.0);
        assert_eq!(
            lived.recent(one_step, 0.93),
            None,
            "four rounds are too few"
        );
        rounds(&mut lived, one_step, 5, 5, 9.0);
        // The members trained 90 % where 93 % was planned: 90 % stands.
        let r = lived.recent(one_step, 0.93).unwrap();
        assert!((r - 0.9).abs() < 1e-9, "{r}");
        // A third stall in the window moves it.
        every(&mut lived, one_step, 6, 4.0);
        let r = lived.recent(one_step, 0.5).unwrap();
        assert!((r - 0.4).abs() < 1e-9, "{r}");
        rounds(&mut lived, one_step, 7, 7, 9.0);
        // Rounds that one node alone reported so far do not count.
        for round in 8..=9 {
            lived.closed(round, one_step, 10.0, &[0, 1, 2, 3]);
            lived.observe(&[report(0, round, 1.0, 9.0)]);
        }
        let r = lived.recent(one_step, 0.93).unwrap();
        assert!((r - 0.9).abs() < 1e-9, "{r}");
        // Within the bound of the planner's figure, either way.
        assert_eq!(lived.recent(one_step, 0.50), Some(0.50 + MAX_CORRECTION));
        assert_eq!(lived.recent(one_step, f64::NAN), None);
        // Only the last rounds of the setting's stretch count: a link that got worse moves it.
        lived.chosen(through, 0.8);
        for round in 10..=12 {
            every(&mut lived, through, round, 9.0);
        }
        for round in 13..=17 {
            every(&mut lived, through, round, 6.0);
        }
        let r = lived.recent(through, 0.7).unwrap();
        assert!((r - 0.6).abs() < 1e-9, "{r}");
        assert_eq!(lived.recent(through, 0.80), Some(0.80 - MAX_CORRECTION));
        assert_eq!(lived.recent(one_step, 0.93), None, "its stretch ended");
        // ... while the whole tally remembers the good rounds too.
        let c = lived.correction(through).unwrap();
        assert!((c - (57.0 / 80.0 - 0.8)).abs() < 1e-9, "{c}");
        // Reports of a round not yet closed, or from a node that did not upload, do not count.
        lived.closed(18, through, 10.0, &[0, 1, 2]);
        lived.observe(&[report(3, 18, 10.0, 0.0), report(0, 19, 10.0, 0.0)]);
        assert!(lived.rounds[&18].nodes.is_empty());
        assert!(!lived.rounds.contains_key(&19));
    }

    #[test]
    fn one_node_alone_cannot_move_a_correction_and_it_is_bounded() {
        let s = settings(Wire::Int4Delta, 0);
        let mut lived = Lived::default();
        lived.chosen(s, 0.95);
        // Node 3 says it trained nothing: the lower median is the others' 90 %.
        rounds(&mut lived, s, 1, 4, 0.0);
        let c = lived.correction(s).unwrap();
        assert!((c - (0.9 - 0.95)).abs() < 1e-9, "{c}");
        // Reports of a round it did not upload to, or of a round not kept, count for nothing.
        lived.closed(5, s, 10.0, &[0, 1, 2]);
        lived.observe(&[report(3, 5, 0.0, 1e6), report(2, 99, 0.0, 1e6)]);
        assert!((lived.correction(s).unwrap() - c).abs() < 1e-12);
        // Every node standing still half its round: the correction stops at the bound.
        let mut all = Lived::default();
        all.chosen(s, 0.95);
        for round in 1..=3 {
            all.closed(round, s, 10.0, &[0, 1]);
            // 50 s of idle in a 10 s round is read as 10 s.
            all.observe(&[report(0, round, 10.0, 50.0), report(1, round, 5.0, 5.0)]);
        }
        assert_eq!(all.correction(s), Some(-MAX_CORRECTION));
    }

    #[test]
    fn a_setting_that_keeps_falling_short_is_retried_ever_more_rarely() {
        let short = settings(Wire::LowrankDelta, 1);
        let other = settings(Wire::Int4Delta, 0);
        let mut lived = Lived::default();
        // Chosen at 98 %, it lives 90 %; then another setting runs.
        let try_short = |lived: &mut Lived, from: u64| {
            lived.chosen(short, 0.98);
            rounds(lived, short, from, from + 4, 9.0);
            assert!(lived.correction(short).is_some());
            lived.chosen(other, 0.96);
        };
        try_short(&mut lived, 1);
        rounds(&mut lived, other, 6, 65, 9.0);
        assert!(
            lived.correction(short).is_some(),
            "60 rounds after its last"
        );
        rounds(&mut lived, other, 66, 66, 9.0);
        assert_eq!(lived.correction(short), None, "forgotten the first time");
        // Retried, it falls short again: remembered twice as long.
        try_short(&mut lived, 67);
        rounds(&mut lived, other, 72, 71 + 120, 9.0);
        assert!(
            lived.correction(short).is_some(),
            "120 rounds after its last"
        );
        rounds(&mut lived, other, 192, 192, 9.0);
        assert_eq!(lived.correction(short), None);
        // Then four times as long, ... up to 960 rounds.
        let mut from = 193;
        for kept in [240, 480, 960, 960] {
            try_short(&mut lived, from);
            rounds(&mut lived, other, from + 5, from + 4 + kept, 9.0);
            assert!(
                lived.correction(short).is_some(),
                "{kept} rounds after its last"
            );
            rounds(&mut lived, other, from + 5 + kept, from + 5 + kept, 9.0);
            assert_eq!(lived.correction(short), None, "{kept}");
            from += 6 + kept;
        }
        // Chosen again and moved away from after two rounds, too few to tell: the count stays.
        lived.chosen(short, 0.98);
        rounds(&mut lived, short, from, from + 1, 9.0);
        lived.chosen(other, 0.96);
        assert_eq!(lived.short_of(short), MAX_DOUBLINGS + 1);
        from += 2;
        // Living up to its prediction (its members 97 % where 98 % was predicted, within the
        // chooser's margin) starts the count over: forgotten after 60 rounds again, ...
        lived.chosen(short, 0.98);
        for round in from..from + 5 {
            lived.closed(round, short, 100.0, &[0, 1, 2, 3]);
            let reports: Vec<NodeRound> = (0..4).map(|p| report(p, round, 97.0, 3.0)).collect();
            lived.observe(&reports);
        }
        lived.chosen(other, 0.96);
        rounds(&mut lived, other, from + 5, from + 4 + 60, 9.0);
        assert!(
            lived.correction(short).is_some(),
            "60 rounds after its last"
        );
        rounds(&mut lived, other, from + 65, from + 65, 9.0);
        assert_eq!(lived.correction(short), None, "the count started over");
        // ... and falling short again after that counts from one.
        from += 66;
        try_short(&mut lived, from);
        rounds(&mut lived, other, from + 5, from + 65, 9.0);
        assert_eq!(lived.correction(short), None, "60 rounds, not 960");
    }
}
