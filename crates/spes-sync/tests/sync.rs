use spes_model::{expert_tensor_name, ModelConfig, MoeModel, NormPlacement, QkNorm, Role};
use spes_sync::{
    delta, merge_experts, validate, Aggregator, Combine, Coordinator, Layout, MergeSchedule, Named,
    OuterRule, OuterRules, Ownership, RoundError, RoundRules, Scope, Standing, WireForm,
};
use std::collections::BTreeSet;
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
    let mut agg = Aggregator::new(scope.clone(), Combine::Mean);
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
    let scope = Scope::Diloco {
        members: BTreeSet::from([0, 1]),
    };
    let mut agg = Aggregator::new(scope.clone(), Combine::Mean);
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
    let global = snapshot(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 2).unwrap());
    let mut agg = Aggregator::new(scope.clone(), Combine::Mean);
    let good = upload(&layout, &scope, 0, 1.0);
    let err = |u: Named| validate(&layout, &scope, 0, &u, &global, None).unwrap_err();
    let mut wrong_shape = copy(&good);
    wrong_shape[0].1 = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    assert!(err(wrong_shape).contains("has shape [3]"));
    let mut missing = copy(&good);
    let gone = missing.remove(4).0;
    let e = err(missing);
    assert!(e.contains("missing tensor") && e.contains(&gone), "{e}");
    let mut nan = copy(&good);
    nan[1].1 = nan[1].1.fill(f64::NAN);
    assert!(err(nan).contains("non-finite"));
    let mut not_owned = copy(&good);
    let foreign = expert_tensor_name(0, 3, "up_proj");
    not_owned.push((
        foreign.clone(),
        Tensor::zeros([2, 4], (Kind::Float, Device::Cpu)),
    ));
    assert!(err(not_owned).contains("does not own"));
    let mut twice = copy(&good);
    twice.push((good[0].0.clone(), good[0].1.copy()));
    assert!(err(twice).contains("twice"));
    let mut int = copy(&good);
    int[0].1 = int[0].1.to_kind(Kind::Int64);
    assert!(err(int).contains("expected f32 or bf16"));
    assert!(validate(&layout, &scope, 0, &good, &global, None).is_ok());

    // The real uploads still make a correct round; bf16 payloads are accepted and upcast.
    let bf16: Named = good
        .iter()
        .map(|(n, t)| (n.clone(), t.to_kind(Kind::BFloat16)))
        .collect();
    agg.add(&layout, 0, bf16).unwrap();
    let e = agg.add(&layout, 0, copy(&good)).unwrap_err().to_string();
    assert!(e.contains("already uploaded"), "{e}");
    agg.add(&layout, 1, upload(&layout, &scope, 1, 3.0))
        .unwrap();
    let next = agg.finish(&layout, &global);
    assert_eq!(scalar(get(&next, "lm_head.weight")), 2.0);
    assert_eq!(get(&next, "lm_head.weight").kind(), Kind::Float);
}

#[test]
fn the_update_bound_refuses_uploads_that_move_too_far() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let global = snapshot(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 2).unwrap());
    // Honest: every tensor moves by 0.01 per element (RMS 0.01); a bound of 0.05 lets it through.
    let honest: Named = global
        .iter()
        .zip(&layout.entries)
        .filter(|(_, (_, role, _))| scope.uploads(0, *role))
        .map(|((n, t), _)| (n.clone(), t + 0.01))
        .collect();
    assert!(validate(&layout, &scope, 0, &honest, &global, Some(0.05)).is_ok());
    let mut far = copy(&honest);
    far[2].1 = &far[2].1 + 1.0;
    let e = validate(&layout, &scope, 0, &far, &global, Some(0.05)).unwrap_err();
    assert!(
        e.contains(&far[2].0) && e.contains("max_update_factor"),
        "{e}"
    );
    let mut huge = copy(&honest);
    huge[0].1 = huge[0].1.fill(3e38);
    assert!(validate(&layout, &scope, 0, &huge, &global, Some(0.05)).is_err());
    assert!(
        validate(&layout, &scope, 0, &far, &global, None).is_ok(),
        "unchecked"
    );
}

#[test]
fn robust_rules_ignore_one_outlier() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let scope = Scope::Diloco {
        members: (0..5).collect(),
    };
    let values = [1.0, 2.0, 3.0, 4.0, 1000.0];
    let combined = |combine: Combine| {
        let mut agg = Aggregator::new(scope.clone(), combine);
        for (p, v) in values.iter().enumerate() {
            agg.add(&layout, p, upload(&layout, &scope, p, *v)).unwrap();
        }
        scalar(get(&agg.finish(&layout, &snapshot(&m)), "lm_head.weight"))
    };
    assert_eq!(combined(Combine::Mean), 202.0);
    assert_eq!(combined(Combine::Median), 3.0);
    // 20 % of 5 = one value trimmed from each end: mean of 2, 3, 4.
    assert_eq!(combined(Combine::TrimmedMean { fraction: 0.2 }), 3.0);
    // Even counts: the median is the mean of the two middle values.
    let mut agg = Aggregator::new(scope.clone(), Combine::Median);
    for (p, v) in [1.0, 2.0, 5.0, 100.0].iter().enumerate() {
        agg.add(&layout, p, upload(&layout, &scope, p, *v)).unwrap();
    }
    assert_eq!(
        scalar(get(&agg.finish(&layout, &snapshot(&m)), "lm_head.weight")),
        3.5
    );
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

fn rules() -> RoundRules {
    RoundRules {
        sync_steps: 10,
        timeout_s: 5.0,
        lease_s: 3.0,
        evict_after_s: 10.0,
        merge: Some(MergeSchedule {
            every: 20,
            alpha0: 0.1,
            until: 100,
            top_k: 2,
        }),
        combine: Combine::Mean,
        max_update_rms: None,
        wire: WireForm::Values,
        outer: OuterRules::AVERAGE,
        rotate_every: 0,
    }
}

fn coordinator(m: &MoeModel, peers: usize, rules: RoundRules, now: f64) -> Coordinator {
    let scope = Scope::Spes(Ownership::resolve(&[], 4, peers).unwrap());
    Coordinator::new(
        Layout::of(m),
        scope,
        rules,
        snapshot(m),
        0,
        BTreeSet::new(),
        now,
    )
}

/// Uploads `value` for `peer` under the coordinator's open round and ownership.
fn up(
    c: &mut Coordinator,
    layout: &Layout,
    peer: usize,
    value: f64,
    now: f64,
) -> Result<(), RoundError> {
    let u = upload(layout, c.scope(), peer, value);
    let round = c.round();
    c.upload(peer, 100 + peer as u64, round, u, now)
}

#[test]
fn coordinator_closes_on_all_live_peers_or_timeout_and_rejects_stale_rounds() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut c = coordinator(&m, 2, rules(), 100.0);
    assert_eq!(c.round(), 1);
    assert!(!c.ready(1000.0), "never closes without an upload");
    c.join(0, 100, false, 100.0).unwrap();
    c.join(1, 101, false, 100.0).unwrap();
    up(&mut c, &layout, 0, 1.0, 101.0).unwrap();
    c.join(1, 101, false, 102.0).unwrap();
    assert!(!c.ready(104.9), "node 1 is live and has not uploaded");
    assert!(
        c.ready(105.0),
        "timeout counts from the round's opening, not the first upload"
    );
    up(&mut c, &layout, 1, 2.0, 102.5).unwrap();
    assert!(c.ready(102.5));
    let r = c.close(103.0);
    assert_eq!(
        (r.round, r.step, r.peers.clone(), r.merge_alpha),
        (1, 10, vec![0, 1], None)
    );
    assert_eq!(r.owners, vec![0, 0, 1, 1]);
    assert_eq!(c.global().1, 1);

    let e = c
        .upload(0, 100, 1, upload(&layout, c.scope(), 0, 1.0), 104.0)
        .unwrap_err();
    assert_eq!(e, RoundError::Closed { round: 1, fetch: 1 });
    assert!(e.to_string().contains("load round 1"), "{e}");
    let e = c
        .upload(0, 100, 3, upload(&layout, c.scope(), 0, 1.0), 104.0)
        .unwrap_err();
    assert_eq!(e, RoundError::NotOpen { round: 3, open: 2 });
    up(&mut c, &layout, 0, 5.0, 104.0).unwrap();
    assert_eq!(
        up(&mut c, &layout, 0, 5.0, 104.0),
        Err(RoundError::Duplicate { peer: 0, round: 2 })
    );

    // Round 2 = step 20, a merge step. Node 1's lease lapses (last seen 102.5), so the round
    // closes without waiting for the timeout, and its experts keep their values before merging.
    assert!(!c.ready(105.0));
    assert!(c.ready(105.6));
    let before = scalar(get(c.global().0, &expert_tensor_name(0, 3, "up_proj")));
    let r = c.close(105.6);
    assert_eq!(r.missing, vec![1]);
    assert!(
        r.evicted.is_empty(),
        "expired, but not for evict_after_s yet"
    );
    assert!((r.merge_alpha.unwrap() - 0.08).abs() < 1e-12);
    assert_eq!(r.merges.len(), 4);
    assert_eq!(scalar(get(c.global().0, "lm_head.weight")), 5.0);
    let after = scalar(get(c.global().0, &expert_tensor_name(0, 3, "up_proj")));
    assert_ne!(
        after, before,
        "merging moved the absent owner's expert toward its neighbours"
    );
}

#[test]
fn dead_nodes_are_evicted_and_their_experts_adopted_and_joiners_admitted() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut c = coordinator(
        &m,
        2,
        RoundRules {
            merge: None,
            ..rules()
        },
        0.0,
    );
    c.join(0, 100, false, 0.0).unwrap();
    c.join(1, 101, false, 0.0).unwrap();
    // Node 1 dies at t=0. Node 0 keeps uploading; at t=13 node 1's lease has been expired for
    // 10 s, so the close evicts it and node 0 owns every expert from round 2.
    up(&mut c, &layout, 0, 1.0, 13.5).unwrap();
    let r = c.close(13.5);
    assert_eq!((r.evicted.clone(), r.missing.clone()), (vec![1], vec![1]));
    assert_eq!(
        r.owners,
        vec![0, 0, 1, 1],
        "round 1 was still trained under the old map"
    );
    assert_eq!(c.scope().members(), BTreeSet::from([0]));
    assert_eq!(c.gone(), &BTreeSet::from([1]));
    // A second process with node 0's id is refused while node 0 is live.
    let e = c.join(0, 999, false, 14.0).unwrap_err();
    assert!(matches!(e, RoundError::PeerTaken { peer: 0, .. }), "{e:?}");
    assert!(
        e.to_string().contains("peer 0 is held by a live node"),
        "{e}"
    );
    // A stranger needs --join; peer 3 joins and becomes a member from round 3.
    assert_eq!(
        c.join(3, 103, false, 14.0),
        Err(RoundError::NotMember { peer: 3 })
    );
    assert_eq!(
        c.join(3, 103, true, 14.0),
        Ok(Standing::Joining { from: 3 })
    );
    assert_eq!(
        c.join(9, 1, true, 14.0),
        Err(RoundError::OutOfRange { peer: 9, max: 4 })
    );
    // The evicted node comes back: it is admitted like a joiner, without --join.
    assert_eq!(
        c.join(1, 101, false, 14.0),
        Ok(Standing::Joining { from: 3 })
    );
    up(&mut c, &layout, 0, 2.0, 15.0).unwrap();
    assert!(c.ready(15.0), "joiners are not waited for");
    let r = c.close(15.0);
    assert_eq!(r.owners, vec![0, 0, 0, 0]);
    assert_eq!(r.joined, vec![1, 3]);
    assert_eq!(c.scope().members(), BTreeSet::from([0, 1, 3]));
    let Scope::Spes(o) = c.scope() else { panic!() };
    let mut counts: Vec<usize> = [0, 1, 3].iter().map(|&p| o.experts_of(p).len()).collect();
    counts.sort();
    assert_eq!(counts, vec![1, 1, 2]);
    assert!(c.gone().is_empty());
    // Every member uploads; the joiners' lower values average in.
    for (p, v) in [(0, 3.0), (1, 6.0), (3, 9.0)] {
        up(&mut c, &layout, p, v, 16.0).unwrap();
    }
    let r = c.close(16.0);
    assert_eq!(r.peers, vec![0, 1, 3]);
    assert_eq!(scalar(get(c.global().0, "lm_head.weight")), 6.0);
}

#[test]
fn a_run_whose_nodes_all_died_admits_a_joiner_at_once_and_evicts_the_dead_later() {
    let m = model(1, 4);
    let mut c = coordinator(&m, 2, rules(), 0.0);
    // Nobody live, nothing uploaded: the joiner becomes a member of the open round.
    assert_eq!(c.join(2, 7, true, 100.0), Ok(Standing::Member));
    assert_eq!(c.round(), 1);
    assert_eq!(c.scope().members(), BTreeSet::from([0, 1, 2]));
    // With every member expired for long, a close evicts none of the live ones.
    let layout = Layout::of(&m);
    up(&mut c, &layout, 2, 1.0, 200.0).unwrap();
    let r = c.close(200.0);
    assert_eq!(r.evicted, vec![0, 1]);
    assert_eq!(c.scope().members(), BTreeSet::from([2]));
}

#[test]
fn a_non_finite_aggregate_is_never_published() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut c = coordinator(
        &m,
        2,
        RoundRules {
            merge: None,
            ..rules()
        },
        0.0,
    );
    // Each upload is finite, but the fp32 sum of the two overflows.
    up(&mut c, &layout, 0, 3e38, 1.0).unwrap();
    up(&mut c, &layout, 1, 3e38, 1.0).unwrap();
    let before = snapshot(&m);
    let r = c.close(1.0);
    assert!(
        r.discarded.as_deref().unwrap_or("").contains("not finite"),
        "{r:?}"
    );
    assert_eq!(c.global().1, 1, "the round still closes");
    for ((n, a), (_, b)) in before.iter().zip(c.global().0) {
        assert!(a.equal(b), "`{n}` changed");
    }
}

/// A node's view in the delta test: its fp32 model, bit-identical to the coordinator's.
fn apply_published(node: &mut Named, published: &spes_sync::RoundDelta, own: &Named) {
    for (name, t) in node.iter_mut() {
        let d = published
            .delta
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, d)| d.shallow_clone())
            // An own expert published verbatim: the node applies what it sent.
            .or_else(|| {
                own.iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, d)| d.shallow_clone())
            });
        if let Some(d) = d {
            *t = delta::apply(t, &d);
        }
    }
}

#[test]
fn bf16_deltas_keep_server_and_nodes_bit_identical_and_masters_unrounded() {
    let m = model(2, 4);
    let layout = Layout::of(&m);
    let mut r = rules();
    r.wire = WireForm::Bf16Delta;
    r.merge = Some(MergeSchedule {
        every: 20,
        alpha0: 0.1,
        until: 100,
        top_k: 2,
    });
    let mut c = coordinator(&m, 2, r, 0.0);
    let mut nodes = [snapshot(&m), snapshot(&m)];
    tch::manual_seed(7);
    for round in 1..=4u64 {
        let now = round as f64;
        let mut own_sent: Vec<Named> = Vec::new();
        for (peer, node) in nodes.iter().enumerate() {
            c.join(peer, 100 + peer as u64, false, now).unwrap();
            // "Training": a small fp32 change of every tensor this node uploads.
            let trained: Named = node
                .iter()
                .zip(&layout.entries)
                .filter(|(_, (_, role, _))| c.scope().uploads(peer, *role))
                .map(|((n, t), _)| (n.clone(), t + t.randn_like() * 1e-3))
                .collect();
            let wire: Named = trained
                .iter()
                .map(|(n, t)| (n.clone(), delta::encode(t, get(node, n))))
                .collect();
            let experts: Named = wire
                .iter()
                .filter(|(n, _)| n.contains(".experts."))
                .map(|(n, d)| (n.clone(), d.shallow_clone()))
                .collect();
            own_sent.push(experts);
            c.upload(peer, 100 + peer as u64, round, wire, now).unwrap();
        }
        let report = c.close(now + 0.5);
        let published = c.delta().expect("delta mode publishes a delta");
        let merged = !report.merges.is_empty();
        assert_eq!(merged, round % 2 == 0, "merges at steps 20 and 40");
        if merged {
            assert!(
                published.verbatim.is_empty(),
                "a merge re-encodes every expert"
            );
        } else {
            assert_eq!(
                published.verbatim.keys().copied().collect::<Vec<_>>(),
                vec![0, 1]
            );
        }
        for (peer, node) in nodes.iter_mut().enumerate() {
            // Nodes leave their own experts out of the download when published verbatim.
            let skip = published.verbatim.contains_key(&peer);
            let mut view = spes_sync::RoundDelta {
                delta: published
                    .delta
                    .iter()
                    .filter(|(n, _)| !(skip && published.verbatim[&peer].contains(n)))
                    .map(|(n, d)| (n.clone(), d.shallow_clone()))
                    .collect(),
                verbatim: Default::default(),
            };
            let own = if skip {
                copy(&own_sent[peer])
            } else {
                Vec::new()
            };
            apply_published(node, &view, &own);
            view.delta.clear();
            for ((name, a), (_, b)) in node.iter().zip(c.global().0) {
                assert!(
                    a.equal(b),
                    "round {round}: peer {peer}'s `{name}` differs from the server's"
                );
                assert_eq!(a.kind(), Kind::Float);
            }
        }
    }
    // The fp32 masters carry more than bf16 precision: rounding them would change them.
    let g = c.global().0;
    let embed = get(g, "model.embed_tokens.weight");
    assert!(!embed
        .to_kind(Kind::BFloat16)
        .to_kind(Kind::Float)
        .equal(embed));
    assert!(c.delta().unwrap().bytes() > 0);
}

#[test]
fn a_delta_upload_must_be_bf16_of_the_right_shape() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut r = rules();
    r.wire = WireForm::Bf16Delta;
    let mut c = coordinator(&m, 2, r, 0.0);
    let fp32 = upload(&layout, c.scope(), 0, 0.0);
    let e = c.upload(0, 100, 1, fp32, 0.0).unwrap_err();
    assert!(e.to_string().contains("expected a bf16 delta"), "{e}");
    let mut wrong: Named = upload(&layout, c.scope(), 0, 0.0)
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(Kind::BFloat16)))
        .collect();
    wrong[0].1 = Tensor::zeros([3], (Kind::BFloat16, Device::Cpu));
    let e = c.upload(0, 100, 1, wrong, 0.0).unwrap_err();
    assert!(e.to_string().contains("has shape"), "{e}");
    // A zero delta of everything this node owns is accepted and changes nothing it owns.
    let zero: Named = upload(&layout, c.scope(), 0, 0.0)
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(Kind::BFloat16)))
        .collect();
    c.upload(0, 100, 1, zero, 0.0).unwrap();
    let before = snapshot(&m);
    c.close(1.0);
    let g = c.global().0;
    let name = expert_tensor_name(0, 0, "up_proj");
    assert!(get(g, &name).equal(get(&before, &name)));
    // Node 1 did not upload: its experts did not change and are not published at all.
    let other = expert_tensor_name(0, 3, "up_proj");
    assert!(!c.delta().unwrap().delta.iter().any(|(n, _)| *n == other));
}

#[test]
fn a_quantized_upload_must_have_its_sizes_and_sane_scales() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut r = rules();
    r.wire = WireForm::Quantized { bits: 4 };
    r.max_update_rms = Some(1.0);
    let mut c = coordinator(&m, 2, r, 0.0);
    let good = |c: &Coordinator| -> Named {
        upload(&layout, c.scope(), 0, 0.0)
            .into_iter()
            .flat_map(|(n, t)| {
                delta::compress(&(t.randn_like() * 1e-3), WireForm::Quantized { bits: 4 })
                    .into_wire(&n)
            })
            .collect()
    };
    let mut cases: Vec<(Named, &str)> = Vec::new();
    let mut short = good(&c);
    let i = short.iter().position(|(n, _)| n.ends_with("#q")).unwrap();
    short[i].1 = short[i].1.narrow(0, 0, 4);
    cases.push((short, "uint8 codes"));
    let mut eight = good(&c);
    let i = eight.iter().position(|(n, _)| n.ends_with("#q")).unwrap();
    eight[i].1 = eight[i].1.repeat([2]);
    cases.push((eight, "uint8 codes"));
    for (bad, why) in [
        (-1.0, "negative scale"),
        (f64::NAN, "non-finite"),
        (1e3, "moved by RMS"),
    ] {
        let u = good(&c);
        let i = u.iter().position(|(n, _)| n.ends_with("#scale")).unwrap();
        let _ = u[i].1.get(0).fill_(bad);
        cases.push((u, why));
    }
    let mut unpaired = good(&c);
    unpaired.retain(|(n, _)| !n.ends_with("#scale"));
    cases.push((unpaired, "lacks its"));
    for (u, why) in cases {
        let e = c.upload(0, 100, 1, u, 0.0).unwrap_err();
        assert!(e.to_string().contains(why), "{why}: {e}");
        assert!(c.uploaded().is_empty());
    }
    c.upload(0, 100, 1, good(&c), 0.0).unwrap();
}

#[test]
fn the_server_keeps_no_upload_storage() {
    // Uploads may view a mapped file that is unmapped after `upload` returns: overwriting
    // them afterwards must not change the round.
    let m = model(1, 4);
    let layout = Layout::of(&m);
    for form in [
        WireForm::Values,
        WireForm::Bf16Delta,
        WireForm::Quantized { bits: 4 },
        WireForm::Sparse { density: 0.2 },
    ] {
        let mut r = rules();
        r.wire = form;
        r.merge = None;
        // The same uploads for both runs (made once: other tests share the global RNG).
        let scope = coordinator(&m, 2, r, 0.0).scope().clone();
        let uploads: Vec<Named> = (0..2)
            .map(|peer| {
                upload(&layout, &scope, peer, 0.0)
                    .into_iter()
                    .flat_map(|(n, t)| {
                        let change = t.randn_like() * 1e-3;
                        match form {
                            WireForm::Values => vec![(n, t + change)],
                            WireForm::Bf16Delta => vec![(n, change.to_kind(Kind::BFloat16))],
                            lossy => delta::compress(&change, lossy).into_wire(&n).into(),
                        }
                    })
                    .collect()
            })
            .collect();
        let mut published = Vec::new();
        for clobber in [false, true] {
            let mut c = coordinator(&m, 2, r, 0.0);
            for (peer, u) in uploads.iter().enumerate() {
                let u = copy(u);
                let views: Vec<Tensor> = u.iter().map(|(_, t)| t.shallow_clone()).collect();
                c.upload(peer, 100 + peer as u64, 1, u, 0.0).unwrap();
                if clobber {
                    for mut t in views {
                        let _ = t.fill_(3.0);
                    }
                }
            }
            c.close(1.0);
            published.push(copy(c.global().0));
        }
        for ((n, a), (_, b)) in published[0].iter().zip(&published[1]) {
            assert!(
                a.equal(b),
                "{form:?}: `{n}` changed with the upload's storage"
            );
        }
    }
}

/// Four rounds of 2 nodes on a lossy wire (merges on even rounds): checks after every round
/// that each node's copy of the global model equals the server's bit for bit. Returns, per
/// round, how many entries of the embedding the global model has moved, and the RMS of what
/// the embedding's global has not yet absorbed of the nodes' mean change.
fn lossy_rounds(form: WireForm) -> (Vec<i64>, Vec<f64>) {
    let m = model(2, 4);
    let layout = Layout::of(&m);
    let mut r = rules();
    r.wire = form;
    let mut c = coordinator(&m, 2, r, 0.0);
    // Each node's copy of the global model, and its working weights (which keep what it has
    // not sent yet).
    let mut bases = [snapshot(&m), snapshot(&m)];
    let mut work = [snapshot(&m), snapshot(&m)];
    tch::manual_seed(3);
    let embed = "model.embed_tokens.weight";
    let e = layout
        .entries
        .iter()
        .position(|(n, _, _)| n == embed)
        .unwrap();
    let (mut embed_moved, mut behind) = (Vec::new(), Vec::new());
    // The embedding's θ⁰ plus the nodes' mean change so far.
    let mut ideal = get(&snapshot(&m), embed).copy();
    for round in 1..=4u64 {
        let now = round as f64;
        let mut sent: Vec<Vec<(String, delta::Compressed)>> = Vec::new();
        for peer in 0..2 {
            c.join(peer, 100 + peer as u64, false, now).unwrap();
            let mut wire = Vec::new();
            let mut mine = Vec::new();
            for (i, (name, role, _)) in layout.entries.iter().enumerate() {
                if !c.scope().uploads(peer, *role) {
                    continue;
                }
                // Training moves every weight a little; only part of it is sent.
                let w = &mut work[peer][i].1;
                let step = w.randn_like() * 1e-3;
                if i == e {
                    ideal += &step / 2.0;
                }
                *w = &*w + step;
                let v = &*w - &bases[peer][i].1;
                let sent = delta::compress(&v, form);
                mine.push((name.clone(), sent.share()));
                wire.extend(sent.into_wire(name));
            }
            sent.push(mine);
            c.upload(peer, 100 + peer as u64, round, wire, now).unwrap();
        }
        let report = c.close(now + 0.5);
        let published = c.delta().unwrap();
        assert_eq!(!report.merges.is_empty(), round % 2 == 0);
        for peer in 0..2 {
            let own: std::collections::HashSet<&str> = published
                .verbatim
                .get(&peer)
                .map(|v| {
                    v.iter()
                        .filter_map(|w| delta::split_wire_name(w).map(|(n, _)| n))
                        .collect()
                })
                .unwrap_or_default();
            let mut parts: std::collections::HashMap<&str, Vec<(delta::WirePart, Tensor)>> =
                Default::default();
            for (w, t) in &published.delta {
                let (name, part) = delta::split_wire_name(w).expect("a compressed part");
                parts
                    .entry(name)
                    .or_default()
                    .push((part, t.shallow_clone()));
            }
            for (i, (name, _, shape)) in layout.entries.iter().enumerate() {
                let numel: i64 = shape.iter().product();
                // The published parts, or (own experts the node did not download) what it sent.
                let got = if own.contains(name.as_str()) {
                    sent[peer]
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, c)| c.share())
                } else {
                    parts.get(name.as_str()).map(|p| decode_parts(p, numel))
                };
                let base = &mut bases[peer][i].1;
                let before = base.copy();
                if let Some(c) = &got {
                    c.apply_(base);
                }
                // Working weights: the new global plus whatever was not sent.
                if let Some((_, mine)) = sent[peer].iter().find(|(n, _)| n == name) {
                    let unsent = mine.subtract_from(&(&work[peer][i].1 - &before));
                    work[peer][i].1 = &*base + unsent;
                } else {
                    work[peer][i].1 = base.copy();
                }
            }
            for ((name, a), (_, b)) in bases[peer].iter().zip(c.global().0) {
                assert!(
                    a.equal(b),
                    "round {round}: peer {peer}'s `{name}` differs from the server's"
                );
            }
        }
        let global = get(c.global().0, embed);
        embed_moved.push(
            (global - get(&snapshot(&m), embed))
                .ne(0.0)
                .sum(Kind::Int64)
                .int64_value(&[]),
        );
        behind.push(scalar(&(global - &ideal).square().mean(Kind::Float).sqrt()));
    }
    (embed_moved, behind)
}

/// A compressed delta from its published parts.
fn decode_parts(parts: &[(delta::WirePart, Tensor)], numel: i64) -> delta::Compressed {
    use delta::WirePart;
    let part = |p: WirePart| {
        parts
            .iter()
            .find(|(q, _)| *q == p)
            .map(|(_, t)| t.shallow_clone())
    };
    match (part(WirePart::Idx), part(WirePart::Val)) {
        (Some(idx), Some(val)) => delta::Compressed::Sparse(delta::Sparse { idx, val }),
        _ => {
            let (codes, scale) = (
                part(WirePart::Codes).unwrap(),
                part(WirePart::Scale).unwrap(),
            );
            let bits = [8u8, 4, 2]
                .into_iter()
                .find(|&b| delta::quantized_sizes(numel, b).1 == codes.numel() as i64)
                .unwrap();
            delta::Compressed::Quantized(delta::Quantized { codes, scale, bits })
        }
    }
}

#[test]
fn sparse_deltas_keep_the_global_bit_identical_and_carry_the_rest_over() {
    let (moved, _) = lossy_rounds(WireForm::Sparse { density: 0.25 });
    // Each round publishes at most a quarter of the entries, and what was held back reaches
    // the global model in later rounds.
    let n = get(&snapshot(&model(2, 4)), "model.embed_tokens.weight").numel() as i64;
    assert!(moved[0] <= n / 4 + 1, "{moved:?} of {n}");
    assert!(moved[3] > moved[0], "{moved:?}");
}

#[test]
fn quantized_deltas_keep_the_global_bit_identical_and_carry_the_rest_over() {
    for bits in [8u8, 4, 2] {
        let (_, behind) = lossy_rounds(WireForm::Quantized { bits });
        // Error feedback: the global lags the nodes' mean change by about one round's
        // rounding, which does not grow (four rounds of steps of RMS 1e-3 each, averaged
        // over two nodes, move the ideal by RMS ≈ 1.4e-3).
        // Measured: about 5e-6, 9e-5 and 7e-4 in every round for 8, 4 and 2 bits.
        let limit = match bits {
            8 => 2e-5,
            4 => 2e-4,
            _ => 1.1e-3,
        };
        assert!(
            behind.iter().all(|b| *b < limit) && behind[3] < 2.0 * behind[0],
            "{bits} bits: the global lags the nodes by {behind:?}"
        );
    }
}

/// Round 1 and 2 of a 2-node run where node 0 uploads 1.0 and node 1 uploads 3.0 everywhere.
fn outer_round(c: &mut Coordinator, layout: &Layout, wire: WireForm, now: f64) {
    for peer in 0..2 {
        c.join(peer, 100 + peer as u64, false, now).unwrap();
    }
    if wire == WireForm::Values {
        up(c, layout, 0, 1.0, now).unwrap();
        up(c, layout, 1, 3.0, now).unwrap();
    } else {
        for (peer, v) in [(0usize, 1.0), (1, 3.0)] {
            let round = c.round();
            let base = copy(c.global().0);
            let wire: Named = upload(layout, c.scope(), peer, v)
                .into_iter()
                .map(|(n, t)| {
                    let d = delta::encode(&t, get(&base, &n));
                    (n, d)
                })
                .collect();
            c.upload(peer, 100 + peer as u64, round, wire, now).unwrap();
        }
    }
    c.close(now + 0.5);
}

#[test]
fn the_outer_optimizer_steps_each_change_with_momentum_and_survives_a_restart() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let outer = OuterRules {
        averaged: OuterRule {
            lr: 0.5,
            momentum: 0.5,
            nesterov: true,
        },
        owned: OuterRule {
            lr: 2.0,
            momentum: 0.0,
            nesterov: true,
        },
        norm_preserving: false,
    };
    let theta0 = snapshot(&m);
    let shared = "model.embed_tokens.weight";
    let expert = expert_tensor_name(0, 0, "gate_proj"); // node 0's
    for wire in [WireForm::Values, WireForm::Bf16Delta] {
        let r = RoundRules {
            merge: None,
            wire,
            outer,
            ..rules()
        };
        let mut c = coordinator(&m, 2, r, 0.0);
        outer_round(&mut c, &layout, wire, 1.0);
        let g1 = copy(c.global().0);
        // Δ = mean − θ0 = 2 − θ0; Nesterov: θ0 + lr·(Δ + μ·Δ) = θ0 + 0.75·Δ.
        let t0 = get(&theta0, shared);
        let want = t0 + (t0.neg() + 2.0) * 0.75;
        // bf16 uploads of changes near 2 are exact to ~1 %.
        let tol = if wire == WireForm::Values { 1e-5 } else { 2e-2 };
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < tol;
        assert!(close(get(&g1, shared), &want), "{wire:?}: shared round 1");
        // The owner's change 1 − θ0, doubled.
        let e0 = get(&theta0, &expert);
        assert!(close(get(&g1, &expert), &(e0 + (e0.neg() + 1.0) * 2.0)));
        if wire == WireForm::Bf16Delta {
            let published = c.delta().unwrap();
            assert!(
                published.verbatim.is_empty(),
                "the server changed the experts"
            );
            let mut node = copy(&theta0);
            apply_published(&mut node, published, &Vec::new());
            for ((name, a), (_, b)) in node.iter().zip(c.global().0) {
                assert!(
                    a.equal(b),
                    "{name}: a node's model differs from the server's"
                );
            }
        }
        let carried = c.carried();
        assert!(carried.iter().all(|(n, _)| n.starts_with("momentum/")));
        assert!(carried
            .iter()
            .any(|(n, _)| *n == format!("momentum/{shared}")));
        assert!(
            !carried.iter().any(|(n, _)| n.contains(".experts.")),
            "no momentum kept for μ = 0"
        );
        // A restarted server resumes with the momenta; one without them steps differently.
        let scope = c.scope().clone();
        let restart = |restore: bool| {
            let mut d = Coordinator::new(
                layout.clone(),
                scope.clone(),
                r,
                copy(&g1),
                1,
                BTreeSet::new(),
                2.0,
            );
            if restore {
                d.restore_carried(copy(&carried)).unwrap();
            }
            outer_round(&mut d, &layout, wire, 2.0);
            copy(d.global().0)
        };
        let (resumed, forgot) = (restart(true), restart(false));
        outer_round(&mut c, &layout, wire, 2.0);
        for ((name, a), (_, b)) in c.global().0.iter().zip(&resumed) {
            assert!(a.equal(b), "{wire:?}: `{name}` differs after a restart");
        }
        assert!(!get(&forgot, shared).equal(get(c.global().0, shared)));
        // Round 2: Δ2 = 2 − θ1, m2 = μ·Δ1 + Δ2, θ2 = θ1 + lr·(Δ2 + μ·m2).
        let t1 = get(&g1, shared);
        let (d1, d2) = (t0.neg() + 2.0, t1.neg() + 2.0);
        let m2 = &d1 * 0.5 + &d2;
        let want2 = t1 + (&d2 + m2 * 0.5) * 0.5;
        assert!(
            close(get(c.global().0, shared), &want2),
            "{wire:?}: round 2"
        );
        let mut bad = c.carried();
        bad[0].0 = "momentum/no.such.tensor".into();
        assert!(c
            .restore_carried(bad)
            .unwrap_err()
            .contains("no.such.tensor"));
    }
}

/// Norm-preserving scale (`outer.norm_preserving`): 4 nodes upload bf16 deltas towards values
/// 1, −1, 1 and 3 everywhere. Each shared tensor's mean change is scaled by
/// √(mean ‖Δᵢ‖² / ‖Δ̄‖²), clamped to [1, 2]; owners' experts are published as sent, the report
/// gives the scale, and a node applying the published round lands on the server's model.
#[test]
fn norm_preserving_scale_undoes_what_averaging_shrank() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let theta0 = snapshot(&m);
    let values = [1.0, -1.0, 1.0, 3.0];
    let shared = "model.embed_tokens.weight";
    let expert = expert_tensor_name(0, 1, "up_proj"); // node 1's
    let mut finals = Vec::new();
    for on in [false, true] {
        let r = RoundRules {
            merge: None,
            wire: WireForm::Bf16Delta,
            outer: OuterRules {
                norm_preserving: on,
                ..OuterRules::AVERAGE
            },
            ..rules()
        };
        let mut c = coordinator(&m, 4, r, 0.0);
        let mut deltas: Vec<Named> = Vec::new();
        for (peer, v) in values.iter().enumerate() {
            c.join(peer, 100 + peer as u64, false, 0.0).unwrap();
            let wire: Named = upload(&layout, c.scope(), peer, *v)
                .into_iter()
                .map(|(n, t)| {
                    let d = delta::encode(&t, get(&theta0, &n));
                    (n, d)
                })
                .collect();
            deltas.push(copy(&wire));
            let round = c.round();
            c.upload(peer, 100 + peer as u64, round, wire, 0.5).unwrap();
        }
        let report = c.close(1.0);
        // Each averaged tensor's scale from the uploaded (bf16) deltas themselves.
        let sq = |t: &Tensor| {
            t.to_kind(Kind::Double)
                .square()
                .sum(Kind::Double)
                .double_value(&[])
        };
        let natural = |name: &str| {
            let ds: Vec<Tensor> = deltas
                .iter()
                .map(|d| get(d, name).to_kind(Kind::Float))
                .collect();
            let mean = ds.iter().fold(ds[0].zeros_like(), |a, d| a + d) / 4.0;
            let mean_sq = ds.iter().map(sq).sum::<f64>() / 4.0;
            // Changes that cancel exactly (norms at 1 moved by 0, −2, 0, 2) stay unscaled.
            let scale = match sq(&mean) {
                0.0 => 1.0,
                m => (mean_sq / m).sqrt().clamp(1.0, 2.0),
            };
            (scale, mean)
        };
        let (embed_scale, mean) = natural(shared);
        assert!(
            embed_scale > 1.3,
            "the uploads disagree, so the scale matters: {embed_scale}"
        );
        let scale = if on { embed_scale } else { 1.0 };
        let want = get(&theta0, shared) + &mean * scale;
        let got = get(c.global().0, shared);
        let err = (got - &want).abs().max().double_value(&[]);
        assert!(err < 2e-2, "norm_preserving {on}: off by {err}");
        // The report: the scales averaged over every averaged value.
        let (mut sum, mut count) = (0.0, 0.0);
        for (name, t) in &deltas[0] {
            if !name.contains(".experts.") {
                sum += natural(name).0 * t.numel() as f64;
                count += t.numel() as f64;
            }
        }
        match report.outer_scale {
            Some(s) if on => assert!(
                (s - sum / count).abs() < 1e-3,
                "reported {s}, want {}",
                sum / count
            ),
            None if !on => {}
            other => panic!("norm_preserving {on}: reported {other:?}"),
        }
        // Node 1's expert: its own delta, as sent, whatever the rule.
        let sent = delta::apply(get(&theta0, &expert), get(&deltas[1], &expert));
        assert!(get(c.global().0, &expert).equal(&sent));
        let mut node = copy(&theta0);
        apply_published(&mut node, c.delta().unwrap(), &Vec::new());
        for ((name, a), (_, b)) in node.iter().zip(c.global().0) {
            assert!(
                a.equal(b),
                "{name}: a node's model differs from the server's"
            );
        }
        finals.push(copy(c.global().0));
    }
    assert!(!get(&finals[0], shared).equal(get(&finals[1], shared)));
}

#[test]
fn ownership_rotates_after_every_r_rounds_and_uploads_follow_it() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let r = RoundRules {
        merge: None,
        rotate_every: 2,
        ..rules()
    };
    let mut c = coordinator(&m, 2, r, 0.0);
    let mut owners = vec![c.scope().owners()];
    for round in 1..=4u64 {
        let now = round as f64;
        for peer in 0..2 {
            c.join(peer, 100 + peer as u64, false, now).unwrap();
        }
        up(&mut c, &layout, 0, 1.0, now).unwrap();
        up(&mut c, &layout, 1, 1.0, now).unwrap();
        let report = c.close(now + 0.5);
        assert_eq!(report.owners, owners[round as usize - 1], "round {round}");
        owners.push(c.scope().owners());
    }
    assert_eq!(owners[0], vec![0, 0, 1, 1]);
    assert_eq!(owners[1], owners[0], "no rotation after round 1");
    assert_eq!(owners[2], vec![1, 1, 0, 0], "rotated after round 2");
    assert_eq!(owners[3], owners[2]);
    assert_eq!(owners[4], owners[0], "and back after round 4");
    // An upload of the old ownership is refused once it rotated.
    let stale = upload(
        &layout,
        &Scope::Spes(Ownership::from_owners(vec![1, 1, 0, 0]).unwrap()),
        0,
        1.0,
    );
    let round = c.round();
    assert!(matches!(
        c.upload(0, 100, round, stale, 5.0),
        Err(RoundError::Invalid { .. })
    ));
}
