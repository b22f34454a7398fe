//! What the spes-model test binaries share: a small config and loss weights.
#![allow(dead_code)]

use spes_model::{LossWeights, ModelConfig, NormPlacement, QkNorm};

/// A two-layer model of six experts, small enough for exact CPU comparisons.
pub fn small(qk_norm: QkNorm, n_kv_heads: usize, normalize_topk: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 97,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads,
        head_dim: 8,
        n_experts: 6,
        top_k: 2,
        expert_hidden: 24,
        context_length: 16,
        rope_theta: 10_000.0,
        qk_norm,
        normalize_topk,
        norm_eps: 1e-6,
        init_std: 0.02,
        norm_placement: NormPlacement::Pre,
        qkv_bias: false,
    }
}

pub const W: LossWeights = LossWeights {
    z_loss: 1e-4,
    lb: 0.01,
    router_z: 0.001,
};
