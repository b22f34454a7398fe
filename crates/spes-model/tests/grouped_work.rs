//! What the grouped MoE kernel computes, watched at the operator: in a binary of its own,
//! since the watch sees every thread of the process.

mod common;

use common::{small, W};
use spes_model::{MoeKernel, MoeModel, QkNorm, Role};
use tch::{Device, Kind, Tensor};

/// The grouped kernel computes weight gradients for the trained experts alone: each
/// weight-gradient `_grouped_mm` (both operands 2-D) covers as many groups as the layer has
/// trained experts, and a layer with none has no such call. Stacking the frozen experts with
/// the trained ones again (dW for every expert) fails this test.
#[test]
fn the_grouped_kernel_computes_no_weight_gradient_for_frozen_experts() {
    let mut m = MoeModel::seeded(&small(QkNorm::Full, 2, false), Device::Cpu, 13).unwrap();
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
