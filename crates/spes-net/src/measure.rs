//! What a run's rounds measured of each node's link and speed, and what the planner
//! ([`crate::plan`]) predicts from it for every wire: the planner fed the links the run lives
//! rather than flags. The server's own timings come first (an upload's receive time gives the
//! node's uplink, its fold the server's rate); a node's report fills in what the server cannot
//! see (its download, its apply, its steps), each kept within the rest of its report. The
//! run-wide figures are those of the node at a quantile of slowness, so one node's report
//! alone cannot move them when the quantile is below the slowest.

use crate::choose::Prediction;
use crate::link::LinkSpec;
use crate::plan::{self, PlanInput, PlanRow, WireOption};
use spes_sync::wire_cost::WireCosts;
use spes_sync::RoundSettings;
use spes_train::metrics::{Planned, PlannedOption, RoundClose, UploadTiming};
use spes_train::{Mode, RunConfig};
use std::collections::BTreeMap;
use std::time::Duration;

/// The newest round's figure weighs this much in a node's running mean.
const WEIGHT: f64 = 0.3;

/// Uploads smaller than this are not timed for a rate: their bytes may arrive with their
/// header, and their time is the latency's.
const MIN_TIMED_BYTES: u64 = 64 << 10;

/// One node's figures: running means over the rounds it took part in.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeFigures {
    /// Uplink, bytes per second: the server's receive times of its uploads.
    pub up_bytes_per_s: Option<f64>,
    /// Downlink, bytes per second: its own timing of its downloads.
    pub down_bytes_per_s: Option<f64>,
    /// Seconds an exchange costs beyond its bytes: its upload's time to the acknowledgement
    /// less the bytes at its uplink rate and the server's fold (round trips, handshakes).
    pub latency_s: Option<f64>,
    /// Seconds its steps of a round take.
    pub compute_s: Option<f64>,
    /// Whether its newest upload went through the run's store (its own upload time then
    /// times the store, not the server).
    pub staged: bool,
    /// Seconds it took to apply a download, and that download's bytes.
    pub apply: Option<(f64, f64)>,
}

/// Every node's figures and the server's fold, as the rounds so far measured them.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    nodes: BTreeMap<usize, NodeFigures>,
    /// Per node, the newest round of its own report taken in (a report repeats until the
    /// next).
    reported: BTreeMap<usize, u64>,
    /// The server's fold of one upload: seconds and bytes, a running mean.
    fold: Option<(f64, f64)>,
    /// The server's close and durable write of a round, seconds.
    close_s: Option<f64>,
    /// The slowest member's compute of a round beyond the fastest's, seconds.
    skew_s: Option<f64>,
    /// The settings of the rounds the fold, close and apply figures come from: they depend
    /// on the wire, so a change starts them over.
    settings: Option<RoundSettings>,
}

/// The running mean with `new` taken in; a figure that is not a finite number is left out.
fn mean(old: Option<f64>, new: f64) -> Option<f64> {
    if !new.is_finite() {
        return old;
    }
    Some(old.map_or(new, |o| o + WEIGHT * (new - o)))
}

fn mean2(old: Option<(f64, f64)>, new: (f64, f64)) -> Option<(f64, f64)> {
    if !(new.0.is_finite() && new.1.is_finite()) {
        return old;
    }
    Some(old.map_or(new, |o| {
        (o.0 + WEIGHT * (new.0 - o.0), o.1 + WEIGHT * (new.1 - o.1))
    }))
}

impl Measured {
    /// Takes in a closed round's timings.
    pub fn observe(&mut self, close: &RoundClose) {
        if close.settings.is_some() && close.settings != self.settings {
            if self.settings.is_some() {
                self.fold = None;
                self.close_s = None;
                for n in self.nodes.values_mut() {
                    n.apply = None;
                }
            }
            self.settings = close.settings;
        }
        for u in &close.uploads {
            self.fold = mean2(self.fold, (u.fold_s, u.bytes as f64));
            let n = self.nodes.entry(u.peer).or_default();
            n.staged = u.receive_s.is_none();
            if let Some(rate) = upload_rate(u) {
                n.up_bytes_per_s = mean(n.up_bytes_per_s, rate);
            }
        }
        self.close_s = mean(self.close_s, close.aggregation_s + close.publish_s);
        let computes: Vec<f64> = close
            .work
            .iter()
            .map(|w| w.work.compute_s)
            .filter(|&c| c > 0.0)
            .collect();
        if computes.len() > 1 {
            let (lo, hi) = computes
                .iter()
                .fold((f64::INFINITY, 0.0f64), |(lo, hi), &c| {
                    (lo.min(c), hi.max(c))
                });
            self.skew_s = mean(self.skew_s, hi - lo);
        }
        for w in &close.work {
            if w.work.compute_s > 0.0 {
                let n = self.nodes.entry(w.peer).or_default();
                n.compute_s = mean(n.compute_s, w.work.compute_s);
            }
        }
        for r in &close.nodes {
            // A report counts once, and only with its download timed within its sync.
            let timed = r.down_s > 0.0 && r.down_s <= r.sync_s && r.sync_s.is_finite();
            if self.reported.get(&r.peer) >= Some(&r.round) || !timed {
                continue;
            }
            self.reported.insert(r.peer, r.round);
            let fold = self.fold.map_or(0.0, |(s, _)| s);
            let n = self.nodes.entry(r.peer).or_default();
            // A node's own seconds cannot exceed the sync they are part of.
            let (apply_s, up_s) = (r.apply_s.min(r.sync_s), r.up_s.min(r.sync_s));
            if r.bytes_down >= MIN_TIMED_BYTES {
                n.down_bytes_per_s = mean(n.down_bytes_per_s, r.bytes_down as f64 / r.down_s);
            }
            if r.bytes_down > 0 {
                n.apply = mean2(n.apply, (apply_s, r.bytes_down as f64));
            }
            // Latency from uploads the server received itself, when this one was one.
            let sent = up_s > 0.0 && r.bytes_up > 0 && !n.staged;
            if let Some(rate) = n.up_bytes_per_s.filter(|_| sent) {
                let beyond = up_s - r.bytes_up as f64 / rate - fold;
                n.latency_s = mean(n.latency_s, beyond.max(0.0));
            }
        }
    }

    /// A node's figures, once measured.
    pub fn node(&self, peer: usize) -> Option<&NodeFigures> {
        self.nodes.get(&peer)
    }

    /// Per figure, the value of the node at quantile `q` of slowness among `peers` (1: the
    /// slowest; 0.5: the median): the lower rates, the longer times. `None` until every
    /// figure was measured for one of them.
    pub fn at_quantile(&self, peers: &[usize], q: f64) -> Option<Figures> {
        let of = |f: &dyn Fn(&NodeFigures) -> Option<f64>, slow_high: bool| {
            let mut v: Vec<f64> = peers
                .iter()
                .filter_map(|p| self.nodes.get(p).and_then(f))
                .collect();
            if v.is_empty() {
                return None;
            }
            v.sort_by(f64::total_cmp);
            if !slow_high {
                v.reverse();
            }
            let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
            Some(v[i])
        };
        let apply_per_byte = |n: &NodeFigures| n.apply.map(|(s, b)| s / b);
        let (fold_s, fold_bytes) = self.fold?;
        let computes: Vec<f64> = peers
            .iter()
            .filter_map(|p| self.nodes.get(p)?.compute_s)
            .collect();
        let pace_s = computes.iter().copied().fold(0.0, f64::max)
            - computes.iter().copied().fold(f64::INFINITY, f64::min);
        Some(Figures {
            up_bytes_per_s: of(&|n| n.up_bytes_per_s, false)?,
            down_bytes_per_s: of(&|n| n.down_bytes_per_s, false)?,
            latency_s: of(&|n| n.latency_s, true)?,
            compute_s: of(&|n| n.compute_s, true)?,
            apply_s_per_byte: of(&apply_per_byte, true)?,
            fold_s_per_byte: fold_s / fold_bytes.max(1.0),
            close_s: self.close_s?,
            skew_s: self.skew_s.unwrap_or(0.0),
            pace_s: pace_s.max(0.0),
        })
    }
}

/// An upload's rate as the server received it, when it is large enough to tell.
fn upload_rate(u: &UploadTiming) -> Option<f64> {
    let s = u.receive_s.filter(|&s| s > 0.0)?;
    (u.bytes >= MIN_TIMED_BYTES).then(|| u.bytes as f64 / s)
}

/// The run-wide figures the planner takes: one node's link and speed, and the server's fold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub up_bytes_per_s: f64,
    pub down_bytes_per_s: f64,
    pub latency_s: f64,
    /// Seconds the node's steps of a round take.
    pub compute_s: f64,
    pub apply_s_per_byte: f64,
    pub fold_s_per_byte: f64,
    /// The server's close and durable write of a round.
    pub close_s: f64,
    /// The slowest member's compute of a round beyond the fastest's, round by round.
    pub skew_s: f64,
    /// The slowest member's mean compute of a round beyond the fastest's mean: its pace.
    pub pace_s: f64,
}

/// The planner's input for `cfg` with `members` nodes on the measured `f`, its apply and fold
/// scaled so that `current` (the run's own option) takes what was measured.
pub fn plan_input(
    cfg: &RunConfig,
    members: usize,
    f: &Figures,
    current: Option<WireOption>,
) -> PlanInput {
    let mut input = PlanInput {
        model: cfg.model.clone(),
        nodes: members.max(1),
        diloco: cfg.sync.mode == Mode::Diloco,
        node_link: LinkSpec {
            up_bps: f.up_bytes_per_s * 8.0,
            down_bps: f.down_bytes_per_s * 8.0,
            rtt: Duration::from_secs_f64(f.latency_s),
            loss: 0.0,
        },
        server_link: LinkSpec {
            up_bps: f64::INFINITY,
            down_bps: f64::INFINITY,
            rtt: Duration::ZERO,
            loss: 0.0,
        },
        shards: 1,
        step_s: f.compute_s / cfg.sync.sync_steps.max(1) as f64,
        sync_steps: cfg.sync.sync_steps,
        overlap_cap: cfg.sync.overlap_cap(),
        stride: cfg.sync.stride.max(1),
        sparse_chunk: cfg.sync.sparse_chunk,
        sparse_k: cfg.sync.sparse_k,
        rank: cfg.sync.rank,
        aggregate_bytes_per_s: plan::AGGREGATE_GBPS * 1e9,
        lossy_values_per_s: plan::LOSSY_GVPS * 1e9,
        sparse_values_per_s: plan::SPARSE_GVPS * 1e9,
        lowrank_values_per_s: plan::LOWRANK_GVPS * 1e9,
        encode_values_per_s: plan::ENCODE_GVPS * 1e9,
        disk_bytes_per_s: plan::DISK_GBPS * 1e9,
        apply_scale: 1.0,
        fold_scale: 1.0,
        close_scale: 1.0,
        skew_s: f.skew_s,
        pace_s: f.pace_s.min(f.skew_s),
    };
    if let Some(option) = current {
        let planned = plan::plan(&input, option);
        if planned.apply_s > 0.0 {
            input.apply_scale = f.apply_s_per_byte * planned.down_bytes / planned.apply_s;
        }
        if planned.fold_s > 0.0 {
            input.fold_scale = f.fold_s_per_byte * planned.up_bytes / planned.fold_s;
        }
        if planned.close_s > 0.0 {
            input.close_scale = f.close_s / planned.close_s;
        }
    }
    input
}

/// The planner's input for `option` in a run that ran `current` on `input` (scaled to what
/// `current` measured). Where `costs` timed both wires' code, `option`'s fold and close are
/// the running wire's measured ones plus the timed difference (the server timed both, on the
/// machine that folds; the close also the planner's difference of bytes written), and its
/// apply the running one's times the timed ratio (a node's machine may be faster or slower
/// than the server's: only the ratio carries over, timed on the server's CPU even where nodes
/// apply on a GPU). Otherwise `option` borrows the running wire's scales.
fn input_for(
    input: &PlanInput,
    current: Option<WireOption>,
    option: WireOption,
    costs: Option<&WireCosts>,
) -> PlanInput {
    let timed = |o: WireOption| costs.and_then(|c| c.get(&o.wire()));
    let Some(cur) = current.filter(|c| c.wire() != option.wire()) else {
        return input.clone();
    };
    let (Some(ran_cost), Some(cost)) = (timed(cur), timed(option)) else {
        return input.clone();
    };
    let ran = plan::plan(input, cur);
    let rated = plan::plan(
        &PlanInput {
            apply_scale: 1.0,
            fold_scale: 1.0,
            close_scale: 1.0,
            ..input.clone()
        },
        option,
    );
    let scale = |target: f64, rated: f64, otherwise: f64| {
        if rated > 0.0 && target.is_finite() {
            target.max(0.0) / rated
        } else {
            otherwise
        }
    };
    let total = input.model.param_counts().total.max(1) as f64;
    let shards = input.shards.max(1) as f64;
    let share = ran.up_values / total;
    // Never less than the option's own code as timed: the running wire's measured figure
    // can be below its timed one on a busy machine, and the difference then overshoots.
    let fold = (ran.fold_s + share * (cost.fold_s - ran_cost.fold_s)).max(share * cost.fold_s);
    let close = (ran.close_s
        + (cost.encode_s - ran_cost.encode_s) / shards
        + (rated.write_s - ran.write_s))
        .max(cost.encode_s / shards + rated.write_s);
    let apply = ran.apply_s * cost.apply_s / ran_cost.apply_s;
    PlanInput {
        fold_scale: scale(fold, rated.fold_s, input.fold_scale),
        close_scale: scale(close, rated.close_s, input.close_scale),
        apply_scale: scale(apply, rated.apply_s, input.apply_scale),
        ..input.clone()
    }
}

/// What every wire option would give on the measured links, the run's own option first.
pub fn predict(
    input: &PlanInput,
    current: Option<WireOption>,
    costs: Option<&WireCosts>,
) -> Vec<PlanRow> {
    let mut options: Vec<WireOption> = current.into_iter().collect();
    options.extend(WireOption::ALL.into_iter().filter(|o| Some(*o) != current));
    options
        .into_iter()
        .map(|o| plan::plan(&input_for(input, current, o, costs), o))
        .collect()
}

/// The slowest member's figures among `members`, once every one was measured and is a number
/// the planner can take.
fn slowest(measured: &Measured, members: &[usize]) -> Option<Figures> {
    let f = measured.at_quantile(members, 1.0)?;
    let positive = [f.up_bytes_per_s, f.down_bytes_per_s, f.compute_s];
    let finite = [
        f.latency_s,
        f.apply_s_per_byte,
        f.fold_s_per_byte,
        f.close_s,
        f.skew_s,
        f.pace_s,
    ];
    (positive.iter().all(|v| v.is_finite() && *v > 0.0)
        && finite.iter().all(|v| v.is_finite() && *v >= 0.0))
    .then_some(f)
}

/// Each of `candidates`' predicted utilization of the slowest member among `members` on the
/// links `measured`, for a run of `cfg` whose `sync` holds the open round's settings (its
/// measured apply, fold and close carried to every candidate's wire by `costs`:
/// [`input_for`]); `None` until the figures are in.
pub fn predict_settings(
    cfg: &RunConfig,
    measured: &Measured,
    members: &[usize],
    candidates: &[RoundSettings],
    costs: Option<&WireCosts>,
) -> Option<Vec<Prediction>> {
    let f = slowest(measured, members)?;
    let current = WireOption::of(&cfg.sync);
    let input = plan_input(cfg, members.len(), &f, current);
    Some(
        candidates
            .iter()
            .filter_map(|&s| {
                let (option, cap) = WireOption::of_settings(s, cfg.sync.sync_steps)?;
                let row = plan::plan(
                    &PlanInput {
                        overlap_cap: cap,
                        ..input_for(&input, current, option, costs)
                    },
                    option,
                );
                Some(Prediction {
                    settings: s,
                    utilization: 1.0 - row.idle_share,
                    bytes: row.up_bytes + row.down_bytes,
                })
            })
            .collect(),
    )
}

/// What the planner predicts for `cfg`'s run on the links `measured` among `members` (the
/// slowest member's figures), once every figure it needs was measured.
pub fn planned(
    cfg: &RunConfig,
    measured: &Measured,
    members: &[usize],
    costs: Option<&WireCosts>,
) -> Option<Planned> {
    let f = slowest(measured, members)?;
    let current = WireOption::of(&cfg.sync);
    let input = plan_input(cfg, members.len(), &f, current);
    let options = predict(&input, current, costs)
        .into_iter()
        .map(|r| PlannedOption {
            wire: r.option.label().to_owned(),
            up_bytes: r.up_bytes,
            down_bytes: r.down_bytes,
            round_s: r.round_s,
            utilization: 1.0 - r.idle_share,
        })
        .filter(|o| {
            [o.up_bytes, o.down_bytes, o.round_s, o.utilization]
                .iter()
                .all(|v| v.is_finite())
        })
        .collect();
    Some(Planned {
        up_mbit_s: f.up_bytes_per_s * 8e-6,
        down_mbit_s: f.down_bytes_per_s * 8e-6,
        latency_s: f.latency_s,
        step_s: input.step_s,
        skew_s: input.skew_s,
        pace_s: input.pace_s,
        apply_scale: input.apply_scale,
        fold_scale: input.fold_scale,
        close_scale: input.close_scale,
        options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spes_sync::{PeerWork, Wire, Work};
    use spes_train::metrics::NodeRound;

    fn close(round: u64, up_s: [f64; 2], down_s: f64) -> RoundClose {
        RoundClose {
            uploads: (0..2)
                .map(|p| UploadTiming {
                    peer: p,
                    bytes: 1 << 20,
                    receive_s: Some(up_s[p]),
                    fold_s: 0.1,
                })
                .chain([UploadTiming {
                    peer: 2,
                    bytes: 1000,
                    receive_s: Some(1e-4),
                    fold_s: 0.1,
                }])
                .collect(),
            work: (0..2)
                .map(|p| PeerWork {
                    peer: p,
                    work: Work {
                        rows: 20,
                        compute_s: 10.0,
                    },
                    weight: 0.5,
                })
                .collect(),
            nodes: (0..2)
                .map(|p| NodeRound {
                    peer: p,
                    round,
                    sync_s: 3.0,
                    bytes_up: 1 << 20,
                    bytes_down: 2 << 20,
                    up_s: 1.5,
                    down_s,
                    apply_s: 0.5,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Rates come from the server's receive times (a small upload's is left out), a node's
    /// report counts once per round and within its sync, and the slowest node's figures are
    /// the run's at quantile 1.
    #[test]
    fn figures_come_from_the_servers_timings_and_bounded_reports() {
        let mut m = Measured::default();
        m.observe(&close(0, [1.0, 0.5], 0.25));
        let n0 = *m.node(0).unwrap();
        assert_eq!(n0.up_bytes_per_s, Some((1 << 20) as f64));
        assert_eq!(n0.down_bytes_per_s, Some((8 << 20) as f64));
        assert_eq!(n0.compute_s, Some(10.0));
        assert!(
            m.node(2).unwrap().up_bytes_per_s.is_none(),
            "too small to time"
        );
        // The same report again changes nothing, nor does a download longer than its sync or
        // a figure that is not a finite number; a new round's report counts.
        m.observe(&close(0, [1.0, 0.5], 0.25));
        assert_eq!(m.node(0).unwrap().down_bytes_per_s, n0.down_bytes_per_s);
        m.observe(&close(1, [1.0, 0.5], 10.0));
        let mut bad = close(2, [1.0, 0.5], 1e-310);
        bad.work[0].work.compute_s = f64::INFINITY;
        m.observe(&bad);
        assert_eq!(m.node(0).unwrap().compute_s, Some(10.0));
        assert!(m.node(0).unwrap().down_bytes_per_s.unwrap().is_finite());
        m.observe(&close(3, [1.0, 0.5], 0.5));
        let down = m.node(0).unwrap().down_bytes_per_s.unwrap();
        let expected = (8 << 20) as f64 + WEIGHT * ((4 << 20) as f64 - (8 << 20) as f64);
        assert!((down - expected).abs() < 1e-6, "{down} vs {expected}");
        let slow = m.at_quantile(&[0, 1], 1.0).unwrap();
        let fast = m.at_quantile(&[0, 1], 0.0).unwrap();
        assert_eq!(slow.up_bytes_per_s, (1 << 20) as f64);
        assert_eq!(fast.up_bytes_per_s, (2 << 20) as f64);
        assert!(
            m.at_quantile(&[2], 1.0).is_none(),
            "node 2 measured no download"
        );
        // An upload's 1.5 s less its bytes (1 s, 0.5 s) and the 0.1 s fold; per figure the
        // slowest node's.
        assert!((fast.latency_s - 0.4).abs() < 1e-9, "{}", fast.latency_s);
        assert!((slow.latency_s - 0.9).abs() < 1e-9, "{}", slow.latency_s);
    }

    /// The members' spread round by round is `skew_s`; the part that lasts, one node slower
    /// every round, is `pace_s`, which chance spreads do not build.
    #[test]
    fn a_pace_is_the_spread_that_lasts() {
        let with_compute = |round: u64, c: [f64; 2]| {
            let mut r = close(round, [1.0, 0.5], 0.25);
            for w in &mut r.work {
                w.work.compute_s = c[w.peer];
            }
            r
        };
        let mut steady = Measured::default();
        let mut chance = Measured::default();
        for round in 0..6 {
            steady.observe(&with_compute(round, [10.0, 11.0]));
            let turn = if round % 2 == 0 {
                [10.0, 11.0]
            } else {
                [11.0, 10.0]
            };
            chance.observe(&with_compute(round, turn));
        }
        let s = steady.at_quantile(&[0, 1], 1.0).unwrap();
        assert!(
            (s.skew_s - 1.0).abs() < 1e-9 && (s.pace_s - 1.0).abs() < 1e-9,
            "{s:?}"
        );
        let c = chance.at_quantile(&[0, 1], 1.0).unwrap();
        assert!((c.skew_s - 1.0).abs() < 1e-9, "{c:?}");
        assert!(c.pace_s < 0.5, "{c:?}");
    }

    /// A change of settings starts the wire's costs (fold, close, apply) over, so figures of
    /// one wire never scale another's; the links and steps carry over. The candidates' predictions
    /// follow the planner: on a slow uplink, overlap keeps the node busier than waiting.
    #[test]
    fn a_change_of_settings_starts_the_wires_costs_over() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
        let cfg = RunConfig::load(&path, &[]).unwrap();
        let on = |s: RoundSettings, round: u64| RoundClose {
            settings: Some(s),
            ..close(round, [1.0, 0.5], 0.25)
        };
        let first = cfg.sync.settings();
        let other = RoundSettings {
            wire: Wire::Bf16Delta,
            overlap: false,
            overlap_steps: 0,
        };
        let mut m = Measured::default();
        m.observe(&on(first, 0));
        m.observe(&on(first, 1));
        assert!(m.at_quantile(&[0, 1], 1.0).is_some());
        let candidates = [first, other];
        let predicted = predict_settings(&cfg, &m, &[0, 1], &candidates, None).unwrap();
        assert_eq!(predicted.len(), 2);
        assert!(
            predicted[0].utilization > predicted[1].utilization,
            "{predicted:?}"
        );
        assert!(predicted[0].bytes < predicted[1].bytes, "{predicted:?}");
        // The first round on the other wire brings its uploads' fold but no report of its
        // apply yet: nothing to plan on until it does.
        let mut next = on(other, 2);
        next.nodes.clear();
        m.observe(&next);
        assert!(m.node(0).unwrap().apply.is_none());
        assert!(m.node(0).unwrap().up_bytes_per_s.is_some());
        assert!(m.at_quantile(&[0, 1], 1.0).is_none());
        m.observe(&on(other, 3));
        assert!(m.at_quantile(&[0, 1], 1.0).is_some());
    }

    /// Fed the figures a run measured, the planner's round for the run's own wire applies and
    /// folds in the measured seconds; the demo's first rounds are the int4 overlapped option,
    /// and with low rank pinned the low-rank one, which the figures below are of.
    #[test]
    fn the_runs_own_option_takes_what_was_measured() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
        let shipped = RunConfig::load(&path, &[]).unwrap();
        assert_eq!(WireOption::of(&shipped.sync), Some(WireOption::Int4Overlap));
        let cfg = RunConfig::load(&path, &["sync.wire=lowrank_delta".to_string()]).unwrap();
        let current = WireOption::of(&cfg.sync);
        assert_eq!(current, Some(WireOption::LowrankOverlap));
        assert_eq!(
            WireOption::of(&spes_sync::SyncConfig::default()),
            Some(WireOption::Overlap)
        );
        let f = Figures {
            up_bytes_per_s: 2.5e6,
            down_bytes_per_s: 12.5e6,
            latency_s: 0.2,
            compute_s: 2.0,
            apply_s_per_byte: 5e-7,
            fold_s_per_byte: 2e-7,
            close_s: 0.3,
            skew_s: 0.0,
            pace_s: 0.0,
        };
        let input = plan_input(&cfg, 4, &f, current);
        let rows = predict(&input, current, None);
        assert_eq!(rows.len(), WireOption::ALL.len());
        let own = &rows[0];
        assert_eq!(own.option, WireOption::LowrankOverlap);
        assert!(
            (own.apply_s - 5e-7 * own.down_bytes).abs() < 1e-9,
            "{own:?}"
        );
        assert!((own.fold_s - 2e-7 * own.up_bytes).abs() < 1e-9, "{own:?}");
        assert!((own.close_s - 0.3).abs() < 1e-9, "{own:?}");
        assert_eq!(own.compute_s, 2.0, "the slowest node's steps of a round");
        // Heavier wires take longer to send on the same links.
        let bf16 = rows
            .iter()
            .find(|r| r.option == WireOption::Overlap)
            .unwrap();
        assert!(bf16.sync_s > own.sync_s, "{bf16:?} vs {own:?}");

        // With the wires' code timed, another wire's fold and close are the running one's
        // plus the timed difference, and its apply the running one's times the timed ratio;
        // an untimed wire borrows the running one's scales as before.
        let cost = |encode_s, fold_s, apply_s| spes_sync::wire_cost::WireCost {
            encode_s,
            fold_s,
            apply_s,
        };
        let costs: WireCosts = [
            (Wire::LowrankDelta, cost(0.25, 0.04, 0.12)),
            (Wire::Int4Delta, cost(0.1, 0.03, 0.03)),
        ]
        .into();
        let timed = predict(&input, current, Some(&costs));
        let find = |rows: &[PlanRow], o| rows.iter().find(|r| r.option == o).unwrap().clone();
        let int4 = find(&timed, WireOption::Int4Overlap);
        let share = own.up_values / cfg.model.param_counts().total as f64;
        assert!(share > 0.0 && share < 1.0, "{share}");
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(int4.fold_s, own.fold_s - 0.01 * share), "{int4:?}");
        let written = int4.write_s - own.write_s;
        assert!(near(int4.close_s, 0.3 - 0.15 + written), "{int4:?}");
        assert!(near(int4.apply_s, own.apply_s * 0.25), "{int4:?}");
        // The running wire measured below its own timed code: the other's fold and close are
        // never less than its own timed code.
        let slow_timing: WireCosts = [
            (Wire::LowrankDelta, cost(5.0, 4.0, 0.12)),
            (Wire::Int4Delta, cost(0.1, 0.03, 0.03)),
        ]
        .into();
        let floored = find(&predict(&input, current, Some(&slow_timing)), int4.option);
        assert!(near(floored.fold_s, 0.03 * share), "{floored:?}");
        assert!(near(floored.close_s, 0.1 + floored.write_s), "{floored:?}");
        // A wire whose apply was timed at nothing borrows the running wire's scales.
        let no_apply: WireCosts = [
            (Wire::LowrankDelta, cost(0.25, 0.04, 0.0)),
            (Wire::Int4Delta, cost(0.1, 0.03, 0.03)),
        ]
        .into();
        let borrowed = find(&predict(&input, current, Some(&no_apply)), int4.option);
        let before = find(&rows, int4.option);
        assert!(near(borrowed.apply_s, before.apply_s), "{borrowed:?}");
        let untimed = WireOption::SparseOverlap;
        assert!(near(
            find(&timed, untimed).round_s,
            find(&rows, untimed).round_s
        ));
        assert!(near(timed[0].round_s, own.round_s));
    }
}
