mod common;

use common::{small, W};
use spes_model::{
    load_balancing_loss, LossWeights, ModelConfig, MoeKernel, MoeModel, NormPlacement, QkNorm,
    Role, Stage,
};
use tch::{Device, Kind, Tensor};

#[test]
fn actual_tensors_match_analytic_counts() {
    for cfg in [
        ModelConfig::preset("tiny").unwrap(),
        small(QkNorm::PerHead, 2, true),
        small(QkNorm::None, 4, false),
        ModelConfig {
            qkv_bias: true,
            norm_placement: NormPlacement::Post,
            ..small(QkNorm::Full, 2, false)
        },
    ] {
        let m = MoeModel::seeded(&cfg, Device::Cpu, 0).unwrap();
        let n = cfg.param_counts();
        let params = m.params();
        let total: i64 = params.iter().map(|p| p.tensor.numel() as i64).sum();
        let shared: i64 = params
            .iter()
            .filter(|p| p.role == Role::Shared)
            .map(|p| p.tensor.numel() as i64)
            .sum();
        assert_eq!(total as u64, n.total);
        assert_eq!(shared as u64, n.shared);
        let e0: i64 = params
            .iter()
            .filter(|p| p.role == Role::Expert { layer: 1, index: 3 })
            .map(|p| p.tensor.numel() as i64)
            .sum();
        assert_eq!(e0 as u64, n.per_expert);
        // The shapes the planners count: the shared tensors in order, then expert 0's.
        let mut actual: Vec<(Vec<i64>, bool)> = params
            .iter()
            .filter(|p| p.role == Role::Shared)
            .map(|p| (p.tensor.size(), false))
            .collect();
        actual.extend(
            params
                .iter()
                .filter(|p| matches!(p.role, Role::Expert { index: 0, .. }))
                .map(|p| (p.tensor.size(), true)),
        );
        assert_eq!(cfg.shapes(), actual);
    }
}

#[test]
fn init_is_truncated_normal() {
    let m = MoeModel::seeded(&ModelConfig::preset("tiny").unwrap(), Device::Cpu, 1).unwrap();
    let head = m
        .params()
        .into_iter()
        .find(|p| p.name == "lm_head.weight")
        .unwrap()
        .tensor;
    let std = head.std(true).double_value(&[]);
    let max = head.abs().max().double_value(&[]);
    // A normal cut at ±3σ has std 0.986σ.
    assert!((std - 0.0197).abs() < 0.0005, "std {std}");
    assert!(max <= 0.06 + 1e-6 && max > 0.055, "max {max}");
}

/// The same MoE computed densely: every expert on every token, weighted by the top-k mask.
fn dense_moe_reference(m: &MoeModel, layer: usize, x: &Tensor) -> Tensor {
    let cfg = &m.cfg;
    let p = |name: String| {
        m.params()
            .into_iter()
            .find(|q| q.name == name)
            .unwrap()
            .tensor
    };
    let router = p(format!("model.layers.{layer}.mlp.gate.weight"));
    let probs = x.matmul(&router.tr()).softmax(-1, Kind::Float);
    let (mut w, idx) = probs.topk(cfg.top_k as i64, -1, true, false);
    if cfg.normalize_topk {
        w = &w / w.sum_dim_intlist(-1, true, Kind::Float);
    }
    let mut y = x.zeros_like();
    for e in 0..cfg.n_experts {
        let ex = |n: &str| {
            p(format!(
                "model.layers.{layer}.mlp.experts.{e}.{n}_proj.weight"
            ))
        };
        let out =
            (x.matmul(&ex("gate").tr()).silu() * x.matmul(&ex("up").tr())).matmul(&ex("down").tr());
        let weight =
            (&w * idx.eq(e as i64).to_kind(Kind::Float)).sum_dim_intlist(-1, true, Kind::Float);
        y += out * weight;
    }
    y
}

#[test]
fn dropless_dispatch_equals_dense_computation() {
    for normalize in [false, true] {
        tch::manual_seed(2);
        let cfg = ModelConfig {
            n_layers: 1,
            ..small(QkNorm::Full, 4, normalize)
        };
        let m = MoeModel::new(&cfg, Device::Cpu).unwrap();
        // Make the router decisive so the test exercises uneven expert loads.
        tch::no_grad(|| {
            let mut r = m
                .params()
                .into_iter()
                .find(|p| p.name.ends_with("mlp.gate.weight"))
                .unwrap()
                .tensor;
            let _ = r.normal_(0.0, 1.0);
        });
        let tokens = Tensor::randint(97, [3, 11], (Kind::Int64, Device::Cpu));
        let (logits, aux) = m.forward(&tokens);
        let counts = aux.expert_counts.sum(Kind::Int64).int64_value(&[]);
        assert_eq!(counts, 3 * 11 * 2, "dropless: every token gets top_k slots");

        // Recompute the block by hand with the dense reference MoE.
        let p = |name: &str| {
            m.params()
                .into_iter()
                .find(|q| q.name == name)
                .unwrap()
                .tensor
        };
        let x = Tensor::embedding(&p("model.embed_tokens.weight"), &tokens, -1, false, false);
        let norm = |x: &Tensor, w: &str| x.rms_norm([32], Some(&p(w)), 1e-6);
        // Rebuild the logits by hand: reference attention, then the dense reference MoE.
        let h = norm(&x, "model.layers.0.input_layernorm.weight");
        let attn = reference_attention(&m, &h);
        let x1 = &x + attn;
        let h2 = norm(&x1, "model.layers.0.post_attention_layernorm.weight").view([33, 32]);
        let x2 = &x1 + dense_moe_reference(&m, 0, &h2).view([3, 11, 32]);
        let expect = norm(&x2, "model.norm.weight").matmul(&p("lm_head.weight").tr());
        let diff = (&expect - &logits).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "normalize={normalize}: max diff {diff}");
    }
}

/// Plain causal attention with full QK-norm and rotate-half RoPE, written out with no fused op.
fn reference_attention(m: &MoeModel, x: &Tensor) -> Tensor {
    let p = |name: &str| {
        m.params()
            .into_iter()
            .find(|q| q.name == name)
            .unwrap()
            .tensor
    };
    let (b, t, _) = x.size3().unwrap();
    let q = x
        .matmul(&p("model.layers.0.self_attn.q_proj.weight").tr())
        .rms_norm(
            [32],
            Some(&p("model.layers.0.self_attn.q_norm.weight")),
            1e-6,
        );
    let k = x
        .matmul(&p("model.layers.0.self_attn.k_proj.weight").tr())
        .rms_norm(
            [32],
            Some(&p("model.layers.0.self_attn.k_norm.weight")),
            1e-6,
        );
    let v = x.matmul(&p("model.layers.0.self_attn.v_proj.weight").tr());
    let heads = |y: Tensor| y.view([b, t, 4, 8]).transpose(1, 2);
    let (q, k, v) = (heads(q), heads(k), heads(v));
    let mut cos = vec![0f32; (t * 8) as usize];
    let mut sin = vec![0f32; (t * 8) as usize];
    for pos in 0..t as usize {
        for i in 0..4 {
            let f = pos as f64 / 10_000f64.powf(2.0 * i as f64 / 8.0);
            for j in [i, i + 4] {
                cos[pos * 8 + j] = f.cos() as f32;
                sin[pos * 8 + j] = f.sin() as f32;
            }
        }
    }
    let cos = Tensor::from_slice(&cos).view([t, 8]);
    let sin = Tensor::from_slice(&sin).view([t, 8]);
    let rot = |y: &Tensor| {
        let r = Tensor::cat(&[&y.narrow(3, 4, 4).neg(), &y.narrow(3, 0, 4)], -1);
        y * &cos + r * &sin
    };
    let (q, k) = (rot(&q), rot(&k));
    let scores = q.matmul(&k.transpose(2, 3)) / (8f64).sqrt();
    let mask = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
    let att = scores
        .masked_fill(&mask, f64::NEG_INFINITY)
        .softmax(-1, Kind::Float);
    att.matmul(&v)
        .transpose(1, 2)
        .reshape([b, t, 32])
        .matmul(&p("model.layers.0.self_attn.o_proj.weight").tr())
}

#[test]
fn load_balancing_loss_matches_hand_computation() {
    // 4 tokens, 3 experts, top-1 picks: expert 0 twice, experts 1 and 2 once.
    let probs = Tensor::from_slice(&[
        0.7f32, 0.2, 0.1, //
        0.5, 0.3, 0.2, //
        0.1, 0.8, 0.1, //
        0.2, 0.2, 0.6,
    ])
    .view([4, 3]);
    let counts = Tensor::from_slice(&[2i64, 1, 1]);
    // p̄ = (0.375, 0.375, 0.25); Σ c·p̄ = 0.75 + 0.375 + 0.25 = 1.375; × E/(T·k) = 3/4.
    let lb = load_balancing_loss(&probs, &counts, 1).double_value(&[]);
    assert!((lb - 1.03125).abs() < 1e-6, "lb {lb}");
    // Perfectly uniform routing gives exactly 1.
    let uniform = Tensor::full([6, 3], 1.0 / 3.0, (Kind::Float, Device::Cpu));
    let lb = load_balancing_loss(&uniform, &Tensor::from_slice(&[4i64, 4, 4]), 2);
    assert!((lb.double_value(&[]) - 1.0).abs() < 1e-6);
}

#[test]
fn frozen_experts_get_no_gradient_but_pass_activations() {
    let mut m = MoeModel::seeded(&small(QkNorm::Full, 2, false), Device::Cpu, 3).unwrap();
    let own = |r: Role| matches!(r, Role::Shared | Role::Expert { index: 0..=1, .. });
    m.set_trainable(own);
    let batch = Tensor::randint(97, [4, 13], (Kind::Int64, Device::Cpu));
    m.backward(&batch, &W, 1.0, false);
    for p in m.params() {
        let has_grad = p.tensor.grad().defined();
        assert_eq!(has_grad, own(p.role), "{}", p.name);
        assert_eq!(p.tensor.requires_grad(), own(p.role), "{}", p.name);
    }
    // Gradient reached the router and embeddings through the frozen experts' activations.
    let router_grad = m
        .params()
        .into_iter()
        .find(|p| p.name == "model.layers.0.mlp.gate.weight")
        .unwrap()
        .tensor
        .grad();
    assert!(router_grad.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    assert_eq!(m.trainable_params().len(), m.params().len() - 2 * 4 * 3);
}

#[test]
fn gqa_and_per_head_norm_run_and_initial_loss_is_uniform() {
    let m = MoeModel::seeded(&small(QkNorm::PerHead, 2, true), Device::Cpu, 4).unwrap();
    // 512 tokens: torch's generator is shared with tests running beside this one, so the draw
    // varies, and one token's CE at init varies by about 0.1 nats; their mean varies by 0.005.
    let batch = Tensor::randint(97, [32, 16], (Kind::Int64, Device::Cpu));
    let l = m.backward(&batch, &W, 1.0, false);
    let ce = l.ce.double_value(&[]);
    assert!((ce - (97f64).ln()).abs() < 0.05, "ce {ce}");
    let lb = l.lb.double_value(&[]);
    assert!(lb > 0.9 && lb < 1.5, "lb {lb}");
}

#[test]
fn load_rejects_missing_and_misshapen_tensors() {
    let cfg = small(QkNorm::Full, 4, false);
    let m = MoeModel::new(&cfg, Device::Cpu).unwrap();
    let mut named: Vec<(String, Tensor)> = m
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.copy()))
        .collect();
    m.load(&named, "x.safetensors").unwrap();
    named[3].1 = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu));
    let err = m.load(&named, "x.safetensors").unwrap_err().to_string();
    assert!(
        err.contains("x.safetensors") && err.contains(&named[3].0),
        "{err}"
    );
    let _ = named.remove(3);
    let err = m.load(&named, "x.safetensors").unwrap_err().to_string();
    assert!(err.contains("missing tensor"), "{err}");
}

#[test]
fn biases_and_post_norm_blocks_train() {
    tch::manual_seed(5);
    let cfg = ModelConfig {
        qkv_bias: true,
        norm_placement: NormPlacement::Post,
        ..small(QkNorm::Full, 2, false)
    };
    let mut m = MoeModel::new(&cfg, Device::Cpu).unwrap();
    let names: Vec<String> = m.params().into_iter().map(|p| p.name).collect();
    for n in [
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
    ] {
        assert!(names.iter().any(|x| x == n), "missing {n}");
    }
    assert!(!names.iter().any(|x| x.ends_with("input_layernorm.weight")));
    m.set_trainable(|_| true);
    let batch = Tensor::randint(97, [2, 9], (Kind::Int64, Device::Cpu));
    m.backward(&batch, &W, 1.0, false);
    for p in m.params() {
        if p.name.ends_with(".bias") || p.name.contains("feedforward_layernorm") {
            let g = p.tensor.grad().abs().sum(Kind::Float).double_value(&[]);
            assert!(g > 0.0, "{} gets no gradient", p.name);
        }
    }
}

/// The reference objective from whole logits: mean token cross-entropy and the output z-loss `mean(logsumexp(logits)²)`, in fp32.
fn token_losses(logits: &Tensor, targets: &Tensor) -> (Tensor, Tensor) {
    let v = logits.size()[2];
    let logits = logits.reshape([-1, v]).to_kind(Kind::Float);
    let lse = logits.logsumexp([-1], false);
    let target_logit = logits
        .gather(1, &targets.reshape([-1, 1]), false)
        .squeeze_dim(1);
    let ce = (&lse - target_logit).mean(Kind::Float);
    (ce, lse.square().mean(Kind::Float))
}

/// One optimizer step's backward over `batches` (half weight each; with `copies`, on the
/// step's compute copies; `staged`: in stages with checkpointing): the summed loss and the
/// gradients taken.
fn step(
    m: &MoeModel,
    batches: &[Tensor],
    copies: bool,
    staged: bool,
) -> (f64, Vec<(String, Tensor)>) {
    if copies {
        m.begin_step();
    }
    let mut loss = 0.0;
    for b in batches {
        let l = if staged {
            m.backward_in_stages(b, &W, 0.5, true, &mut |_| {})
        } else {
            m.backward(b, &W, 0.5, false)
        };
        loss += l.total.double_value(&[]);
    }
    m.end_step();
    (loss, take_grads(m))
}

/// Every parameter's gradient, by name (zeros where none), then cleared.
fn take_grads(m: &MoeModel) -> Vec<(String, Tensor)> {
    m.params()
        .into_iter()
        .map(|p| {
            let g = p.tensor.grad();
            let g = if g.defined() {
                let copy = g.copy();
                let _ = g.shallow_clone().zero_();
                copy
            } else {
                p.tensor.zeros_like()
            };
            (p.name, g)
        })
        .collect()
}

/// Top-1 routing that gives expert 5 no token: its logit is 0 while expert 0's or 1's is
/// |x·r₀| > 0.
fn starve_expert_5(m: &MoeModel) {
    tch::no_grad(|| {
        for p in m.params() {
            if p.name.ends_with("mlp.gate.weight") {
                let r = p.tensor;
                r.get(1).copy_(&-r.get(0));
                let _ = r.get(5).zero_();
            }
        }
    });
}

fn assert_close(a: &[(String, Tensor)], b: &[(String, Tensor)], rel: f64, what: &str) {
    for ((name, x), (_, y)) in a.iter().zip(b) {
        let scale = y.abs().max().double_value(&[]).max(1e-12);
        let diff = (x - y).abs().max().double_value(&[]);
        assert!(
            diff <= rel * scale,
            "{what}: {name} differs by {diff} (scale {scale})"
        );
    }
}

/// The chunked LM-head loss (3 chunks here) gives the same losses as full logits through
/// `token_losses` within 1e-5, and the same gradient for every parameter, scale included.
#[test]
fn chunked_head_loss_matches_full_logits() {
    let mut m = MoeModel::seeded(&small(QkNorm::Full, 2, false), Device::Cpu, 6).unwrap();
    m.set_trainable(|_| true);
    let batch = Tensor::randint(97, [3, 12], (Kind::Int64, Device::Cpu));
    let w = LossWeights { z_loss: 0.05, ..W };

    let (logits, aux) = m.forward(&batch.narrow(1, 0, 11));
    let (ce, z) = token_losses(&logits, &batch.narrow(1, 1, 11));
    let total = &ce + &z * w.z_loss + &aux.lb * w.lb + &aux.router_z * w.router_z;
    (total * 0.5).backward();
    let reference = take_grads(&m);

    m.set_logits_chunk(14 * 97); // 14 rows of 33 per chunk: 3 chunks, the last short
    let l = m.backward(&batch, &w, 0.5, false);
    for (got, want) in [(&l.ce, &ce), (&l.z_loss, &z)] {
        let (got, want) = (got.double_value(&[]), want.double_value(&[]));
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
    assert!(!l.total.requires_grad());
    assert_close(&take_grads(&m), &reference, 1e-5, "chunked head");
}

/// Activation checkpointing recomputes each block in backward, and the staged backward runs
/// one stage at a time (for reductions overlapped with it): same losses, and every gradient
/// within 1e-6 relative, with pre- and post-norm blocks and frozen experts.
#[test]
fn checkpointed_and_staged_backward_give_the_same_gradients() {
    for placement in [NormPlacement::Pre, NormPlacement::Post] {
        tch::manual_seed(7);
        let cfg = ModelConfig {
            norm_placement: placement,
            ..small(QkNorm::Full, 2, true)
        };
        let mut m = MoeModel::new(&cfg, Device::Cpu).unwrap();
        m.set_trainable(|r| !matches!(r, Role::Expert { index: 4.., .. }));
        let batch = Tensor::randint(97, [2, 14], (Kind::Int64, Device::Cpu));
        let plain = m.backward(&batch, &W, 1.0, false);
        let reference = take_grads(&m);
        let ckpt = m.backward(&batch, &W, 1.0, true);
        assert_eq!(
            plain.total.double_value(&[]),
            ckpt.total.double_value(&[]),
            "{placement:?}"
        );
        assert!(plain.expert_counts.equal(&ckpt.expert_counts));
        assert_close(&take_grads(&m), &reference, 1e-6, "checkpointed");
        // Frozen experts get no gradient (a trainable one may get none if no token reached it).
        for p in m.params().into_iter().filter(|p| !p.tensor.requires_grad()) {
            assert!(!p.tensor.grad().defined(), "{}", p.name);
        }
        // In stages, with or without checkpointing: each stage's gradients are final when it
        // is announced, stages come from the top, and the losses and gradients are the same.
        for checkpoint in [false, true] {
            let mut order = Vec::new();
            let staged = m.backward_in_stages(&batch, &W, 1.0, checkpoint, &mut |stage| {
                for p in m.params() {
                    let g = p.tensor.grad();
                    if MoeModel::stage_of(&p.name) == stage && g.defined() {
                        let (_, want) = reference.iter().find(|(n, _)| *n == p.name).unwrap();
                        let diff = (&g - want).abs().max().double_value(&[]);
                        let scale = want.abs().max().double_value(&[]).max(1e-12);
                        assert!(diff <= 1e-6 * scale, "{} at {stage:?}", p.name);
                    }
                }
                order.push(stage);
            });
            let layers = cfg.n_layers;
            let mut want = vec![Stage::Head];
            want.extend((0..layers).rev().map(Stage::Block));
            want.push(Stage::Embedding);
            assert_eq!(order, want);
            assert_eq!(
                staged.total.double_value(&[]),
                plain.total.double_value(&[])
            );
            assert_close(&take_grads(&m), &reference, 1e-6, "in stages");
        }
    }
}

/// The grouped MoE kernel (`_grouped_mm` over stacked experts) gives the loop's losses and
/// gradients: on CPU in fp32 within 1e-6, on CUDA (when there is one) in bf16 within 2e-2
/// (the kernels round differently). Frozen experts get no gradient either way, and an expert
/// that no token reaches (an empty group) is handled.
#[test]
fn grouped_experts_match_the_loop() {
    let mut devices = vec![(Device::Cpu, Kind::Float, 1e-6)];
    if tch::Cuda::is_available() {
        devices.push((Device::Cuda(0), Kind::BFloat16, 2e-2));
    }
    for (device, kind, rel) in devices {
        for top_k in [2, 1] {
            tch::manual_seed(8);
            let cfg = ModelConfig {
                top_k,
                d_model: 64,
                head_dim: 16,
                expert_hidden: 32,
                ..small(QkNorm::Full, 2, false)
            };
            let mut m = MoeModel::new(&cfg, device).unwrap();
            m.set_compute_kind(kind);
            m.set_trainable(|r| !matches!(r, Role::Expert { index: 4.., .. }));
            if top_k == 1 {
                starve_expert_5(&m);
            }
            let batch = Tensor::randint(97, [3, 13], (Kind::Int64, device));
            let looped = m.backward(&batch, &W, 1.0, false);
            let reference = take_grads(&m);
            m.set_moe_kernel(MoeKernel::Grouped);
            let grouped = m.backward(&batch, &W, 1.0, false);
            m.set_moe_kernel(MoeKernel::Loop);
            assert!(looped.expert_counts.equal(&grouped.expert_counts));
            if top_k == 1 {
                let empty = looped.expert_counts.select(1, 5).sum(Kind::Int64);
                assert_eq!(empty.int64_value(&[]), 0, "expert 5 gets no token");
            }
            let (a, b) = (
                looped.total.double_value(&[]),
                grouped.total.double_value(&[]),
            );
            assert!(
                (a - b).abs() <= rel * a.abs(),
                "{device:?} top-{top_k}: {a} vs {b}"
            );
            assert_close(&take_grads(&m), &reference, rel, "grouped");
            for p in m.params().into_iter().filter(|p| !p.tensor.requires_grad()) {
                assert!(!p.tensor.grad().defined(), "{}", p.name);
            }
        }
    }
}

/// Frozen experts resident in bf16 compute as if their weights were rounded to bf16, while
/// `params()` keeps their exact fp32 values: a trainable expert's gradient equals that of a
/// model whose frozen experts were rounded (within 1e-6: the resident copy stacks gate and up
/// into one matmul, which sums in another order than two); loading new weights refreshes the
/// copies; an expert that becomes trainable again starts from its exact fp32 master.
#[test]
fn frozen_experts_resident_in_bf16() {
    tch::manual_seed(9);
    let cfg = small(QkNorm::Full, 2, false);
    let own = |r: Role| !matches!(r, Role::Expert { index: 2.., .. });
    let mut m = MoeModel::new(&cfg, Device::Cpu).unwrap();
    let exact: Vec<(String, Tensor)> = m
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.copy()))
        .collect();
    m.set_frozen_experts_bf16(true);
    m.set_trainable(own);
    let mut rounded = MoeModel::new(&cfg, Device::Cpu).unwrap();
    let is_frozen_expert = |name: &str| {
        m.params()
            .into_iter()
            .any(|p| p.name == name && !p.tensor.requires_grad() && p.role != Role::Shared)
    };
    let with_rounding: Vec<(String, Tensor)> = exact
        .iter()
        .map(|(n, t)| {
            let t = if is_frozen_expert(n) {
                t.to_kind(Kind::BFloat16).to_kind(Kind::Float)
            } else {
                t.copy()
            };
            (n.clone(), t)
        })
        .collect();
    rounded.load(&with_rounding, "rounded").unwrap();
    rounded.set_trainable(own);
    let batch = Tensor::randint(97, [2, 14], (Kind::Int64, Device::Cpu));
    let a = m.backward(&batch, &W, 1.0, false);
    let b = rounded.backward(&batch, &W, 1.0, false);
    let (a_loss, b_loss) = (a.total.double_value(&[]), b.total.double_value(&[]));
    assert!(
        (a_loss - b_loss).abs() <= 1e-6 * b_loss.abs(),
        "{a_loss} vs {b_loss}"
    );
    assert_close(
        &take_grads(&m),
        &take_grads(&rounded),
        1e-6,
        "resident bf16",
    );
    // The masters are still the exact values.
    for (p, (_, t)) in m.params().into_iter().zip(&exact) {
        assert!(p.tensor.equal(t), "{}", p.name);
    }
    // A load reaches the copies: the rounded weights give the rounded model's loss again,
    // whatever the copies held before.
    let zeros: Vec<(String, Tensor)> = exact
        .iter()
        .map(|(n, t)| (n.clone(), t.zeros_like()))
        .collect();
    m.load(&zeros, "zeros").unwrap();
    m.load(&with_rounding, "rounded").unwrap();
    let again = m.backward(&batch, &W, 1.0, false);
    assert_eq!(again.total.double_value(&[]), a_loss);
    let _ = take_grads(&m);
    // Training every expert again: masters as they were loaded, nothing resident.
    m.set_trainable(|_| true);
    let all = m.backward(&batch, &W, 1.0, false);
    rounded.set_trainable(|_| true);
    let reference = rounded.backward(&batch, &W, 1.0, false);
    assert_eq!(
        all.total.double_value(&[]),
        reference.total.double_value(&[])
    );
}

/// Mixed precision with the step's compute copies ([`MoeModel::begin_step`]: bf16 weights made
/// once per optimizer step, q/k/v and each expert's gate/up fused into one matmul) gives the
/// per-matmul casts' losses and gradients over two accumulated micro-batches, within bf16
/// rounding, whether experts are frozen in fp32 or resident in bf16, and in stages or with
/// checkpointing; the masters keep their layout and frozen tensors get no gradient. In fp32
/// there is nothing to copy and the gradients are the same bit for bit.
#[test]
fn step_copies_match_per_matmul_casts() {
    for (kind, resident, rel) in [
        (Kind::BFloat16, false, 2e-2f64),
        (Kind::BFloat16, true, 2e-2),
        (Kind::Float, false, 0.0),
    ] {
        tch::manual_seed(11);
        let cfg = small(QkNorm::Full, 2, false);
        let mut m = MoeModel::new(&cfg, Device::Cpu).unwrap();
        m.set_compute_kind(kind);
        m.set_frozen_experts_bf16(resident);
        m.set_trainable(|r| !matches!(r, Role::Expert { index: 3.., .. }));
        let before: Vec<(String, Tensor)> = m
            .params()
            .into_iter()
            .map(|p| (p.name, p.tensor.copy()))
            .collect();
        let batches: Vec<Tensor> = (0..2)
            .map(|_| Tensor::randint(97, [2, 14], (Kind::Int64, Device::Cpu)))
            .collect();
        let run = |m: &MoeModel, copies: bool, staged: bool| step(m, &batches, copies, staged);
        let (a, reference) = run(&m, false, false);
        let (b, copied) = run(&m, true, false);
        assert!(
            (a - b).abs() <= rel.max(1e-12) * a.abs(),
            "{kind:?}: {a} vs {b}"
        );
        assert_close(&copied, &reference, rel, &format!("{kind:?} copies"));
        let (c, staged) = run(&m, true, true);
        assert!((c - b).abs() <= 1e-6 * b.abs(), "{kind:?}: {c} vs {b}");
        assert_close(
            &staged,
            &copied,
            1e-6,
            &format!("{kind:?} copies in stages"),
        );
        for p in m.params().into_iter().filter(|p| !p.tensor.requires_grad()) {
            assert!(!p.tensor.grad().defined(), "{}", p.name);
        }
        for (p, (n, t)) in m.params().into_iter().zip(&before) {
            assert!(p.tensor.equal(t) && p.tensor.kind() == Kind::Float, "{n}");
        }
    }
}

/// A node whose experts are scattered over a layer (experts 1 and 4 of 6 in layer 0) and who
/// owns none of another (layer 1): the grouped kernel, which stacks the trained experts first,
/// gives the loop's losses and gradients over two micro-batches, plain and in stages with
/// checkpointing, in fp32 (within 1e-6) and in bf16 with the step's copies, frozen experts in
/// fp32 or resident (within 2e-2); an expert no token reaches (top-1) is handled, and frozen
/// experts get no gradient.
#[test]
fn grouped_kernel_with_scattered_ownership_matches_the_loop() {
    let owned = |r: Role| match r {
        Role::Expert { layer, index } => layer == 0 && (index == 1 || index == 4),
        Role::Shared => true,
    };
    for (kind, resident, rel) in [
        (Kind::Float, false, 1e-6),
        (Kind::BFloat16, false, 2e-2),
        (Kind::BFloat16, true, 2e-2),
    ] {
        for top_k in [2, 1] {
            tch::manual_seed(12);
            let cfg = ModelConfig {
                top_k,
                ..small(QkNorm::Full, 2, false)
            };
            let mut m = MoeModel::new(&cfg, Device::Cpu).unwrap();
            m.set_compute_kind(kind);
            m.set_frozen_experts_bf16(resident);
            m.set_trainable(owned);
            if top_k == 1 {
                starve_expert_5(&m);
            }
            let batches: Vec<Tensor> = (0..2)
                .map(|_| Tensor::randint(97, [2, 14], (Kind::Int64, Device::Cpu)))
                .collect();
            let run = |m: &MoeModel, staged: bool| step(m, &batches, true, staged);
            let what = format!("{kind:?} resident {resident} top-{top_k}");
            let (a, looped) = run(&m, false);
            m.set_moe_kernel(MoeKernel::Grouped);
            for staged in [false, true] {
                let (b, grouped) = run(&m, staged);
                assert!((a - b).abs() <= rel * a.abs(), "{what}: {a} vs {b}");
                assert_close(&grouped, &looped, rel, &format!("{what} staged {staged}"));
            }
            for p in m.params().into_iter().filter(|p| !p.tensor.requires_grad()) {
                assert!(!p.tensor.grad().defined(), "{what}: {}", p.name);
            }
        }
    }
}
