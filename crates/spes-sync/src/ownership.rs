//! Which node owns (trains) which expert. The same expert indices in every layer (docs/design/algorithm.md §2).
//! Ownership is a per-round fact: when nodes leave or join, [`Ownership::rebalance`] moves as few
//! experts as possible so every member owns ⌊E/N⌋ or ⌈E/N⌉ of them.

use anyhow::{bail, Result};
use spes_model::Role;
use std::collections::BTreeSet;

/// `owner[e]` = the peer that trains expert index `e` in every layer.
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

    /// `owners()[e]` = the peer owning expert index `e`.
    pub fn owners(&self) -> &[usize] {
        &self.owner
    }

    /// Peers that own at least one expert.
    pub fn members(&self) -> BTreeSet<usize> {
        self.owner.iter().copied().collect()
    }

    /// The ownership for `members`, moving as few experts as possible: experts of non-members
    /// and the surplus of members above their share go, lowest index first, to the members
    /// below their share, lowest peer id first. Shares differ by at most one; the larger shares
    /// go to the members that already hold the most (ties: lower peer id). Deterministic.
    pub fn rebalance(&self, members: &BTreeSet<usize>) -> Result<Self> {
        let e = self.owner.len();
        let m = members.len();
        if m == 0 || m > e {
            bail!("cannot split {e} experts over {m} nodes: need 1..={e} nodes");
        }
        let held = |p: usize| self.owner.iter().filter(|&&o| o == p).count();
        let mut by_load: Vec<usize> = members.iter().copied().collect();
        by_load.sort_by_key(|&p| (std::cmp::Reverse(held(p)), p));
        let share = |p: usize| {
            let rank = by_load.iter().position(|&q| q == p).expect("a member");
            e / m + usize::from(rank < e % m)
        };
        let mut owner = self.owner.clone();
        let mut pool: Vec<usize> = Vec::new();
        for (i, o) in owner.iter().enumerate() {
            if !members.contains(o) {
                pool.push(i);
            }
        }
        for &p in members {
            let mine: Vec<usize> = (0..e).filter(|&i| owner[i] == p).collect();
            let surplus = mine.len().saturating_sub(share(p));
            pool.extend(mine.iter().rev().take(surplus));
        }
        pool.sort_unstable();
        let mut pool = pool.into_iter();
        for &p in members {
            let have = owner.iter().filter(|&&o| o == p).count();
            for _ in have..share(p) {
                let i = pool.next().expect("shares add up to the expert count");
                owner[i] = p;
            }
        }
        Ok(Ownership { owner })
    }

    /// Every expert passes to the next member in peer order (the last member's to the first),
    /// so over `members` rotations each expert is trained on every member's data.
    pub fn rotated(&self) -> Self {
        let members: Vec<usize> = self.members().into_iter().collect();
        let next = |o: usize| {
            let i = members.iter().position(|&m| m == o).expect("an owner");
            members[(i + 1) % members.len()]
        };
        Ownership {
            owner: self.owner.iter().map(|&o| next(o)).collect(),
        }
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
        let r = o.rebalance(&BTreeSet::from([0, 2, 3])).unwrap();
        assert_eq!(r.members(), BTreeSet::from([0, 2, 3]));
        let counts: Vec<usize> = [0, 2, 3].iter().map(|&p| r.experts_of(p).len()).collect();
        assert_eq!(counts, vec![6, 5, 5]);
        for p in [0, 2, 3] {
            for x in o.experts_of(p) {
                assert_eq!(r.owner_of(x), p, "expert {x} stayed with its live owner");
            }
        }
        assert_eq!(r, o.rebalance(&BTreeSet::from([0, 2, 3])).unwrap());
        // Peer 7 joins: it takes the surplus of the fullest members, nothing else moves.
        let j = r.rebalance(&BTreeSet::from([0, 2, 3, 7])).unwrap();
        let counts: Vec<usize> = [0, 2, 3, 7]
            .iter()
            .map(|&p| j.experts_of(p).len())
            .collect();
        assert_eq!(counts, vec![4, 4, 4, 4]);
        let moved = (0..16).filter(|&x| j.owner_of(x) != r.owner_of(x)).count();
        assert_eq!(moved, 4);
        // Every expert keeps exactly one owner, and the same members give the same map.
        assert_eq!(j.owners().len(), 16);
        assert_eq!(j.rebalance(&j.members()).unwrap(), j);
        assert!(o.rebalance(&BTreeSet::new()).is_err());
    }

    #[test]
    fn rotation_passes_blocks_along_and_covers_every_member() {
        let o = Ownership::contiguous(6, 3)
            .unwrap()
            .rebalance(&BTreeSet::from([0, 2, 5]))
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
}
