//! Which node owns (trains) which expert. The same expert indices in every layer (docs/design/algorithm.md §2).
//! Ownership is a per-round fact: when nodes leave or join, or their claims change,
//! [`Ownership::rebalance`] moves as few experts as possible so every member owns its share:
//! ⌊E/N⌋ or ⌈E/N⌉ of them when all claim alike, else in proportion to each member's weight
//! (its throughput) and never more than its cap (the experts its memory holds), see [`shares`].

use anyhow::{bail, Result};
use spes_model::Role;
use std::collections::{BTreeMap, BTreeSet};

/// The owner of an expert that no member has room for: nobody trains it, so it keeps its value
/// until a member with room joins. Fits the wire's `uint32` and JSON.
pub const UNOWNED: usize = u32::MAX as usize;

/// What members claim of the experts: a weight in the split (its throughput; 1 when not
/// measured) and a cap (the most experts its memory holds). A member not listed claims a
/// weight of 1 and no cap, so `Claims::default()` splits evenly.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Claims {
    pub weight: BTreeMap<usize, f64>,
    pub cap: BTreeMap<usize, usize>,
}

impl Claims {
    /// Member `p`'s weight in the split (finite and positive, else 1).
    pub fn weight(&self, p: usize) -> f64 {
        self.weight
            .get(&p)
            .copied()
            .filter(|w| w.is_finite() && *w > 0.0)
            .unwrap_or(1.0)
    }

    /// The most experts member `p` can own.
    pub fn cap(&self, p: usize) -> usize {
        self.cap.get(&p).copied().unwrap_or(usize::MAX)
    }
}

/// Each member's exact share of `e` experts under `claims`: one expert each, then the rest in
/// proportion to the weights, a member whose quota passes its cap keeping its cap and the
/// others splitting what is left (water-filling). They sum to `e`, or to the caps when those
/// do not cover `e`.
fn quotas(e: usize, members: &BTreeSet<usize>, claims: &Claims) -> BTreeMap<usize, f64> {
    let mut quota = BTreeMap::new();
    let mut open: Vec<usize> = members.iter().copied().collect();
    let mut rest = (e - members.len()) as f64;
    loop {
        let total: f64 = open.iter().map(|&p| claims.weight(p)).sum();
        let extra = |p: usize| rest * claims.weight(p) / total;
        let (capped, free): (Vec<usize>, Vec<usize>) = open
            .iter()
            .partition(|&&p| extra(p) >= (claims.cap(p) - 1) as f64);
        if capped.is_empty() {
            for p in free {
                quota.insert(p, 1.0 + extra(p));
            }
            return quota;
        }
        for &p in &capped {
            quota.insert(p, claims.cap(p) as f64);
            rest -= (claims.cap(p) - 1) as f64;
        }
        open = free;
        if open.is_empty() {
            return quota;
        }
    }
}

/// Each member's share of the `owner.len()` experts under `claims`: its quota (one expert
/// each, the rest by weight within the caps) rounded by largest remainder; equal remainders
/// favour the members that hold the most now, then the lower peer id. Equal claims give
/// ⌊E/N⌋ or ⌈E/N⌉. Shares sum to fewer than E only when the caps do.
pub fn shares(
    owner: &[usize],
    members: &BTreeSet<usize>,
    claims: &Claims,
) -> Result<BTreeMap<usize, usize>> {
    let (e, m) = (owner.len(), members.len());
    if m == 0 || m > e {
        bail!("cannot split {e} experts over {m} nodes: need 1..={e} nodes");
    }
    if let Some(p) = members.iter().find(|&&p| claims.cap(p) == 0) {
        bail!("node {p} has room for no expert: every member must own at least one");
    }
    let held = |p: usize| owner.iter().filter(|&&o| o == p).count();
    let mut by_load: Vec<usize> = members.iter().copied().collect();
    by_load.sort_by_key(|&p| (std::cmp::Reverse(held(p)), p));
    let quota = quotas(e, members, claims);
    let covered = members
        .iter()
        .fold(0usize, |n, &p| n.saturating_add(claims.cap(p)))
        .min(e);
    let mut share: BTreeMap<usize, usize> = quota
        .iter()
        .map(|(&p, q)| (p, (q.floor() as usize).min(claims.cap(p))))
        .collect();
    let given: usize = share.values().sum();
    let mut order: Vec<(f64, usize, usize)> = by_load
        .iter()
        .enumerate()
        .filter(|&(_, &p)| share[&p] < claims.cap(p))
        .map(|(rank, &p)| (quota[&p] - quota[&p].floor(), rank, p))
        .collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, _, p) in order.iter().take(covered.saturating_sub(given)) {
        *share.get_mut(&p).expect("a member") += 1;
    }
    Ok(share)
}

/// `owner[e]` = the peer that trains expert index `e` in every layer, or [`UNOWNED`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    owner: Vec<usize>,
}

impl Ownership {
    /// Contiguous blocks: peer p owns `p·E/N .. (p+1)·E/N` (rounded down), so uneven splits
    /// differ by at most one expert.
    pub fn contiguous(n_experts: usize, peers: usize) -> Result<Self> {
        if peers == 0 || peers > n_experts {
            bail!(
                "cannot split {n_experts} experts over {peers} nodes: need 1..={n_experts} nodes"
            );
        }
        let owner = (0..n_experts).map(|e| e * peers / n_experts).collect();
        Ok(Ownership { owner })
    }

    /// An explicit map, `map[p]` = expert indices of peer p. Must cover every expert exactly once.
    pub fn from_map(map: &[Vec<usize>], n_experts: usize) -> Result<Self> {
        let mut owner = vec![usize::MAX; n_experts];
        for (p, experts) in map.iter().enumerate() {
            if experts.is_empty() {
                bail!("sync.ownership[{p}] is empty: every node must own at least one expert");
            }
            for &e in experts {
                if e >= n_experts {
                    bail!("sync.ownership[{p}] names expert {e}, but the model has {n_experts} (0..{n_experts})");
                }
                if owner[e] != usize::MAX {
                    bail!(
                        "sync.ownership: expert {e} is owned by both node {} and node {p}",
                        owner[e]
                    );
                }
                owner[e] = p;
            }
        }
        if let Some(e) = owner.iter().position(|&o| o == usize::MAX) {
            bail!("sync.ownership does not cover expert {e}: every expert needs exactly one owner");
        }
        Ok(Ownership { owner })
    }

    /// The config's map if given (its length must equal `peers`), else contiguous blocks.
    pub fn resolve(map: &[Vec<usize>], n_experts: usize, peers: usize) -> Result<Self> {
        if map.is_empty() {
            return Self::contiguous(n_experts, peers);
        }
        if map.len() != peers {
            bail!(
                "sync.ownership lists {} nodes but sync.nodes is {peers}",
                map.len()
            );
        }
        Self::from_map(map, n_experts)
    }

    /// An owner list as sent on the wire or persisted (`owners[e]` = peer of expert e).
    pub fn from_owners(owners: Vec<usize>) -> Result<Self> {
        if owners.is_empty() {
            bail!("an ownership map needs at least one expert");
        }
        Ok(Ownership { owner: owners })
    }

    /// `owners()[e]` = the peer owning expert index `e`, or [`UNOWNED`].
    pub fn owners(&self) -> &[usize] {
        &self.owner
    }

    /// Peers that own at least one expert.
    pub fn members(&self) -> BTreeSet<usize> {
        self.owner
            .iter()
            .copied()
            .filter(|&o| o != UNOWNED)
            .collect()
    }

    /// Experts nobody trains: the members' caps did not cover them ([`UNOWNED`]).
    pub fn unowned(&self) -> Vec<usize> {
        self.experts_of(UNOWNED)
    }

    /// The ownership for `members` under `claims`, moving as few experts as possible: each
    /// member's share is [`shares`]; experts of non-members (and unowned ones) and the surplus
    /// of members above their share go, lowest index first, to the members below their share,
    /// lowest peer id first; what no member has room for stays [`UNOWNED`]. Deterministic.
    pub fn rebalance(&self, members: &BTreeSet<usize>, claims: &Claims) -> Result<Self> {
        let e = self.owner.len();
        let target = shares(&self.owner, members, claims)?;
        let mut owner = self.owner.clone();
        let mut pool: Vec<usize> = Vec::new();
        for (i, o) in owner.iter().enumerate() {
            if !members.contains(o) {
                pool.push(i);
            }
        }
        for &p in members {
            let mine: Vec<usize> = (0..e).filter(|&i| owner[i] == p).collect();
            let surplus = mine.len().saturating_sub(target[&p]);
            pool.extend(mine.iter().rev().take(surplus));
        }
        pool.sort_unstable();
        let mut pool = pool.into_iter();
        for &p in members {
            let have = owner.iter().filter(|&&o| o == p).count();
            for _ in have..target[&p] {
                let i = pool.next().expect("shares never exceed the experts");
                owner[i] = p;
            }
        }
        for i in pool {
            owner[i] = UNOWNED;
        }
        Ok(Ownership { owner })
    }

    /// Whether this ownership strays from what `claims` ask of its members: a member holds
    /// more than its cap, an unowned expert has a member with room, or, when the claims weigh
    /// members, a member's count is a whole expert or more from its exact quota (so noise in
    /// the weights moves nothing). Without weights a split stays as it is (an explicit
    /// `sync.ownership` too) until members change.
    pub fn strays_from(&self, claims: &Claims) -> bool {
        let members = self.members();
        let roomless = members.iter().any(|&p| claims.cap(p) == 0);
        if members.is_empty() || members.len() > self.owner.len() || roomless {
            return false;
        }
        let quota = quotas(self.owner.len(), &members, claims);
        let unowned = self.owner.contains(&UNOWNED);
        members.iter().any(|&p| {
            let have = self.experts_of(p).len();
            let cap = claims.cap(p);
            let off = !claims.weight.is_empty() && (have as f64 - quota[&p]).abs() >= 1.0;
            have > cap || (unowned && have < cap) || off
        })
    }

    /// Every member's experts pass to the next member in peer order (the last member's to
    /// the first), each member keeping its count: members' experts in peer order, shifted by
    /// the last member's count, are dealt out again. With equal counts each expert is trained
    /// on every member's data over `members` rotations. Unowned experts stay unowned.
    pub fn rotated(&self) -> Self {
        let members: Vec<usize> = self.members().into_iter().collect();
        let mut order: Vec<usize> = members.iter().flat_map(|&p| self.experts_of(p)).collect();
        let last = members.last().map_or(0, |&p| self.experts_of(p).len());
        order.rotate_right(last);
        let mut owner = self.owner.clone();
        let mut order = order.into_iter();
        for &p in &members {
            for _ in 0..self.experts_of(p).len() {
                owner[order.next().expect("as many experts as before")] = p;
            }
        }
        Ownership { owner }
    }

    /// The peer owning expert index `e`.
    pub fn owner_of(&self, e: usize) -> usize {
        self.owner[e]
    }

    /// Expert indices owned by `peer`, ascending.
    pub fn experts_of(&self, peer: usize) -> Vec<usize> {
        (0..self.owner.len())
            .filter(|&e| self.owner[e] == peer)
            .collect()
    }

    /// Whether `peer` trains a parameter of this role: shared ones always, experts it owns.
    pub fn trains(&self, peer: usize, role: Role) -> bool {
        match role {
            Role::Shared => true,
            Role::Expert { index, .. } => self.owner[index] == peer,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_blocks_even_and_uneven() {
        let o = Ownership::contiguous(16, 4).unwrap();
        assert_eq!(o.experts_of(1), vec![4, 5, 6, 7]);
        let o = Ownership::contiguous(10, 4).unwrap();
        let sizes: Vec<usize> = (0..4).map(|p| o.experts_of(p).len()).collect();
        assert_eq!(sizes, vec![3, 2, 3, 2]);
        assert_eq!(sizes.iter().sum::<usize>(), 10);
        assert!(Ownership::contiguous(3, 4).is_err());
    }

    #[test]
    fn explicit_maps_must_cover_every_expert_once() {
        let o = Ownership::from_map(&[vec![3, 0], vec![1, 2]], 4).unwrap();
        assert_eq!(o.owner_of(3), 0);
        assert!(o.trains(0, Role::Expert { layer: 5, index: 0 }));
        assert!(!o.trains(0, Role::Expert { layer: 0, index: 1 }));
        assert!(o.trains(1, Role::Shared));
        let err = |m: &[Vec<usize>]| Ownership::from_map(m, 4).unwrap_err().to_string();
        assert!(err(&[vec![0, 1], vec![1, 2, 3]]).contains("expert 1 is owned by both"));
        assert!(err(&[vec![0, 1], vec![2]]).contains("does not cover expert 3"));
        assert!(err(&[vec![0, 1, 2, 3, 4], vec![]]).contains("names expert 4"));
        assert_eq!(o.members(), BTreeSet::from([0, 1]));
        let e = Ownership::resolve(&[vec![0, 1, 2, 3]], 4, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sync.nodes is 2"), "{e}");
    }

    #[test]
    fn rebalance_moves_few_experts_and_balances() {
        let o = Ownership::contiguous(16, 4).unwrap();
        // Peer 1 is gone: its 4 experts spread over 0, 2, 3 (shares 6, 5, 5).
        let r = o
            .rebalance(&BTreeSet::from([0, 2, 3]), &Claims::default())
            .unwrap();
        assert_eq!(r.members(), BTreeSet::from([0, 2, 3]));
        let counts: Vec<usize> = [0, 2, 3].iter().map(|&p| r.experts_of(p).len()).collect();
        assert_eq!(counts, vec![6, 5, 5]);
        for p in [0, 2, 3] {
            for x in o.experts_of(p) {
                assert_eq!(r.owner_of(x), p, "expert {x} stayed with its live owner");
            }
        }
        assert_eq!(
            r,
            o.rebalance(&BTreeSet::from([0, 2, 3]), &Claims::default())
                .unwrap()
        );
        // Peer 7 joins: it takes the surplus of the fullest members, nothing else moves.
        let j = r
            .rebalance(&BTreeSet::from([0, 2, 3, 7]), &Claims::default())
            .unwrap();
        let counts: Vec<usize> = [0, 2, 3, 7]
            .iter()
            .map(|&p| j.experts_of(p).len())
            .collect();
        assert_eq!(counts, vec![4, 4, 4, 4]);
        let moved = (0..16).filter(|&x| j.owner_of(x) != r.owner_of(x)).count();
        assert_eq!(moved, 4);
        // Every expert keeps exactly one owner, and the same members give the same map.
        assert_eq!(j.owners().len(), 16);
        assert_eq!(j.rebalance(&j.members(), &Claims::default()).unwrap(), j);
        assert!(o.rebalance(&BTreeSet::new(), &Claims::default()).is_err());
    }

    #[test]
    fn rotation_passes_blocks_along_and_covers_every_member() {
        let o = Ownership::contiguous(6, 3)
            .unwrap()
            .rebalance(&BTreeSet::from([0, 2, 5]), &Claims::default())
            .unwrap();
        let start = o.clone();
        let mut seen: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); 6];
        let mut r = o;
        for _ in 0..3 {
            for (e, s) in seen.iter_mut().enumerate() {
                s.insert(r.owner_of(e));
            }
            let next = r.rotated();
            for p in [0, 2, 5] {
                assert_eq!(next.experts_of(p).len(), 2, "shares are kept");
            }
            assert_eq!(next.members(), r.members());
            r = next;
        }
        assert!(seen.iter().all(|s| *s == BTreeSet::from([0, 2, 5])));
        assert_eq!(r, start, "three rotations come back to the start");
        let first = start.rotated();
        assert_eq!(first.experts_of(2), start.experts_of(0));
        assert_eq!(first.experts_of(0), start.experts_of(5));
    }

    fn counts(o: &Ownership, peers: &[usize]) -> Vec<usize> {
        peers.iter().map(|&p| o.experts_of(p).len()).collect()
    }

    #[test]
    fn caps_bound_shares_and_the_rest_is_split_by_weight() {
        let o = Ownership::contiguous(16, 4).unwrap();
        let all = BTreeSet::from([0, 1, 2, 3]);
        // Node 3's memory holds 2 experts: the others share its surplus.
        let half = Claims {
            cap: BTreeMap::from([(3, 2)]),
            ..Claims::default()
        };
        let r = o.rebalance(&all, &half).unwrap();
        assert_eq!(counts(&r, &[0, 1, 2, 3]), vec![5, 5, 4, 2]);
        assert_eq!(
            r.experts_of(3),
            vec![12, 13],
            "it keeps the lowest of its own"
        );
        assert!(o.strays_from(&half) && !r.strays_from(&half));
        // Throughput 1 : 2 : 2 : 2 — the slow node owns fewer; one expert each first.
        let slow = Claims {
            weight: BTreeMap::from([(0, 1.0), (1, 2.0), (2, 2.0), (3, 2.0)]),
            ..Claims::default()
        };
        let t = o.rebalance(&all, &slow).unwrap();
        assert_eq!(counts(&t, &[0, 1, 2, 3]), vec![3, 5, 4, 4]);
        assert!(o.strays_from(&slow), "4 against a quota of 2.7");
        assert!(!t.strays_from(&slow));
        // Noise of less than one expert moves nothing.
        let noisy = Claims {
            weight: BTreeMap::from([(0, 1.1), (1, 2.0), (2, 1.9), (3, 2.1)]),
            ..Claims::default()
        };
        assert!(!t.strays_from(&noisy));
        assert!(!o.strays_from(&Claims::default()), "even shares stay");
        // Equal claims are today's split exactly.
        assert_eq!(
            o.rebalance(&BTreeSet::from([0, 2, 3]), &Claims::default())
                .unwrap(),
            o.rebalance(
                &BTreeSet::from([0, 2, 3]),
                &Claims {
                    weight: BTreeMap::from([(0, 3.0), (2, 3.0), (3, 3.0)]),
                    ..Claims::default()
                }
            )
            .unwrap()
        );
    }

    #[test]
    fn experts_beyond_every_cap_stay_unowned_until_room_returns() {
        let o = Ownership::contiguous(8, 2).unwrap();
        let small = Claims {
            cap: BTreeMap::from([(0, 3), (1, 2)]),
            ..Claims::default()
        };
        let r = o.rebalance(&BTreeSet::from([0, 1]), &small).unwrap();
        assert_eq!(counts(&r, &[0, 1]), vec![3, 2]);
        assert_eq!(r.unowned(), vec![3, 6, 7]);
        assert_eq!(r.members(), BTreeSet::from([0, 1]));
        assert!(!r.strays_from(&small));
        // A node with room joins: it takes the unowned experts, nothing else moves.
        let more = Claims {
            cap: BTreeMap::from([(0, 3), (1, 2)]),
            ..Claims::default()
        };
        let j = r.rebalance(&BTreeSet::from([0, 1, 5]), &more).unwrap();
        assert_eq!(counts(&j, &[0, 1, 5]), vec![3, 2, 3]);
        assert!(j.unowned().is_empty());
        assert_eq!(j.experts_of(5), vec![3, 6, 7]);
        // Rotation keeps counts and leaves unowned experts alone.
        let rot = r.rotated();
        assert_eq!(counts(&rot, &[0, 1]), vec![3, 2]);
        assert_eq!(rot.unowned(), r.unowned());
        let zero = Claims {
            cap: BTreeMap::from([(1, 0)]),
            ..Claims::default()
        };
        let e = o.rebalance(&BTreeSet::from([0, 1]), &zero).unwrap_err();
        assert!(
            e.to_string().contains("node 1 has room for no expert"),
            "{e}"
        );
    }
}
