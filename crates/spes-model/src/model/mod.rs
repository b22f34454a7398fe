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
//!
//! This file reads top to bottom: the names, the model's fields, its constructor, `forward`
//! (trunk, block, attention, MoE). Each layer multiplies by its weights for the step under way
//! ([`weights`]: the mixed-precision copies, or the masters); beside it are the tensors of a
//! layer ([`layer`]), the MoE kernels ([`experts`]), the training machinery (the staged
//! backward, the chunked LM head and the losses: [`train`]) and the settings, parameters and
//! loading ([`params`]).

mod experts;
mod layer;
mod params;
mod train;
mod weights;

pub use train::{define_grads, LossWeights, Losses, Stage};

use crate::config::{ModelConfig, NormPlacement, QkNorm};
use anyhow::Result;
use layer::{Expert, Layer, Slots};
use tch::{Device, Kind, Tensor};
use train::LOGITS_CHUNK_ELEMENTS;
use weights::{LayerWeights, StepCopies};

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
    /// Load-balancing counts `[layers, E]` that replace each layer's own ([`MoeModel::set_lb_counts`]).
    lb_counts: Option<Tensor>,
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
            lb_counts: None,
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
        for l in 0..self.layers.len() {
            let (y, moe) = self.block(&self.weights(l, step.as_ref()), &x, &cos, &sin);
            x = y;
            moes.push(moe);
        }
        (
            rms_norm(&x, &self.final_norm, self.cfg.norm_eps),
            router_aux(moes),
        )
    }

    /// One decoder block, `[B, T, d]` to `[B, T, d]`, with its MoE layer's statistics; it
    /// multiplies by its weights `w` for this step.
    fn block(
        &self,
        w: &LayerWeights,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> (Tensor, MoeOutput) {
        let (cfg, layer) = (&self.cfg, w.layer);
        let (b, t, d) = x.size3().expect("hidden states are [batch, seq, d]");
        // Residual adds allocate (`x + y`), never `+=`: the RMSNorm backward still needs x.
        match cfg.norm_placement {
            NormPlacement::Pre => {
                let h = rms_norm(x, &layer.attn_norm, cfg.norm_eps);
                let x = x + self.attention(w, &h, cos, sin);
                let h = rms_norm(&x, &layer.ffn_norm, cfg.norm_eps);
                let moe = self.moe(w, &h.view([b * t, d]));
                (x + moe.y.view([b, t, d]), moe)
            }
            NormPlacement::Post => {
                let a = self.attention(w, x, cos, sin);
                let x = x + rms_norm(&a, &layer.attn_norm, cfg.norm_eps);
                let moe = self.moe(w, &x.view([b * t, d]));
                let y = rms_norm(&moe.y.view([b, t, d]), &layer.ffn_norm, cfg.norm_eps);
                (x + y, moe)
            }
        }
    }

    /// Causal self-attention with QK-norm, RoPE and grouped-query heads.
    fn attention(&self, w: &LayerWeights, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (cfg, layer) = (&self.cfg, w.layer);
        let (b, t, _) = x.size3().unwrap();
        let (hq, hkv, hd) = (
            cfg.n_heads as i64,
            cfg.n_kv_heads as i64,
            cfg.head_dim as i64,
        );
        let (mut q, mut k, mut v) = w.qkv(self, x);
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
        w.o(self, &y)
    }

    /// Dropless top-k MoE over flattened tokens `[N, d]`.
    fn moe(&self, w: &LayerWeights, x: &Tensor) -> MoeOutput {
        let (cfg, layer) = (&self.cfg, w.layer);
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
            MoeKernel::Loop => self.experts_loop(w, &grouped, &counts),
            MoeKernel::Grouped => self.experts_grouped(w, &grouped, &counts),
        }
        .to_kind(Kind::Float);
        let gate = weights.view([-1]).index_select(0, &order).unsqueeze(-1);
        let y = x
            .to_kind(Kind::Float)
            .zeros_like()
            .index_add(0, &token_of, &(expert_out * gate));

        let lb_counts = match &self.lb_counts {
            Some(all) => all.get(w.index as i64),
            None => counts.shallow_clone(),
        };
        let lb = match &self.lb_count_scale {
            Some(scale) => {
                load_balancing_loss(&probs, &(lb_counts.to_kind(Kind::Float) * scale), cfg.top_k)
            }
            None => load_balancing_loss(&probs, &lb_counts, cfg.top_k),
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
