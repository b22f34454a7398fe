//! A node's side of a round's exchange: its upload written for the wire, the upload and fetch
//! (waited for, or run on another thread with overlap), what the server's answer or refusal
//! means, the fetched round applied, and the sync's checkpoint and record.

use super::transport::{Exchange, Upload};
use super::{Node, Pending};
use crate::dial::explain;
use crate::proto::refusal::Kind as Refused;
use crate::proto::PayloadHeader;
use crate::refusal;
use anyhow::{bail, Result};
use spes_sync::{delta, Named, Prepared, Preparer, Published, Sent, Uploader, Work};
use spes_train::metrics::{Event, SyncRecord};
use std::time::Instant;
use tonic::Code;

/// What a sync's upload, download and apply took, as this node timed them; 0 where the
/// round's own exchange did not happen (a refusal, or the newest model taken instead).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SyncTimes {
    up_s: f64,
    down_s: f64,
    apply_s: f64,
}

/// What the overlap thread hands back: its upload's encoding, how the exchange went and, for a
/// fetched delta of the round, that round read and prepared while the node trained on
/// ([`Preparer`]).
pub(super) struct Done {
    /// What the upload left the replica, when it was encoded there.
    sent: Option<Sent>,
    exchange: Exchange,
    ready: Option<Result<Ready>>,
}

/// A round prepared on the overlap thread, and the seconds its read and preparation took there.
pub(super) struct Ready {
    prepared: Prepared,
    seconds: f64,
}

/// A round as [`Node::load`] takes it: its wire tensors, or prepared ahead.
pub(super) enum Incoming {
    Tensors(Named),
    Prepared(Prepared),
}

/// A round's upload as taken at the step boundary ([`Node::take_upload`]), to be encoded.
pub(super) struct Outgoing {
    round: u64,
    uploader: Uploader,
    /// How its floats are stored ([`delta::payload_kind`]).
    kind: tch::Kind,
    /// The experts it hands over.
    handover: Vec<usize>,
    work: Work,
}

impl Outgoing {
    /// Encodes the upload for the wire, per server shard.
    fn encode(self, link: &super::transport::Link) -> (Vec<Upload>, Sent, Work) {
        let t = Instant::now();
        let (wire, sent) = self.uploader.encode();
        let files = link.encode_upload(wire, self.kind, &self.handover);
        tracing::debug!(
            "node {}: round {} encoded in {:.3} s",
            link.peer,
            self.round,
            t.elapsed().as_secs_f64()
        );
        (files, sent, self.work)
    }
}

/// The overlap thread's work: encodes the upload, uploads and fetches, then reads and prepares
/// the fetched round with `preparer` when it is the upload's round's delta.
fn exchange_and_prepare(
    link: &super::transport::Link,
    out: Outgoing,
    plan: spes_sync::FetchPlan,
    mut preparer: Option<Preparer>,
) -> Done {
    let round = out.round;
    let (files, sent, work) = out.encode(link);
    if let Some(p) = &mut preparer {
        p.with_upload(&sent);
    }
    let exchange = link.exchange(round, files, work, plan);
    let ready = match (&exchange, preparer) {
        (Exchange::Fetched { fetched, .. }, Some(preparer))
            if fetched.header.delta && fetched.header.round == round =>
        {
            let t = Instant::now();
            let ready = fetched.read().and_then(|tensors| {
                let read_s = t.elapsed().as_secs_f64();
                let prepared = preparer.prepare(Published {
                    round,
                    tensors,
                    skipped_own: fetched.header.skipped_own,
                    after_upload: true,
                    // Known when the round is finished, not here.
                    trained_since_upload: true,
                })?;
                let seconds = t.elapsed().as_secs_f64();
                tracing::debug!(
                    "node {}: round {round} read in {read_s:.3} s and prepared in {:.3} s while training on",
                    link.peer,
                    seconds - read_s
                );
                Ok(Ready { prepared, seconds })
            });
            Some(ready)
        }
        _ => None,
    };
    Done {
        sent: Some(sent),
        exchange,
        ready,
    }
}

impl Node {
    /// Takes the upload of the round that ends now, with what the round trained: the change of
    /// each trained tensor copied when `ahead` (encoded while the node trains on).
    pub(super) fn take_upload(&mut self, upload: &Named, ahead: bool) -> Result<Outgoing> {
        self.session.check_lost()?;
        let work = std::mem::take(&mut self.work);
        let round = self.trainer.step / self.trainer.cfg.sync.sync_steps;
        let last = self.trainer.step >= self.trainer.cfg.train.max_steps;
        let handover = self.replica.handing_over(round);
        if !handover.is_empty() {
            tracing::info!(
                "node {}: hands over what it trained of experts {handover:?} and had not sent",
                self.peer()
            );
        }
        let uploader = self.replica.take_upload(upload, round, last, ahead)?;
        Ok(Outgoing {
            round,
            uploader,
            kind: delta::payload_kind(self.replica.cfg().wire()),
            handover,
            work,
        })
    }

    /// Overlap: encodes, uploads and fetches the round that ends now on another thread while
    /// this one trains on; the result is applied when it is in ([`Node::train_round`]).
    pub(super) fn start_sync(&mut self, upload: &Named) -> Result<()> {
        let t = Instant::now();
        // On CPU, encoding the upload and decoding the round are most of a sync's work: done
        // while training on, they leave the node a copy of its change and a few element-wise
        // passes. A GPU does both in place (milliseconds), keeping its memory for training.
        let ahead = self.trainer.device == tch::Device::Cpu;
        let out = self.take_upload(upload, ahead)?;
        let round = out.round;
        let plan = self.replica.fetch_plan(Some(round), true);
        let preparer =
            (plan.have_previous && ahead).then(|| self.replica.preparer(&self.weights(), true));
        let link = self.link.clone();
        let job: Box<dyn FnOnce() -> Done + Send> = if ahead {
            Box::new(move || exchange_and_prepare(&link, out, plan, preparer))
        } else {
            let (files, sent, work) = out.encode(&self.link);
            self.replica.sent(sent);
            Box::new(move || Done {
                sent: None,
                exchange: link.exchange(round, files, work, plan),
                ready: None,
            })
        };
        let thread = std::thread::Builder::new()
            .name(format!("sync-{round}"))
            .spawn(job)?;
        let encode = t.elapsed();
        tracing::debug!(
            "node {}: round {round} taken for its upload in {:.3} s",
            self.peer(),
            encode.as_secs_f64()
        );
        self.pending = Some(Pending {
            thread,
            started: t,
            encode,
            round,
        });
        Ok(())
    }

    /// Waits for the overlapped exchange (if still running) and applies it.
    pub(super) fn settle_pending(&mut self) -> Result<()> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        // Training stood still while the upload was taken too, before the exchange began.
        let now = Instant::now();
        let t = now.checked_sub(p.encode).unwrap_or(now);
        let done = p
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("node {}: the sync thread panicked", self.peer()))?;
        if let Some(sent) = done.sent {
            self.replica.sent(sent);
        }
        self.settle(done.exchange, done.ready, p.round, p.started, t)?;
        Ok(())
    }

    /// Uploads `upload` for the round that ends at the current step, then loads the aggregate
    /// (or whatever round the server says to load). Returns the round now loaded.
    pub fn sync(&mut self, upload: &Named) -> Result<u64> {
        let t0 = Instant::now();
        let out = self.take_upload(upload, false)?;
        let round = out.round;
        let (files, sent, work) = out.encode(&self.link);
        self.replica.sent(sent);
        let plan = self.replica.fetch_plan(Some(round), true);
        let exchange = self.link.exchange(round, files, work, plan);
        self.settle(exchange, None, round, t0, t0)
    }

    /// Acts on how an upload and fetch went: loads the fetched round (`ready`: prepared on the
    /// overlap thread), or whatever round the server's refusal names; then follows the round's
    /// ownership and checkpoints.
    pub(super) fn settle(
        &mut self,
        exchange: Exchange,
        ready: Option<Result<Ready>>,
        round: u64,
        t0: Instant,
        idle_from: Instant,
    ) -> Result<u64> {
        let peer = self.peer();
        let (up, target) = match exchange {
            Exchange::Fetched { fetched, up } => {
                self.refusals.accepted();
                self.meter.bytes_up += up.bytes;
                let header = fetched.header.clone();
                let t = Instant::now();
                let (incoming, ahead_s) = match ready {
                    Some(ready) => {
                        let ready = ready?;
                        (Incoming::Prepared(ready.prepared), ready.seconds)
                    }
                    None => (Incoming::Tensors(fetched.read()?), 0.0),
                };
                let read_s = t.elapsed().as_secs_f64();
                self.load(&header, incoming, true)?;
                let load_s = t.elapsed().as_secs_f64() - read_s;
                self.follow(&header)?;
                tracing::debug!(
                    "node {peer}: round {} stood still {:.3} s (its upload taken or encoded included), read in {read_s:.3} s, applied in {load_s:.3} s, followed in {:.3} s",
                    header.round,
                    (t - idle_from).as_secs_f64(),
                    t.elapsed().as_secs_f64() - read_s - load_s
                );
                // The apply's whole cost, wherever it ran: the planner decides what it hides.
                let times = SyncTimes {
                    up_s: up.seconds,
                    down_s: fetched.transfer_s,
                    apply_s: ahead_s + read_s + load_s,
                };
                return self.finish_sync(t0, idle_from, up.bytes, header.total_bytes, times);
            }
            Exchange::FetchFailed { status, up } => {
                self.refusals.accepted();
                self.meter.bytes_up += up.bytes;
                if status.code() != Code::NotFound {
                    return Err(explain(status, "the server"));
                }
                tracing::warn!("node {peer}: {}; taking the newest model", status.message());
                (up.bytes, None)
            }
            Exchange::UploadRefused(s) => match (refusal::kind(&s), refusal::of_status(&s)) {
                (Some(Refused::Duplicate), _) => {
                    self.refusals.accepted();
                    (0, Some(round))
                }
                (Some(kind), _) if self.backs_off(kind, &s)? => {
                    return self.finish_sync(t0, idle_from, 0, 0, SyncTimes::default());
                }
                (Some(Refused::Closed), Some(r)) => {
                    tracing::warn!("node {peer}: {}; loading round {}", s.message(), r.round);
                    (0, Some(r.round))
                }
                (Some(Refused::NotOpen), Some(r)) if r.round <= round => {
                    tracing::warn!(
                        "node {peer}: the server is collecting round {} (it lost newer rounds); taking its newest model",
                        r.round
                    );
                    (0, None)
                }
                (Some(Refused::NotMember), _) => {
                    tracing::warn!("node {peer}: {}", s.message());
                    self.rejoin()?;
                    return self.finish_sync(t0, idle_from, 0, 0, SyncTimes::default());
                }
                _ => return Err(explain(s, "the server")),
            },
        };
        let header = self.fetch_and_load(target)?;
        self.follow(&header)?;
        // Not this round's exchange (a refusal, or the newest model instead): nothing to time.
        self.finish_sync(t0, idle_from, up, header.total_bytes, SyncTimes::default())
    }

    /// Counts a refusal of `kind`; once the same kind keeps coming, waits (saying so at most
    /// once a minute) and joins again instead of trying the same way: true when it did.
    fn backs_off(&mut self, kind: Refused, s: &tonic::Status) -> Result<bool> {
        let now = self.meter.started.elapsed().as_secs_f64();
        let Some(b) = self.refusals.refused(kind, now) else {
            return Ok(false);
        };
        if b.log {
            tracing::warn!(
                "node {}: the server refused {} uploads running ({}); waiting {:.0} s, then joining again",
                self.peer(),
                b.count,
                s.message(),
                b.wait.as_secs_f64()
            );
        }
        std::thread::sleep(b.wait);
        self.rejoin()?;
        Ok(true)
    }

    /// Checkpoints and logs a sync: `sync_s` from the upload to the loaded model, `idle_s` the
    /// time training stood still for it (the upload's take, or its encoding where it is encoded in place, and the checkpoint included), `compute_s` the round's steps,
    /// and what the upload, download and apply took.
    pub(super) fn finish_sync(
        &mut self,
        t0: Instant,
        idle_from: Instant,
        up: u64,
        down: u64,
        times: SyncTimes,
    ) -> Result<u64> {
        let sync_s = t0.elapsed().as_secs_f64();
        let h = self.trainer.cfg.sync.sync_steps;
        let loaded = self.replica.base_round().unwrap_or(self.trainer.step / h);
        self.checkpoint(loaded)?;
        let compute_s = self.meter.take_round_compute_s();
        let bytes_written = self.meter.take_bytes_written();
        let (bytes_down_store, bytes_down_server) = self.meter.take_downloads(&self.link.read);
        self.meter.log_sync(SyncRecord {
            event: Event::Sync,
            step: self.trainer.step,
            round: loaded,
            bytes_up: up,
            bytes_down: down,
            bytes_down_store,
            bytes_down_server,
            sync_s,
            idle_s: idle_from.elapsed().as_secs_f64(),
            compute_s,
            bytes_written,
            up_s: times.up_s,
            down_s: times.down_s,
            apply_s: times.apply_s,
        })?;
        Ok(loaded)
    }

    /// Fetches round `round` (waiting for it) or the newest and loads it; without overlap the
    /// trainer's step becomes that round's last step. Returns the payload's header (with the
    /// next round's ownership).
    pub(super) fn fetch_and_load(&mut self, round: Option<u64>) -> Result<PayloadHeader> {
        // No upload of this node counted for this round: its own experts come back too.
        let plan = self.replica.fetch_plan(round, false);
        let fetched = match self.link.fetch(&plan) {
            Ok(f) => f,
            // The server keeps only recent rounds; a node that fell behind takes the newest.
            Err(s) if s.code() == Code::NotFound && round.is_some() => {
                tracing::warn!(
                    "node {}: {}; taking the newest model",
                    self.peer(),
                    s.message()
                );
                return self.fetch_and_load(None);
            }
            Err(s) => return Err(explain(s, "the server")),
        };
        let header = fetched.header.clone();
        self.load(&header, Incoming::Tensors(fetched.read()?), false)?;
        Ok(header)
    }

    /// Loads a fetched payload: a whole model, or a delta the replica applies (keeping the
    /// progress made since this node's upload, when its upload counted: `after_upload`).
    pub(super) fn load(
        &mut self,
        header: &PayloadHeader,
        incoming: Incoming,
        after_upload: bool,
    ) -> Result<()> {
        let h = self.trainer.cfg.sync.sync_steps;
        let weights = self.weights();
        let trained_since_upload = self.trainer.step > header.round * h;
        let kept_progress = if header.delta {
            let applied = match incoming {
                Incoming::Prepared(p) => self.replica.finish(p, &weights, trained_since_upload)?,
                Incoming::Tensors(tensors) => self.replica.apply(
                    Published {
                        round: header.round,
                        tensors,
                        skipped_own: header.skipped_own,
                        after_upload,
                        trained_since_upload,
                    },
                    &weights,
                )?,
            };
            // In place, unlike `MoeModel::load`, which refreshes the copies itself.
            self.trainer.model.refresh_resident();
            applied.kept_progress
        } else {
            // Only deltas are prepared ahead (`exchange_and_prepare`): a guard, not a path.
            let Incoming::Tensors(named) = incoming else {
                bail!(
                    "round {}: a whole model is never prepared ahead",
                    header.round
                );
            };
            let source = format!("round {} from the server", header.round);
            self.trainer.model.load(&named, &source)?;
            drop(named);
            self.replica.hold(header.round, &weights);
            false
        };
        if !kept_progress {
            // What the node trained since its upload is gone with its weights: its next upload
            // reports only what it trains from here.
            self.work = Work::default();
            // Behind (a joiner, a restart from an older checkpoint): the data stream skips
            // the steps in between. Ahead (the server lost rounds): the step goes back.
            let step = header.round * h;
            if step > self.trainer.step {
                self.trainer.skip_to(step)?;
            } else {
                self.trainer.step = step;
            }
        }
        self.meter.bytes_down += header.total_bytes;
        self.trainer.publish_weights()
    }
}
