//! What the server heard from its nodes and when: besides the leases, what decides whom a round
//! waits for. Two silent faults shape it.
//!
//! A member can be live by its heartbeats and still make no progress (stuck, or a round behind
//! and about to be refused). Each heartbeat carries the node's activity counter (steps trained
//! and payload chunks moved), and a member whose counter has stood still for
//! [`SyncConfig::stall_after_s`] is not waited for: the round closes once the others are in.
//!
//! The server itself can go deaf (its process paused, its link cut): every lease then runs out
//! at once, and the server cannot tell its own outage from the nodes'. Live nodes heartbeat
//! every `lease_s / 4`, so hearing nobody for half a lease is a silence of the server's: it
//! then keeps waiting for the members whose leases were current when the silence began, until
//! a lease after it hears again, so the first node back does not close the round alone; the
//! silence does not count toward the round's timeout.

use crate::config::SyncConfig;
use std::collections::BTreeMap;

/// A member's newest activity counter and when it last changed.
#[derive(Clone, Copy, Debug)]
struct Progress {
    activity: u64,
    at: f64,
}

/// Who was heard, when, and who made progress; time is passed in.
#[derive(Clone, Debug)]
pub(crate) struct Hearing {
    /// When any node was last heard (a join, heartbeat or upload).
    last: f64,
    /// The newest silence ([`Hearing::silent_after`]): when it began and when a node was heard
    /// again.
    silence: Option<(f64, f64)>,
    /// The seconds of every silence that ended so far.
    silent_s: f64,
    progress: BTreeMap<usize, Progress>,
}

impl Hearing {
    /// Starts as if every node had just been heard (a new or restarted server).
    pub fn new(now: f64) -> Self {
        Hearing {
            last: now,
            silence: None,
            silent_s: 0.0,
            progress: BTreeMap::new(),
        }
    }

    /// How long hearing nobody is a silence of the server's own: two heartbeat intervals.
    fn silent_after(cfg: &SyncConfig) -> f64 {
        cfg.lease_s / 2.0
    }

    /// A node was heard at `now`.
    pub fn heard(&mut self, now: f64, cfg: &SyncConfig) {
        if now - self.last >= Self::silent_after(cfg) {
            self.silence = Some((self.last, now));
            self.silent_s += now - self.last;
        }
        self.last = self.last.max(now);
    }

    /// The seconds the server has been silent (deaf) up to `now`, the ongoing silence
    /// included.
    pub fn silent_s(&self, now: f64, cfg: &SyncConfig) -> f64 {
        let ongoing = if self.deaf(now, cfg) {
            now - self.last
        } else {
            0.0
        };
        self.silent_s + ongoing
    }

    /// `peer` reported its activity counter; a new value is progress (a restarted node's
    /// counter starts again, which is progress too).
    pub fn activity(&mut self, peer: usize, activity: u64, now: f64) {
        if self
            .progress
            .get(&peer)
            .is_none_or(|p| p.activity != activity)
        {
            self.progress.insert(peer, Progress { activity, at: now });
        }
    }

    /// `peer` made progress the server saw itself (an upload began or arrived).
    pub fn progressed(&mut self, peer: usize, now: f64) {
        let activity = self.progress.get(&peer).map_or(0, |p| p.activity);
        self.progress.insert(peer, Progress { activity, at: now });
    }

    /// Forgets an evicted peer.
    pub fn forget(&mut self, peer: usize) {
        self.progress.remove(&peer);
    }

    /// Whether the server has heard nobody for [`Hearing::silent_after`] up to `now`.
    pub fn deaf(&self, now: f64, cfg: &SyncConfig) -> bool {
        now - self.last >= Self::silent_after(cfg)
    }

    /// Whether a member whose lease was last renewed at `renewed` counts as live for the open
    /// round: its lease is current, or it expired during the server's own silence (ongoing, or
    /// ended less than a lease ago) while the member was live when the silence began.
    pub fn presumed_live(&self, renewed: f64, now: f64, cfg: &SyncConfig) -> bool {
        let lease = cfg.lease_s;
        if now - renewed < lease {
            return true;
        }
        if self.deaf(now, cfg) {
            return renewed + lease > self.last;
        }
        self.silence
            .is_some_and(|(from, back)| renewed + lease > from && now < back + lease)
    }

    /// Seconds the server could have heard a member last renewed at `renewed` by `now`: the
    /// time since, less the server's newest silence when the member's lease ran out in it. What
    /// eviction counts, so a member whose lease ran out in the server's own outage keeps its
    /// place until it has had a whole `lease_s + evict_after_s` to be heard again (a link back
    /// after a cut may take seconds of TCP retransmissions to carry).
    pub fn unheard_s(&self, renewed: f64, now: f64, cfg: &SyncConfig) -> f64 {
        let overlap = self
            .silence
            .filter(|&(from, _)| renewed + cfg.lease_s > from)
            .map_or(0.0, |(from, back)| {
                (back.min(now) - from.max(renewed)).max(0.0)
            });
        (now - renewed - overlap).max(0.0)
    }

    /// Whether `peer` showed progress within [`SyncConfig::stall_after_s`] of `now`, counting
    /// from the round's opening at the earliest and from the end of the server's last silence
    /// (while deaf, the server cannot know and assumes so).
    pub fn progressing(&self, peer: usize, opened_at: f64, now: f64, cfg: &SyncConfig) -> bool {
        if self.deaf(now, cfg) {
            return true;
        }
        let since = [
            Some(opened_at),
            self.progress.get(&peer).map(|p| p.at),
            self.silence.map(|(_, back)| back),
        ]
        .into_iter()
        .flatten()
        .fold(f64::NEG_INFINITY, f64::max);
        now - since < cfg.stall_after_s()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SyncConfig {
        SyncConfig {
            lease_s: 5.0,
            stall_s: 20.0,
            ..SyncConfig::default()
        }
    }

    #[test]
    fn a_member_whose_counter_stands_still_stalls_after_stall_s() {
        let c = cfg();
        let mut h = Hearing::new(0.0);
        for t in 1..=40 {
            h.heard(t as f64, &c);
            h.activity(0, t, t as f64); // trains
            h.activity(1, 7, t as f64); // live, but never moves past 7
        }
        assert!(h.progressing(0, 0.0, 40.0, &c));
        assert!(!h.progressing(1, 0.0, 40.0, &c), "no progress since t=1");
        assert!(
            h.progressing(1, 25.0, 40.0, &c),
            "the round opened 15 s ago"
        );
        h.progressed(1, 41.0);
        assert!(h.progressing(1, 0.0, 41.5, &c), "an upload began");
    }

    #[test]
    fn a_deaf_server_keeps_waiting_for_the_members_live_when_it_went_deaf() {
        let c = cfg();
        let mut h = Hearing::new(10.0);
        // Member A renewed at 10, B at 2 (already expired when the silence began at 10).
        let (a, b) = (10.0, 2.0);
        for now in [16.0, 20.0, 25.0] {
            assert!(h.presumed_live(a, now, &c), "deaf at {now}: A stays");
            assert!(!h.presumed_live(b, now, &c), "B was gone before");
            assert!(h.progressing(0, 0.0, now, &c));
        }
        // The server hears again at 25 (from someone else): A keeps its place for a lease.
        h.heard(25.0, &c);
        assert_eq!(h.silent_s(25.0, &c), 15.0);
        for t in 26..=29 {
            h.heard(t as f64, &c);
        }
        assert!(h.presumed_live(a, 29.9, &c));
        h.heard(30.0, &c);
        assert!(!h.presumed_live(a, 30.0, &c), "a lease after hearing again");
        for t in 31..=45 {
            h.heard(t as f64, &c);
        }
        assert!(h.progressing(0, 0.0, 44.9, &c), "stall counts from 25");
        assert!(!h.progressing(0, 0.0, 45.0, &c));
        // Gaps shorter than two heartbeats are no silence.
        let mut h = Hearing::new(0.0);
        h.heard(2.4, &c);
        h.heard(4.0, &c);
        assert!(
            !h.presumed_live(0.0, 5.0, &c),
            "others were heard: its lease ran out"
        );
        assert_eq!(h.silent_s(5.0, &c), 0.0);
        // A member whose lease runs out just before the server notices its silence: its last
        // heartbeat came a quarter lease before the last word the server heard, and the server
        // is deaf half a lease after that, before the member's lease ends.
        let mut h = Hearing::new(0.0);
        h.heard(10.0, &c);
        let b = 10.0 - c.lease_s / 4.0;
        for now in [12.0, 12.5, 13.75, 14.0] {
            assert!(h.presumed_live(b, now, &c), "at {now}");
        }
    }

    #[test]
    fn eviction_counts_only_the_time_the_server_could_hear() {
        let c = cfg();
        let mut h = Hearing::new(0.0);
        for t in 1..=10 {
            h.heard(t as f64, &c);
        }
        // Deaf from 10 to 40; a member last heard at 9 is unheard for 1 s before the silence
        // and for what passed since the server heard again.
        h.heard(40.0, &c);
        assert_eq!(h.unheard_s(9.0, 40.0, &c), 1.0);
        assert_eq!(h.unheard_s(9.0, 43.5, &c), 4.5);
        // A member heard after the silence, or whose lease ran out before it, counts plainly.
        assert_eq!(h.unheard_s(41.0, 43.0, &c), 2.0);
        assert_eq!(h.unheard_s(2.0, 43.0, &c), 41.0);
    }
}
