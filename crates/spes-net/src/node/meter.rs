//! What a node shows and records: its progress (a bar, JSON lines for `spes demo`, or nothing),
//! its `metrics.jsonl` (a [`StepRecord`] per logged step, a [`SyncRecord`] per sync) and its
//! running totals for the summary.

use super::Progress;
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use spes_train::metrics::{
    MetricsLog, NodeLine, NodeReport, NodeRound, ProgressLine, StepRecord, SyncRecord,
};
use spes_train::StepStats;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A node's progress display, metrics log and counters.
pub(super) struct Meter {
    peer: usize,
    max_steps: u64,
    progress: Progress,
    bar: ProgressBar,
    log: MetricsLog,
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// Tokens and seconds of the steps since the last logged one.
    window: (u64, f64),
    /// Seconds of the steps of the round in progress.
    round_compute_s: f64,
    /// The process's bytes written to disk at the last sync.
    written: u64,
    /// The payload bytes read from the store and the server by the last sync.
    downloaded: (u64, u64),
    pub started: Instant,
    /// The newest step and sync, which the heartbeat sends the server.
    pub report: Arc<Mutex<Option<NodeReport>>>,
    /// Wakes the heartbeat after a sync, so the server has each round's report at its close.
    pub synced: Arc<tokio::sync::Notify>,
}

impl Meter {
    /// Opens `<out>/metrics.jsonl`, keeping the lines through `resumed_step` of a resumed run.
    pub fn open(
        out: &Path,
        tensorboard: Option<&Path>,
        peer: usize,
        max_steps: u64,
        progress: Progress,
        resumed_step: Option<u64>,
    ) -> Result<Meter> {
        let bar = match progress {
            Progress::Bar => {
                let bar = ProgressBar::new(max_steps);
                bar.set_style(
                    ProgressStyle::with_template(
                        "node {prefix} step {pos}/{len} [{bar:25}] {msg} | eta {eta}",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                bar.set_prefix(peer.to_string());
                bar
            }
            _ => ProgressBar::hidden(),
        };
        Ok(Meter {
            peer,
            max_steps,
            progress,
            bar,
            log: MetricsLog::open(out, resumed_step)?
                .with_tensorboard(tensorboard, &format!("node-{peer}"))?,
            bytes_up: 0,
            bytes_down: 0,
            window: (0, 0.0),
            round_compute_s: 0.0,
            written: spes_train::process::bytes_written(),
            downloaded: (0, 0),
            started: Instant::now(),
            report: Arc::default(),
            synced: Arc::default(),
        })
    }

    /// Counts a step's tokens and time.
    pub fn count(&mut self, s: &StepStats, step: u64) {
        self.window.0 += s.tokens;
        self.window.1 += s.seconds;
        self.round_compute_s += s.seconds;
        self.bar.set_position(step);
    }

    /// Logs step `step` of round `round` (`tokens` so far), with the rate since the last one.
    pub fn log_step(&mut self, s: &StepStats, step: u64, tokens: u64, round: u64) -> Result<()> {
        let tps = self.window.0 as f64 / self.window.1.max(1e-9);
        self.window = (0, 0.0);
        let record = StepRecord {
            round: Some(round),
            ..s.record(step, tokens, tps)
        };
        self.log.write(&record)?;
        {
            let mut report = self.report.lock().unwrap();
            let report = report.get_or_insert_with(NodeReport::default);
            report.step = step;
            report.tokens = tokens;
            report.tokens_per_s = tps;
            report.losses = s.losses.clone();
        }
        self.show(
            NodeLine::Step(record),
            format!("loss {:.3} | {tps:.0} tok/s", s.losses.loss),
        );
        Ok(())
    }

    /// The round's compute seconds so far, resetting them for the next round.
    pub fn take_round_compute_s(&mut self) -> f64 {
        std::mem::take(&mut self.round_compute_s)
    }

    /// Bytes the process wrote to disk since the last call.
    pub fn take_bytes_written(&mut self) -> u64 {
        let now = spes_train::process::bytes_written();
        now.saturating_sub(std::mem::replace(&mut self.written, now))
    }

    /// The payload bytes read from the store and from the server since the last sync.
    pub fn take_downloads(&mut self, read: &super::transport::Downloads) -> (u64, u64) {
        let now = read.totals();
        let before = std::mem::replace(&mut self.downloaded, now);
        (now.0 - before.0, now.1 - before.1)
    }

    /// Logs a sync.
    pub fn log_sync(&mut self, record: SyncRecord) -> Result<()> {
        self.log.write(&record)?;
        self.report
            .lock()
            .unwrap()
            .get_or_insert_with(NodeReport::default)
            .sync = Some(NodeRound::from(&record));
        self.synced.notify_waiters();
        let message = format!("synced round {}", record.round);
        self.show(NodeLine::Sync(record), message);
        Ok(())
    }

    fn show(&self, line: NodeLine, message: String) {
        match self.progress {
            Progress::Bar => self.bar.set_message(message),
            Progress::Json => {
                let line = ProgressLine {
                    line,
                    peer: self.peer,
                    max_steps: self.max_steps,
                };
                if let Ok(text) = serde_json::to_string(&line) {
                    println!("{text}");
                }
            }
            Progress::Quiet => {}
        }
    }

    /// Clears the progress bar at the end.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
