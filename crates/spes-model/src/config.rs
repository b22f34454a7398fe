//! Model shapes: the built-in presets (docs/design/algorithm.md §1) and analytic parameter counts.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Where QK-norm normalises: over the whole q/k projection (OLMoE) or per head (Qwen3, the 9B).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    Full,
    PerHead,
}

/// Where a block normalises: before each sublayer (Llama, OLMoE, Qwen3) or on each sublayer's
/// output before the residual add (OLMo2, FlexOlmo).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    #[default]
    Pre,
    Post,
}

/// Every shape of the decoder. A TOML `[model]` section may give a `preset` and override any field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub expert_hidden: usize,
    /// Longest sequence the model is trained for (exported as `max_position_embeddings`).
    pub context_length: usize,
    pub rope_theta: f64,
    pub qk_norm: QkNorm,
    /// Renormalise the top-k router probabilities to sum to one (the 9B does).
    pub normalize_topk: bool,
    pub norm_eps: f64,
    pub init_std: f64,
    #[serde(default)]
    pub norm_placement: NormPlacement,
    /// Biases on the q, k and v projections (Qwen2).
    #[serde(default)]
    pub qkv_bias: bool,
}

/// Names accepted by [`ModelConfig::preset`].
pub const PRESETS: &[&str] = &["micro", "tiny", "small", "1b", "7b", "9b"];

/// The Qwen2.5 tokenizer's size, the vocabulary of the paper's runs.
const QWEN_VOCAB: usize = 151_665;

impl ModelConfig {
    /// A built-in shape: `micro` (~50k parameters) is what tests and harnesses run in seconds,
    /// `tiny` trains on two CPU cores in minutes, `small` (~0.12B) is the
    /// largest meant for CPUs; `1b`, `7b`, `9b` are docs/design/algorithm.md §1.
    pub fn preset(name: &str) -> Result<Self> {
        let olmoe = |n_layers, d_model, n_heads, n_experts, top_k, expert_hidden| ModelConfig {
            vocab_size: QWEN_VOCAB,
            d_model,
            n_layers,
            n_heads,
            n_kv_heads: n_heads,
            head_dim: d_model / n_heads,
            n_experts,
            top_k,
            expert_hidden,
            context_length: 2048,
            rope_theta: 500_000.0,
            qk_norm: QkNorm::Full,
            normalize_topk: false,
            norm_eps: 1e-6,
            init_std: 0.02,
            norm_placement: NormPlacement::Pre,
            qkv_bias: false,
        };
        Ok(match name {
            // `tiny`'s form at the least size that still routes, merges and shards.
            "micro" => ModelConfig {
                vocab_size: 512,
                context_length: 32,
                rope_theta: 10_000.0,
                ..olmoe(2, 32, 2, 8, 2, 32)
            },
            "tiny" => ModelConfig {
                vocab_size: 8192,
                context_length: 256,
                rope_theta: 10_000.0,
                ..olmoe(4, 256, 4, 16, 2, 256)
            },
            // ~0.12B parameters: the largest that trains on a CPU in reasonable time.
            "small" => ModelConfig {
                vocab_size: 8192,
                context_length: 512,
                rope_theta: 10_000.0,
                ..olmoe(8, 512, 8, 16, 2, 512)
            },
            "1b" => olmoe(12, 768, 12, 16, 2, 2048),
            // RoPE θ as in the authors' 7B config.
            "7b" => ModelConfig {
                rope_theta: 32_000.0,
                ..olmoe(16, 2048, 16, 32, 4, 2048)
            },
            "9b" => ModelConfig {
                // Qwen3-1.7B's embedding rows, so its upcycled checkpoint loads as is.
                vocab_size: 151_936,
                n_kv_heads: 8,
                head_dim: 128,
                context_length: 4096,
                rope_theta: 1_000_000.0,
                qk_norm: QkNorm::PerHead,
                normalize_topk: true,
                ..olmoe(28, 2048, 16, 8, 2, 6144)
            },
            other => bail!("unknown model preset `{other}`; expected one of {PRESETS:?}"),
        })
    }

    /// Checks relations between fields that serde cannot.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("n_experts", self.n_experts),
            ("top_k", self.top_k),
            ("expert_hidden", self.expert_hidden),
            ("context_length", self.context_length),
        ];
        for (key, v) in positive {
            if v == 0 {
                bail!("model.{key} must be > 0");
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "model.n_heads ({}) must be a multiple of model.n_kv_heads ({})",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("model.head_dim ({}) must be even for RoPE", self.head_dim);
        }
        if self.top_k > self.n_experts {
            bail!(
                "model.top_k ({}) must be <= model.n_experts ({})",
                self.top_k,
                self.n_experts
            );
        }
        Ok(())
    }

    /// The alignment the grouped MoE kernel needs: PyTorch's `_grouped_mm` wants every row of
    /// its operands 16-byte aligned, so `d_model` and `expert_hidden` must be multiples of 8
    /// (bf16). PyTorch checks it on CUDA only, so a config that trains on a CPU could throw on
    /// a GPU; run configs are held to it everywhere ([`crate::MoeModel::new`] is not, so tests
    /// can build models of any width).
    pub fn check_alignment(&self) -> Result<()> {
        for (key, v) in [
            ("d_model", self.d_model),
            ("expert_hidden", self.expert_hidden),
        ] {
            if !v.is_multiple_of(8) {
                bail!(
                    "model.{key} ({v}) must be a multiple of 8: the grouped MoE kernel on a GPU \
                     needs 16-byte aligned rows"
                );
            }
        }
        Ok(())
    }

    /// Parameter counts derived from the shapes alone.
    pub fn param_counts(&self) -> ParamCounts {
        let (d, l) = (self.d_model as u64, self.n_layers as u64);
        let q = (self.n_heads * self.head_dim) as u64;
        let kv = (self.n_kv_heads * self.head_dim) as u64;
        let qk_norm = match self.qk_norm {
            QkNorm::None => 0,
            QkNorm::Full => q + kv,
            QkNorm::PerHead => 2 * self.head_dim as u64,
        };
        let bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        let attention = d * q + 2 * d * kv + q * d + qk_norm + bias;
        let per_layer_shared = attention + 2 * d + d * self.n_experts as u64;
        let embeddings = 2 * self.vocab_size as u64 * d;
        let shared = l * per_layer_shared + embeddings + d;
        let per_expert = 3 * d * self.expert_hidden as u64;
        let experts = l * self.n_experts as u64 * per_expert;
        ParamCounts {
            total: shared + experts,
            active: shared + l * self.top_k as u64 * per_expert,
            shared,
            per_expert,
            embeddings,
        }
    }

    /// The shape of every parameter tensor, without building the model: the shared ones
    /// (`expert` false) in [`crate::MoeModel::params`]' order, then one expert's tensors of every layer
    /// (`expert` true), which every expert repeats. The planners count bytes from it.
    pub fn shapes(&self) -> Vec<(Vec<i64>, bool)> {
        let (d, v) = (self.d_model as i64, self.vocab_size as i64);
        let q = (self.n_heads * self.head_dim) as i64;
        let kv = (self.n_kv_heads * self.head_dim) as i64;
        let h = self.expert_hidden as i64;
        let mut out = vec![(vec![v, d], false)];
        for _ in 0..self.n_layers {
            out.extend(
                [vec![d], vec![q, d], vec![kv, d], vec![kv, d], vec![d, q]].map(|s| (s, false)),
            );
            if self.qkv_bias {
                out.extend([vec![q], vec![kv], vec![kv]].map(|s| (s, false)));
            }
            match self.qk_norm {
                QkNorm::None => {}
                QkNorm::Full => out.extend([vec![q], vec![kv]].map(|s| (s, false))),
                QkNorm::PerHead => {
                    let hd = self.head_dim as i64;
                    out.extend([vec![hd], vec![hd]].map(|s| (s, false)))
                }
            }
            out.extend([vec![d], vec![self.n_experts as i64, d]].map(|s| (s, false)));
        }
        out.extend([vec![d], vec![v, d]].map(|s| (s, false)));
        for _ in 0..self.n_layers {
            out.extend([vec![h, d], vec![h, d], vec![d, h]].map(|s| (s, true)));
        }
        out
    }

    /// Model FLOPs of training on one token of a `seq_len` window, by PaLM's MFU convention:
    /// 6 per weight of every matmul the token goes through (attention, router, its top-k
    /// experts, LM head; not the embedding lookup or norms) plus 12·layers·(heads·head_dim)·T
    /// for attention scores. Frozen experts are counted as trained, as every MFU figure does.
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        let (d, l) = (self.d_model as f64, self.n_layers as f64);
        let q = (self.n_heads * self.head_dim) as f64;
        let kv = (self.n_kv_heads * self.head_dim) as f64;
        let per_layer = 2.0 * d * q
            + 2.0 * d * kv
            + d * self.n_experts as f64
            + self.top_k as f64 * 3.0 * d * self.expert_hidden as f64;
        let matmul = l * per_layer + self.vocab_size as f64 * d;
        6.0 * matmul + 12.0 * l * q * seq_len as f64
    }

    /// The FLOPs a SPES node does per token when it trains `own` of the experts of each layer
    /// (all: `None`): [`ModelConfig::train_flops_per_token`] less the weight gradients of the
    /// frozen experts (2 of the 6 per weight), with routing spread evenly over the experts.
    pub fn node_train_flops_per_token(&self, seq_len: usize, own: Option<usize>) -> f64 {
        let all = self.train_flops_per_token(seq_len);
        let Some(own) = own else {
            return all;
        };
        let frozen = 1.0 - own.min(self.n_experts) as f64 / self.n_experts as f64;
        let expert_weights = self.n_layers as f64
            * self.top_k as f64
            * 3.0
            * self.d_model as f64
            * self.expert_hidden as f64;
        all - 2.0 * frozen * expert_weights
    }
}

/// Parameter counts of a configuration. `active` is what one token touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ParamCounts {
    pub total: u64,
    pub active: u64,
    /// Everything that is not an expert: embeddings, head, attention, norms, routers.
    pub shared: u64,
    /// One expert in one layer (gate + up + down).
    pub per_expert: u64,
    /// Input embedding plus output head.
    pub embeddings: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paper prints sizes in billions with two decimals: the count must round to them.
    fn rounds_to(actual: u64, billions: f64) -> bool {
        ((actual as f64 / 1e9) * 100.0).round() / 100.0 == billions
    }

    #[test]
    fn paper_presets_report_paper_sizes() {
        let expect = [("1b", 1.17, 0.37), ("7b", 7.33, 1.70), ("9b", 9.43, 3.09)];
        for (name, total, active) in expect {
            let c = ModelConfig::preset(name).unwrap();
            c.validate().unwrap();
            let n = c.param_counts();
            assert!(rounds_to(n.total, total), "{name} total {}", n.total);
            assert!(rounds_to(n.active, active), "{name} active {}", n.active);
            let total_err = (n.total as f64 / 1e9 - total).abs() / total;
            assert!(
                total_err < 0.01,
                "{name} total {} off by {total_err}",
                n.total
            );
            assert_eq!(
                n.total,
                n.shared + (c.n_layers * c.n_experts) as u64 * n.per_expert
            );
        }
    }

    #[test]
    fn train_flops_count_every_active_weight_but_lookups_and_norms() {
        for name in PRESETS {
            let c = ModelConfig::preset(name).unwrap();
            let n = c.param_counts();
            let (d, l) = (c.d_model as u64, c.n_layers as u64);
            let q = (c.n_heads * c.head_dim) as u64;
            let qk_norm = (n.shared - n.embeddings - d) / l
                - 2 * d
                - d * c.n_experts as u64
                - (2 * d * q + 2 * d * (c.n_kv_heads * c.head_dim) as u64);
            let norms = l * (2 * d + qk_norm) + d;
            let matmul = n.active - n.embeddings / 2 - norms;
            let expect = 6.0 * matmul as f64 + 12.0 * (l * q * 512) as f64;
            let got = c.train_flops_per_token(512);
            assert!(
                (got - expect).abs() / expect < 1e-12,
                "{name}: {got} vs {expect}"
            );
        }
    }

    #[test]
    fn a_node_that_freezes_experts_does_no_weight_gradient_for_them() {
        let c = ModelConfig::preset("1b").unwrap();
        let all = c.train_flops_per_token(2048);
        assert_eq!(c.node_train_flops_per_token(2048, None), all);
        assert_eq!(c.node_train_flops_per_token(2048, Some(c.n_experts)), all);
        let experts =
            c.n_layers as f64 * c.top_k as f64 * 3.0 * (c.d_model * c.expert_hidden) as f64;
        let quarter = c.node_train_flops_per_token(2048, Some(c.n_experts / 4));
        assert!((all - quarter - 2.0 * 0.75 * experts).abs() / all < 1e-12);
        assert!(quarter < all && quarter > all - 2.0 * experts);
    }

    #[test]
    fn bad_shapes_name_the_field() {
        let mut c = ModelConfig::preset("tiny").unwrap();
        c.n_kv_heads = 3;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("model.n_kv_heads"), "{err}");
        let mut c = ModelConfig::preset("tiny").unwrap();
        assert!(c.check_alignment().is_ok());
        c.d_model = 100;
        let err = c.check_alignment().unwrap_err().to_string();
        assert!(
            err.contains("model.d_model (100) must be a multiple of 8"),
            "{err}"
        );
        c.d_model = 96;
        c.expert_hidden = 36;
        let err = c.check_alignment().unwrap_err().to_string();
        assert!(err.contains("model.expert_hidden"), "{err}");
        assert!(ModelConfig::preset("2b")
            .unwrap_err()
            .to_string()
            .contains("unknown model preset `2b`"));
    }
}
