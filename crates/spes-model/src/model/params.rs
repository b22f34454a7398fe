//! Settings, parameters and (de)serialization: which tensors train, their names and roles,
//! loading, and the frozen experts' resident copies.

use super::layer::Slots;
use super::{
    expert_tensor_name, router_tensor_name, MoeKernel, MoeModel, Param, Role, EXPERT_PARTS,
};
use crate::config::NormPlacement;
use anyhow::{bail, Context, Result};
use tch::{Kind, Tensor};

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

    /// Takes every layer's load-balancing counts from `counts` (`[layers, E]`, per token of a
    /// batch as large as this model's) instead of its own routing; `None` restores its own.
    /// `spes simulate --oracle load-balance` gives every node the union batch's.
    pub fn set_lb_counts(&mut self, counts: Option<Tensor>) {
        self.lb_counts = counts;
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
