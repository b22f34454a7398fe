//! How a node becomes and stays a member: entering the run after a join (fresh, resumed, or
//! admitted from a later round), taking a round as its delta base, following each round's
//! ownership into the trainer, and asking to join again after an eviction.

use super::saved::Saved;
use super::transport::Fetched;
use super::Node;
use crate::dial::explain;
use crate::proto::{JoinReply, PayloadHeader};
use crate::settings;
use anyhow::Result;
use spes_sync::{FetchPlan, Follow, ReplicaState};
use tonic::Code;

impl Node {
    /// Brings the node to the model it trains next, after a join: the round it is admitted
    /// from (a joiner), the newest model (fresh, or resumed from a checkpoint older than the
    /// newest round: its AdamW moments are kept, and its step and data follow the round), or
    /// the weights its checkpoint describes when that is the newest round.
    pub(super) fn enter(&mut self, reply: &JoinReply, saved: Option<Saved>) -> Result<()> {
        if let Some(s) = &reply.settings {
            self.replica.follow_settings(settings::from_proto(s)?);
        }
        if reply.member_from > 0 {
            return self.wait_for_membership(reply.member_from);
        }
        let newest = reply.published_round;
        match saved {
            None => {
                // Fresh: start from θ⁰, or from the newest model when starting late.
                let header = self.fetch_and_load(if newest > 0 { None } else { Some(0) })?;
                self.follow(&header)
            }
            Some(Saved {
                replica: Some(state),
                ..
            }) if state.base_round == newest => self.restore(state),
            Some(Saved {
                has_model: true,
                loaded,
                ..
            }) => self.resume_with_weights(reply, loaded),
            Some(saved) => {
                // Behind (or ahead of a server that rolled back): the newest model, with the
                // checkpoint's AdamW moments; step and data follow the round.
                let from = saved
                    .replica
                    .as_ref()
                    .map(|r| r.base_round)
                    .or(saved.loaded);
                tracing::info!(
                    "node {}: resumed from its checkpoint of round {} (step {}); rejoining at round {newest}",
                    self.peer(),
                    from.map_or("?".into(), |r| r.to_string()),
                    self.trainer.step
                );
                let header = self.fetch_and_load(None)?;
                self.follow(&header)
            }
        }
    }

    /// Rebuilds the weights a checkpoint without a model describes: round `base_round`'s
    /// model (the newest) plus the saved remainder.
    fn restore(&mut self, state: ReplicaState) -> Result<()> {
        let Some(fetched) = self.fetch_whole(state.base_round)? else {
            return Ok(());
        };
        let weights = self.weights();
        self.replica.restore(state, fetched.read()?, &weights)?;
        self.trainer
            .set_trainable(|role| self.replica.trains(role))?;
        self.meter.bytes_down += fetched.header.total_bytes;
        self.trainer.model.refresh_resident();
        self.trainer.publish_weights()?;
        self.follow(&fetched.header)
    }

    /// Continues from a checkpoint that holds the weights (the last round's, or one of an
    /// older spes, which checkpointed every round): exactly where it was when they are the
    /// newest round's, else from the newest model.
    fn resume_with_weights(&mut self, reply: &JoinReply, loaded: Option<u64>) -> Result<()> {
        let sync = self.replica.cfg();
        let (h, keeps_progress, delta_wire) = (
            sync.sync_steps,
            sync.keeps_progress(),
            sync.wire().is_delta(),
        );
        // Without overlap a checkpoint is taken right after loading round step / h.
        let at = match loaded {
            Some(r) => Some(r),
            None if !keeps_progress => Some(self.trainer.step / h),
            None => None,
        };
        let Some(at) = at.filter(|&r| reply.published_round == r) else {
            let header = self.fetch_and_load(None)?;
            return self.follow(&header);
        };
        let owners = self.owners_from_join(reply);
        let members = [self.peer()];
        let weights = self.weights();
        self.replica.follow(&owners, &members, &weights);
        self.trainer
            .set_trainable(|role| self.replica.trains(role))?;
        if !keeps_progress && self.trainer.step.is_multiple_of(h) || !delta_wire {
            // Saved right after loading round `at`: the trained tensors are that round's.
            self.replica.hold(at, &weights);
        } else {
            self.fetch_base(at)?;
        }
        Ok(())
    }

    /// The owners a join reply implies for this node's experts (others' unknown until the
    /// first fetch).
    fn owners_from_join(&self, reply: &JoinReply) -> Vec<usize> {
        let n = self.trainer.cfg.model.n_experts;
        (0..n)
            .map(|e| {
                if reply.owned_experts.contains(&(e as u32)) {
                    self.peer()
                } else {
                    usize::MAX
                }
            })
            .collect()
    }

    /// Takes round `round`'s trained tensors as the delta base, keeping the weights (which
    /// hold progress made since that round).
    fn fetch_base(&mut self, round: u64) -> Result<()> {
        let Some(fetched) = self.fetch_whole(round)? else {
            return Ok(());
        };
        let weights = self.weights();
        self.replica.take_base(round, fetched.read()?, &weights)?;
        Ok(())
    }

    /// Round `round`'s whole model; `None` when the server no longer keeps it, after taking
    /// the newest model instead (and following its ownership).
    fn fetch_whole(&mut self, round: u64) -> Result<Option<Fetched>> {
        let plan = FetchPlan {
            round: Some(round),
            have_previous: false,
            skip_own: false,
        };
        match self.link.fetch(&plan) {
            Ok(f) => Ok(Some(f)),
            Err(s) if s.code() == Code::NotFound => {
                tracing::warn!(
                    "node {}: {}; taking the newest model",
                    self.peer(),
                    s.message()
                );
                let header = self.fetch_and_load(None)?;
                self.follow(&header)?;
                Ok(None)
            }
            Err(s) => Err(explain(s, "the server")),
        }
    }

    /// Takes the settings, ownership (and, by tokens, the rows) a fetched round announces for
    /// the next round; waits to be admitted again if this node is not a member of it.
    pub(super) fn follow(&mut self, header: &PayloadHeader) -> Result<()> {
        if let Some(s) = &header.settings {
            let s = settings::from_proto(s)?;
            if s != self.replica.cfg().settings() {
                tracing::info!("node {}: round {} runs {s}", self.peer(), header.round + 1);
            }
            self.replica.follow_settings(s);
        }
        let owners: Vec<usize> = header.owners.iter().map(|&o| o as usize).collect();
        let members: Vec<usize> = header.members.iter().map(|&m| m as usize).collect();
        let weights = self.weights();
        let untrained = self.trainer.opt.param_names().next().is_none();
        self.replica.follow_budget(&members, &header.budget);
        match self.replica.follow(&owners, &members, &weights) {
            Follow::NotMember => {
                tracing::warn!(
                    "node {}: not a member of round {}; asking to join again",
                    self.peer(),
                    header.round + 1
                );
                self.rejoin()
            }
            Follow::Member {
                changed,
                reset,
                experts,
            } => {
                if !(changed || untrained) {
                    return Ok(());
                }
                let r = self
                    .trainer
                    .set_trainable(|role| self.replica.trains(role))?;
                if !r.fresh.is_empty() || !r.dropped.is_empty() {
                    tracing::info!(
                        "node {}: trains experts {experts:?} from step {}: {} tensors start fresh AdamW moments, {} dropped",
                        self.peer(),
                        self.trainer.step,
                        r.fresh.len(),
                        r.dropped.len()
                    );
                }
                if reset {
                    self.trainer.model.refresh_resident();
                    self.trainer.publish_weights()?;
                }
                Ok(())
            }
        }
    }

    /// Joins again (after an eviction) and waits until this node is a member.
    pub(super) fn rejoin(&mut self) -> Result<()> {
        let reply = self
            .link
            .join(false)
            .map_err(|e| explain(e, "the server"))?;
        let from = if reply.member_from > 0 {
            reply.member_from
        } else {
            reply.published_round + 1
        };
        self.wait_for_membership(from)
    }

    /// Loads round `from - 1` (waiting for it) and follows its ownership.
    fn wait_for_membership(&mut self, from: u64) -> Result<()> {
        tracing::info!(
            "node {}: member from round {from}; waiting for round {}",
            self.peer(),
            from - 1
        );
        let header = self.fetch_and_load(Some(from - 1))?;
        self.follow(&header)
    }
}
