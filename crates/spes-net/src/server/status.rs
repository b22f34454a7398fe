//! The server's [`RunView`]: the coordinator's members and leases, the watch's per-peer
//! counters and reports, and its history, in one snapshot for the page, `/metrics` and the
//! `Status` call.

use super::closer::Settle;
use super::State;
use crate::view::{NodeView, RunInfo, RunView};
use spes_model::Role;
use std::collections::BTreeSet;

impl State {
    /// The run as an operator sees it now.
    pub(super) fn view(&self) -> RunView {
        let now = self.now();
        let (open_round, scope, ages, settings) = {
            let coord = self.coord.lock().unwrap();
            let settings = coord.cfg().settings();
            (
                coord.round(),
                coord.scope().clone(),
                coord.lease_ages(now),
                settings,
            )
        };
        let choice = match &*self.settle.lock().unwrap() {
            Settle::Adaptive { choices, .. } => {
                choices.choices.last().map_or_else(String::new, |c| {
                    format!("from round {}: {} ({})", c.from_round, c.settings, c.reason)
                })
            }
            _ => String::new(),
        };
        let (round, tokens, initial_val_loss) = {
            let st = &self.progress.read().0;
            (st.newest().round, st.newest().tokens, st.initial_val_loss)
        };
        let members = scope.members();
        let watch = self.watch.lock().unwrap();
        let peers: BTreeSet<usize> = members
            .iter()
            .chain(ages.keys())
            .chain(watch.peers.keys())
            .copied()
            .collect();
        let n_experts = self.cfg.model.n_experts;
        let nodes = peers
            .into_iter()
            .map(|peer| {
                let w = watch.peers.get(&peer).cloned().unwrap_or_default();
                let member = members.contains(&peer);
                NodeView {
                    peer,
                    member,
                    lease_age_s: ages.get(&peer).copied(),
                    experts: (0..n_experts)
                        .filter(|&e| {
                            member && scope.uploads(peer, Role::Expert { layer: 0, index: e })
                        })
                        .collect(),
                    uploads: w.uploads,
                    bytes_in: w.bytes_in,
                    bytes_out: w.bytes_out,
                    refusals: w.refusals,
                    report_age_s: w.report.as_ref().map(|(_, at)| (now - at).max(0.0)),
                    report: w.report.map(|(r, _)| r),
                }
            })
            .collect();
        let h = &watch.history;
        RunView {
            run: RunInfo {
                round,
                final_round: self.final_round,
                open_round,
                tokens,
                sync_steps: self.cfg.sync.sync_steps,
                wire: match self.cfg.sync.adaptive() {
                    true => format!("{settings} (adaptive)"),
                    false => settings.to_string(),
                },
                choice,
                n_layers: self.cfg.model.n_layers,
                n_experts,
                lease_s: self.cfg.sync.lease_s,
                uptime_s: now,
                val_loss: watch.val_loss,
                initial_val_loss,
                shard: format!("{}/{}", self.shard.0, self.shard.1),
                done: round >= self.final_round,
            },
            nodes,
            loss: h.loss(),
            rounds: h.rounds(),
            timeline: h.timeline(),
            expert_load: h.expert_load.clone(),
            events: h.events(),
            counters: watch.counters.clone(),
        }
    }
}
