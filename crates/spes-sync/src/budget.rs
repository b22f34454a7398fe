//! Rounds by tokens (`sync.round_by = "tokens"`, [`crate::RoundBy`]): how the server splits a
//! round's rows among its members by the throughput each one measured, and how a node spreads
//! its share over the round's steps. Pure functions of what the round record holds, so every
//! server shard, and a restarted server, computes the same split.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a node trained in a round, as its upload reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Work {
    /// Rows (sequences) trained in the round, every rank's; 0: not reported.
    pub rows: u64,
    /// Seconds spent training them (the steps alone, not waiting for the server).
    pub compute_s: f64,
}

impl Work {
    /// Rows trained per second, when measured.
    pub fn rows_per_s(&self) -> Option<f64> {
        let r = self.rows as f64 / self.compute_s;
        (self.rows > 0 && self.compute_s > 0.0 && r.is_finite()).then_some(r)
    }
}

/// Splits `total` rows among `members` in proportion to the throughput each measured in `work`,
/// each at least `floor` (so every step has a row), summing to `total` exactly. A member with
/// no measurement (a joiner, a node that missed the round) counts at the median of the
/// measured ones; with none measured the shares are equal. Fractions go to the largest
/// remainders, ties to the earlier member.
pub fn split(total: u64, floor: u64, members: &[usize], work: &BTreeMap<usize, Work>) -> Vec<u64> {
    let n = members.len();
    if n == 0 {
        return Vec::new();
    }
    let speed = speeds(members, work).unwrap_or_else(|| vec![1.0; n]);
    if total < floor * n as u64 {
        return equal(total, n);
    }
    // Members whose proportional share falls below the floor get the floor; the rest share
    // what is left in proportion, until no share is below it.
    let mut pinned = vec![false; n];
    let raw = loop {
        let free: f64 = (0..n).filter(|&i| !pinned[i]).map(|i| speed[i]).sum();
        let left = (total - floor * pinned.iter().filter(|&&p| p).count() as u64) as f64;
        let raw: Vec<f64> = (0..n)
            .map(|i| {
                if pinned[i] {
                    floor as f64
                } else {
                    left * speed[i] / free
                }
            })
            .collect();
        let low: Vec<usize> = (0..n)
            .filter(|&i| !pinned[i] && raw[i] < floor as f64)
            .collect();
        if low.is_empty() {
            break raw;
        }
        for i in low {
            pinned[i] = true;
        }
    };
    let mut shares: Vec<u64> = raw.iter().map(|r| r.floor() as u64).collect();
    let short = total.saturating_sub(shares.iter().sum());
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| (raw[b] - raw[b].floor()).total_cmp(&(raw[a] - raw[a].floor())));
    for &i in order.iter().take(short as usize) {
        shares[i] += 1;
    }
    shares
}

/// Each member's rows per second in `work`, a member with no measurement (a joiner, a node
/// that missed the round) at the median of the measured ones; `None` when none is measured.
pub fn speeds(members: &[usize], work: &BTreeMap<usize, Work>) -> Option<Vec<f64>> {
    let mut measured: Vec<f64> = members
        .iter()
        .filter_map(|p| work.get(p).and_then(Work::rows_per_s))
        .collect();
    measured.sort_by(f64::total_cmp);
    let median = *measured.get(measured.len() / 2)?;
    Some(
        members
            .iter()
            .map(|p| work.get(p).and_then(Work::rows_per_s).unwrap_or(median))
            .collect(),
    )
}

fn equal(total: u64, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| step_rows(total, n as u64, i))
        .collect()
}

/// Rows of step `k` (from 0) of a round of `steps` steps that trains `rows` rows: as even as
/// possible, the larger steps first.
pub fn step_rows(rows: u64, steps: u64, k: u64) -> u64 {
    rows / steps + u64::from(k < rows % steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(list: &[(usize, u64, f64)]) -> BTreeMap<usize, Work> {
        list.iter()
            .map(|&(p, rows, compute_s)| (p, Work { rows, compute_s }))
            .collect()
    }

    #[test]
    fn shares_follow_throughput_and_sum_to_the_round() {
        // Three nodes at 4 rows/s, one at 2: the slow one gets half a fast one's share.
        let w = work(&[(0, 20, 5.0), (1, 20, 5.0), (2, 20, 5.0), (3, 20, 10.0)]);
        let s = split(80, 5, &[0, 1, 2, 3], &w);
        assert_eq!(s.iter().sum::<u64>(), 80);
        assert_eq!(s, vec![23, 23, 23, 11]);
        // Every node then takes 23/4 ≈ 11/2 ≈ 5.7 s: the round is even.
    }

    #[test]
    fn unmeasured_members_count_at_the_median_and_nobody_drops_below_the_floor() {
        let w = work(&[(0, 20, 1.0), (1, 20, 2.0), (2, 20, 100.0)]);
        let s = split(80, 5, &[0, 1, 2, 7], &w);
        assert_eq!(s.iter().sum::<u64>(), 80);
        assert_eq!(s[2], 5, "{s:?}");
        // Peer 7 (a joiner) runs at the median, peer 1's 10 rows/s.
        assert_eq!(s[1], s[3], "{s:?}");
        assert!(s[0] > s[1], "{s:?}");
        // Nothing measured: equal shares; too few rows for the floor: as equal as can be.
        assert_eq!(split(80, 5, &[0, 1, 2], &BTreeMap::new()), vec![27, 27, 26]);
        assert_eq!(split(7, 5, &[0, 1], &w), vec![4, 3]);
        assert!(split(7, 5, &[], &w).is_empty());
    }

    #[test]
    fn a_round_of_rows_spreads_evenly_over_its_steps() {
        let per: Vec<u64> = (0..5).map(|k| step_rows(22, 5, k)).collect();
        assert_eq!(per, vec![5, 5, 4, 4, 4]);
        assert_eq!((0..5).map(|k| step_rows(20, 5, k)).sum::<u64>(), 20);
        assert_eq!(step_rows(20, 5, 4), 4);
    }
}
