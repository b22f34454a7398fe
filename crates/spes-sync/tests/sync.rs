use spes_model::{expert_tensor_name, ModelConfig, MoeModel, NormPlacement, QkNorm, Role};
use spes_sync::{
    merge_experts, Aggregator, Coordinator, Layout, MergeSchedule, Named, Ownership, RoundRules,
    Scope,
};
use tch::{Device, Kind, Tensor};

fn model(n_layers: usize, n_experts: usize) -> MoeModel {
    let cfg = ModelConfig {
        vocab_size: 11,
        d_model: 4,
        n_layers,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 4,
        n_experts,
        top_k: 1,
        expert_hidden: 2,
        context_length: 8,
        rope_theta: 10_000.0,
        qk_norm: QkNorm::Full,
        normalize_topk: false,
        norm_eps: 1e-6,
        init_std: 0.02,
        norm_placement: NormPlacement::Pre,
        qkv_bias: false,
    };
    tch::manual_seed(0);
    MoeModel::new(&cfg, Device::Cpu).unwrap()
}

fn snapshot(m: &MoeModel) -> Named {
    m.params()
        .into_iter()
        .map(|p| (p.name, p.tensor.copy()))
        .collect()
}

/// The tensors `peer` uploads under `scope`, each filled with `value`.
fn upload(layout: &Layout, scope: &Scope, peer: usize, value: f64) -> Named {
    layout
        .entries
        .iter()
        .filter(|(_, role, _)| scope.uploads(peer, *role))
        .map(|(n, _, shape)| {
            (
                n.clone(),
                Tensor::full(shape.as_slice(), value, (Kind::Float, Device::Cpu)),
            )
        })
        .collect()
}

fn get<'a>(named: &'a Named, name: &str) -> &'a Tensor {
    &named.iter().find(|(n, _)| n == name).unwrap().1
}

fn copy(named: &Named) -> Named {
    named.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
}

fn scalar(t: &Tensor) -> f64 {
    t.flatten(0, -1).get(0).double_value(&[])
}

#[test]
fn shared_params_are_averaged_and_experts_come_from_their_owner() {
    let m = model(2, 4);
    let layout = Layout::of(&m);
    let prev = snapshot(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 2).unwrap());
    let mut agg = Aggregator::new(scope.clone());
    agg.add(&layout, 0, upload(&layout, &scope, 0, 1.0))
        .unwrap();
    agg.add(&layout, 1, upload(&layout, &scope, 1, 4.0))
        .unwrap();
    let next = agg.finish(&layout, &prev);
    assert_eq!(scalar(get(&next, "model.embed_tokens.weight")), 2.5);
    assert_eq!(scalar(get(&next, "model.layers.1.mlp.gate.weight")), 2.5);
    // Node 0 owns experts 0,1; node 1 owns 2,3 (contiguous).
    assert_eq!(
        scalar(get(&next, &expert_tensor_name(1, 1, "down_proj"))),
        1.0
    );
    assert_eq!(
        scalar(get(&next, &expert_tensor_name(0, 2, "gate_proj"))),
        4.0
    );
    assert_eq!(next.len(), prev.len());
}

#[test]
fn diloco_averages_every_parameter_including_experts() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let scope = Scope::Diloco { peers: 2 };
    let mut agg = Aggregator::new(scope.clone());
    agg.add(&layout, 0, upload(&layout, &scope, 0, 1.0))
        .unwrap();
    agg.add(&layout, 1, upload(&layout, &scope, 1, 3.0))
        .unwrap();
    let next = agg.finish(&layout, &snapshot(&m));
    for (name, t) in &next {
        assert_eq!(scalar(t), 2.0, "{name}");
    }
    // A DiLoCo node uploads experts it would not own under SPES.
    assert!(scope.uploads(0, Role::Expert { layer: 0, index: 3 }));
}

#[test]
fn bad_uploads_are_rejected_without_side_effects() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 2).unwrap());
    let mut agg = Aggregator::new(scope.clone());
    let good = upload(&layout, &scope, 0, 1.0);
    let err = |agg: &mut Aggregator, peer: usize, u: Named| {
        agg.add(&layout, peer, u).unwrap_err().to_string()
    };

    assert!(err(&mut agg, 2, copy(&good)).contains("peer 2 is out of range"));
    let mut wrong_shape = copy(&good);
    wrong_shape[0].1 = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    assert!(err(&mut agg, 0, wrong_shape).contains("has shape [3]"));
    let mut missing = copy(&good);
    let gone = missing.remove(4).0;
    let e = err(&mut agg, 0, missing);
    assert!(e.contains("missing tensor") && e.contains(&gone), "{e}");
    let mut nan = copy(&good);
    nan[1].1 = nan[1].1.fill(f64::NAN);
    assert!(err(&mut agg, 0, nan).contains("non-finite"));
    let mut not_owned = copy(&good);
    let foreign = expert_tensor_name(0, 3, "up_proj");
    not_owned.push((
        foreign.clone(),
        Tensor::zeros([2, 4], (Kind::Float, Device::Cpu)),
    ));
    assert!(err(&mut agg, 0, not_owned).contains("does not own"));
    let mut int = copy(&good);
    int[0].1 = int[0].1.to_kind(Kind::Int64);
    assert!(err(&mut agg, 0, int).contains("expected f32 or bf16"));
    assert!(agg.uploaded().is_empty(), "rejections leave no trace");

    // The real uploads still make a correct round; bf16 payloads are accepted and upcast.
    let bf16: Named = good
        .iter()
        .map(|(n, t)| (n.clone(), t.to_kind(Kind::BFloat16)))
        .collect();
    agg.add(&layout, 0, bf16).unwrap();
    assert!(err(&mut agg, 0, copy(&good)).contains("already uploaded"));
    agg.add(&layout, 1, upload(&layout, &scope, 1, 3.0))
        .unwrap();
    let next = agg.finish(&layout, &snapshot(&m));
    assert_eq!(scalar(get(&next, "lm_head.weight")), 2.0);
    assert_eq!(get(&next, "lm_head.weight").kind(), Kind::Float);
}

#[test]
fn merge_schedule_edges() {
    let m = MergeSchedule {
        every: 200,
        alpha0: 0.05,
        until: 2000,
        top_k: 4,
    };
    assert_eq!(m.alpha(0), Some(0.05));
    assert_eq!(m.alpha(100), None, "not a multiple of M");
    assert!((m.alpha(1000).unwrap() - 0.025).abs() < 1e-12);
    assert_eq!(m.alpha(2000), None, "α reaches 0 at T");
    assert_eq!(m.alpha(2200), None, "and stays 0 after");
    assert_eq!(MergeSchedule { every: 0, ..m }.alpha(0), None);
}

#[test]
fn merge_mixes_each_expert_with_its_most_similar_from_pre_merge_values() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut g = snapshot(&m);
    // Gate directions: 0 ≈ 1 (cos 0.8), 2 nearly ⟂ 0, 3 = −0. Up/down hold the expert's index.
    let gates = [[1.0f32, 0.0], [0.8, 0.6], [0.1, 1.0], [-1.0, 0.0]];
    for (i, v) in gates.iter().enumerate() {
        let set = |g: &mut Named, part: &str, t: Tensor| {
            let name = expert_tensor_name(0, i, part);
            g.iter_mut().find(|(n, _)| *n == name).unwrap().1 = t;
        };
        let gate = Tensor::zeros([2, 4], (Kind::Float, Device::Cpu));
        gate.get(0).narrow(0, 0, 2).copy_(&Tensor::from_slice(v));
        set(&mut g, "gate_proj", gate);
        set(
            &mut g,
            "up_proj",
            Tensor::full([2, 4], (i * 10) as f64, (Kind::Float, Device::Cpu)),
        );
        set(
            &mut g,
            "down_proj",
            Tensor::full([4, 2], i as f64, (Kind::Float, Device::Cpu)),
        );
    }
    let events = merge_experts(&mut g, &layout, 2, 0.5);
    assert_eq!(events.len(), 4);
    // cos: C01=.8 C02=.0995 C03=-1 C12=.677 C13=-.8 C23=-.0995.
    assert_eq!(events[0].neighbours, vec![1, 2]);
    assert_eq!(events[1].neighbours, vec![0, 2]);
    assert_eq!(events[2].neighbours, vec![1, 0]);
    assert_eq!(events[3].neighbours, vec![2, 1]);
    // up_i ← up_i + α·(mean(up_N(i)) − up_i), all from the values before the merge.
    let up = |i: usize| scalar(get(&g, &expert_tensor_name(0, i, "up_proj")));
    assert_eq!(up(0), 0.0 + 0.5 * ((10.0 + 20.0) / 2.0 - 0.0));
    assert_eq!(up(1), 10.0 + 0.5 * ((0.0 + 20.0) / 2.0 - 10.0));
    assert_eq!(up(2), 20.0 + 0.5 * ((10.0 + 0.0) / 2.0 - 20.0));
    assert_eq!(up(3), 30.0 + 0.5 * ((20.0 + 10.0) / 2.0 - 30.0));
    let down3 = scalar(get(&g, &expert_tensor_name(0, 3, "down_proj")));
    assert_eq!(down3, 3.0 + 0.5 * (1.5 - 3.0));
    // The gate itself merges too: expert 0's first entry 1 + 0.5·((0.8 + 0.1)/2 − 1).
    let gate0 = scalar(get(&g, &expert_tensor_name(0, 0, "gate_proj")));
    assert!((gate0 - 0.725).abs() < 1e-6, "{gate0}");
}

#[test]
fn coordinator_closes_on_all_peers_or_timeout_and_rejects_stale_rounds() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 2).unwrap());
    let rules = RoundRules {
        sync_steps: 10,
        timeout_s: 5.0,
        merge: Some(MergeSchedule {
            every: 20,
            alpha0: 0.1,
            until: 100,
            top_k: 2,
        }),
    };
    let mut c = Coordinator::new(layout.clone(), scope.clone(), rules, snapshot(&m), 0);
    assert_eq!(c.round(), 1);
    assert!(!c.ready(0.0));
    c.upload(0, 1, upload(&layout, &scope, 0, 1.0), 100.0)
        .unwrap();
    assert!(!c.ready(104.9));
    assert!(c.ready(105.0), "timeout after the first upload");
    c.upload(1, 1, upload(&layout, &scope, 1, 2.0), 101.0)
        .unwrap();
    assert!(c.ready(101.0));
    let r = c.close();
    assert_eq!(
        (r.round, r.step, r.peers.clone(), r.merge_alpha),
        (1, 10, vec![0, 1], None)
    );
    assert_eq!(c.global().1, 1);

    let e = c
        .upload(0, 1, upload(&layout, &scope, 0, 1.0), 110.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("round 1 is closed") && e.contains("fetch round 1"),
        "{e}"
    );
    let e = c
        .upload(0, 3, upload(&layout, &scope, 0, 1.0), 110.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not open yet"), "{e}");

    // Round 2 = step 20, a merge step; node 1 never shows up, so its experts keep their values.
    let before = scalar(get(c.global().0, &expert_tensor_name(0, 3, "up_proj")));
    c.upload(0, 2, upload(&layout, &scope, 0, 5.0), 200.0)
        .unwrap();
    assert!(c.ready(205.0));
    let r = c.close();
    assert_eq!(r.missing, vec![1]);
    assert!((r.merge_alpha.unwrap() - 0.08).abs() < 1e-12);
    assert_eq!(r.merges.len(), 4);
    assert_eq!(scalar(get(c.global().0, "lm_head.weight")), 5.0);
    let after = scalar(get(c.global().0, &expert_tensor_name(0, 3, "up_proj")));
    assert_ne!(
        after, before,
        "merging moved the absent owner's expert toward its neighbours"
    );
}
