//! The operator's view of a run: [`RunView`], one snapshot of everything an operator watches
//! (members and leases, per-node reports, loss, rounds, timeline, expert load, events), which
//! the live page, `/metrics` and `spes status` all read. `history` bounds what the server
//! remembers; `prom` writes the Prometheus text; `http` is the optional listener.

pub mod browser;
pub mod client;
pub mod history;
pub mod http;
pub mod prom;

use crate::proto;
use serde::{Deserialize, Serialize};
use spes_train::metrics::{NodeReport, NodeRound, StepLosses};
use std::collections::BTreeMap;

/// The whole view at one moment (`/api/run`, `spes status`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunView {
    pub run: RunInfo,
    pub nodes: Vec<NodeView>,
    /// (tokens, validation loss), downsampled.
    pub loss: Vec<[f64; 2]>,
    pub rounds: Vec<RoundPoint>,
    /// Each node's part of the newest rounds, as the nodes reported it.
    pub timeline: Vec<NodeRound>,
    pub expert_load: Option<LoadView>,
    /// Newest first.
    pub events: Vec<EventView>,
    pub counters: Counters,
}

/// The run as a whole.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The newest published round.
    pub round: u64,
    pub final_round: u64,
    pub open_round: u64,
    pub tokens: u64,
    pub sync_steps: u64,
    /// The open round's wire and overlap, in words; "(adaptive)" when the server chooses them.
    pub wire: String,
    /// An adaptive run's newest choice and why (empty before one).
    #[serde(default)]
    pub choice: String,
    pub n_layers: usize,
    pub n_experts: usize,
    pub lease_s: f64,
    pub uptime_s: f64,
    pub val_loss: Option<f64>,
    pub initial_val_loss: Option<f64>,
    /// `i/k` for `--shard i/k`.
    pub shard: String,
    /// The last round is published.
    pub done: bool,
}

/// One node as the server sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub peer: usize,
    /// A member of the open round.
    pub member: bool,
    /// Seconds since its lease was last renewed; `None` without one.
    pub lease_age_s: Option<f64>,
    /// Experts it trains in the open round.
    pub experts: Vec<usize>,
    pub uploads: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub refusals: u64,
    pub report: Option<NodeReport>,
    pub report_age_s: Option<f64>,
}

/// A round, compactly.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundPoint {
    pub round: u64,
    pub tokens: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub round_s: f64,
    pub aggregation_s: f64,
    pub peers: usize,
    pub missing: usize,
}

/// The newest scored expert load, `load[layer][expert]`, and who owns each expert.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadView {
    pub round: u64,
    pub load: Vec<Vec<f64>>,
    pub owners: Vec<usize>,
}

/// What happened to whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    Evicted,
    Joined,
    Missing,
    Discarded,
    Refused,
}

/// One event of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventView {
    pub round: u64,
    pub kind: EventKind,
    pub peer: Option<usize>,
    pub text: String,
}

/// Counts since the server process started (Prometheus counters reset with it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub joins: u64,
    pub evictions: u64,
    /// Refused calls by reason (a refusal kind, or the gRPC code).
    pub refusals: BTreeMap<String, u64>,
    /// Node reports dropped as invalid.
    pub bad_reports: u64,
    /// The last round's durable publication.
    pub publish_s: f64,
    /// Fetches answered with a presigned URL of the run's store (`--store`).
    #[serde(default)]
    pub links: u64,
    /// Fetches of nodes the store failed (expired URLs renewed twice, broken or corrupt
    /// downloads, a store they cannot reach), served by the server instead.
    #[serde(default)]
    pub fallbacks: u64,
}

/// What the server tracks per peer between rounds.
#[derive(Clone, Debug, Default)]
pub struct PeerWatch {
    pub uploads: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub refusals: u64,
    /// The newest valid report and when (server seconds) it came.
    pub report: Option<(NodeReport, f64)>,
}

/// The server's live bookkeeping for the view.
#[derive(Default)]
pub struct Watch {
    pub history: History,
    /// The newest validation loss scored.
    pub val_loss: Option<f64>,
    pub peers: BTreeMap<usize, PeerWatch>,
    pub counters: Counters,
}

pub use history::History;

impl Watch {
    /// The newest sync each of `members` reported, for the round record's timeline.
    pub fn node_rounds(&self, members: &[usize]) -> Vec<NodeRound> {
        members
            .iter()
            .filter_map(|&peer| {
                let (report, _) = self.peers.get(&peer)?.report.as_ref()?;
                Some(NodeRound {
                    peer,
                    ..report.sync.clone()?
                })
            })
            .collect()
    }

    /// Counts a refused call and shows it as an event.
    pub fn refused(&mut self, peer: Option<usize>, round: u64, reason: &str, text: String) {
        *self.counters.refusals.entry(reason.to_owned()).or_default() += 1;
        if let Some(p) = peer {
            self.peers.entry(p).or_default().refusals += 1;
        }
        self.history.event(EventView {
            round,
            kind: EventKind::Refused,
            peer,
            text,
        });
    }
}

/// The largest value a report's counts and seconds may hold: far beyond any real run, small
/// enough that sums of them stay exact.
const MAX_REPORTED: f64 = 1e15;

/// A node's heartbeat report, checked like any other untrusted input: every number finite,
/// non-negative and below [`MAX_REPORTED`].
pub fn report_of(p: &proto::NodeReport) -> Result<NodeReport, String> {
    let check = |name: &str, v: f64| {
        if v.is_finite() && (0.0..MAX_REPORTED).contains(&v) {
            Ok(v)
        } else {
            Err(format!(
                "report field {name} = {v} is not a finite number in [0, 1e15)"
            ))
        }
    };
    let count = |name: &str, v: u64| check(name, v as f64).map(|_| v);
    let sync = match &p.sync {
        Some(s) => Some(NodeRound {
            peer: 0,
            round: count("sync.round", s.round)?,
            compute_s: check("sync.compute_s", s.compute_s)?,
            sync_s: check("sync.sync_s", s.sync_s)?,
            idle_s: check("sync.idle_s", s.idle_s)?,
            bytes_up: count("sync.bytes_up", s.bytes_up)?,
            bytes_down: count("sync.bytes_down", s.bytes_down)?,
            up_s: check("sync.up_s", s.up_s)?,
            down_s: check("sync.down_s", s.down_s)?,
            apply_s: check("sync.apply_s", s.apply_s)?,
        }),
        None => None,
    };
    Ok(NodeReport {
        step: count("step", p.step)?,
        tokens: count("tokens", p.tokens)?,
        tokens_per_s: check("tokens_per_s", p.tokens_per_s)?,
        losses: StepLosses {
            loss: check("loss", p.loss)?,
            ce: check("ce", p.ce)?,
            z_loss: check("z_loss", p.z_loss)?,
            lb_loss: check("lb_loss", p.lb_loss)?,
            router_z_loss: check("router_z_loss", p.router_z_loss)?,
            grad_norm: check("grad_norm", p.grad_norm)?,
            lr: check("lr", p.lr)?,
        },
        sync,
    })
}

/// The wire form of a report.
pub fn report_to_proto(r: &NodeReport) -> proto::NodeReport {
    let l = &r.losses;
    proto::NodeReport {
        step: r.step,
        tokens: r.tokens,
        tokens_per_s: r.tokens_per_s,
        loss: l.loss,
        ce: l.ce,
        z_loss: l.z_loss,
        lb_loss: l.lb_loss,
        router_z_loss: l.router_z_loss,
        grad_norm: l.grad_norm,
        lr: l.lr,
        sync: r.sync.as_ref().map(|s| proto::NodeSync {
            round: s.round,
            compute_s: s.compute_s,
            sync_s: s.sync_s,
            idle_s: s.idle_s,
            bytes_up: s.bytes_up,
            bytes_down: s.bytes_down,
            up_s: s.up_s,
            down_s: s.down_s,
            apply_s: s.apply_s,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_bad_numbers_are_named() {
        let r = NodeReport {
            step: 10,
            tokens: 4096,
            tokens_per_s: 812.5,
            losses: StepLosses {
                loss: 5.5,
                lr: 3e-4,
                ..Default::default()
            },
            sync: Some(NodeRound {
                peer: 0,
                round: 2,
                compute_s: 4.0,
                idle_s: 1.0,
                bytes_up: 77,
                down_s: 0.25,
                ..Default::default()
            }),
        };
        assert_eq!(report_of(&report_to_proto(&r)).unwrap(), r);
        for bad in [f64::NAN, f64::INFINITY, -1.0, 1e300] {
            let mut p = report_to_proto(&r);
            p.sync.as_mut().unwrap().idle_s = bad;
            let e = report_of(&p).unwrap_err();
            assert!(e.contains("sync.idle_s"), "{e}");
        }
        let mut p = report_to_proto(&r);
        p.step = u64::MAX;
        assert!(report_of(&p).unwrap_err().contains("step"));
    }
}
