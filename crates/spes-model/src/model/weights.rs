//! The precision copies: the weights one optimizer step's micro-batches multiply by in mixed
//! precision, made once per step from the fp32 masters, and the gradients they collect added
//! back to the masters'. [`LayerWeights`] is what a layer multiplies by in the step under way.

use super::layer::{Expert, Layer};
use super::{define_grads, MoeModel};
use spes_ext::count::{enter, Phase};
use tch::{Kind, Tensor};

/// The weights one optimizer step's micro-batches multiply by in mixed precision, made once
/// per step from the fp32 masters ([`MoeModel::begin_step`]) instead of cast at every matmul of
/// every micro-batch: q, k and v stacked into one matrix, and every expert of a layer in one
/// stack, each expert's gate and up fused so each is one matmul over the input. The copies of
/// trained weights are leaves that collect gradients, which are added to the masters' (in
/// fp32) after every backward; the stored tensors, the checkpoints and the Hugging Face export
/// keep their own layout.
pub(super) struct StepCopies {
    pub(super) layers: Vec<LayerCopies>,
    /// The LM head (its gradient is computed by hand, straight into the master).
    pub(super) head: Tensor,
}

pub(super) struct LayerCopies {
    /// q, k and v stacked `[q + 2·kv, d]`.
    pub(super) qkv: Tensor,
    pub(super) o: Tensor,
    /// Every expert's gate and up `[E, 2·hidden, d]` and down `[E, d, hidden]`, in the layer's
    /// slot order, without gradient (the frozen slots are the resident copies where there are).
    pub(super) experts: [Tensor; 2],
    /// The trained slots of `experts` (the first T, same storage): leaves that collect the
    /// trained experts' gradients.
    pub(super) trained: [Tensor; 2],
}

impl LayerCopies {
    /// The same copies (sharing their storage).
    pub(super) fn share(&self) -> Self {
        let two = |[a, b]: &[Tensor; 2]| [a.shallow_clone(), b.shallow_clone()];
        LayerCopies {
            qkv: self.qkv.shallow_clone(),
            o: self.o.shallow_clone(),
            experts: two(&self.experts),
            trained: two(&self.trained),
        }
    }
}

/// What one layer multiplies by in the step under way: the step's compute copies (mixed
/// precision, between [`MoeModel::begin_step`] and [`MoeModel::end_step`]), else its masters.
#[derive(Clone, Copy)]
pub(super) struct LayerWeights<'a> {
    /// The layer's place in the stack, from 0 at the embedding.
    pub(super) index: usize,
    pub(super) layer: &'a Layer,
    pub(super) copies: Option<&'a LayerCopies>,
}

impl LayerWeights<'_> {
    /// q, k and v of `x` `[B, T, d]`: one matmul with the step's copies, three without.
    pub(super) fn qkv(&self, m: &MoeModel, x: &Tensor) -> (Tensor, Tensor, Tensor) {
        let cfg = &m.cfg;
        let (hq, hkv, hd) = (
            cfg.n_heads as i64,
            cfg.n_kv_heads as i64,
            cfg.head_dim as i64,
        );
        match self.copies {
            // One matmul for all three, split along the output.
            Some(c) => {
                let qkv = m.matmul(x, &c.qkv);
                let mut parts = qkv.split_with_sizes([hq * hd, hkv * hd, hkv * hd], -1);
                let v = parts.pop().expect("three parts");
                let k = parts.pop().expect("three parts");
                (parts.pop().expect("three parts"), k, v)
            }
            None => (
                m.linear(x, &self.layer.q_proj),
                m.linear(x, &self.layer.k_proj),
                m.linear(x, &self.layer.v_proj),
            ),
        }
    }

    /// The attention output projection of `y`.
    pub(super) fn o(&self, m: &MoeModel, y: &Tensor) -> Tensor {
        match self.copies {
            Some(c) => m.matmul(y, &c.o),
            None => m.linear(y, &self.layer.o_proj),
        }
    }
}

impl MoeModel {
    /// Layer `l`'s weights for this step: its part of `step` (the step's copies), else its
    /// masters.
    pub(super) fn weights<'a>(
        &'a self,
        l: usize,
        step: Option<&'a StepCopies>,
    ) -> LayerWeights<'a> {
        LayerWeights {
            index: l,
            layer: &self.layers[l],
            copies: step.map(|s| &s.layers[l]),
        }
    }

    /// The step's compute copies (sharing their storage), if a step is on.
    pub(super) fn step_copies(&self) -> Option<StepCopies> {
        let step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        step.as_ref().map(|s| StepCopies {
            layers: s.layers.iter().map(LayerCopies::share).collect(),
            head: s.head.shallow_clone(),
        })
    }

    /// Starts an optimizer step: in mixed precision, makes the bf16 compute copies every
    /// micro-batch of the step multiplies by ([`StepCopies`]); in fp32 the masters serve as
    /// they are. Call after the masters last changed, before the step's first backward.
    pub fn begin_step(&self) {
        if self.compute == Kind::Float {
            return;
        }
        let _bookkeeping = enter(Phase::Bookkeeping);
        // The masters' gradients must exist to take the copies' in place (once: the
        // optimizer zeroes them, never drops them).
        let trained: Vec<Tensor> = self
            .trainable_params()
            .into_iter()
            .map(|p| p.tensor)
            .collect();
        define_grads(&trained);
        let (layers, head) = tch::no_grad(|| {
            let layers = self.layers.iter().map(|l| self.layer_copies(l)).collect();
            (layers, self.head.to_kind(self.compute))
        });
        *self.step.lock().unwrap_or_else(|e| e.into_inner()) = Some(StepCopies { layers, head });
    }

    /// One layer's compute copies, one cast per group of weights: q, k and v into one
    /// matrix; every expert not already resident into its slot of the layer's stacks.
    pub(super) fn layer_copies(&self, l: &Layer) -> LayerCopies {
        let (kind, device) = (self.compute, self.device);
        let rows = |ws: &[&Tensor]| ws.iter().map(|w| w.size()[0]).sum::<i64>();
        let qkv_masters = [&l.q_proj, &l.k_proj, &l.v_proj];
        let qkv = Tensor::empty([rows(&qkv_masters), l.q_proj.size()[1]], (kind, device));
        let _ = Tensor::cat_out(&qkv, &qkv_masters, 0);
        let trains = |ws: &[&Tensor]| ws.iter().any(|w| w.requires_grad());
        let qkv = qkv.set_requires_grad(trains(&qkv_masters));
        let o = l
            .o_proj
            .to_kind(kind)
            .set_requires_grad(l.o_proj.requires_grad());
        let e = l.experts.len() as i64;
        let (h, d) = l.experts[0].gate.size2().expect("an expert matrix is 2-D");
        let [gate_up, down] = match &l.slots.resident {
            Some([gu, dn]) => [gu.shallow_clone(), dn.shallow_clone()],
            None => [
                Tensor::empty([e, 2 * h, d], (kind, device)),
                Tensor::empty([e, d, h], (kind, device)),
            ],
        };
        // Resident copies hold the frozen slots already; the trained ones (and without
        // residents, every slot) are cast from their masters here.
        let fill = match l.slots.resident {
            Some(_) => l.slots.trained,
            None => l.experts.len(),
        };
        if fill > 0 {
            let masters: Vec<&Expert> = l.slots.expert_of[..fill]
                .iter()
                .map(|&x| &l.experts[x])
                .collect();
            let gu: Vec<&Tensor> = masters.iter().flat_map(|x| [&x.gate, &x.up]).collect();
            let n = fill as i64;
            let _ = Tensor::cat_out(&gate_up.narrow(0, 0, n).view([n * 2 * h, d]), &gu, 0);
            let dn: Vec<&Tensor> = masters.iter().map(|x| &x.down).collect();
            let _ = Tensor::stack_out(&down.narrow(0, 0, n), &dn, 0);
        }
        let t = l.slots.trained as i64;
        let leaf = |all: &Tensor| all.narrow(0, 0, t).detach().set_requires_grad(t > 0);
        LayerCopies {
            qkv,
            o,
            trained: [leaf(&gate_up), leaf(&down)],
            experts: [gate_up, down],
        }
    }

    /// Ends the optimizer step: drops its compute copies (the masters are about to change).
    pub fn end_step(&self) {
        let _bookkeeping = enter(Phase::Bookkeeping);
        *self.step.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Adds what the step copies of layer `layer` (all layers: `None`) collected in the last
    /// backward to their masters' gradients, in fp32, and clears theirs: one multi-tensor add
    /// and one multi-tensor zero over views of the copies' gradients.
    pub(super) fn flush_grads(&self, layer: Option<usize>) {
        // Borrowed under the lock: this runs after every stage of a staged backward.
        let step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let Some(step) = step.as_ref() else {
            return;
        };
        let _bookkeeping = enter(Phase::Bookkeeping);
        let (mut to, mut from, mut used) = (Vec::new(), Vec::new(), Vec::new());
        // `parts` are views of `copy`'s gradient, one per master in order.
        let mut collect =
            |copy: &Tensor, parts: &dyn Fn(&Tensor) -> Vec<Tensor>, masters: &[&Tensor]| {
                let g = copy.grad();
                if !copy.requires_grad() || !g.defined() {
                    return;
                }
                for (m, part) in masters.iter().zip(parts(&g)) {
                    if m.requires_grad() {
                        to.push(m.grad());
                        from.push(part);
                    }
                }
                used.push(g);
            };
        for (l, (w, c)) in self.layers.iter().zip(&step.layers).enumerate() {
            if layer.is_some_and(|want| want != l) {
                continue;
            }
            let qkv = [&w.q_proj, &w.k_proj, &w.v_proj];
            let sizes: Vec<i64> = qkv.iter().map(|m| m.size()[0]).collect();
            collect(&c.qkv, &|g| g.split_with_sizes(&sizes, 0), &qkv);
            collect(&c.o, &|g| vec![g.shallow_clone()], &[&w.o_proj]);
            let trained: Vec<&Expert> = w.slots.expert_of[..w.slots.trained]
                .iter()
                .map(|&e| &w.experts[e])
                .collect();
            let gate_up: Vec<&Tensor> = trained.iter().flat_map(|x| [&x.gate, &x.up]).collect();
            let h = w.experts[0].gate.size()[0];
            collect(
                &c.trained[0],
                &|g| g.reshape([-1, h, g.size()[2]]).unbind(0),
                &gate_up,
            );
            let down: Vec<&Tensor> = trained.iter().map(|x| &x.down).collect();
            collect(&c.trained[1], &|g| g.unbind(0), &down);
        }
        tch::no_grad(|| {
            spes_ext::add_lists(&to, &from).expect("adding the copies' gradients to the masters'");
            spes_ext::zero(&used).expect("zeroing the copies' gradients");
        });
    }
}
