//! Settings that choose themselves (`sync.wire` or `sync.overlap_steps = "adaptive"`): after
//! every round the server asks the planner, fed what the run measured ([`crate::measure`]), how
//! much of its round the slowest member would train under each candidate setting, and takes,
//! from two rounds on, the candidate of least expected loss among those that keep it at least
//! `sync.target_utilization` busy; if none does, the busiest (of those as busy, the least
//! expected loss: what keeps the member idle is then not the exchange). The expected loss is
//! [`spes_sync::LOSS_TABLE`], measured once; of candidates it does not tell apart (one class:
//! [`classes`]), the one of fewest bytes. A change needs a margin over the target and
//! [`MIN_ROUNDS`] rounds on the setting before, so measurements that swing do not make the
//! run flap.

use spes_sync::{loss_table, LossRow, RoundSettings};
use spes_train::metrics::Chosen;

/// Rounds a setting runs before the next change.
pub const MIN_ROUNDS: u64 = 5;

/// How far above the target a setting's predicted utilization must be to change to it.
pub const MARGIN: f64 = 0.02;

/// Settings whose bytes a round are within this share of each other's count as alike.
pub const FEWER_BYTES: f64 = 0.1;

/// Predicted utilizations this close count as equally busy.
pub const AS_BUSY: f64 = 0.005;

/// What the server predicts of one candidate setting: the share of its round the slowest
/// member would train, and the bytes one node would send and receive each round.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub settings: RoundSettings,
    pub utilization: f64,
    pub bytes: f64,
}

/// An adaptive run's chooser: its candidates, the settings it runs and since when.
#[derive(Clone, Debug)]
pub struct Chooser {
    target: f64,
    rows: Vec<LossRow>,
    /// Each row's class: rows the table does not tell apart share one ([`classes`]).
    class: Vec<usize>,
    current: RoundSettings,
    since: u64,
    /// Whether the current settings were chosen on measurements (not the first rounds').
    chosen: bool,
}

impl Chooser {
    /// A chooser among `rows` (best loss first; [`spes_sync::loss_table::candidates`] gives a
    /// run's) for a target
    /// utilization, whose rounds from `since` run `current` (`chosen`: on measurements, rather
    /// than the first rounds' settings).
    pub fn new(
        target: f64,
        rows: Vec<LossRow>,
        current: RoundSettings,
        since: u64,
        chosen: bool,
    ) -> Chooser {
        Chooser {
            target,
            class: classes(&rows),
            rows,
            current,
            since,
            chosen,
        }
    }

    /// The settings the chooser asks predictions for.
    pub fn candidates(&self) -> Vec<RoundSettings> {
        self.rows.iter().map(|r| r.settings).collect()
    }

    /// The expected loss of `s` over the best measured setting's, if it is a candidate.
    pub fn loss_ratio(&self, s: RoundSettings) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.settings == s)
            .map(|r| r.loss_ratio)
    }

    /// After round `round` closed, given each candidate's predicted utilization: the settings
    /// from round `round + 2` on (the next close announces them), if they change.
    pub fn choose(&mut self, round: u64, predicted: &[Prediction]) -> Option<Chosen> {
        let from_round = round + 2;
        if self.chosen && from_round < self.since + MIN_ROUNDS {
            return None;
        }
        let of = |s: RoundSettings| predicted.iter().find(|p| p.settings == s);
        let util = |s: RoundSettings| of(s).map(|p| p.utilization).filter(|u| u.is_finite());
        let bytes = |s: RoundSettings| of(s).map_or(f64::INFINITY, |p| p.bytes);
        let current_util = util(self.current)?;
        let fits = |s: RoundSettings, extra: f64| util(s).is_some_and(|u| u >= self.target + extra);
        let class_of = |s: RoundSettings| {
            let i = self.rows.iter().position(|r| r.settings == s)?;
            Some(self.class[i])
        };
        let current_class = class_of(self.current).unwrap_or(usize::MAX);
        let fitting: Vec<usize> = (0..self.rows.len())
            .filter(|&i| {
                let s = self.rows[i].settings;
                if s == self.current {
                    fits(s, 0.0)
                } else {
                    fits(s, MARGIN)
                }
            })
            .collect();
        // The first decision is recorded even where it keeps the first rounds' setting, so
        // that every run says what it chose and why, and a replay takes the same path.
        let first = self
            .rows
            .iter()
            .find(|r| r.settings == self.current && !self.chosen)
            .copied();
        let pick = self.fewest_bytes_of_best_class(&fitting, &bytes);
        let (pick, why) = match pick {
            Some(p) if p.settings == self.current && self.chosen => return self.keep(),
            Some(p) if p.settings == self.current => (
                p,
                "the first rounds' setting is the one of least expected loss (then fewest bytes) that keeps the slowest member busy enough",
            ),
            Some(p) if fits(self.current, 0.0) => {
                let class = class_of(p.settings).unwrap_or(usize::MAX);
                if class < current_class {
                    (
                        p,
                        "a lower expected loss that keeps the slowest member busy enough",
                    )
                } else if class == current_class
                    && bytes(p.settings) < (1.0 - FEWER_BYTES) * bytes(self.current)
                {
                    (
                        p,
                        "the same expected loss (within what the loss table resolves) for fewer bytes, and it keeps the slowest member busy enough",
                    )
                } else if let Some(current) = first {
                    (
                        current,
                        "the first rounds' setting keeps the slowest member busy enough, and no other does for a lower expected loss, or for as low with fewer bytes",
                    )
                } else {
                    return self.keep();
                }
            }
            Some(p) => (
                p,
                "the current setting leaves the slowest member idle too long",
            ),
            None => {
                // Nothing reaches the target: the busiest, if clearly busier or as busy and of
                // a better loss class (what keeps the member idle is then not the exchange, as
                // while a run's row split settles); of settings as busy (an exchange hidden
                // whole by each), the least expected loss, then the fewest bytes.
                let most = self
                    .rows
                    .iter()
                    .filter_map(|r| util(r.settings))
                    .max_by(f64::total_cmp)?;
                let as_busy: Vec<usize> = (0..self.rows.len())
                    .filter(|&i| util(self.rows[i].settings).is_some_and(|u| u >= most - AS_BUSY))
                    .collect();
                let busiest = self.fewest_bytes_of_best_class(&as_busy, &bytes)?;
                let busiest_util = util(busiest.settings)?;
                let busier = busiest_util >= current_util + MARGIN;
                // Within half a point of the most, so about as busy as the current setting or
                // busier: a better class costs nothing in utilization.
                let better = class_of(busiest.settings).unwrap_or(usize::MAX) < current_class;
                if busier {
                    (
                        busiest,
                        "the current setting falls short of the target and no other is predicted above it by the margin a change needs; this one comes closest",
                    )
                } else if better {
                    (
                        busiest,
                        "no setting is predicted to keep the slowest member busy enough, and this one keeps it as busy as any for a lower expected loss",
                    )
                } else if let Some(current) = first {
                    (
                        current,
                        "no setting is predicted to keep the slowest member busy enough, and none is clearly busier than the first rounds' setting, or as busy for a lower expected loss",
                    )
                } else {
                    return self.keep();
                }
            }
        };
        let options: Vec<String> = self
            .rows
            .iter()
            .map(|r| match util(r.settings) {
                Some(u) => format!(
                    "{} {:.1} %, {:.1} MiB (loss {:.4}×)",
                    r.settings,
                    100.0 * u,
                    bytes(r.settings) / f64::from(1 << 20),
                    r.loss_ratio
                ),
                None => format!("{} unpredicted", r.settings),
            })
            .collect();
        let reason = format!(
            "{why} (target {:.0} %): predicted {}",
            100.0 * self.target,
            options.join(", ")
        );
        self.current = pick.settings;
        self.since = from_round;
        self.chosen = true;
        Some(Chosen {
            from_round,
            settings: pick.settings,
            reason,
        })
    }

    /// Of the rows at `indices` (best loss first), those in the best one's class, the one of
    /// fewest bytes: the same expected loss for less of the links. Bytes alike within
    /// [`FEWER_BYTES`] keep the current setting, then the table's order; bytes not predicted
    /// count as the most.
    fn fewest_bytes_of_best_class(
        &self,
        indices: &[usize],
        bytes: &dyn Fn(RoundSettings) -> f64,
    ) -> Option<LossRow> {
        let best = self.class[*indices.first()?];
        let bytes = |r: &LossRow| Some(bytes(r.settings)).filter(|b| b.is_finite());
        let equals: Vec<LossRow> = indices
            .iter()
            .filter(|&&i| self.class[i] == best)
            .map(|&i| self.rows[i])
            .collect();
        let fewest = equals
            .iter()
            .filter_map(bytes)
            .fold(f64::INFINITY, f64::min);
        let few_enough: Vec<LossRow> = equals
            .iter()
            .filter(|r| bytes(r).is_some_and(|b| b <= fewest / (1.0 - FEWER_BYTES)))
            .copied()
            .collect();
        few_enough
            .iter()
            .find(|r| r.settings == self.current)
            .or(few_enough.first())
            .or(equals.first())
            .copied()
    }

    /// Once a setting was taken on measurements, keeping it counts as chosen too.
    fn keep(&mut self) -> Option<Chosen> {
        self.chosen = true;
        None
    }
}

/// Each row's class, rows best loss first: a class opens at the first row not yet in one and
/// holds the rows within [`loss_table::RESOLUTION`] of it, so that "the same expected loss"
/// is one relation for every decision (on `LOSS_TABLE`: the top three rows, then low rank
/// without and with one step apart, then the three through the round).
fn classes(rows: &[LossRow]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::with_capacity(rows.len());
    let mut opened_at = f64::NEG_INFINITY;
    for r in rows {
        let class = match out.last() {
            Some(&c) if r.loss_ratio < opened_at + loss_table::RESOLUTION => c,
            last => {
                opened_at = r.loss_ratio;
                last.map_or(0, |c| c + 1)
            }
        };
        out.push(class);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use spes_sync::Wire;

    /// The first rounds' setting of these tests: the chooser takes it as given, whatever
    /// [`spes_sync::FIRST_ROUNDS`] a run starts on.
    const FIRST_ROUNDS: RoundSettings = RoundSettings {
        wire: Wire::LowrankDelta,
        overlap: true,
        overlap_steps: 1,
    };

    const fn row(wire: Wire, overlap: Option<u64>, loss_ratio: f64) -> LossRow {
        LossRow::new(wire, overlap, loss_ratio)
    }

    /// Rows of made-up losses, best first: bf16 without and with overlap, low rank with one
    /// step (the first rounds') and through the round.
    fn rows() -> Vec<LossRow> {
        vec![
            row(Wire::Bf16Delta, None, 1.0),
            row(Wire::Bf16Delta, Some(1), 1.003),
            row(Wire::LowrankDelta, Some(1), 1.01),
            row(Wire::LowrankDelta, Some(0), 1.02),
        ]
    }

    fn chooser(chosen: bool) -> Chooser {
        Chooser::new(0.95, rows(), FIRST_ROUNDS, 1, chosen)
    }

    /// Predictions where each candidate keeps the slowest member `u(s)` busy, with the bytes
    /// of its wire.
    fn predicted(c: &Chooser, u: impl Fn(RoundSettings) -> f64) -> Vec<Prediction> {
        c.candidates()
            .into_iter()
            .map(|s| Prediction {
                settings: s,
                utilization: u(s),
                bytes: match s.wire {
                    Wire::Bf16Delta => 40e6,
                    Wire::Int4Delta => 12e6,
                    _ => 1e6,
                },
            })
            .collect()
    }

    #[test]
    fn a_fast_link_takes_the_best_loss_and_a_slow_one_the_busiest() {
        let mut c = chooser(false);
        // Every setting keeps the node busy: the best row, as soon as it is measured.
        let d = c.choose(2, &predicted(&c, |_| 0.99)).unwrap();
        assert_eq!(d.settings, rows()[0].settings);
        assert_eq!(d.from_round, 4);
        assert!(d.reason.contains("99.0 %"), "{}", d.reason);
        // Then not again before MIN_ROUNDS rounds on it, whatever the link does.
        assert_eq!(c.choose(3, &predicted(&c, |_| 0.1)), None);
        // A link that slows down: only the whole-round overlap keeps up.
        let whole = rows()[3].settings;
        let slow = |s: RoundSettings| if s == whole { 0.97 } else { 0.6 };
        let d = c.choose(2 + MIN_ROUNDS, &predicted(&c, slow)).unwrap();
        assert_eq!(d.settings, whole);
        // Nothing reaches the target: the busiest, if clearly busier than the current.
        let mut c = chooser(false);
        let util = |s: RoundSettings| if s == whole { 0.80 } else { 0.5 };
        assert_eq!(c.choose(2, &predicted(&c, util)).unwrap().settings, whole);
        // Nothing clearly busier: the first decision keeps the first rounds' setting, and
        // says so.
        let mut c = chooser(false);
        let close = |s: RoundSettings| if s == whole { 0.51 } else { 0.5 };
        let d = c.choose(2, &predicted(&c, close)).unwrap();
        assert_eq!(d.settings, FIRST_ROUNDS);
        assert!(d.reason.contains("none is clearly busier"), "{}", d.reason);
        assert_eq!(c.choose(2 + MIN_ROUNDS, &predicted(&c, close)), None);
        // Every setting as short (what keeps the member idle is not the exchange): the least
        // expected loss of those as busy as the busiest, not the first rounds' setting.
        let mut c = chooser(false);
        let d = c.choose(2, &predicted(&c, |_| 0.886)).unwrap();
        assert_eq!(d.settings, rows()[0].settings);
        assert!(d.reason.contains("as busy as any"), "{}", d.reason);
        let mut c = chooser(false);
        let first = |s: RoundSettings| if s == FIRST_ROUNDS { 0.89 } else { 0.886 };
        assert_eq!(
            c.choose(2, &predicted(&c, first)).unwrap().settings,
            rows()[0].settings
        );
        // ... but not for a worse class, nor one less busy than the current.
        let mut c = chooser(false);
        let worse = |s: RoundSettings| if s == whole { 0.89 } else { 0.88 };
        assert_eq!(
            c.choose(2, &predicted(&c, worse)).unwrap().settings,
            FIRST_ROUNDS
        );
        let mut c = chooser(false);
        let less = |s: RoundSettings| if s == FIRST_ROUNDS { 0.886 } else { 0.88 };
        assert_eq!(
            c.choose(2, &predicted(&c, less)).unwrap().settings,
            FIRST_ROUNDS
        );
        // Settings as busy as the busiest (each hides the exchange whole): the least loss.
        let other = row(Wire::Int4Delta, Some(0), 1.025);
        let rows = [rows(), vec![other]].concat();
        for (w, o, pick) in [
            (0.90, 0.898, whole),
            (0.897, 0.90, whole),
            (0.88, 0.90, other.settings),
        ] {
            let mut c = Chooser::new(0.95, rows.clone(), FIRST_ROUNDS, 1, false);
            let util = |s: RoundSettings| match s {
                s if s == whole => w,
                s if s == other.settings => o,
                _ => 0.5,
            };
            assert_eq!(c.choose(2, &predicted(&c, util)).unwrap().settings, pick);
        }
    }

    #[test]
    fn a_change_needs_a_margin_and_a_lower_loss() {
        let mut c = chooser(true);
        // The best row only just reaches the target: not enough to move; the next one is.
        let [best, next, ..] = [rows()[0].settings, rows()[1].settings];
        let just = |s: RoundSettings| if s == best { 0.955 } else { 0.99 };
        assert_eq!(c.choose(10, &predicted(&c, just)).unwrap().settings, next);
        // A setting that reaches the target stays unless another is clearly better.
        // Better by 0.15 % (less than the table resolves) it stays; by 0.25 % it moves.
        for (current, moves) in [(1.0015, false), (1.0025, true)] {
            let rows = vec![
                row(Wire::Bf16Delta, None, 1.0),
                row(Wire::LowrankDelta, Some(1), current),
            ];
            let mut c = Chooser::new(0.95, rows, FIRST_ROUNDS, 1, true);
            let chosen = c.choose(10, &predicted(&c, |_| 0.99));
            assert_eq!(chosen.is_some(), moves, "{current}");
        }
        // The first decision is recorded even where it keeps the first rounds' setting; a later
        // keep is not.
        let first = vec![
            row(Wire::LowrankDelta, Some(1), 1.0),
            row(Wire::Bf16Delta, None, 1.01),
        ];
        let mut c = Chooser::new(0.95, first, FIRST_ROUNDS, 1, false);
        let kept = c.choose(10, &predicted(&c, |_| 0.99)).unwrap();
        assert_eq!((kept.from_round, kept.settings), (12, FIRST_ROUNDS));
        assert_eq!(c.choose(20, &predicted(&c, |_| 0.99)), None);
        // A prediction missing for the current setting decides nothing.
        let mut c = chooser(true);
        let alone = Prediction {
            settings: best,
            utilization: 1.0,
            bytes: 1.0,
        };
        assert_eq!(c.choose(10, &[alone]), None);
    }

    /// Of settings the loss table does not tell apart, the one of fewest bytes: taken first,
    /// moved to from a setting that keeps its target, and not when the table orders them.
    /// The shipped table's classes: the top three, low rank without and with one step
    /// apart, the three through the round.
    #[test]
    fn the_loss_tables_classes() {
        assert_eq!(classes(&spes_sync::LOSS_TABLE), [0, 0, 0, 1, 2, 3, 3, 3]);
    }

    #[test]
    fn of_equal_losses_the_fewest_bytes() {
        let bf16 = row(Wire::Bf16Delta, Some(1), 1.0);
        let close = |int4_loss| {
            vec![
                bf16,
                row(Wire::Int4Delta, Some(1), int4_loss),
                row(Wire::LowrankDelta, Some(1), 1.02),
            ]
        };
        let int4 = close(1.0005)[1].settings;
        let mut c = Chooser::new(0.95, close(1.0005), FIRST_ROUNDS, 1, false);
        let d = c.choose(2, &predicted(&c, |_| 0.99)).unwrap();
        assert_eq!(d.settings, int4);
        assert!(d.reason.contains("11.4 MiB"), "{}", d.reason);
        // Running bf16 on its target, the same loss for fewer bytes moves; once the table
        // orders them (0.25 %), the better loss stays.
        for (int4_loss, moves) in [(1.0005, true), (1.0025, false)] {
            let mut c = Chooser::new(0.95, close(int4_loss), bf16.settings, 1, true);
            let d = c.choose(10, &predicted(&c, |_| 0.99));
            assert_eq!(d.map(|d| d.settings), moves.then_some(int4), "{int4_loss}");
        }
        // Low rank without overlap, a class of its own below the top one, moves up once a
        // row of the top class fits; of that class, the fewest bytes.
        let three = vec![
            bf16,
            row(Wire::Int4Delta, Some(1), 1.0005),
            row(Wire::LowrankDelta, None, 1.0023),
            row(Wire::LowrankDelta, Some(1), 1.0044),
        ];
        assert_eq!(classes(&three), [0, 0, 1, 2]);
        let mut c = Chooser::new(0.95, three.clone(), three[2].settings, 1, true);
        let d = c.choose(10, &predicted(&c, |_| 0.99)).unwrap();
        assert_eq!(d.settings, int4);
        assert!(
            d.reason.starts_with("a lower expected loss"),
            "{}",
            d.reason
        );
        // Bytes alike within 10 % keep the current setting.
        let alike = vec![bf16, row(Wire::Bf16Delta, None, 1.0)];
        let mut c = Chooser::new(0.95, alike.clone(), alike[1].settings, 1, true);
        assert_eq!(c.choose(10, &predicted(&c, |_| 0.99)), None);
        // Nothing reaches the target and both are as busy: the fewer bytes.
        let mut c = Chooser::new(0.95, close(1.0005), FIRST_ROUNDS, 1, false);
        let util = |s: RoundSettings| {
            if s.wire == Wire::LowrankDelta {
                0.5
            } else {
                0.93
            }
        };
        assert_eq!(c.choose(2, &predicted(&c, util)).unwrap().settings, int4);
    }
}
