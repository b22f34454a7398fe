//! Training machinery: the backward pass (whole, or in stages from the head down with
//! activation checkpointing), the chunked LM head with its hand-written gradient, and the
//! losses.

use super::{rms_norm, router_aux, MoeModel, MoeOutput, RouterAux};
use spes_ext::count::{enter, Phase};
use tch::{Kind, Tensor};

/// Where a parameter's gradient is completed in [`MoeModel::backward_in_stages`], which
/// runs them in the order head, `Block(L−1)` … `Block(0)`, embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The final norm and the LM head.
    Head,
    /// Block (layer) `l`: its norms, attention, router and experts.
    Block(usize),
    /// The token embedding.
    Embedding,
}

/// A block's part of a staged backward pass: its input, and, unless it is recomputed
/// (checkpointing), its output and MoE statistics with their graph.
pub(super) struct BlockTape {
    pub(super) input: Tensor,
    pub(super) graph: Option<(Tensor, MoeOutput)>,
}

/// Loss weights (docs/design/algorithm.md §1); the default weighs the cross-entropy alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct LossWeights {
    pub z_loss: f64,
    pub lb: f64,
    pub router_z: f64,
}

/// The training objective and its parts, as scalar values (no graph).
pub struct Losses {
    pub total: Tensor,
    pub ce: Tensor,
    pub z_loss: Tensor,
    pub lb: Tensor,
    pub router_z: Tensor,
    pub expert_counts: Tensor,
}

impl Losses {
    fn new(ce: Tensor, z_loss: Tensor, aux: RouterAux, w: &LossWeights) -> Self {
        let (lb, router_z) = (aux.lb.detach(), aux.router_z.detach());
        let total = &ce + &z_loss * w.z_loss + &lb * w.lb + &router_z * w.router_z;
        Losses {
            total,
            ce,
            z_loss,
            lb,
            router_z,
            expert_counts: aux.expert_counts,
        }
    }
}

/// The LM head's losses over a batch and the surrogate that carries their gradient.
struct HeadLosses {
    ce: Tensor,
    z_loss: Tensor,
    /// A scalar whose gradient with respect to the hidden states is the scaled gradient of
    /// the head's losses (the head's own is added to its `.grad` directly); its value means
    /// nothing.
    surrogate: Tensor,
}

/// Default logits elements per chunk of the LM-head loss (256 MiB in fp32): large enough to
/// keep matmuls efficient, small beside the `[B·T, V]` tensor it replaces.
pub(super) const LOGITS_CHUNK_ELEMENTS: i64 = 1 << 26;

impl MoeModel {
    /// Forward and backward of one `[B, T+1]` window batch: adds `scale` times the gradient of
    /// the weighted objective to every trainable tensor's `.grad`, and returns the loss parts
    /// (values only). The LM head and its losses run over row chunks, so no `[B·T, V]` fp32
    /// logits tensor exists. With `checkpoint`, only each block's input is kept through the
    /// forward pass and the block is recomputed during backward (activation checkpointing).
    pub fn backward(
        &self,
        batch: &Tensor,
        w: &LossWeights,
        scale: f64,
        checkpoint: bool,
    ) -> Losses {
        if checkpoint {
            return self.backward_in_stages(batch, w, scale, true, &mut |_| {});
        }
        let forward = enter(Phase::Forward);
        let t = batch.size()[1] - 1;
        let inputs = batch.narrow(1, 0, t);
        let targets = batch.narrow(1, 1, t).reshape([-1]);
        let (h, aux) = self.trunk(&inputs);
        let h = h.view([-1, self.cfg.d_model as i64]);
        let head = self.head_losses(&h, &targets, w.z_loss, Some(scale));
        let objective = head.surrogate + (&aux.lb * w.lb + &aux.router_z * w.router_z) * scale;
        drop(forward);
        run_backward(&objective);
        self.flush_grads(None);
        Losses::new(head.ce, head.z_loss, aux, w)
    }

    /// [`MoeModel::backward`] one stage at a time from the top: head, blocks from the last,
    /// embedding. `ready(stage)` is called as soon as the gradients of that stage's parameters
    /// ([`MoeModel::stage_of`]) are complete, so a caller can reduce them while the stages below
    /// compute. Each block is given the gradient of its output (`Σ out·g` has gradient g):
    /// recomputed with `checkpoint`, else from the graph its forward kept, cut from its
    /// neighbours' so that it runs alone.
    pub fn backward_in_stages(
        &self,
        batch: &Tensor,
        w: &LossWeights,
        scale: f64,
        checkpoint: bool,
        ready: &mut dyn FnMut(Stage),
    ) -> Losses {
        let forward = enter(Phase::Forward);
        let t = batch.size()[1] - 1;
        let inputs = batch.narrow(1, 0, t);
        let targets = batch.narrow(1, 1, t).reshape([-1]);
        let d = self.cfg.d_model as i64;
        let (cos, sin) = self.rope(&inputs);
        let mut x = tch::no_grad(|| Tensor::embedding(&self.embed, &inputs, -1, false, false));
        let mut tapes = Vec::with_capacity(self.layers.len());
        let mut stats = Vec::with_capacity(self.layers.len());
        let step = self.step_copies();
        let weights = |l: usize| self.weights(l, step.as_ref());
        for l in 0..self.layers.len() {
            let (tape, y) = if checkpoint {
                let (y, moe) = tch::no_grad(|| self.block(&weights(l), &x, &cos, &sin));
                stats.push(moe.detached());
                (
                    BlockTape {
                        input: x,
                        graph: None,
                    },
                    y,
                )
            } else {
                let input = x.set_requires_grad(true);
                let (y, moe) = self.block(&weights(l), &input, &cos, &sin);
                stats.push(moe.detached());
                let cut = y.detach();
                // The MoE output is in the graph already; the tape keeps the losses.
                let graph = Some((
                    y,
                    MoeOutput {
                        y: Tensor::new(),
                        ..moe
                    },
                ));
                (BlockTape { input, graph }, cut)
            };
            tapes.push(tape);
            x = y;
        }
        let x = x.set_requires_grad(true);
        let h = rms_norm(&x, &self.final_norm, self.cfg.norm_eps);
        let head = self.head_losses(&h.view([-1, d]), &targets, w.z_loss, Some(scale));
        drop(forward);
        let _backward = enter(Phase::Backward);
        run_backward(&head.surrogate);
        ready(Stage::Head);
        let mut g = x.grad();
        let per_layer_lb = w.lb / self.layers.len() as f64;
        for (l, tape) in tapes.into_iter().enumerate().rev() {
            let (x, (y, moe)) = match tape.graph {
                Some(graph) => (tape.input, graph),
                None => {
                    let x = tape.input.set_requires_grad(true);
                    let out = self.block(&weights(l), &x, &cos, &sin);
                    (x, out)
                }
            };
            let objective = (&y * &g).sum(Kind::Float)
                + (moe.lb * per_layer_lb + moe.router_z * w.router_z) * scale;
            run_backward(&objective);
            self.flush_grads(Some(l));
            ready(Stage::Block(l));
            g = x.grad();
        }
        let embedded = Tensor::embedding(&self.embed, &inputs, -1, false, false);
        run_backward(&(embedded * g).sum(Kind::Float));
        ready(Stage::Embedding);
        Losses::new(head.ce, head.z_loss, router_aux(stats), w)
    }

    /// The loss parts of a `[B, T+1]` window batch without any gradient (validation), with the
    /// same chunked head as [`MoeModel::backward`].
    pub fn loss_values(&self, batch: &Tensor, w: &LossWeights) -> Losses {
        let _forward = enter(Phase::Forward);
        tch::no_grad(|| {
            let t = batch.size()[1] - 1;
            let (h, aux) = self.trunk(&batch.narrow(1, 0, t));
            let targets = batch.narrow(1, 1, t).reshape([-1]);
            let h = h.view([-1, self.cfg.d_model as i64]);
            let head = self.head_losses(&h, &targets, w.z_loss, None);
            Losses::new(head.ce, head.z_loss, aux, w)
        })
    }

    /// Cross-entropy and z-loss of the LM head on final hidden states `h` `[N, d]` against
    /// `targets` `[N]`; with `scale`, adds `scale ×` the head's gradient of
    /// `ce + z_weight·z_loss` to its `.grad` and returns a surrogate whose gradient with
    /// respect to `h` is that of `h`.
    ///
    /// The head runs over row chunks: each chunk's logits give its loss and, right away, its
    /// gradient, which is folded into the gradients of `h` and of the head. So no fp32 logits
    /// tensor of the whole batch is ever held: with a 151k vocabulary that is ~5 GB per 8k
    /// tokens. Per chunk, the passes over its `[rows, V]` logits are: the product; one
    /// log-softmax (fp32 out), whose exponential is written once in the compute precision;
    /// and the two products of the gradient. Row `r` of the gradient with respect to the
    /// logits is `c_r·(p_r − onehot_r/u_r)` with `u_r = 1 + 2·z_weight·lse_r` and `c_r =
    /// scale·u_r/N`: the matrix `G` holds `p` with `p_t − 1/u` at each target, and `c` scales
    /// rows of the products instead of a pass over `G`. On CUDA in bf16 the head's gradient
    /// accumulates in fp32 inside the product (`addmm` with an fp32 output); elsewhere each
    /// chunk's product, in the compute precision, is added to it.
    fn head_losses(
        &self,
        h: &Tensor,
        targets: &Tensor,
        z_weight: f64,
        scale: Option<f64>,
    ) -> HeadLosses {
        let (n, v) = (h.size()[0], self.cfg.vocab_size as i64);
        let rows = (self.logits_chunk / v).max(1);
        let train_head = scale.is_some() && self.head.requires_grad();
        let train_h = scale.is_some() && h.requires_grad();
        let a = scale.unwrap_or(0.0) / n as f64;
        if train_head {
            define_grads(&[self.head.shallow_clone()]);
        }
        let (ce, z_loss, grad_h) = tch::no_grad(|| {
            let step = self.step.lock().unwrap_or_else(|e| e.into_inner());
            let head = match step.as_ref() {
                Some(s) => s.head.shallow_clone(),
                None => self.head.to_kind(self.compute),
            };
            drop(step);
            let mut head_grad = train_head.then(|| self.head.grad());
            let fused_accumulate = self.fused_head_accumulate
                && self.compute != Kind::Float
                && head.device().is_cuda();
            let (mut ce, mut z) = (Vec::new(), Vec::new());
            let mut grad_h = Vec::new();
            for (hc, tc) in h.split(rows, 0).iter().zip(targets.split(rows, 0)) {
                let hc = hc.to_kind(self.compute);
                let logits = hc.matmul(&head.tr());
                let mut logp = logits.log_softmax(-1, Kind::Float);
                let tc = tc.unsqueeze(1);
                let logp_t = logp.gather(1, &tc, false);
                let lse = logits.gather(1, &tc, false).to_kind(Kind::Float) - &logp_t;
                ce.push(-logp_t.sum(Kind::Float));
                z.push(lse.square().sum(Kind::Float));
                if !(train_h || train_head) {
                    continue;
                }
                let _backward = enter(Phase::Backward);
                let u = &lse * (2.0 * z_weight) + 1.0;
                let mut g = if self.compute == Kind::Float {
                    logp.exp_()
                } else {
                    logp.exp_out(&logits)
                };
                let at_target = logp_t.exp() - u.reciprocal();
                let _ = g.scatter_(1, &tc, &at_target.to_kind(g.kind()));
                let c = u * a;
                if train_h {
                    grad_h.push(g.matmul(&head).to_kind(Kind::Float) * &c);
                }
                if let Some(acc) = &mut head_grad {
                    let hs = (hc.to_kind(Kind::Float) * &c).to_kind(self.compute);
                    if self.compute == Kind::Float {
                        let _ = acc.addmm_(&g.tr(), &hs);
                    } else if fused_accumulate {
                        let _ = acc.addmm_dtype_out(acc, &g.tr(), &hs, Kind::Float);
                    } else {
                        let _ = acc.g_add_(&g.tr().matmul(&hs));
                    }
                }
            }
            let sum = |xs: Vec<Tensor>| Tensor::stack(&xs, 0).sum(Kind::Float) / n as f64;
            let grad_h = train_h.then(|| Tensor::cat(&grad_h, 0));
            (sum(ce), sum(z), grad_h)
        });
        let surrogate = match grad_h {
            Some(g) => (h * g).sum(Kind::Float),
            None => Tensor::zeros([], (Kind::Float, h.device())),
        };
        HeadLosses {
            ce,
            z_loss,
            surrogate,
        }
    }

    /// The stage of [`MoeModel::backward_in_stages`] that completes the gradient of the
    /// parameter named `name` (as [`MoeModel::params`] names it).
    pub fn stage_of(name: &str) -> Stage {
        if name.starts_with("model.embed_tokens.") {
            return Stage::Embedding;
        }
        name.strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|l| l.parse().ok())
            .map_or(Stage::Head, Stage::Block)
    }
}

/// Gives every tensor of `ts` that has none a zero gradient, with one backward of a zero
/// objective, so its gradient can be added to, reduced or read like the others'.
pub fn define_grads(ts: &[Tensor]) {
    let _bookkeeping = enter(Phase::Bookkeeping);
    let missing: Vec<&Tensor> = ts.iter().filter(|t| !t.grad().defined()).collect();
    if !missing.is_empty() {
        let zero: Tensor = missing.iter().map(|t| (*t * 0.0).sum(Kind::Float)).sum();
        zero.backward();
    }
}

/// Backward from `objective`, unless nothing that needs a gradient depends on it.
fn run_backward(objective: &Tensor) {
    let _backward = enter(Phase::Backward);
    if objective.requires_grad() {
        objective.backward();
    }
}
