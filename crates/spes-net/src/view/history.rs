//! What the server remembers of a run for its operator: a compact point per round, validation
//! loss against tokens, the newest rounds' per-node timeline, the newest expert load and the
//! last events. Built from the same [`RoundRecord`]s the server writes to `metrics.jsonl`
//! (and read back from it on a restart), bounded in memory whatever the run's length, and
//! downsampled for the page.

use super::{EventKind, EventView, LoadView, RoundPoint};
use spes_train::metrics::{NodeRound, RoundRecord};
use std::collections::VecDeque;

/// Points kept in memory; beyond it the older half is thinned to every other point, so a run
/// of any length costs at most this many (about 100 bytes each).
const MAX_POINTS: usize = 20_000;
/// Rounds of per-node timeline kept.
pub const TIMELINE_ROUNDS: usize = 40;
/// Events kept.
pub const MAX_EVENTS: usize = 100;
/// Points a page gets per series: the newest [`RECENT`] in full, older ones evenly thinned.
pub const SHOWN_POINTS: usize = 1000;
const RECENT: usize = 250;

/// The run's history, in round order.
#[derive(Default)]
pub struct History {
    rounds: Vec<RoundPoint>,
    loss: Vec<[f64; 2]>,
    timeline: VecDeque<(u64, Vec<NodeRound>)>,
    events: VecDeque<EventView>,
    pub expert_load: Option<LoadView>,
}

impl History {
    /// The history of the records a log holds, oldest first.
    pub fn of(records: &[RoundRecord]) -> History {
        let mut h = History::default();
        for r in records {
            h.push(r, false);
        }
        h
    }

    /// Takes a published (and possibly scored) round. `live` rounds leave out their refused
    /// calls, which the server reported as events when it refused them.
    pub fn push(&mut self, r: &RoundRecord, live: bool) {
        if self.rounds.last().is_some_and(|p| p.round >= r.round) && r.round > 0 {
            // A restarted server logs its restart round again: keep the first.
            return;
        }
        let close = r.close.as_ref();
        self.rounds.push(RoundPoint {
            round: r.round,
            tokens: r.tokens,
            bytes_in: close.map_or(0, |c| c.bytes_in),
            bytes_out: close.map_or(0, |c| c.bytes_out),
            round_s: close.map_or(0.0, |c| c.round_s),
            aggregation_s: close.map_or(0.0, |c| c.aggregation_s),
            peers: close.map_or(0, |c| c.peers.len()),
            missing: close.map_or(0, |c| c.missing.len()),
        });
        if self.rounds.len() > MAX_POINTS {
            thin_older_half(&mut self.rounds);
        }
        if let Some(v) = r.val_loss {
            self.loss.push([r.tokens as f64, v]);
            if self.loss.len() > MAX_POINTS {
                thin_older_half(&mut self.loss);
            }
        }
        if let Some(load) = &r.expert_load {
            self.expert_load = Some(LoadView {
                round: r.round,
                load: load.clone(),
                owners: r.owners.clone(),
            });
        }
        let Some(c) = close else { return };
        if !c.nodes.is_empty() {
            let rows = c.nodes.clone();
            self.timeline.push_back((r.round, rows));
            while self.timeline.len() > TIMELINE_ROUNDS {
                self.timeline.pop_front();
            }
        }
        let mut event = |kind, peer, text: String| {
            self.event(EventView {
                round: r.round,
                kind,
                peer,
                text,
            })
        };
        for &p in &c.evicted {
            event(
                EventKind::Evicted,
                Some(p),
                format!("peer {p} evicted (its lease expired)"),
            );
        }
        for &p in &c.joined {
            event(EventKind::Joined, Some(p), format!("peer {p} admitted"));
        }
        for &p in &c.missing {
            event(
                EventKind::Missing,
                Some(p),
                format!("peer {p} did not upload in time"),
            );
        }
        if let Some(why) = &c.discarded {
            event(
                EventKind::Discarded,
                None,
                format!("aggregate discarded: {why}"),
            );
        }
        if !live {
            for text in &c.rejected {
                event(EventKind::Refused, None, text.clone());
            }
        }
    }

    /// Adds an event, dropping the oldest beyond [`MAX_EVENTS`].
    pub fn event(&mut self, e: EventView) {
        self.events.push_back(e);
        while self.events.len() > MAX_EVENTS {
            self.events.pop_front();
        }
    }

    /// The round points a page shows (at most [`SHOWN_POINTS`]).
    pub fn rounds(&self) -> Vec<RoundPoint> {
        downsample(&self.rounds)
    }

    /// (tokens, validation loss) points a page shows.
    pub fn loss(&self) -> Vec<[f64; 2]> {
        downsample(&self.loss)
    }

    /// The newest rounds' per-node rows, oldest first.
    pub fn timeline(&self) -> Vec<NodeRound> {
        self.timeline
            .iter()
            .flat_map(|(_, rows)| rows.clone())
            .collect()
    }

    /// The last events, newest first.
    pub fn events(&self) -> Vec<EventView> {
        self.events.iter().rev().cloned().collect()
    }

    /// The newest round's point.
    pub fn newest(&self) -> Option<&RoundPoint> {
        self.rounds.last()
    }
}

/// Every other point of the older half, so recent rounds keep their detail.
fn thin_older_half<T: Clone>(v: &mut Vec<T>) {
    let half = v.len() / 2;
    let kept: Vec<T> = v[..half].iter().step_by(2).cloned().collect();
    v.splice(..half, kept);
}

/// The newest [`RECENT`] points whole, and older ones evenly thinned to fill the rest of
/// [`SHOWN_POINTS`] (the first point always kept, so a curve starts where the run did).
fn downsample<T: Clone>(v: &[T]) -> Vec<T> {
    if v.len() <= SHOWN_POINTS {
        return v.to_vec();
    }
    let (old, recent) = v.split_at(v.len() - RECENT);
    let room = SHOWN_POINTS - RECENT;
    let stride = old.len().div_ceil(room);
    old.iter()
        .step_by(stride)
        .chain(recent.iter())
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use spes_train::metrics::RoundClose;

    fn record(round: u64) -> RoundRecord {
        let nodes = vec![NodeRound {
            peer: 1,
            round: round.saturating_sub(1),
            compute_s: 2.0,
            ..Default::default()
        }];
        RoundRecord {
            round,
            tokens: round * 100,
            val_loss: Some(10.0 / (round + 1) as f64),
            close: (round > 0).then(|| RoundClose {
                evicted: if round == 7 { vec![3] } else { vec![] },
                rejected: vec![format!("peer 2 round {round}: closed")],
                nodes,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_long_run_stays_bounded_and_keeps_its_ends() {
        let records: Vec<RoundRecord> = (0..=60_000).map(record).collect();
        let h = History::of(&records);
        assert!(h.rounds.len() <= MAX_POINTS && h.loss.len() <= MAX_POINTS);
        let shown = h.rounds();
        assert!(shown.len() <= SHOWN_POINTS, "{}", shown.len());
        assert_eq!(shown.first().unwrap().round, 0, "the run's start");
        let last: Vec<u64> = shown[shown.len() - RECENT..]
            .iter()
            .map(|p| p.round)
            .collect();
        assert_eq!(
            last,
            (60_001 - RECENT as u64..=60_000).collect::<Vec<_>>(),
            "recent rounds whole"
        );
        assert!(shown.windows(2).all(|w| w[0].round < w[1].round));
        assert_eq!(h.timeline().len(), TIMELINE_ROUNDS);
        assert_eq!(h.events().len(), MAX_EVENTS);
    }

    #[test]
    fn events_come_newest_first_and_live_refusals_are_not_doubled() {
        let mut h = History::default();
        for r in 0..=8 {
            h.push(&record(r), true);
        }
        let events = h.events();
        assert_eq!(events.len(), 1, "only the eviction: {events:?}");
        assert_eq!(
            (events[0].kind, events[0].peer, events[0].round),
            (EventKind::Evicted, Some(3), 7)
        );
        let replayed = History::of(&(0..=8).map(record).collect::<Vec<_>>());
        assert_eq!(replayed.events().len(), 9, "8 refusals and the eviction");
        assert_eq!(replayed.events()[0].round, 8);
        // A restart logs its round again; the history keeps one point per round.
        let mut again = History::of(&[record(0), record(1), record(2)]);
        again.push(&record(2), false);
        assert_eq!(again.rounds().len(), 3);
    }
}
