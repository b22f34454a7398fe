//! Which node owns (trains) which expert. The same expert indices in every layer (SPES.md §2).

use anyhow::{bail, Result};
use spes_model::Role;

/// `owner[e]` = the peer that trains expert index `e` in every layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    owner: Vec<usize>,
    peers: usize,
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
        Ok(Ownership { owner, peers })
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
        Ok(Ownership {
            owner,
            peers: map.len(),
        })
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

    pub fn peers(&self) -> usize {
        self.peers
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
        let e = Ownership::resolve(&[vec![0, 1, 2, 3]], 4, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sync.nodes is 2"), "{e}");
    }
}
