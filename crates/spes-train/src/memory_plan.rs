//! What one rank of a node needs in memory to train, by category, before it runs
//! (`spes plan memory`): weights, AdamW moments, gradients, the bf16 weight copies and
//! activations autograd keeps for backward, and the working set of the chunked LM head.
//!
//! Activations are counted tensor by tensor from what `spes-model`'s forward pass keeps for
//! backward (see [`layer_activation_bytes`]); `spes bench step` measures the real peak, and a test
//! holds the two within 15 % on CPU.

use crate::config::RunConfig;
use crate::trainer::{compute_kind, frozen_experts_bf16, moe_kernel, UnionEstimate};
use spes_model::{ModelConfig, MoeKernel};
use tch::{Device, Kind};

/// What to plan for.
#[derive(Clone, Debug)]
pub struct MemoryInput {
    pub model: ModelConfig,
    /// Experts per layer this node trains: `n_experts / nodes` in SPES, all of them
    /// centralized or in DiLoCo.
    pub own_experts: usize,
    /// Data-parallel ranks of the node, which share its AdamW moments (ZeRO-1).
    pub ranks: usize,
    /// Sequences per micro-batch on this rank.
    pub micro_batch: usize,
    pub seq_len: usize,
    /// Bytes per value of the matmuls: 4 (fp32) or 2 (bf16 mixed precision).
    pub compute_bytes: u64,
    pub activation_checkpointing: bool,
    /// The grouped MoE kernel, which keeps a stacked copy of every expert's matrices for
    /// backward (in fp32 too; the loop keeps none there).
    pub grouped_experts: bool,
    /// Frozen experts resident in bf16 on the device, their fp32 masters in host memory
    /// (`train.frozen_experts_bf16`, on by default on CUDA).
    pub frozen_bf16: bool,
    /// Logits per chunk of the LM-head loss (spes-model's default: 2^26).
    pub logits_chunk: u64,
    /// `train.second_moment = "union_estimate"`: a noise average and a gradient copy per
    /// averaged tensor this rank owns.
    pub estimate: Option<UnionEstimate>,
    /// Memory in use before the first tensor: the CUDA context and kernels on a GPU, the
    /// process with libtorch loaded on CPU.
    pub runtime_bytes: u64,
    /// Headroom for the allocator's fragmentation, as a fraction of everything else but the
    /// runtime. Measured on CPU (glibc): the peak is 0–15 % above the live tensors.
    pub slack: f64,
}

/// Bytes by category at the peak of a training step (after the first, when gradients exist).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemoryPlan {
    /// Weights of the experts this node does not train: fp32, or their bf16 copies.
    pub frozen_weights: u64,
    /// fp32 master weights of what it trains (shared parameters and own experts).
    pub trainable_weights: u64,
    /// AdamW's two fp32 moments, this rank's share.
    pub adamw_moments: u64,
    /// fp32 gradients of the trainable weights (every rank holds all of them).
    pub gradients: u64,
    /// bf16 copies of the weights that the matmuls keep for backward (none in fp32).
    pub weight_copies: u64,
    /// What the forward pass keeps for backward, for one micro-batch.
    pub activations: u64,
    /// The larger of the LM head's chunk working set and one block's backward buffers.
    pub workspace: u64,
    /// `train.second_moment = "union_estimate"` (0 without): per averaged tensor this rank
    /// owns, its noise average (AdamW state) and a copy of its gradient (after the first half
    /// of the rows, or this rank's own before the reduction).
    pub second_moment_estimate: u64,
    pub runtime: u64,
    /// The allocator's headroom ([`MemoryInput::slack`]).
    pub slack: u64,
    /// Host memory (not in the total): the fp32 masters of frozen experts resident in bf16.
    pub host_frozen_masters: u64,
}

impl MemoryPlan {
    pub fn total(&self) -> u64 {
        self.frozen_weights
            + self.trainable_weights
            + self.adamw_moments
            + self.gradients
            + self.weight_copies
            + self.activations
            + self.workspace
            + self.second_moment_estimate
            + self.runtime
            + self.slack
    }
}

/// Bytes one block keeps for backward per token, from what each operation of spes-model's
/// forward pass saves (`c`: bytes of a matmul value).
///
/// Per token, with `dq`, `dkv` the query and key/value widths and k experts per token:
/// - norms keep their fp32 inputs (block input, attention residual): 2·4d; the router
///   matmul keeps its fp32 input: 4d;
/// - q/k/v matmuls keep their input: 4d in fp32 (one tensor), 3·2d in bf16 (one cast each);
/// - QK-norm keeps q and k in fp32: 4(dq + dkv); RoPE keeps the normed and the rotated halves
///   of q and k: 2c(dq + dkv); attention keeps q, k, v, its output and log-sum-exp:
///   c(dq + 2dkv) + c·dq + 4·heads; the output projection keeps a contiguous copy: c·dq;
/// - the router keeps its logits and softmax (8E) and the top-k indices, the sort order and
///   each slot's token (3·8k);
/// - per slot: the gathered token (4d in fp32; two bf16 casts, 2·2d, in bf16), gate and up
///   outputs, SiLU output and their product (4cH), and the fp32 expert output weighed by
///   the router (4d).
pub fn layer_activation_bytes(m: &ModelConfig, c: u64) -> u64 {
    let (d, e, k, h) = (
        m.d_model as u64,
        m.n_experts as u64,
        m.top_k as u64,
        m.expert_hidden as u64,
    );
    let (dq, dkv) = (
        (m.n_heads * m.head_dim) as u64,
        (m.n_kv_heads * m.head_dim) as u64,
    );
    let qkv_inputs = if c == 4 { 4 * d } else { 3 * 2 * d };
    let qk_norm = match m.qk_norm {
        spes_model::QkNorm::None => 0,
        _ => 4 * (dq + dkv),
    };
    let attention =
        qk_norm + 2 * c * (dq + dkv) + c * (dq + 2 * dkv) + c * dq + 4 * m.n_heads as u64 + c * dq;
    let router = 8 * e + 3 * 8 * k;
    // The gathered fp32 token in fp32, or its two bf16 casts (gate and up) in bf16: 4d both.
    let experts = k * (4 * d + 4 * c * h + 4 * d);
    3 * 4 * d + qkv_inputs + attention + router + experts
}

impl MemoryInput {
    /// What a node of run `cfg` on `device` with `ranks` ranks plans for, owning `own_experts`
    /// experts per layer: its micro-batch, precision, kernel and frozen-expert residency as the
    /// trainer resolves them, 1 GiB of runtime (`spes plan memory`'s default) and 10 % headroom.
    pub fn of_node(cfg: &RunConfig, device: Device, ranks: usize, own_experts: usize) -> Self {
        let t = &cfg.train;
        let bf16 = compute_kind(t.precision, device) == Kind::BFloat16;
        MemoryInput {
            model: cfg.model.clone(),
            own_experts,
            ranks,
            micro_batch: t.micro_rows(),
            seq_len: t.seq_len,
            compute_bytes: if bf16 { 2 } else { 4 },
            activation_checkpointing: t.activation_checkpointing,
            grouped_experts: moe_kernel(t.moe_kernel, device, compute_kind(t.precision, device))
                == MoeKernel::Grouped,
            frozen_bf16: bf16 && frozen_experts_bf16(t.frozen_experts_bf16, device),
            estimate: UnionEstimate::of(cfg),
            logits_chunk: 1 << 26,
            runtime_bytes: 1 << 30,
            slack: 0.1,
        }
    }
}

/// How many experts per layer a node can own within `budget` bytes: the most whose plan fits
/// (every expert at most), or `Err` with the bytes one expert would need.
pub fn experts_that_fit(i: &MemoryInput, budget: u64) -> Result<usize, u64> {
    let total = |own: usize| {
        plan(&MemoryInput {
            own_experts: own,
            ..i.clone()
        })
        .total()
    };
    let fits = (1..=i.model.n_experts)
        .take_while(|&k| total(k) <= budget)
        .last();
    fits.ok_or_else(|| total(1))
}

const GIB: f64 = (1u64 << 30) as f64;

/// The most experts per layer a node of run `cfg` may own under its `train.memory_gib`
/// (`None`: no budget), or an error saying what would fit: the budget one expert needs, and
/// the other ways to get there.
pub fn node_cap(cfg: &RunConfig, device: Device, ranks: usize) -> anyhow::Result<Option<usize>> {
    let gib = cfg.train.memory_gib;
    if gib <= 0.0 || cfg.sync.mode != crate::config::Mode::Spes {
        return Ok(None);
    }
    let input = MemoryInput::of_node(cfg, device, ranks, 1);
    match experts_that_fit(&input, (gib * GIB) as u64) {
        Ok(k) => Ok(Some(k)),
        Err(one) => anyhow::bail!(
            "train.memory_gib = {gib} GiB holds no expert: owning one expert per layer needs \
             {:.2} GiB at micro-batch {} × {} tokens (spes plan memory counts it); give at least \
             that, or lower train.micro_batch, or set train.activation_checkpointing = true",
            one as f64 / GIB,
            input.micro_batch,
            input.seq_len
        ),
    }
}

/// Bytes at the peak of a training step.
pub fn plan(i: &MemoryInput) -> MemoryPlan {
    let m = &i.model;
    let counts = m.param_counts();
    let (expert, shared) = (counts.per_expert, counts.shared);
    let layers = m.n_layers as u64;
    let own = i.own_experts.min(m.n_experts) as u64;
    let frozen = layers * (m.n_experts as u64 - own) * expert;
    let trainable = shared + layers * own * expert;
    let tokens = (i.micro_batch * i.seq_len) as u64;
    let (d, v, c) = (m.d_model as u64, m.vocab_size as u64, i.compute_bytes);
    let per_layer = layer_activation_bytes(m, c) * tokens;
    // bf16: the step's compute copies of every layer's weights, made once per step (frozen
    // experts already resident in bf16 are not copied again, under either kernel).
    let cast_experts = if i.frozen_bf16 {
        own
    } else {
        m.n_experts as u64
    };
    let layer_weights = (shared - counts.embeddings) / layers.max(1) + cast_experts * expert;
    // fp32: the grouped kernel stacks every expert's matrices at each forward and keeps the
    // stack until the block's backward; the loop multiplies by the masters.
    let copies = |n_layers: u64| match (c, i.grouped_experts) {
        (4, false) => 0,
        (4, true) => 4 * n_layers * m.n_experts as u64 * expert,
        _ => 2 * layers * layer_weights,
    };
    let (activations, weight_copies) = if i.activation_checkpointing {
        // Every block's input, plus one block recomputed with its graph.
        (layers * 4 * d * tokens + per_layer, copies(1))
    } else {
        (layers * per_layer, copies(layers))
    };
    // The head, per chunk of rows: the logits in the compute precision and their fp32
    // log-softmax (the gradient is written over one of them), and in bf16 its weight's cast
    // and one chunk's product for its gradient; then the hidden states' gradient.
    let rows = (i.logits_chunk / v).clamp(1, tokens.max(1));
    let head = (c + 4) * rows * v + 2 * c * v * d * u64::from(c != 4) + 2 * 4 * tokens * d;
    let mut p = MemoryPlan {
        frozen_weights: if i.frozen_bf16 { 2 } else { 4 } * frozen,
        trainable_weights: 4 * trainable,
        adamw_moments: 8 * trainable.div_ceil(i.ranks.max(1) as u64),
        gradients: 4 * trainable,
        weight_copies,
        activations,
        workspace: head.max(per_layer),
        second_moment_estimate: i.estimate.map_or(0, |e| {
            let averaged = if e.experts { trainable } else { shared };
            8 * averaged.div_ceil(i.ranks.max(1) as u64)
        }),
        runtime: 0,
        slack: 0,
        host_frozen_masters: if i.frozen_bf16 { 4 * frozen } else { 0 },
    };
    p.slack = (p.total() as f64 * i.slack) as u64;
    p.runtime = i.runtime_bytes;
    p
}

/// The largest micro-batch (sequences) whose plan fits in `budget` bytes, if any.
pub fn largest_micro_batch(i: &MemoryInput, budget: u64) -> Option<usize> {
    let fits = |b: usize| {
        plan(&MemoryInput {
            micro_batch: b,
            ..i.clone()
        })
        .total()
            <= budget
    };
    if !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1usize, 2usize);
    while fits(hi) && hi < 1 << 20 {
        (lo, hi) = (hi, hi * 2);
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(preset: &str, own: usize) -> MemoryInput {
        MemoryInput {
            model: ModelConfig::preset(preset).unwrap(),
            own_experts: own,
            ranks: 1,
            micro_batch: 4,
            seq_len: 1024,
            compute_bytes: 2,
            activation_checkpointing: false,
            grouped_experts: true,
            frozen_bf16: false,
            estimate: None,
            logits_chunk: 1 << 26,
            runtime_bytes: 1 << 30,
            slack: 0.0,
        }
    }

    /// The second-moment estimate keeps two fp32 values per averaged tensor (the shared ones in
    /// SPES, every trained one in DiLoCo): the noise average and a gradient copy, each rank of
    /// several for the tensors it owns.
    #[test]
    fn the_second_moment_estimate_costs_two_values_of_the_averaged_tensors() {
        let i = input("1b", 1);
        let counts = i.model.param_counts();
        let with = |experts| {
            plan(&MemoryInput {
                estimate: Some(UnionEstimate { nodes: 16, experts }),
                ..i.clone()
            })
        };
        assert_eq!(plan(&i).second_moment_estimate, 0);
        assert_eq!(with(false).second_moment_estimate, 8 * counts.shared);
        assert_eq!(with(false).total() - plan(&i).total(), 8 * counts.shared);
        let trained = counts.shared + i.model.n_layers as u64 * counts.per_expert;
        assert_eq!(with(true).second_moment_estimate, 8 * trained);
        let ranks = plan(&MemoryInput {
            ranks: 8,
            estimate: Some(UnionEstimate {
                nodes: 16,
                experts: false,
            }),
            ..i.clone()
        });
        assert_eq!(ranks.second_moment_estimate, 8 * counts.shared.div_ceil(8));
    }

    #[test]
    fn a_budget_caps_the_experts_a_node_owns() {
        let i = input("1b", 1);
        let at = |own: usize| {
            plan(&MemoryInput {
                own_experts: own,
                ..i.clone()
            })
            .total()
        };
        assert_eq!(experts_that_fit(&i, at(5)), Ok(5));
        assert_eq!(experts_that_fit(&i, at(5) + 1), Ok(5));
        assert_eq!(experts_that_fit(&i, at(6) - 1), Ok(5));
        assert_eq!(experts_that_fit(&i, u64::MAX), Ok(i.model.n_experts));
        assert_eq!(experts_that_fit(&i, at(1) - 1), Err(at(1)));
        // Halving the experts halves their moments: the shared part is the same.
        let (four, two) = (plan(&input("1b", 4)), plan(&input("1b", 2)));
        let shared = plan(&input("1b", 0)).adamw_moments;
        assert_eq!(
            four.adamw_moments - shared,
            2 * (two.adamw_moments - shared)
        );
    }

    #[test]
    fn a_node_budget_gives_its_cap_or_says_what_one_expert_needs() {
        let toml = "[model]\npreset = \"tiny\"\n[data]\npath = \"d\"\n[train]\nmax_steps = 10\n\
                    batch_size = 4\nseq_len = 256\n[sync]\nmode = \"spes\"\nsync_steps = 5\n";
        let run = |gib: f64| {
            let sets = [format!("train.memory_gib={gib}")];
            let cfg = RunConfig::parse(toml, &sets).unwrap();
            node_cap(&cfg, Device::Cpu, 1)
        };
        let need = |own: usize| {
            let cfg = RunConfig::parse(toml, &[]).unwrap();
            plan(&MemoryInput::of_node(&cfg, Device::Cpu, 1, own)).total() as f64 / GIB
        };
        assert_eq!(run(0.0).unwrap(), None, "no budget, no cap");
        assert_eq!(run((need(2) + need(3)) / 2.0).unwrap(), Some(2));
        assert_eq!(run(64.0).unwrap(), Some(16));
        let e = run(need(1) * 0.9).unwrap_err().to_string();
        assert!(
            e.contains("holds no expert") && e.contains(&format!("{:.2} GiB", need(1))),
            "{e}"
        );
    }

    #[test]
    fn weights_add_up_and_ranks_split_only_the_moments() {
        let i = input("1b", 4);
        let p = plan(&i);
        let c = i.model.param_counts();
        assert_eq!(p.frozen_weights + p.trainable_weights, 4 * c.total);
        let bf16 = plan(&MemoryInput {
            frozen_bf16: true,
            grouped_experts: false,
            ..i.clone()
        });
        assert_eq!(
            (bf16.frozen_weights, bf16.host_frozen_masters),
            (p.frozen_weights / 2, p.frozen_weights)
        );
        let cast = plan(&MemoryInput {
            grouped_experts: false,
            ..i.clone()
        });
        // Frozen bf16 experts need no cast copies: 12 of 16 experts less, under either
        // kernel (the grouped one multiplies by the resident stack).
        assert_eq!(
            cast.weight_copies - bf16.weight_copies,
            2 * 12 * 12 * c.per_expert
        );
        let bf16_grouped = plan(&MemoryInput {
            frozen_bf16: true,
            ..i.clone()
        });
        assert_eq!(bf16_grouped.weight_copies, bf16.weight_copies);
        assert_eq!(p.gradients, p.trainable_weights);
        assert_eq!(p.adamw_moments, 2 * p.trainable_weights);
        let two = plan(&MemoryInput {
            ranks: 2,
            ..i.clone()
        });
        assert_eq!(two.adamw_moments, p.adamw_moments / 2);
        assert_eq!(two.total(), p.total() - p.adamw_moments / 2);
        // A DiLoCo node trains everything.
        let all = plan(&input("1b", 16));
        assert_eq!(
            (all.frozen_weights, all.trainable_weights),
            (0, 4 * c.total)
        );
    }

    #[test]
    fn checkpointing_and_fp32_change_what_they_should() {
        let i = input("7b", 8);
        let (plain, ckpt) = (
            plan(&i),
            plan(&MemoryInput {
                activation_checkpointing: true,
                ..i.clone()
            }),
        );
        assert!(ckpt.activations * 4 < plain.activations);
        // The step's bf16 copies live through the whole step, checkpointed or not.
        assert_eq!(ckpt.weight_copies, plain.weight_copies);
        let fp32 = plan(&MemoryInput {
            compute_bytes: 4,
            ..i.clone()
        });
        assert_eq!(
            fp32.weight_copies,
            4 * 32 * 16 * i.model.param_counts().per_expert
        );
        let fp32_loop = plan(&MemoryInput {
            compute_bytes: 4,
            grouped_experts: false,
            ..i.clone()
        });
        assert_eq!(fp32_loop.weight_copies, 0);
        assert!(fp32.activations > plain.activations);
        // Activations grow linearly with the micro-batch.
        let double = plan(&MemoryInput {
            micro_batch: 8,
            ..i.clone()
        });
        assert_eq!(double.activations, 2 * plain.activations);
        let slack = plan(&MemoryInput { slack: 0.1, ..i });
        assert_eq!(
            slack.slack,
            ((plain.total() - plain.runtime) as f64 * 0.1) as u64
        );
    }

    #[test]
    fn the_largest_micro_batch_fits_and_one_more_does_not() {
        let i = input("1b", 4);
        let budget = 48u64 << 30;
        let b = largest_micro_batch(&i, budget).unwrap();
        let at = |b| {
            plan(&MemoryInput {
                micro_batch: b,
                ..i.clone()
            })
            .total()
        };
        assert!(at(b) <= budget && at(b + 1) > budget, "{b}");
        assert_eq!(largest_micro_batch(&i, 1 << 30), None);
    }
}
