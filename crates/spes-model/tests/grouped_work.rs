//! What the grouped MoE kernel computes, watched at the operator: in a binary of its own,
//! since the watch sees every thread of the process.

use spes_model::{LossWeights, ModelConfig, MoeKernel, MoeModel, NormPlacement, QkNorm, Role};
use tch::{Device, Kind, Tensor};

const W: LossWeights = LossWeights {
    z_loss: 1e-4,
    lb: 0.01,
    router_z: 0.001,
};

/// The grouped kernel computes weight gradients for the trained experts alone: each
/// weight-gradient `_grouped_mm` (both operands 2-D) covers as many groups as the layer has
/// trained experts, and a layer with none has no such call. Stacking the frozen experts with
/// the trained ones again (dW for every expert) fails this test.
#[test]
fn the_grouped_kernel_computes_no_weight_gradient_for_frozen_experts() {
    let cfg = ModelConfig {
        vocab_size: 97,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        n_experts: 6,
        top_k: 2,
        expert_hidden: 24,
        context_length: 16,
        rope_theta: 10_000.0,
        qk_norm: QkNorm::Full,
        normalize_topk: false,
        norm_eps: 1e-6,
        init_std: 0.02,
        norm_placement: NormPlacement::Pre,
        qkv_bias: false,
    };
    let mut m = MoeModel::seeded(&cfg, Device::Cpu, 13).unwrap();
    m.set_moe_kernel(MoeKernel::Grouped);
    // Layer 0 trains experts 0, 2 and 5 of 6; layer 1 none.
    m.set_trainable(|r| match r {
        Role::Expert { layer, index } => layer == 0 && [0, 2, 5].contains(&index),
        Role::Shared => true,
    });
    let batch = Tensor::randint(97, [2, 14], (Kind::Int64, Device::Cpu));
    for kind in [Kind::Float, Kind::BFloat16] {
        m.set_compute_kind(kind);
        m.begin_step();
        spes_ext::count::watch("aten::_grouped_mm").unwrap();
        m.backward(&batch, &W, 1.0, false);
        spes_ext::count::unwatch().unwrap();
        m.end_step();
        let calls = spes_ext::count::watched();
        // Forward: gate/up and down in each of 2 layers; backward: their input gradients.
        let weight_grads: Vec<&Vec<Vec<i64>>> = calls
            .iter()
            .filter(|c| c[0].len() == 2 && c[1].len() == 2)
            .collect();
        assert_eq!(calls.len(), 8 + weight_grads.len(), "{kind:?}: {calls:?}");
        assert_eq!(
            weight_grads.len(),
            2,
            "{kind:?}: layer 0's gate/up and down only"
        );
        for c in weight_grads {
            assert_eq!(c[2], vec![3], "{kind:?}: 3 trained experts' groups, {c:?}");
        }
        for p in m.params() {
            let g = p.tensor.grad();
            if g.defined() {
                let _ = g.shallow_clone().zero_();
            }
        }
    }
}
