//! Who is in the run: the leases nodes hold, who is joining, who was evicted, the caps nodes
//! declared, who sits the open round out and who owned each expert the round before. The
//! [`Coordinator`](super::Coordinator) asks it whom a round waits for and whom a close evicts
//! and admits; it holds no tensors. Time is passed in.

use super::RoundError;
use crate::config::SyncConfig;
use crate::hearing::Hearing;
use crate::round::Scope;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Copy, Debug)]
struct Lease {
    /// Process instance holding the peer id; 0 = not known yet (after a server restart).
    session: u64,
    renewed: f64,
}

/// Membership beyond the open round's scope, which the coordinator's aggregator holds.
#[derive(Debug)]
pub(crate) struct Members {
    leases: BTreeMap<usize, Lease>,
    /// Who was heard and who made progress: whom the open round waits for besides the leases.
    hearing: Hearing,
    /// The server's silent seconds when the open round opened.
    silent_at_open: f64,
    joining: BTreeSet<usize>,
    /// Evicted peers; one that comes back is admitted again like a joiner.
    gone: BTreeSet<usize>,
    /// The most experts each node that declared one can own (persisted).
    caps: BTreeMap<usize, usize>,
    /// Members sitting the open round out: their cap is below what they own in it.
    sitting_out: BTreeSet<usize>,
    /// `owners[e]` of the round before the open one (empty: not known).
    previous_owners: Vec<usize>,
}

/// Who leaves and who comes in at a round's close.
#[derive(Debug, PartialEq)]
pub(crate) struct Turnover {
    pub evicted: Vec<usize>,
    pub joined: Vec<usize>,
    /// The next round's members.
    pub next: BTreeSet<usize>,
}

impl Members {
    /// `members` with fresh leases of unknown session at `now` (a restarted server waits for
    /// its nodes to report instead of declaring them dead), the peers evicted so far and the
    /// caps nodes declared.
    pub fn new(
        members: BTreeSet<usize>,
        gone: BTreeSet<usize>,
        caps: BTreeMap<usize, usize>,
        now: f64,
    ) -> Members {
        let fresh = Lease {
            session: 0,
            renewed: now,
        };
        Members {
            leases: members.into_iter().map(|p| (p, fresh)).collect(),
            hearing: Hearing::new(now),
            silent_at_open: 0.0,
            joining: BTreeSet::new(),
            gone,
            caps,
            sitting_out: BTreeSet::new(),
            previous_owners: Vec::new(),
        }
    }

    /// Evicted peers (persisted, so a restart remembers them).
    pub fn gone(&self) -> &BTreeSet<usize> {
        &self.gone
    }

    /// The caps nodes declared (persisted).
    pub fn caps(&self) -> &BTreeMap<usize, usize> {
        &self.caps
    }

    /// Members sitting the open round out.
    pub fn sitting_out(&self) -> &BTreeSet<usize> {
        &self.sitting_out
    }

    /// `owners[e]` of the round before the open one (empty: not known).
    pub fn previous_owners(&self) -> &[usize] {
        &self.previous_owners
    }

    /// Sets [`Members::previous_owners`] (a restarted server, from its restart point).
    pub fn set_previous_owners(&mut self, owners: Vec<usize>) {
        self.previous_owners = owners;
    }

    /// Whether `peer` holds a current lease, member or not.
    pub fn is_live(&self, peer: usize, now: f64, cfg: &SyncConfig) -> bool {
        self.leases
            .get(&peer)
            .is_some_and(|l| now - l.renewed < cfg.lease_s)
    }

    /// Seconds since each lease holder last renewed its lease, expired ones included until
    /// they are evicted.
    pub fn lease_ages(&self, now: f64) -> BTreeMap<usize, f64> {
        self.leases
            .iter()
            .map(|(&p, l)| (p, (now - l.renewed).max(0.0)))
            .collect()
    }

    /// Takes or renews `peer`'s lease for process `session`: refused only while another live
    /// process holds the id.
    pub fn take_lease(
        &mut self,
        peer: usize,
        session: u64,
        now: f64,
        cfg: &SyncConfig,
    ) -> Result<(), RoundError> {
        self.hearing.heard(now, cfg);
        if let Some(l) = self.leases.get(&peer) {
            let age_s = now - l.renewed;
            let other = l.session != 0 && l.session != session;
            if other && age_s < cfg.lease_s {
                return Err(RoundError::PeerTaken {
                    peer,
                    age_s,
                    wait_s: cfg.lease_s - age_s,
                });
            }
        }
        let lease = Lease {
            session,
            renewed: now,
        };
        self.leases.insert(peer, lease);
        Ok(())
    }

    /// Records the cap `peer` declared, if it declared one.
    pub fn declare_cap(&mut self, peer: usize, cap: Option<usize>) {
        if let Some(c) = cap {
            self.caps.insert(peer, c);
        }
    }

    /// Whether member `peer` trains the open round of `scope` given its cap (else it sits the
    /// round out). The open round's ownership never changes here, so every server shard
    /// decides alike whatever order joins reach it in.
    pub fn trains_within_cap(&mut self, scope: &Scope, peer: usize) -> bool {
        let owns = match scope {
            Scope::Spes(o) => o.experts_of(peer).len(),
            Scope::Diloco { .. } => 0,
        };
        let cap = self.caps.get(&peer).copied().unwrap_or(usize::MAX);
        if owns > cap {
            self.sitting_out.insert(peer);
        }
        !self.sitting_out.contains(&peer)
    }

    /// Enlists `peer`, not a member of `scope`, to join: refused (its lease dropped) unless it
    /// asked to `join`, is joining already or was evicted, and while the run is full.
    pub fn enlist(&mut self, scope: &Scope, peer: usize, join: bool) -> Result<(), RoundError> {
        if !(join || self.joining.contains(&peer) || self.gone.contains(&peer)) {
            self.leases.remove(&peer);
            return Err(RoundError::NotMember { peer });
        }
        let members = scope.members().len();
        let max = scope.max_members();
        if !self.joining.contains(&peer) && members + self.joining.len() >= max {
            self.leases.remove(&peer);
            return Err(RoundError::RunFull { peer, members, max });
        }
        self.joining.insert(peer);
        Ok(())
    }

    /// Every joiner, admitted now (no longer gone).
    pub fn take_joiners(&mut self) -> BTreeSet<usize> {
        let joiners = std::mem::take(&mut self.joining);
        for p in &joiners {
            self.gone.remove(p);
        }
        joiners
    }

    /// `peer`'s heartbeat reported `activity` ([`crate::hearing`]); ignored without a lease.
    pub fn report_activity(&mut self, peer: usize, activity: u64, now: f64) {
        if self.leases.contains_key(&peer) {
            self.hearing.activity(peer, activity, now);
        }
    }

    /// `peer` made progress the server saw itself (an upload began).
    pub fn progressed(&mut self, peer: usize, now: f64) {
        self.hearing.progressed(peer, now);
    }

    /// Members of `scope` whose lease is current or ran out while the server itself heard
    /// nobody.
    pub fn presumed_live(&self, scope: &Scope, now: f64, cfg: &SyncConfig) -> BTreeSet<usize> {
        let mut members = scope.members();
        members.retain(|p| {
            self.leases
                .get(p)
                .is_some_and(|l| self.hearing.presumed_live(l.renewed, now, cfg))
        });
        members
    }

    /// The members of `scope` the round opened at `opened_at` waits for: presumed live, not
    /// sitting out, and making progress.
    pub fn waited(
        &self,
        scope: &Scope,
        opened_at: f64,
        now: f64,
        cfg: &SyncConfig,
    ) -> BTreeSet<usize> {
        self.training(scope, now, cfg, |p| {
            self.hearing.progressing(p, opened_at, now, cfg)
        })
    }

    /// Presumed-live members of `scope`, not sitting out, whose progress stalled since the
    /// round opened at `opened_at`.
    pub fn stalled(
        &self,
        scope: &Scope,
        opened_at: f64,
        now: f64,
        cfg: &SyncConfig,
    ) -> BTreeSet<usize> {
        self.training(scope, now, cfg, |p| {
            !self.hearing.progressing(p, opened_at, now, cfg)
        })
    }

    /// Presumed-live members of `scope`, not sitting out, that pass `keep`.
    fn training(
        &self,
        scope: &Scope,
        now: f64,
        cfg: &SyncConfig,
        keep: impl Fn(usize) -> bool,
    ) -> BTreeSet<usize> {
        let mut out = self.presumed_live(scope, now, cfg);
        out.retain(|&p| !self.sitting_out.contains(&p) && keep(p));
        out
    }

    /// The server's silent seconds since the open round opened: not counted toward its
    /// timeout.
    pub fn silent_since_open(&self, now: f64, cfg: &SyncConfig) -> f64 {
        self.hearing.silent_s(now, cfg) - self.silent_at_open
    }

    /// At the close of a round of `scope` at `now`: evicts the members neither presumed live
    /// nor heard for `lease_s + evict_after_s` of time the server could hear (never all of
    /// them: nobody would be left to adopt the experts) and admits joiners while there is room.
    pub fn turnover(&mut self, scope: &Scope, now: f64, cfg: &SyncConfig) -> Turnover {
        let members = scope.members();
        let presumed = self.presumed_live(scope, now, cfg);
        let expired = |p: &usize| {
            !presumed.contains(p)
                && self.leases.get(p).is_none_or(|l| {
                    self.hearing.unheard_s(l.renewed, now, cfg) >= cfg.lease_s + cfg.evict_after_s
                })
        };
        let mut evicted: Vec<usize> = members.iter().filter(|p| expired(p)).copied().collect();
        if evicted.len() == members.len() {
            evicted.clear();
        }
        let mut next: BTreeSet<usize> = members
            .iter()
            .filter(|p| !evicted.contains(p))
            .copied()
            .collect();
        let room = scope.max_members().saturating_sub(next.len());
        let joined: Vec<usize> = self.joining.iter().take(room).copied().collect();
        next.extend(&joined);
        for p in &joined {
            self.joining.remove(p);
            self.gone.remove(p);
        }
        for p in &evicted {
            self.gone.insert(*p);
            self.leases.remove(p);
            self.hearing.forget(*p);
        }
        Turnover {
            evicted,
            joined,
            next,
        }
    }

    /// The next round opens at `now` after one of `owners`: nobody sits it out yet.
    pub fn open_next(&mut self, owners: Vec<usize>, now: f64, cfg: &SyncConfig) {
        self.sitting_out.clear();
        self.previous_owners = owners;
        self.silent_at_open = self.hearing.silent_s(now, cfg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ownership::Ownership;

    fn cfg() -> SyncConfig {
        SyncConfig {
            lease_s: 2.0,
            evict_after_s: 3.0,
            ..SyncConfig::default()
        }
    }

    fn spes(nodes: usize, experts: usize) -> Scope {
        Scope::Spes(Ownership::resolve(&[], experts, nodes).unwrap())
    }

    #[test]
    fn a_lease_is_held_by_one_live_process_at_a_time() {
        let c = cfg();
        let mut m = Members::new(BTreeSet::from([0]), BTreeSet::new(), BTreeMap::new(), 0.0);
        assert!(m.is_live(0, 1.9, &c), "a restarted server's fresh lease");
        m.take_lease(0, 7, 1.0, &c).unwrap();
        let taken = m.take_lease(0, 8, 2.0, &c).unwrap_err();
        assert!(
            matches!(taken, RoundError::PeerTaken { peer: 0, .. }),
            "{taken:?}"
        );
        m.take_lease(0, 7, 2.5, &c).unwrap();
        assert!(!m.is_live(0, 4.5, &c));
        m.take_lease(0, 8, 4.5, &c)
            .expect("an expired lease passes to a new process");
        assert_eq!(m.lease_ages(5.0), BTreeMap::from([(0, 0.5)]));
    }

    #[test]
    fn joiners_are_enlisted_within_room_and_admitted_at_a_close() {
        let c = cfg();
        let scope = spes(2, 3);
        let mut m = Members::new(scope.members(), BTreeSet::new(), BTreeMap::new(), 0.0);
        assert_eq!(
            m.enlist(&scope, 5, false),
            Err(RoundError::NotMember { peer: 5 })
        );
        m.take_lease(2, 1, 0.5, &c).unwrap();
        m.enlist(&scope, 2, true).unwrap();
        m.take_lease(3, 1, 0.5, &c).unwrap();
        assert!(matches!(
            m.enlist(&scope, 3, true),
            Err(RoundError::RunFull { peer: 3, .. })
        ));
        assert!(!m.is_live(3, 0.6, &c), "a refused joiner keeps no lease");
        for p in 0..3 {
            m.take_lease(p, 1, 1.0, &c).unwrap();
        }
        let t = m.turnover(&scope, 1.5, &c);
        assert_eq!(t.joined, vec![2]);
        assert!(t.evicted.is_empty());
        assert_eq!(t.next, BTreeSet::from([0, 1, 2]));
    }

    #[test]
    fn a_close_evicts_the_long_unheard_but_never_everyone() {
        let c = cfg();
        let scope = spes(3, 3);
        let mut m = Members::new(scope.members(), BTreeSet::new(), BTreeMap::new(), 0.0);
        for t in 0..=10 {
            for p in [0, 1] {
                m.take_lease(p, 1, t as f64, &c).unwrap();
            }
        }
        let t = m.turnover(&scope, 10.0, &c);
        assert_eq!(t.evicted, vec![2], "unheard for 10 s > 2 + 3");
        assert!(m.gone().contains(&2) && !m.is_live(2, 10.0, &c));
        assert_eq!(t.next, BTreeSet::from([0, 1]));
        // Everyone unheard: nobody is evicted, or no one would be left to adopt the experts.
        let mut m = Members::new(scope.members(), BTreeSet::new(), BTreeMap::new(), 0.0);
        m.take_lease(0, 1, 0.0, &c).unwrap();
        assert!(m.turnover(&scope, 1.0, &c).evicted.is_empty());
        assert!(m.turnover(&scope, 100.0, &c).evicted.is_empty());
    }

    #[test]
    fn a_member_over_its_cap_sits_the_open_round_out() {
        let scope = spes(2, 4);
        let caps = BTreeMap::from([(1, 1)]);
        let mut m = Members::new(scope.members(), BTreeSet::new(), caps, 0.0);
        assert!(m.trains_within_cap(&scope, 0));
        assert!(!m.trains_within_cap(&scope, 1), "owns 2, room for 1");
        assert_eq!(m.sitting_out(), &BTreeSet::from([1]));
        m.open_next(scope.owners(), 1.0, &cfg());
        assert!(m.sitting_out().is_empty());
        assert_eq!(m.previous_owners(), scope.owners().as_slice());
    }
}
