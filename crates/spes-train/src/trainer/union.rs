//! A node step in phases, so that [`crate::oracle::lockstep`] can give every node statistics of
//! the union of all nodes' batches between them. One process holds every node's trainer
//! (`spes simulate`); a data-parallel node cannot take part.

use super::{backward_batches, Backward, StepStats, Trainer};
use crate::optim::lr_at;
use anyhow::{bail, Result};
use std::collections::HashMap;
use tch::{Kind, Tensor};

impl Trainer {
    /// The next step's `rows` rows, for a step taken in phases.
    pub(crate) fn draw_step(&mut self, rows: usize) -> Result<Vec<Tensor>> {
        if self.dp.is_some() {
            bail!("a step in phases (an oracle of spes simulate) needs a node of one rank");
        }
        if rows == 0 {
            bail!("a training step needs at least one row");
        }
        if self.options.estimate.is_some() {
            bail!("an oracle measures against a node's own second moment: set train.second_moment = \"own\"");
        }
        Ok(self.draw_rows(rows))
    }

    /// Top-k assignments per layer and expert `[layers, E]` of one batch, as the step's
    /// forward pass will route it.
    pub(crate) fn routing_counts(&self, batch: &Tensor) -> Tensor {
        let t = batch.size()[1] - 1;
        self.model.begin_step();
        let counts = tch::no_grad(|| self.model.forward(&batch.narrow(1, 0, t)).1.expert_counts);
        self.model.end_step();
        counts.to_kind(Kind::Float)
    }

    /// Forward and backward over the step's batches: the gradients wait in `.grad`.
    pub(crate) fn backward_step(&self, batches: &[Tensor]) -> Backward {
        backward_batches(&self.model, &self.options, None, batches)
    }

    /// Clips the gradients as a global norm of `norm` (the union's) would, or by their own
    /// norm when `None`; returns the norm used.
    pub(crate) fn clip_step(&self, norm: Option<&Tensor>) -> Result<Tensor> {
        let max = self.options.grad_clip;
        match norm {
            Some(n) => {
                self.opt.clip_to(n, max)?;
                Ok(n.shallow_clone())
            }
            None => self.opt.clip_grad_norm(max),
        }
    }

    /// AdamW's update, its second moment fed `second_moment`'s squares where given, then the
    /// step is counted as [`Trainer::train_rows`] counts it.
    pub(crate) fn finish_step(
        &mut self,
        b: Backward,
        grad_norm: Tensor,
        second_moment: Option<&HashMap<String, Tensor>>,
    ) -> Result<StepStats> {
        let lr = lr_at(self.step, &self.cfg.train);
        match second_moment {
            Some(squares) => self.opt.step_with_second_moment(lr, squares)?,
            None => self.opt.step(lr)?,
        }
        self.opt.zero_grad()?;
        Ok(self.count_step(b.stats(grad_norm, lr)))
    }
}
