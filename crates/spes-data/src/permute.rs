//! A seeded permutation of `0..n` computed one index at a time, so an epoch's shuffled order
//! costs no memory however many windows the corpus has: a balanced Feistel network over the
//! smallest even power of two ≥ n, walking the cycle until it lands inside `0..n`.

/// Feistel rounds; four make a keyed bijection whose output passes as shuffled for data order.
const ROUNDS: u64 = 4;

/// The permutation of `0..n` for one `(seed, epoch)`.
#[derive(Clone, Copy, Debug)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    key: u64,
}

impl Permutation {
    pub fn new(n: u64, seed: u64, epoch: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let key = xxhash_rust::xxh3::xxh3_64_with_seed(&epoch.to_le_bytes(), seed);
        Permutation { n, half_bits, key }
    }

    /// The `i`-th element of the shuffled order (`i < n`).
    pub fn at(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        // The domain is at most 4n, so the walk takes fewer than four steps on average.
        let mut x = self.feistel(i);
        while x >= self.n {
            x = self.feistel(x);
        }
        x
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for round in 0..ROUNDS {
            let mut input = [0u8; 16];
            input[..8].copy_from_slice(&right.to_le_bytes());
            input[8..].copy_from_slice(&round.to_le_bytes());
            let f = xxhash_rust::xxh3::xxh3_64_with_seed(&input, self.key) & mask;
            (left, right) = (right, left ^ f);
        }
        (left << self.half_bits) | right
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_permutation_for_awkward_sizes() {
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let p = Permutation::new(n, 11, 3);
            let mut seen: Vec<u64> = (0..n).map(|i| p.at(i)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
    }

    #[test]
    fn differs_by_seed_and_epoch_and_shuffles() {
        let n = 10_000;
        let order = |seed, epoch| -> Vec<u64> {
            let p = Permutation::new(n, seed, epoch);
            (0..n).map(|i| p.at(i)).collect()
        };
        let a = order(1, 0);
        assert_ne!(a, order(2, 0));
        assert_ne!(a, order(1, 1));
        assert_eq!(a, order(1, 0));
        // Shuffled, not shifted: few elements stay in place and neighbours do not stay together.
        let fixed = a
            .iter()
            .enumerate()
            .filter(|(i, &x)| *i as u64 == x)
            .count();
        assert!(fixed < 20, "{fixed} fixed points");
        let adjacent = a.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(adjacent < 20, "{adjacent} neighbours kept");
    }
}
