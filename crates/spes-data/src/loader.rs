//! A deterministic, resumable loader of `[batch, seq+1]` token windows over memory-mapped token
//! files, from one tokenized directory or a weighted mixture of several.
//!
//! A split's runs of tokens are read as one stream; window `w` holds stream tokens
//! `[w·seq, w·seq + seq + 1)`, so consecutive windows overlap by the one token that is the last
//! target of one and the first input of the next, and the windows do not depend on how the
//! tokens are cut into files. Each epoch of a source visits its every window once, in an order
//! that a seeded [`Permutation`] computes index by index; a mixture picks the source of each
//! draw from a low-discrepancy sequence, so the whole stream is a function of the seed and one
//! position counter, and memory does not grow with the corpus.

use crate::permute::Permutation;
use crate::shard::{Manifest, Shard, ShardInfo};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One tokenized directory of a mixture and its share of the windows drawn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    pub path: PathBuf,
    #[serde(default = "one")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// The runs of one split read as one stream of tokens.
struct Windows {
    runs: Vec<Shard>,
    /// `first[i]` = stream index of run i's first token; last entry = total tokens.
    first: Vec<u64>,
    seq: usize,
}

impl Windows {
    fn open(dir: &Path, manifest: &Manifest, infos: &[ShardInfo], seq: usize) -> Result<Self> {
        let mut runs = Vec::with_capacity(infos.len());
        let mut first = vec![0u64];
        for info in infos {
            let run = Shard::open(dir, info, manifest.dtype)?;
            first.push(first.last().unwrap() + run.len());
            runs.push(run);
        }
        Ok(Windows { runs, first, seq })
    }

    fn tokens(&self) -> u64 {
        *self.first.last().unwrap()
    }

    fn count(&self) -> u64 {
        self.tokens().saturating_sub(1) / self.seq as u64
    }

    fn read(&self, window: u64, out: &mut Vec<i64>) {
        let mut at = window * self.seq as u64;
        let mut left = self.seq + 1;
        let mut run = self.first.partition_point(|&f| f <= at) - 1;
        while left > 0 {
            let offset = at - self.first[run];
            let n = ((self.runs[run].len() - offset) as usize).min(left);
            self.runs[run].read_into(offset, n, out);
            left -= n;
            at += n as u64;
            run += 1;
        }
    }
}

/// Which source each draw of a mixture comes from: draw `i` takes the source whose share of
/// `[0, 2^64)` holds `offset + i·φ·2^64` (the golden-ratio sequence), so every prefix of the
/// stream holds each source in proportion to its weight within a few draws.
#[derive(Clone, Debug)]
struct Schedule {
    /// Upper ends of the sources' shares; the last is `u64::MAX`.
    ends: Vec<u64>,
    offset: u64,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl Schedule {
    fn new(weights: &[f64], seed: u64) -> Self {
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let mut ends: Vec<u64> = weights
            .iter()
            .map(|w| {
                acc += w / total;
                (acc * u64::MAX as f64) as u64
            })
            .collect();
        *ends.last_mut().expect("at least one source") = u64::MAX;
        let offset = xxhash_rust::xxh3::xxh3_64_with_seed(b"mixture", seed);
        Schedule { ends, offset }
    }

    fn source_of(&self, i: u64) -> usize {
        let u = self.offset.wrapping_add(i.wrapping_mul(GOLDEN));
        self.ends
            .partition_point(|&e| e < u)
            .min(self.ends.len() - 1)
    }

    /// Draws of each source among the first `position`.
    fn counts_at(&self, position: u64) -> Vec<u64> {
        let mut counts = vec![0; self.ends.len()];
        if self.ends.len() == 1 {
            counts[0] = position;
        } else {
            (0..position).for_each(|i| counts[self.source_of(i)] += 1);
        }
        counts
    }
}

/// Checks a mixture's weights: each positive, and none so small it would never be drawn.
pub fn check_weights(sources: &[Source]) -> Result<()> {
    for s in sources {
        if !(s.weight.is_finite() && s.weight > 0.0) {
            bail!(
                "[data] source {}: weight must be a positive number, got {}",
                s.path.display(),
                s.weight
            );
        }
    }
    let total: f64 = sources.iter().map(|s| s.weight).sum();
    for s in sources {
        if s.weight / total < 1e-6 {
            bail!(
                "[data] source {}: weight {} is under a millionth of the total {total}: it \
                 would never be drawn",
                s.path.display(),
                s.weight
            );
        }
    }
    Ok(())
}

/// Opens every source's manifest and checks that they share one tokenizer.
fn open_sources(sources: &[Source]) -> Result<Vec<Manifest>> {
    if sources.is_empty() {
        bail!("[data]: no source to read");
    }
    check_weights(sources)?;
    let mut manifests: Vec<Manifest> = Vec::with_capacity(sources.len());
    for s in sources {
        let m = Manifest::load(&s.path)?;
        if let Some(first) = manifests.first() {
            if (m.tokenizer_xxh3.as_str(), m.eos_id)
                != (first.tokenizer_xxh3.as_str(), first.eos_id)
            {
                bail!(
                    "[data] sources {} and {} were tokenized with different tokenizers \
                     (checksums {} and {}); a mixture needs one",
                    sources[0].path.display(),
                    s.path.display(),
                    first.tokenizer_xxh3,
                    m.tokenizer_xxh3
                );
            }
        }
        manifests.push(m);
    }
    Ok(manifests)
}

/// The permutation seed of source `k`: a part of a corpus is seeded by its identity, so
/// whichever node reads it reads it in the same order; else the run's seed itself for the
/// first source (a single directory's order depends on the seed alone) and one derived from
/// its place for the others.
fn source_seed(seed: u64, k: usize, m: &Manifest) -> u64 {
    match m.part_id() {
        Some(id) => xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), seed),
        None if k == 0 => seed,
        None => xxhash_rust::xxh3::xxh3_64_with_seed(&(k as u64).to_le_bytes(), seed),
    }
}

/// Which draws of the seeded stream one reader takes: every `of`-th, from the `index`-th. The
/// `of` readers of one seed together read the stream a single reader would, each window once
/// an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Share {
    pub index: u64,
    pub of: u64,
}

impl Share {
    /// The whole stream.
    pub const WHOLE: Share = Share { index: 0, of: 1 };

    /// Whether this is the whole stream.
    pub fn is_whole(&self) -> bool {
        *self == Share::WHOLE
    }
}

impl Default for Share {
    fn default() -> Self {
        Share::WHOLE
    }
}

/// Training windows in a seeded shuffled order, resumable from any position.
pub struct Loader {
    sources: Vec<Windows>,
    /// Each source's permutation seed.
    seeds: Vec<u64>,
    schedule: Schedule,
    share: Share,
    /// Draws of each source among the stream's first `stream` draws (this reader's and the
    /// other readers' of its share).
    counts: Vec<u64>,
    stream: u64,
    /// Windows this reader drew from each source so far.
    drawn: Vec<u64>,
    /// Windows this reader consumed.
    position: u64,
}

impl Loader {
    /// Opens the train split of one `spes tokenize` directory at `position` windows consumed.
    pub fn open(dir: &Path, seq: usize, seed: u64, position: u64) -> Result<Self> {
        let source = Source {
            path: dir.to_owned(),
            weight: 1.0,
        };
        Self::open_mixture(&[source], seq, seed, position)
    }

    /// Opens the train splits of a weighted mixture of tokenized directories.
    pub fn open_mixture(sources: &[Source], seq: usize, seed: u64, position: u64) -> Result<Self> {
        Self::open_share(sources, seq, seed, position, Share::WHOLE)
    }

    /// [`Loader::open_mixture`] for one reader of `share`, `position` counting its own windows.
    pub fn open_share(
        sources: &[Source],
        seq: usize,
        seed: u64,
        position: u64,
        share: Share,
    ) -> Result<Self> {
        if share.of == 0 || share.index >= share.of {
            bail!(
                "a reader's share must be index < of, got {} of {}",
                share.index,
                share.of
            );
        }
        let manifests = open_sources(sources)?;
        let mut streams = Vec::with_capacity(sources.len());
        for (s, m) in sources.iter().zip(&manifests) {
            let w = Windows::open(&s.path, m, &m.train, seq)?;
            if w.count() == 0 {
                bail!(
                    "{}: the train split has {} tokens, too few for one window of {} tokens",
                    s.path.display(),
                    m.train_tokens,
                    seq + 1
                );
            }
            streams.push(w);
        }
        let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        let schedule = Schedule::new(&weights, seed);
        let stream = position * share.of + share.index;
        let counts = schedule.counts_at(stream);
        let mut drawn = vec![0; streams.len()];
        if share.is_whole() {
            drawn.clone_from(&counts);
        } else {
            (0..position).for_each(|i| drawn[schedule.source_of(i * share.of + share.index)] += 1);
        }
        let seeds = manifests
            .iter()
            .enumerate()
            .map(|(k, m)| source_seed(seed, k, m))
            .collect();
        Ok(Loader {
            sources: streams,
            seeds,
            schedule,
            share,
            counts,
            stream,
            drawn,
            position,
        })
    }

    /// The next `batch` windows, row-major `[batch, seq+1]`.
    pub fn next_batch(&mut self, batch: usize) -> Vec<i64> {
        let seq = self.sources[0].seq;
        let mut out = Vec::with_capacity(batch * (seq + 1));
        for _ in 0..batch {
            let at = self.position * self.share.of + self.share.index;
            // The other readers' draws in between, counted so that each source's epoch and
            // place in it are the stream's.
            if self.counts.len() == 1 {
                self.counts[0] = at;
            } else {
                for i in self.stream..at {
                    self.counts[self.schedule.source_of(i)] += 1;
                }
            }
            let k = self.schedule.source_of(at);
            let source = &self.sources[k];
            let n = source.count();
            let drawn = self.counts[k];
            let order = Permutation::new(n, self.seeds[k], drawn / n);
            source.read(order.at(drawn % n), &mut out);
            self.counts[k] += 1;
            self.stream = at + 1;
            self.drawn[k] += 1;
            self.position += 1;
        }
        out
    }

    /// Windows consumed so far; pass it back to [`Loader::open`] to resume.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Windows drawn from each source so far, in the order the sources were given.
    pub fn drawn(&self) -> &[u64] {
        &self.drawn
    }

    /// Windows in one epoch of every source together.
    pub fn windows_per_epoch(&self) -> u64 {
        self.sources.iter().map(Windows::count).sum()
    }
}

/// The validation split as consecutive, non-shuffled windows (from every source of a mixture,
/// in proportion to their weights).
pub struct ValWindows {
    sources: Vec<Windows>,
    schedule: Schedule,
}

impl ValWindows {
    pub fn open(dir: &Path, seq: usize) -> Result<Self> {
        let source = Source {
            path: dir.to_owned(),
            weight: 1.0,
        };
        Self::open_mixture(&[source], seq)
    }

    pub fn open_mixture(sources: &[Source], seq: usize) -> Result<Self> {
        let manifests = open_sources(sources)?;
        let mut streams = Vec::with_capacity(sources.len());
        for (s, m) in sources.iter().zip(&manifests) {
            let w = Windows::open(&s.path, m, &m.val, seq)?;
            if w.count() == 0 {
                bail!(
                    "{}: the validation split ({} tokens) is shorter than one window of {} tokens; \
                     tokenize with a larger --val-fraction",
                    s.path.display(),
                    m.val_tokens,
                    seq + 1
                );
            }
            streams.push(w);
        }
        let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        Ok(ValWindows {
            sources: streams,
            schedule: Schedule::new(&weights, 0),
        })
    }

    /// Up to `max_batches` batches of `batch` windows, the last one possibly smaller.
    pub fn batches(&self, batch: usize, max_batches: usize) -> Vec<(usize, Vec<i64>)> {
        let seq = self.sources[0].seq;
        let cap: u64 = self.sources.iter().map(Windows::count).sum();
        let total = cap.min((batch * max_batches) as u64);
        let mut taken = vec![0u64; self.sources.len()];
        let mut windows = Vec::with_capacity(total as usize);
        let mut i = 0u64;
        while (windows.len() as u64) < total {
            let k = self.schedule.source_of(i);
            i += 1;
            if taken[k] < self.sources[k].count() {
                windows.push((k, taken[k]));
                taken[k] += 1;
            }
        }
        windows
            .chunks(batch)
            .map(|chunk| {
                let mut out = Vec::with_capacity(chunk.len() * (seq + 1));
                for &(k, w) in chunk {
                    self.sources[k].read(w, &mut out);
                }
                (chunk.len(), out)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_keeps_every_prefix_near_the_weights() {
        let s = Schedule::new(&[0.75, 0.25], 7);
        let counts = s.counts_at(10_000);
        assert_eq!(counts.iter().sum::<u64>(), 10_000);
        let share = counts[0] as f64 / 10_000.0;
        assert!((share - 0.75).abs() < 0.001, "share {share}");
        for n in [10u64, 100, 1000] {
            let c = s.counts_at(n)[0] as f64;
            assert!((c - 0.75 * n as f64).abs() <= 2.0, "{c} of {n}");
        }
    }
}
