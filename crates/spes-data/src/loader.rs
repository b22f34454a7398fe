//! A deterministic, resumable loader of `[batch, seq+1]` token windows over memory-mapped shards.
//!
//! Window `w` of a shard holds tokens `[w·seq, w·seq + seq + 1)`: consecutive windows overlap by
//! the one token that is the last target of one and the first input of the next. Each epoch
//! visits every window once in an order shuffled from `(seed, epoch)`, so the whole stream is a
//! function of the seed and a single position counter.

use crate::shard::{Manifest, Shard, ShardInfo};
use anyhow::{bail, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;

/// Shards of one split with the prefix sums of their window counts.
struct Windows {
    shards: Vec<Shard>,
    /// `first[i]` = index of shard i's first window; last entry = total windows.
    first: Vec<u64>,
    seq: usize,
}

impl Windows {
    fn open(dir: &Path, manifest: &Manifest, infos: &[ShardInfo], seq: usize) -> Result<Self> {
        let mut shards = Vec::with_capacity(infos.len());
        let mut first = vec![0u64];
        for info in infos {
            let shard = Shard::open(dir, info, manifest.dtype)?;
            let n = if shard.len() > seq as u64 {
                (shard.len() - 1) / seq as u64
            } else {
                0
            };
            first.push(first.last().unwrap() + n);
            shards.push(shard);
        }
        Ok(Windows { shards, first, seq })
    }

    fn count(&self) -> u64 {
        *self.first.last().unwrap()
    }

    fn read(&self, window: u64, out: &mut Vec<i64>) {
        let shard = self.first.partition_point(|&f| f <= window) - 1;
        let start = (window - self.first[shard]) * self.seq as u64;
        self.shards[shard].read_into(start, self.seq + 1, out);
    }
}

/// Training windows in a seeded shuffled order, resumable from any position.
pub struct Loader {
    windows: Windows,
    seed: u64,
    epoch: u64,
    order: Vec<u64>,
    position: u64,
}

impl Loader {
    /// Opens the train split of a `spes tokenize` directory at `position` windows consumed.
    pub fn open(dir: &Path, seq: usize, seed: u64, position: u64) -> Result<Self> {
        let manifest = Manifest::load(dir)?;
        let windows = Windows::open(dir, &manifest, &manifest.train, seq)?;
        if windows.count() == 0 {
            bail!(
                "{}: the train split has {} tokens in shards too short for one window of {} tokens",
                dir.display(),
                manifest.train_tokens,
                seq + 1
            );
        }
        let mut loader = Loader {
            windows,
            seed,
            epoch: u64::MAX,
            order: Vec::new(),
            position,
        };
        loader.shuffle_for(position);
        Ok(loader)
    }

    fn shuffle_for(&mut self, position: u64) {
        let epoch = position / self.windows.count();
        if epoch != self.epoch {
            self.order = (0..self.windows.count()).collect();
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
            rng.set_stream(epoch);
            self.order.shuffle(&mut rng);
            self.epoch = epoch;
        }
    }

    /// The next `batch` windows, row-major `[batch, seq+1]`.
    pub fn next_batch(&mut self, batch: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(batch * (self.windows.seq + 1));
        for _ in 0..batch {
            self.shuffle_for(self.position);
            let i = self.position % self.windows.count();
            self.windows.read(self.order[i as usize], &mut out);
            self.position += 1;
        }
        out
    }

    /// Windows consumed so far; pass it back to [`Loader::open`] to resume.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Windows in one epoch.
    pub fn windows_per_epoch(&self) -> u64 {
        self.windows.count()
    }
}

/// The validation split as consecutive, non-shuffled windows.
pub struct ValWindows {
    windows: Windows,
}

impl ValWindows {
    pub fn open(dir: &Path, seq: usize) -> Result<Self> {
        let manifest = Manifest::load(dir)?;
        let windows = Windows::open(dir, &manifest, &manifest.val, seq)?;
        if windows.count() == 0 {
            bail!(
                "{}: the validation split ({} tokens) is shorter than one window of {} tokens; \
                 tokenize with a larger --val-fraction",
                dir.display(),
                manifest.val_tokens,
                seq + 1
            );
        }
        Ok(ValWindows { windows })
    }

    /// Up to `max_batches` batches of `batch` windows, the last one possibly smaller.
    pub fn batches(&self, batch: usize, max_batches: usize) -> Vec<(usize, Vec<i64>)> {
        let total = self.windows.count().min((batch * max_batches) as u64);
        (0..total)
            .step_by(batch)
            .map(|start| {
                let n = (total - start).min(batch as u64);
                let mut out = Vec::with_capacity(n as usize * (self.windows.seq + 1));
                for w in start..start + n {
                    self.windows.read(w, &mut out);
                }
                (n as usize, out)
            })
            .collect()
    }
}
