//! The MoE kernels: each expert run on the tokens routed to it, one matmul per expert and
//! matrix (`Loop`) or one grouped matmul per matrix over the layer's experts stacked
//! (`Grouped`), with weight gradients for the trained experts only.

use super::weights::{LayerCopies, LayerWeights};
use super::MoeModel;
use tch::{Device, Kind, Tensor};

/// One expert's matrices as the forward pass multiplies by them.
pub(super) enum ExpertMats<'a> {
    /// Gate and up stacked `[2·hidden, d]` (one matmul for both), and down: views of a
    /// layer's stacked copies.
    Fused(Tensor, Tensor),
    /// The masters: gate, up and down.
    Split(&'a Tensor, &'a Tensor, &'a Tensor),
}

impl MoeModel {
    /// Expert outputs for tokens `[N·k, d]` grouped by expert (`counts[e]` rows each), one
    /// matmul per expert and matrix; the counts come back to the host once.
    pub(super) fn experts_loop(
        &self,
        w: &LayerWeights,
        grouped: &Tensor,
        counts: &Tensor,
    ) -> Tensor {
        let layer = w.layer;
        let host_counts = Vec::<i64>::try_from(&counts.to_device(Device::Cpu)).unwrap();
        let mut outputs = Vec::with_capacity(layer.experts.len());
        let mats = self.expert_mats(w);
        for ((&n, xe), mats) in host_counts
            .iter()
            .zip(grouped.split_with_sizes(&host_counts, 0))
            .zip(mats)
        {
            if n > 0 {
                let hidden = match mats {
                    ExpertMats::Fused(gate_up, down) => {
                        let gu = self.linear(&xe, &gate_up).chunk(2, -1);
                        (gu[0].silu() * &gu[1], down)
                    }
                    ExpertMats::Split(gate, up, down) => (
                        self.linear(&xe, gate).silu() * self.linear(&xe, up),
                        down.shallow_clone(),
                    ),
                };
                outputs.push(self.linear(&hidden.0, &hidden.1));
            }
        }
        Tensor::cat(&outputs, 0)
    }

    /// Every expert's matrices, by expert index: its slot of the step's copies (the trained
    /// copy if it trains), its resident copy, or its masters. Each stack is split into views
    /// once per layer (one `unbind`, whose backward stacks the slots' gradients once).
    fn expert_mats<'a>(&self, w: &LayerWeights<'a>) -> Vec<ExpertMats<'a>> {
        let (layer, copies) = (w.layer, w.copies);
        let s = &layer.slots;
        let views = |[gu, d]: &[Tensor; 2]| (gu.unbind(0), d.unbind(0));
        let (trained, frozen) = match copies {
            Some(c) => (Some(views(&c.trained)), Some(views(&c.experts))),
            None => (None, s.resident.as_ref().map(views)),
        };
        (0..layer.experts.len())
            .map(|e| {
                let slot = s.slot_of[e];
                let stacked = if slot < s.trained { &trained } else { &frozen };
                match stacked {
                    Some((gu, d)) => {
                        ExpertMats::Fused(gu[slot].shallow_clone(), d[slot].shallow_clone())
                    }
                    None => {
                        let ex = &layer.experts[e];
                        ExpertMats::Split(&ex.gate, &ex.up, &ex.down)
                    }
                }
            })
            .collect()
    }

    /// [`MoeModel::experts_loop`] as two grouped matmuls over the experts stacked in slot
    /// order (trained first), the tokens grouped by slot and the groups given by their end
    /// offsets on the device. Weight gradients are computed for the trained slots only
    /// ([`spes_ext::grouped_mm_trained_first`]). With the step's copies nothing is copied;
    /// without (fp32, evaluation) the stacks are made here.
    pub(super) fn experts_grouped(
        &self,
        w: &LayerWeights,
        grouped: &Tensor,
        counts: &Tensor,
    ) -> Tensor {
        let layer = w.layer;
        let offsets = counts
            .index_select(0, &layer.slots.expert_of_t)
            .cumsum(0, Kind::Int);
        let ([gate_up, down], [trained_gate_up, trained_down]) =
            match w.copies.map(LayerCopies::share) {
                Some(c) => (c.experts, c.trained),
                None => self.expert_stacks(w),
            };
        let mm = |x: &Tensor, all: &Tensor, trained: &Tensor| {
            spes_ext::grouped_mm_trained_first(x, all, trained, &offsets)
                .expect("grouped matmul over a layer's experts")
        };
        let x = grouped.to_kind(self.compute);
        let gu = mm(&x, &gate_up, &trained_gate_up).chunk(2, -1);
        mm(&(gu[0].silu() * &gu[1]), &down, &trained_down)
    }

    /// Without step copies: every slot's gate and up `[E, 2·hidden, d]` and down stacked in
    /// the compute precision without gradient, and the trained slots' stacked from their
    /// masters with it.
    fn expert_stacks(&self, w: &LayerWeights) -> ([Tensor; 2], [Tensor; 2]) {
        let (kind, layer) = (self.compute, w.layer);
        let masters = LayerWeights { copies: None, ..*w };
        let mats = self.expert_mats(&masters);
        let stack = |slots: &[usize]| {
            let mut gate_up = Vec::with_capacity(slots.len());
            let mut down = Vec::with_capacity(slots.len());
            for &e in slots {
                match &mats[e] {
                    ExpertMats::Fused(gu, d) => {
                        gate_up.push(gu.to_kind(kind));
                        down.push(d.to_kind(kind));
                    }
                    ExpertMats::Split(g, u, d) => {
                        gate_up.push(Tensor::cat(&[g.to_kind(kind), u.to_kind(kind)], 0));
                        down.push(d.to_kind(kind));
                    }
                }
            }
            [Tensor::stack(&gate_up, 0), Tensor::stack(&down, 0)]
        };
        let slots = &layer.slots;
        let all = tch::no_grad(|| stack(&slots.expert_of));
        let trained = match slots.trained {
            0 => [all[0].narrow(0, 0, 0), all[1].narrow(0, 0, 0)],
            t => stack(&slots.expert_of[..t]),
        };
        (all, trained)
    }
}
