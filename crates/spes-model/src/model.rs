//! The OLMoE-style mixture-of-experts decoder (docs/design/algorithm.md §1), top to bottom.
//!
//! Block: `x + Attn(RMSNorm(x))`, then `x + MoE(RMSNorm(x))` (or, post-norm as in OLMo2,
//! `x + RMSNorm(Attn(x))`, then `x + RMSNorm(MoE(x))`). Attention has QK-norm, RoPE, optional
//! q/k/v biases (Qwen2) and optional grouped-query heads. The MoE layer routes each token to its top-k of E SwiGLU
//! experts and runs each expert only on the tokens routed to it (dropless).
//!
//! Every expert is its own set of leaf tensors, so a node can freeze exactly the experts it does
//! not own: frozen tensors never get `requires_grad`, hence no gradient and no optimizer state,
//! while activations still flow through them. Tensor names follow Hugging Face's OLMoE layout.

use crate::config::{ModelConfig, NormPlacement, QkNorm};
use anyhow::{bail, Context, Result};
use spes_ext::count::{enter, Phase};
use tch::{Device, Kind, Tensor};

/// What a parameter is for SPES: shared by every node (φ), or one expert of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Shared,
    Expert { layer: usize, index: usize },
}

/// A named parameter. `tensor` shares storage with the model's own tensor.
pub struct Param {
    pub name: String,
    pub role: Role,
    pub tensor: Tensor,
}

/// The three matrices of a SwiGLU expert, by their Hugging Face names.
pub const EXPERT_PARTS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// Name of one expert matrix, e.g. `model.layers.3.mlp.experts.7.gate_proj.weight`.
pub fn expert_tensor_name(layer: usize, index: usize, part: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{index}.{part}.weight")
}

/// The name of layer `layer`'s router (`[E, d]`: row i scores expert i).
pub fn router_tensor_name(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.gate.weight")
}

struct Expert {
    gate: Tensor, // W1 [hidden, d]
    up: Tensor,   // V1 [hidden, d]
    down: Tensor, // W2 [d, hidden]
}

/// One expert's matrices as the forward pass multiplies by them.
enum ExpertMats<'a> {
    /// Gate and up stacked `[2·hidden, d]` (one matmul for both), and down: views of a
    /// layer's stacked copies.
    Fused(Tensor, Tensor),
    /// The masters: gate, up and down.
    Split(&'a Tensor, &'a Tensor, &'a Tensor),
}

impl Expert {
    /// Puts the masters where a trained or a frozen expert keeps them: on `device` with
    /// gradients when trained; when frozen, in host memory if `resident` (bf16 copies on the
    /// device serve the forward pass), else on `device`. A master that moves is a new leaf.
    fn place(&mut self, train: bool, resident: bool, device: Device) {
        let home = if resident && !train {
            Device::Cpu
        } else {
            device
        };
        for w in [&mut self.gate, &mut self.up, &mut self.down] {
            if w.device() != home {
                *w = w.detach().to_device(home);
            }
            let _ = w.set_requires_grad(train);
        }
    }
}

/// A layer's experts in the order its kernels stack them: the trained ones first, then the
/// frozen, so that one grouped matmul computes weight gradients for a prefix of the stack
/// alone. Made by [`MoeModel::set_trainable`], the one place that changes which experts train.
struct Slots {
    /// The expert in each slot.
    expert_of: Vec<usize>,
    /// The slot of each expert.
    slot_of: Vec<usize>,
    /// The first `trained` slots hold the trained experts.
    trained: usize,
    /// `slot_of` and `expert_of` as int64 tensors on the model's device.
    slot_of_t: Tensor,
    expert_of_t: Tensor,
    /// With frozen experts resident in bf16: every slot's gate and up stacked `[E, 2·hidden,
    /// d]` and down `[E, d, hidden]`, bf16 on the device. The frozen slots hold the resident
    /// copies; each step's compute copies fill the trained slots.
    resident: Option<[Tensor; 2]>,
}

impl Slots {
    /// Slots for experts of which `trains[e]` says which train.
    fn new(trains: &[bool], device: Device) -> Self {
        let n = trains.len();
        let mut expert_of: Vec<usize> = (0..n).filter(|&e| trains[e]).collect();
        let trained = expert_of.len();
        expert_of.extend((0..n).filter(|&e| !trains[e]));
        let mut slot_of = vec![0; n];
        for (s, &e) in expert_of.iter().enumerate() {
            slot_of[e] = s;
        }
        let on_device = |v: &[usize]| {
            let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
            Tensor::from_slice(&v).to_device(device)
        };
        Slots {
            slot_of_t: on_device(&slot_of),
            expert_of_t: on_device(&expert_of),
            expert_of,
            slot_of,
            trained,
            resident: None,
        }
    }
}

struct Layer {
    /// Pre-norm: normalises the attention input. Post-norm: the attention output.
    attn_norm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    qkv_bias: Option<[Tensor; 3]>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// Pre-norm: normalises the MoE input. Post-norm: the MoE output.
    ffn_norm: Tensor,
    router: Tensor, // [E, d]
    experts: Vec<Expert>,
    slots: Slots,
}

impl Layer {
    /// Copies the frozen experts' masters into their resident slots (after the masters
    /// changed; once per round, not per step).
    fn refresh_resident(&self) {
        let Some([gate_up, down]) = &self.slots.resident else {
            return;
        };
        tch::no_grad(|| {
            for (s, &e) in self
                .slots
                .expert_of
                .iter()
                .enumerate()
                .skip(self.slots.trained)
            {
                let (ex, s) = (&self.experts[e], s as i64);
                let h = ex.gate.size()[0];
                gate_up.get(s).narrow(0, 0, h).copy_(&ex.gate);
                gate_up.get(s).narrow(0, h, h).copy_(&ex.up);
                down.get(s).copy_(&ex.down);
            }
        });
    }
}

/// The weights one optimizer step's micro-batches multiply by in mixed precision, made once
/// per step from the fp32 masters ([`MoeModel::begin_step`]) instead of cast at every matmul of
/// every micro-batch: q, k and v stacked into one matrix, and every expert of a layer in one
/// stack, each expert's gate and up fused so each is one matmul over the input. The copies of
/// trained weights are leaves that collect gradients, which are added to the masters' (in
/// fp32) after every backward; the stored tensors, the checkpoints and the Hugging Face export
/// keep their own layout.
struct StepCopies {
    layers: Vec<LayerCopies>,
    /// The LM head (its gradient is computed by hand, straight into the master).
    head: Tensor,
}

struct LayerCopies {
    /// q, k and v stacked `[q + 2·kv, d]`.
    qkv: Tensor,
    o: Tensor,
    /// Every expert's gate and up `[E, 2·hidden, d]` and down `[E, d, hidden]`, in the layer's
    /// slot order, without gradient (the frozen slots are the resident copies where there are).
    experts: [Tensor; 2],
    /// The trained slots of `experts` (the first T, same storage): leaves that collect the
    /// trained experts' gradients.
    trained: [Tensor; 2],
}

impl LayerCopies {
    /// The same copies (sharing their storage).
    fn share(&self) -> Self {
        let two = |[a, b]: &[Tensor; 2]| [a.shallow_clone(), b.shallow_clone()];
        LayerCopies {
            qkv: self.qkv.shallow_clone(),
            o: self.o.shallow_clone(),
            experts: two(&self.experts),
            trained: two(&self.trained),
        }
    }
}

/// How a MoE layer runs its experts on the tokens routed to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKernel {
    /// One matmul per expert and matrix on the expert's slice of the tokens; reads the
    /// per-expert counts back to the host (fastest on CPU).
    Loop,
    /// One `_grouped_mm` per matrix over all experts' weights stacked, with the slices'
    /// offsets on the device: no host sync and 3 launches instead of 3 per expert (CUDA).
    Grouped,
}

/// The whole decoder. Parameters are fp32 master weights on one device (frozen experts' in
/// host memory when they are resident in bf16); matmuls run in `compute` precision (fp32, or
/// bf16 for mixed precision), norms, softmax and losses in fp32.
pub struct MoeModel {
    pub cfg: ModelConfig,
    /// Where the forward pass runs.
    device: Device,
    compute: Kind,
    moe_kernel: MoeKernel,
    /// Frozen experts as bf16 copies on `device`, their fp32 masters in host memory.
    frozen_bf16: bool,
    /// Per-expert multiplier of the load-balancing counts `[E]` (docs/design/algorithm.md §6), if any.
    lb_count_scale: Option<Tensor>,
    /// Logits elements per chunk of the LM-head loss ([`MoeModel::set_logits_chunk`]).
    logits_chunk: i64,
    /// On CUDA in bf16, the head's gradient accumulates in fp32 inside its product
    /// ([`MoeModel::set_fused_head_accumulate`]).
    fused_head_accumulate: bool,
    /// RoPE tables, built once for the longest sequence seen (each forward used to rebuild them).
    rope_cache: std::sync::Mutex<Option<RopeTables>>,
    /// The current optimizer step's compute copies, between [`MoeModel::begin_step`] and
    /// [`MoeModel::end_step`] (mixed precision only).
    step: std::sync::Mutex<Option<StepCopies>>,
    embed: Tensor,
    layers: Vec<Layer>,
    final_norm: Tensor,
    head: Tensor,
}

/// RoPE cos and sin tables `[len, head_dim]` on one device; shorter sequences use a prefix.
struct RopeTables {
    device: Device,
    cos: Tensor,
    sin: Tensor,
}

/// Router statistics of one forward pass, for the auxiliary losses and for load plots.
pub struct RouterAux {
    /// Load-balancing loss, averaged over layers; 1.0 when routing is perfectly uniform.
    pub lb: Tensor,
    /// Router z-loss, summed over layers.
    pub router_z: Tensor,
    /// Top-k assignments per expert, `[layers, E]`, no gradient.
    pub expert_counts: Tensor,
}

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
struct BlockTape {
    input: Tensor,
    graph: Option<(Tensor, MoeOutput)>,
}

/// One MoE layer's output and router statistics.
struct MoeOutput {
    /// `[N, d]` in fp32.
    y: Tensor,
    /// Load-balancing loss of the layer.
    lb: Tensor,
    /// Router z-loss of the layer.
    router_z: Tensor,
    /// Top-k assignments per expert, `[E]`.
    counts: Tensor,
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
const LOGITS_CHUNK_ELEMENTS: i64 = 1 << 26;

/// Held while a model is initialised from libtorch's process-wide generator, so a seeded model
/// is exactly θ⁰ even when other threads of the process (tests, in-process roles) draw too.
static INIT_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl MoeModel {
    /// The model `new` makes after seeding libtorch's generator with `seed`, drawn under a
    /// process-wide lock so concurrent draws elsewhere cannot change it.
    pub fn seeded(cfg: &ModelConfig, device: Device, seed: u64) -> Result<Self> {
        let _rng = INIT_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(seed as i64);
        Self::new(cfg, device)
    }

    /// A freshly initialised model: truncated normal(0.02) matrices, norms at 1, drawn from
    /// libtorch's generator as it stands (`seeded` fixes it).
    pub fn new(cfg: &ModelConfig, device: Device) -> Result<Self> {
        cfg.validate()?;
        let (d, v, hd) = (
            cfg.d_model as i64,
            cfg.vocab_size as i64,
            cfg.head_dim as i64,
        );
        let (q, kv) = (cfg.n_heads as i64 * hd, cfg.n_kv_heads as i64 * hd);
        let (e, h) = (cfg.n_experts as i64, cfg.expert_hidden as i64);
        let w = |shape: &[i64]| trunc_normal(shape, cfg.init_std, device);
        let ones = |n: i64| Tensor::ones([n], (Kind::Float, device));
        let (qn, kn) = match cfg.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::Full => (Some(ones(q)), Some(ones(kv))),
            QkNorm::PerHead => (Some(ones(hd)), Some(ones(hd))),
        };
        let layers = (0..cfg.n_layers)
            .map(|_| Layer {
                attn_norm: ones(d),
                q_proj: w(&[q, d]),
                k_proj: w(&[kv, d]),
                v_proj: w(&[kv, d]),
                o_proj: w(&[d, q]),
                qkv_bias: cfg.qkv_bias.then(|| {
                    let zeros = |n: i64| Tensor::zeros([n], (Kind::Float, device));
                    [zeros(q), zeros(kv), zeros(kv)]
                }),
                q_norm: qn.as_ref().map(|t| t.copy()),
                k_norm: kn.as_ref().map(|t| t.copy()),
                ffn_norm: ones(d),
                router: w(&[e, d]),
                experts: (0..e)
                    .map(|_| Expert {
                        gate: w(&[h, d]),
                        up: w(&[h, d]),
                        down: w(&[d, h]),
                    })
                    .collect(),
                slots: Slots::new(&vec![false; cfg.n_experts], device),
            })
            .collect();
        Ok(MoeModel {
            cfg: cfg.clone(),
            compute: Kind::Float,
            lb_count_scale: None,
            moe_kernel: MoeKernel::Loop,
            frozen_bf16: false,
            device,
            logits_chunk: LOGITS_CHUNK_ELEMENTS,
            fused_head_accumulate: true,
            rope_cache: std::sync::Mutex::new(None),
            step: std::sync::Mutex::new(None),
            embed: w(&[v, d]),
            layers,
            final_norm: ones(d),
            head: w(&[v, d]),
        })
    }

    /// Logits `[B, T, V]` for tokens `[B, T]`, plus router statistics (for evaluation; training
    /// goes through [`MoeModel::backward`], which never builds the whole logits tensor).
    pub fn forward(&self, tokens: &Tensor) -> (Tensor, RouterAux) {
        let (h, aux) = self.trunk(tokens);
        (self.linear(&h, &self.head), aux)
    }

    /// Embedding, every block and the final norm: hidden states `[B, T, d]` before the head.
    fn trunk(&self, tokens: &Tensor) -> (Tensor, RouterAux) {
        let (cos, sin) = self.rope(tokens);
        let mut x = Tensor::embedding(&self.embed, tokens, -1, false, false);
        let mut moes = Vec::with_capacity(self.layers.len());
        let step = self.step_copies();
        for (l, layer) in self.layers.iter().enumerate() {
            let copies = step.as_ref().map(|s| &s.layers[l]);
            let (y, moe) = self.block(layer, copies, &x, &cos, &sin);
            x = y;
            moes.push(moe);
        }
        (
            rms_norm(&x, &self.final_norm, self.cfg.norm_eps),
            router_aux(moes),
        )
    }

    /// One decoder block, `[B, T, d]` to `[B, T, d]`, with its MoE layer's statistics; it
    /// multiplies by the step's `copies` when there are any.
    fn block(
        &self,
        layer: &Layer,
        copies: Option<&LayerCopies>,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> (Tensor, MoeOutput) {
        let cfg = &self.cfg;
        let (b, t, d) = x.size3().expect("hidden states are [batch, seq, d]");
        // Residual adds allocate (`x + y`), never `+=`: the RMSNorm backward still needs x.
        match cfg.norm_placement {
            NormPlacement::Pre => {
                let h = rms_norm(x, &layer.attn_norm, cfg.norm_eps);
                let x = x + self.attention(layer, copies, &h, cos, sin);
                let h = rms_norm(&x, &layer.ffn_norm, cfg.norm_eps);
                let moe = self.moe(layer, copies, &h.view([b * t, d]));
                (x + moe.y.view([b, t, d]), moe)
            }
            NormPlacement::Post => {
                let a = self.attention(layer, copies, x, cos, sin);
                let x = x + rms_norm(&a, &layer.attn_norm, cfg.norm_eps);
                let moe = self.moe(layer, copies, &x.view([b * t, d]));
                let y = rms_norm(&moe.y.view([b, t, d]), &layer.ffn_norm, cfg.norm_eps);
                (x + y, moe)
            }
        }
    }

    fn attention(
        &self,
        layer: &Layer,
        copies: Option<&LayerCopies>,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Tensor {
        let cfg = &self.cfg;
        let (b, t, _) = x.size3().unwrap();
        let (hq, hkv, hd) = (
            cfg.n_heads as i64,
            cfg.n_kv_heads as i64,
            cfg.head_dim as i64,
        );
        let (mut q, mut k, mut v) = match copies {
            // One matmul for all three, split along the output.
            Some(c) => {
                let qkv = self.matmul(x, &c.qkv);
                let mut parts = qkv.split_with_sizes([hq * hd, hkv * hd, hkv * hd], -1);
                let v = parts.pop().expect("three parts");
                let k = parts.pop().expect("three parts");
                (parts.pop().expect("three parts"), k, v)
            }
            None => (
                self.linear(x, &layer.q_proj),
                self.linear(x, &layer.k_proj),
                self.linear(x, &layer.v_proj),
            ),
        };
        if let Some([qb, kb, vb]) = &layer.qkv_bias {
            // In place is safe: the matmul backward does not need its own output.
            let kind = q.kind();
            q += qb.to_kind(kind);
            k += kb.to_kind(kind);
            v += vb.to_kind(kind);
        }
        if let (QkNorm::Full, Some(qn), Some(kn)) = (cfg.qk_norm, &layer.q_norm, &layer.k_norm) {
            q = rms_norm(&q, qn, cfg.norm_eps);
            k = rms_norm(&k, kn, cfg.norm_eps);
        }
        let heads = |y: Tensor, n: i64| y.view([b, t, n, hd]).transpose(1, 2);
        let (mut q, mut k, v) = (heads(q, hq), heads(k, hkv), heads(v, hkv));
        if let (QkNorm::PerHead, Some(qn), Some(kn)) = (cfg.qk_norm, &layer.q_norm, &layer.k_norm) {
            q = rms_norm(&q, qn, cfg.norm_eps);
            k = rms_norm(&k, kn, cfg.norm_eps);
        }
        let q = apply_rope(&q, cos, sin);
        let k = apply_rope(&k, cos, sin);
        let y = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            0.0,
            true,
            None,
            hq != hkv,
        );
        let y = y.transpose(1, 2).reshape([b, t, hq * hd]);
        match copies {
            Some(c) => self.matmul(&y, &c.o),
            None => self.linear(&y, &layer.o_proj),
        }
    }

    /// Dropless top-k MoE over flattened tokens `[N, d]`.
    fn moe(&self, layer: &Layer, copies: Option<&LayerCopies>, x: &Tensor) -> MoeOutput {
        let cfg = &self.cfg;
        let (e, k) = (cfg.n_experts as i64, cfg.top_k as i64);
        let router_logits = x.matmul(&layer.router.tr()).to_kind(Kind::Float);
        let probs = router_logits.softmax(-1, Kind::Float);
        let (mut weights, experts) = probs.topk(k, -1, true, false);
        if cfg.normalize_topk {
            weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        }

        // Group the N·k (token, expert) assignments by expert: one sort, one gather of the
        // tokens in that order (whose backward is one scatter, not one per expert); then each
        // expert runs on its contiguous slice, and one scatter-add combines the outputs.
        let flat_experts = experts.view([-1]);
        // The grouped kernel takes the experts in slot order (trained first); the loop runs
        // them in index order.
        let key = match self.moe_kernel {
            MoeKernel::Loop => flat_experts.shallow_clone(),
            MoeKernel::Grouped => layer.slots.slot_of_t.index_select(0, &flat_experts),
        };
        let (_, order) = key.sort_stable(true, 0, false);
        // Not `bincount`, which reads the range back to the host on CUDA.
        let counts = Tensor::zeros([e], (Kind::Int64, x.device())).scatter_add(
            0,
            &flat_experts,
            &flat_experts.ones_like(),
        );
        let token_of = order.divide_scalar_mode(k, "floor");
        let grouped = x.index_select(0, &token_of);
        let expert_out = match self.moe_kernel {
            MoeKernel::Loop => self.experts_loop(layer, copies, &grouped, &counts),
            MoeKernel::Grouped => self.experts_grouped(layer, copies, &grouped, &counts),
        }
        .to_kind(Kind::Float);
        let w = weights.view([-1]).index_select(0, &order).unsqueeze(-1);
        let y = x
            .to_kind(Kind::Float)
            .zeros_like()
            .index_add(0, &token_of, &(expert_out * w));

        let lb = match &self.lb_count_scale {
            Some(scale) => {
                load_balancing_loss(&probs, &(counts.to_kind(Kind::Float) * scale), cfg.top_k)
            }
            None => load_balancing_loss(&probs, &counts, cfg.top_k),
        };
        let router_z = router_logits
            .logsumexp([-1], false)
            .square()
            .mean(Kind::Float);
        MoeOutput {
            y,
            lb,
            router_z,
            counts,
        }
    }

    /// Expert outputs for tokens `[N·k, d]` grouped by expert (`counts[e]` rows each), one
    /// matmul per expert and matrix; the counts come back to the host once.
    fn experts_loop(
        &self,
        layer: &Layer,
        copies: Option<&LayerCopies>,
        grouped: &Tensor,
        counts: &Tensor,
    ) -> Tensor {
        let host_counts = Vec::<i64>::try_from(&counts.to_device(Device::Cpu)).unwrap();
        let mut outputs = Vec::with_capacity(layer.experts.len());
        let mats = self.expert_mats(layer, copies);
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
    fn expert_mats<'a>(
        &self,
        layer: &'a Layer,
        copies: Option<&LayerCopies>,
    ) -> Vec<ExpertMats<'a>> {
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
    fn experts_grouped(
        &self,
        layer: &Layer,
        copies: Option<&LayerCopies>,
        grouped: &Tensor,
        counts: &Tensor,
    ) -> Tensor {
        let offsets = counts
            .index_select(0, &layer.slots.expert_of_t)
            .cumsum(0, Kind::Int);
        let ([gate_up, down], [trained_gate_up, trained_down]) =
            match copies.map(LayerCopies::share) {
                Some(c) => (c.experts, c.trained),
                None => self.expert_stacks(layer),
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
    fn expert_stacks(&self, layer: &Layer) -> ([Tensor; 2], [Tensor; 2]) {
        let kind = self.compute;
        let mats = self.expert_mats(layer, None);
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
        let copies = |l: usize| step.as_ref().map(|s| &s.layers[l]);
        for (l, layer) in self.layers.iter().enumerate() {
            let (tape, y) = if checkpoint {
                let (y, moe) = tch::no_grad(|| self.block(layer, copies(l), &x, &cos, &sin));
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
                let (y, moe) = self.block(layer, copies(l), &input, &cos, &sin);
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
        for (l, (layer, tape)) in self.layers.iter().zip(tapes).enumerate().rev() {
            let (x, (y, moe)) = match tape.graph {
                Some(graph) => (tape.input, graph),
                None => {
                    let x = tape.input.set_requires_grad(true);
                    let out = self.block(layer, copies(l), &x, &cos, &sin);
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
}

/// Settings, parameters and (de)serialization.
impl MoeModel {
    /// Runs matmuls in `kind` (`Kind::BFloat16` for mixed precision); weights stay fp32.
    pub fn set_compute_kind(&mut self, kind: Kind) {
        self.compute = kind;
    }

    /// Keeps frozen experts as bf16 copies on the compute device and their exact fp32
    /// masters in host memory (half the device memory of a frozen expert, and no cast per
    /// matmul); takes effect at the next [`MoeModel::set_trainable`].
    pub fn set_frozen_experts_bf16(&mut self, on: bool) {
        self.frozen_bf16 = on;
    }

    /// How MoE layers run their experts (the loop unless set).
    pub fn set_moe_kernel(&mut self, kernel: MoeKernel) {
        self.moe_kernel = kernel;
    }

    /// Multiplies expert `e`'s load-balancing count by `scale[e]` (`[E]`); `None` disables.
    /// A SPES node uses it to penalise routing to its own experts less early in training.
    pub fn set_lb_count_scale(&mut self, scale: Option<Tensor>) {
        self.lb_count_scale = scale;
    }

    /// The scale set by [`MoeModel::set_lb_count_scale`], if any.
    pub fn lb_count_scale(&self) -> Option<&Tensor> {
        self.lb_count_scale.as_ref()
    }

    /// Caps the LM-head loss's working set at about `elements` fp32 logits per chunk (rows of
    /// the batch at a time); smaller saves memory, larger may run faster.
    pub fn set_logits_chunk(&mut self, elements: i64) {
        self.logits_chunk = elements.max(1);
    }

    /// On CUDA in bf16, accumulates the LM head's gradient in fp32 inside its product (`addmm`
    /// with an fp32 output, on by default) or, off, as elsewhere: each chunk's bf16 product
    /// added to it (what `spes bench step --compare-head` compares).
    pub fn set_fused_head_accumulate(&mut self, on: bool) {
        self.fused_head_accumulate = on;
    }

    /// RoPE cos and sin tables for the positions of `tokens` `[B, T]`.
    fn rope(&self, tokens: &Tensor) -> (Tensor, Tensor) {
        let (t, device) = (tokens.size()[1], tokens.device());
        let mut cache = self.rope_cache.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |c: &RopeTables| c.device == device && c.cos.size()[0] >= t;
        if !cache.as_ref().is_some_and(fits) {
            let len = t.max(self.cfg.context_length as i64);
            let (cos, sin) =
                rope_tables(len, self.cfg.head_dim as i64, self.cfg.rope_theta, device);
            *cache = Some(RopeTables { device, cos, sin });
        }
        let c = cache.as_ref().expect("filled above");
        (c.cos.narrow(0, 0, t), c.sin.narrow(0, 0, t))
    }

    /// `x · wᵀ` in the compute precision.
    fn linear(&self, x: &Tensor, w: &Tensor) -> Tensor {
        x.to_kind(self.compute)
            .matmul(&w.to_kind(self.compute).tr())
    }

    /// `x · wᵀ` for a weight `w` already in the compute precision (a step copy).
    fn matmul(&self, x: &Tensor, w: &Tensor) -> Tensor {
        x.to_kind(self.compute).matmul(&w.tr())
    }

    /// The step's compute copies (sharing their storage), if a step is on.
    fn step_copies(&self) -> Option<StepCopies> {
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
    fn layer_copies(&self, l: &Layer) -> LayerCopies {
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
    fn flush_grads(&self, layer: Option<usize>) {
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

    /// Every parameter, in a fixed order, by its Hugging Face OLMoE name and SPES role.
    pub fn params(&self) -> Vec<Param> {
        let mut out = Vec::new();
        let mut push = |name: String, role: Role, t: &Tensor| {
            out.push(Param {
                name,
                role,
                tensor: t.shallow_clone(),
            })
        };
        push(
            "model.embed_tokens.weight".into(),
            Role::Shared,
            &self.embed,
        );
        // Hugging Face names the norms by position: Llama/OLMoE's "post_attention_layernorm" is
        // the MoE input norm, OLMo2/FlexOlmo's normalises the attention output.
        let (attn_norm, ffn_norm) = match self.cfg.norm_placement {
            NormPlacement::Pre => ("input_layernorm", "post_attention_layernorm"),
            NormPlacement::Post => ("post_attention_layernorm", "post_feedforward_layernorm"),
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let s = Role::Shared;
            push(format!("{p}.{attn_norm}.weight"), s, &layer.attn_norm);
            push(format!("{p}.self_attn.q_proj.weight"), s, &layer.q_proj);
            push(format!("{p}.self_attn.k_proj.weight"), s, &layer.k_proj);
            push(format!("{p}.self_attn.v_proj.weight"), s, &layer.v_proj);
            push(format!("{p}.self_attn.o_proj.weight"), s, &layer.o_proj);
            if let Some(b) = &layer.qkv_bias {
                for (name, t) in ["q_proj", "k_proj", "v_proj"].iter().zip(b) {
                    push(format!("{p}.self_attn.{name}.bias"), s, t);
                }
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                push(format!("{p}.self_attn.q_norm.weight"), s, qn);
                push(format!("{p}.self_attn.k_norm.weight"), s, kn);
            }
            push(format!("{p}.{ffn_norm}.weight"), s, &layer.ffn_norm);
            push(router_tensor_name(l), s, &layer.router);
            for (i, ex) in layer.experts.iter().enumerate() {
                let role = Role::Expert { layer: l, index: i };
                for (part, t) in EXPERT_PARTS.iter().zip([&ex.gate, &ex.up, &ex.down]) {
                    push(expert_tensor_name(l, i, part), role, t);
                }
            }
        }
        push("model.norm.weight".into(), Role::Shared, &self.final_norm);
        push("lm_head.weight".into(), Role::Shared, &self.head);
        out
    }

    /// Marks each parameter trainable or frozen. Frozen ones get no gradient, ever.
    /// With frozen experts resident in bf16 ([`MoeModel::set_frozen_experts_bf16`]), a newly
    /// frozen expert's masters move to host memory and a newly trained one's come back.
    pub fn set_trainable(&mut self, trainable: impl Fn(Role) -> bool) {
        for p in self.params() {
            if p.role == Role::Shared {
                let _ = p.tensor.set_requires_grad(trainable(p.role));
            }
        }
        let (bf16, device) = (self.frozen_bf16, self.device);
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let trains: Vec<bool> = (0..layer.experts.len())
                .map(|e| trainable(Role::Expert { layer: l, index: e }))
                .collect();
            for (ex, &train) in layer.experts.iter_mut().zip(&trains) {
                ex.place(train, bf16, device);
            }
            layer.slots = Slots::new(&trains, device);
            if bf16 {
                let (e, (h, d)) = (trains.len() as i64, layer.experts[0].gate.size2().unwrap());
                let kind = (Kind::BFloat16, device);
                layer.slots.resident = Some([
                    Tensor::empty([e, 2 * h, d], kind),
                    Tensor::empty([e, d, h], kind),
                ]);
                layer.refresh_resident();
            }
        }
    }

    /// The parameters that currently require a gradient.
    pub fn trainable_params(&self) -> Vec<Param> {
        self.params()
            .into_iter()
            .filter(|p| p.tensor.requires_grad())
            .collect()
    }

    /// Overwrites parameters from named tensors. Every parameter must be present with its shape.
    pub fn load(&self, named: &[(String, Tensor)], source: &str) -> Result<()> {
        let map: std::collections::HashMap<&str, &Tensor> =
            named.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let params = self.params();
        for p in &params {
            let src = map
                .get(p.name.as_str())
                .with_context(|| format!("{source}: missing tensor `{}`", p.name))?;
            if src.size() != p.tensor.size() {
                bail!(
                    "{source}: tensor `{}` has shape {:?}, expected {:?}",
                    p.name,
                    src.size(),
                    p.tensor.size()
                );
            }
        }
        if map.len() != params.len() {
            let known: std::collections::HashSet<&str> =
                params.iter().map(|p| p.name.as_str()).collect();
            let extra: Vec<&&str> = map.keys().filter(|k| !known.contains(**k)).collect();
            bail!("{source}: unexpected tensors {extra:?} for this model configuration");
        }
        tch::no_grad(|| {
            for p in &params {
                let mut dst = p.tensor.shallow_clone();
                dst.copy_(map[p.name.as_str()]);
            }
        });
        self.refresh_resident();
        Ok(())
    }

    /// Brings the bf16 copies of frozen experts up to date after their masters changed in
    /// place (a delta applied to [`MoeModel::params`]); [`MoeModel::load`] does it itself.
    pub fn refresh_resident(&self) {
        for layer in &self.layers {
            layer.refresh_resident();
        }
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

/// erf(3/√2): sampling erfinv(u) for u in ±this gives a normal truncated at ±3σ.
const ERF_3_SIGMA: f64 = 0.997_300_203_936_739_8;

/// Truncated normal at ±3σ by inverse-CDF sampling, as PyTorch's `trunc_normal_` does it.
fn trunc_normal(shape: &[i64], std: f64, device: Device) -> Tensor {
    let mut u = Tensor::empty(shape, (Kind::Float, device)).uniform_(-ERF_3_SIGMA, ERF_3_SIGMA);
    let _ = u.erfinv_();
    u * (std * std::f64::consts::SQRT_2)
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let n = weight.size()[0];
    x.to_kind(Kind::Float)
        .rms_norm([n], Some(weight), eps)
        .to_kind(x.kind())
}

/// `[T, head_dim]` cos and sin tables, non-interleaved halves (HF `rotate_half` convention).
fn rope_tables(t: i64, head_dim: i64, theta: f64, device: Device) -> (Tensor, Tensor) {
    let inv_freq = Tensor::arange_start_step(0, head_dim, 2, (Kind::Float, device))
        .divide_scalar(head_dim as f64)
        .multiply_scalar(-theta.ln())
        .exp();
    let pos = Tensor::arange(t, (Kind::Float, device));
    let freqs = pos.outer(&inv_freq);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos(), emb.sin())
}

/// Rotates `x` `[B, H, T, hd]` by position.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos.to_kind(x.kind()) + rotated * sin.to_kind(x.kind())
}

/// Backward from `objective`, unless nothing that needs a gradient depends on it.
fn run_backward(objective: &Tensor) {
    let _backward = enter(Phase::Backward);
    if objective.requires_grad() {
        objective.backward();
    }
}

impl MoeOutput {
    /// The statistics without their graph (the output itself is not needed).
    fn detached(&self) -> MoeOutput {
        MoeOutput {
            y: Tensor::new(),
            lb: self.lb.detach(),
            router_z: self.router_z.detach(),
            counts: self.counts.shallow_clone(),
        }
    }
}

/// Per-layer MoE statistics gathered into the model's router statistics.
fn router_aux(moes: Vec<MoeOutput>) -> RouterAux {
    let (mut lb, mut rz, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    for m in moes {
        lb.push(m.lb);
        rz.push(m.router_z);
        counts.push(m.counts);
    }
    RouterAux {
        lb: Tensor::stack(&lb, 0).mean(Kind::Float),
        router_z: Tensor::stack(&rz, 0).sum(Kind::Float),
        expert_counts: Tensor::stack(&counts, 0),
    }
}

/// One layer's load-balancing loss `E/(T·k) · Σ_e c_e · p̄_e` (1.0 when uniform).
///
/// `probs` is `[T, E]` router softmax, `counts` the (possibly scaled) top-k assignments per
/// expert; no gradient flows through the counts.
pub fn load_balancing_loss(probs: &Tensor, counts: &Tensor, top_k: usize) -> Tensor {
    let (t, e) = probs.size2().unwrap();
    let c = counts.detach().to_kind(Kind::Float);
    let p_mean = probs.mean_dim(0, false, Kind::Float);
    (c * p_mean).sum(Kind::Float) * (e as f64 / (t as f64 * top_k as f64))
}
