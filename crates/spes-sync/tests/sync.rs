//! The server's half of SPES without a network: aggregation, upload checks, merging, the
//! coordinator's rounds and membership, the outer optimizer. Node views of published rounds
//! are real `Replica`s (tests/replica.rs covers them in depth).

mod common;

use common::*;
use spes_model::{expert_tensor_name, MoeModel, Role};
use spes_sync::{
    delta, merge_experts, validate, AggregateRule, Aggregator, Combined, Coordinator, Delta,
    Deltas, Layout, MergeSimilarity, Mode, Named, Ownership, Published, Replica, RoundError, Scope,
    Standing, Start, SyncConfig, Wire, Work, UNOWNED,
};
use std::collections::{BTreeMap, BTreeSet};
use tch::{Device, Kind, Tensor};

/// Whole values as an fp32-wire upload's deltas.
fn values(named: Named) -> Deltas {
    named
        .into_iter()
        .map(|(n, t)| (n, Delta::Value(t)))
        .collect()
}

/// What the coordinator does with an upload's wire tensors before folding them in: decode,
/// then validate.
fn check(
    cfg: &SyncConfig,
    layout: &Layout,
    scope: &Scope,
    upload: Named,
    global: &Named,
    bound: Option<f64>,
) -> Result<(), String> {
    let d = delta::decode(upload, cfg, 1, |n| layout.shape_of(n))?;
    validate(layout, scope, 0, &d, global, bound)
}

/// The combined value (or change) of `name`: averaged, or its owner's.
fn combined(c: &Combined, name: &str) -> f64 {
    match (c.averaged.get(name), c.owned.get(name)) {
        (Some(t), _) => scalar(t),
        (_, Some((_, Delta::Value(t)))) => scalar(t),
        other => panic!("`{name}`: {}", other.0.is_some()),
    }
}

/// A replica of `peer` holding `global` (round `round`) with `weights` its copy of it, owning
/// what `c` says.
fn replica(c: &Coordinator, peer: usize, weights: &Named, round: u64) -> Replica {
    let layout = Layout::new(
        c.layout().entries.clone(),
        c.layout().n_layers,
        c.layout().n_experts,
    );
    let mut r = Replica::new(peer, c.cfg().clone(), layout);
    r.follow(&c.scope().owners(), &[peer], weights);
    r.hold(round, weights);
    r
}

#[test]
fn shared_params_are_averaged_and_experts_come_from_their_owner() {
    let m = model(2, 4);
    let layout = Layout::of(&m);
    let prev = snapshot(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 2).unwrap());
    let mut agg = Aggregator::new(scope.clone(), &cfg());
    agg.add(&layout, 0, values(upload(&layout, &scope, 0, 1.0)), 1.0)
        .unwrap();
    agg.add(&layout, 1, values(upload(&layout, &scope, 1, 4.0)), 1.0)
        .unwrap();
    let next = agg.finish();
    assert_eq!(combined(&next, "model.embed_tokens.weight"), 2.5);
    assert_eq!(combined(&next, "model.layers.1.mlp.gate.weight"), 2.5);
    // Node 0 owns experts 0,1; node 1 owns 2,3 (contiguous).
    assert_eq!(combined(&next, &expert_tensor_name(1, 1, "down_proj")), 1.0);
    assert_eq!(combined(&next, &expert_tensor_name(0, 2, "gate_proj")), 4.0);
    assert_eq!(next.owned[&expert_tensor_name(0, 2, "gate_proj")].0, 1);
    assert_eq!(next.averaged.len() + next.owned.len(), prev.len());
}

#[test]
fn diloco_averages_every_parameter_including_experts() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let scope = Scope::Diloco {
        members: BTreeSet::from([0, 1]),
    };
    let mut agg = Aggregator::new(scope.clone(), &cfg());
    agg.add(&layout, 0, values(upload(&layout, &scope, 0, 1.0)), 1.0)
        .unwrap();
    agg.add(&layout, 1, values(upload(&layout, &scope, 1, 3.0)), 1.0)
        .unwrap();
    let next = agg.finish();
    assert!(next.owned.is_empty());
    assert_eq!(next.averaged.len(), layout.entries.len());
    for (name, t) in &next.averaged {
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
    let mut agg = Aggregator::new(scope.clone(), &cfg());
    let good = upload(&layout, &scope, 0, 1.0);
    let err = |u: Named| check(&cfg(), &layout, &scope, u, &global, None).unwrap_err();
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
    let mut unknown = copy(&good);
    unknown.push((
        "no.such.tensor".into(),
        Tensor::zeros([1], (Kind::Float, Device::Cpu)),
    ));
    assert!(err(unknown).contains("unknown tensor `no.such.tensor`"));
    assert!(check(&cfg(), &layout, &scope, copy(&good), &global, None).is_ok());

    // The real uploads still make a correct round; bf16 payloads are accepted and upcast.
    let bf16: Named = good
        .iter()
        .map(|(n, t)| (n.clone(), t.to_kind(Kind::BFloat16)))
        .collect();
    agg.add(&layout, 0, values(bf16), 1.0).unwrap();
    let e = agg
        .add(&layout, 0, values(copy(&good)), 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("already uploaded"), "{e}");
    agg.add(&layout, 1, values(upload(&layout, &scope, 1, 3.0)), 1.0)
        .unwrap();
    let next = agg.finish();
    assert_eq!(combined(&next, "lm_head.weight"), 2.0);
    assert_eq!(next.averaged["lm_head.weight"].kind(), Kind::Float);
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
    let v = |u: &Named, bound| check(&cfg(), &layout, &scope, copy(u), &global, bound);
    assert!(v(&honest, Some(0.05)).is_ok());
    let mut far = copy(&honest);
    far[2].1 = &far[2].1 + 1.0;
    let e = v(&far, Some(0.05)).unwrap_err();
    assert!(
        e.contains(&far[2].0) && e.contains("max_update_factor"),
        "{e}"
    );
    let mut huge = copy(&honest);
    huge[0].1 = huge[0].1.fill(3e38);
    assert!(v(&huge, Some(0.05)).is_err());
    assert!(v(&far, None).is_ok(), "unchecked");
}

#[test]
fn robust_rules_ignore_one_outlier() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let scope = Scope::Diloco {
        members: (0..5).collect(),
    };
    let values_ = [1.0, 2.0, 3.0, 4.0, 1000.0];
    let rule = |aggregate, trim_fraction| SyncConfig {
        aggregate,
        trim_fraction,
        ..cfg()
    };
    let fold = |cfg: SyncConfig, vals: &[f64]| {
        let mut agg = Aggregator::new(scope.clone(), &cfg);
        for (p, v) in vals.iter().enumerate() {
            agg.add(&layout, p, values(upload(&layout, &scope, p, *v)), 1.0)
                .unwrap();
        }
        combined(&agg.finish(), "lm_head.weight")
    };
    assert_eq!(fold(rule(AggregateRule::Mean, 0.0), &values_), 202.0);
    assert_eq!(fold(rule(AggregateRule::Median, 0.0), &values_), 3.0);
    // 20 % of 5 = one value trimmed from each end: mean of 2, 3, 4.
    assert_eq!(fold(rule(AggregateRule::TrimmedMean, 0.2), &values_), 3.0);
    // Even counts: the median is the mean of the two middle values.
    let even = [1.0, 2.0, 5.0, 100.0];
    assert_eq!(fold(rule(AggregateRule::Median, 0.0), &even), 3.5);
}

#[test]
fn merge_schedule_edges() {
    let m = SyncConfig {
        merge_every: 200,
        merge_alpha: 0.05,
        merge_until: 2000,
        ..cfg()
    };
    assert_eq!(m.merge_alpha_at(0), Some(0.05));
    assert_eq!(m.merge_alpha_at(100), None, "not a multiple of M");
    assert!((m.merge_alpha_at(1000).unwrap() - 0.025).abs() < 1e-12);
    assert_eq!(m.merge_alpha_at(2000), None, "α reaches 0 at T");
    assert_eq!(m.merge_alpha_at(2200), None, "and stays 0 after");
    let off = SyncConfig {
        merge_every: 0,
        ..m.clone()
    };
    assert_eq!(off.merge_alpha_at(0), None);
    let diloco = SyncConfig {
        mode: Mode::Diloco,
        ..m
    };
    assert_eq!(diloco.merge_alpha_at(0), None, "DiLoCo never merges");
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
    let before = g
        .iter()
        .map(|(n, t)| (n.clone(), t.copy()))
        .collect::<Named>();
    let events = merge_experts(&mut g, &layout, 2, 0.5, MergeSimilarity::Experts);
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

    // By the router's view: rows that pair 0 with 3 and 1 with 2, whatever the gates say.
    let mut g = before;
    let rows = [[1.0f32, 0.0], [0.0, 1.0], [0.1, 1.0], [1.0, 0.1]];
    let router = Tensor::zeros([4, 2], (Kind::Float, Device::Cpu));
    for (i, r) in rows.iter().enumerate() {
        router.get(i as i64).copy_(&Tensor::from_slice(r));
    }
    let name = spes_model::router_tensor_name(0);
    let slot = g
        .iter_mut()
        .find(|(n, _)| *n == name)
        .expect("layer 0's router");
    slot.1 = router
        .view([4, 2])
        .pad([0, slot.1.size()[1] - 2], "constant", Some(0.0));
    let events = merge_experts(&mut g, &layout, 1, 0.5, MergeSimilarity::Router);
    let nearest: Vec<usize> = events.iter().map(|e| e.neighbours[0]).collect();
    assert_eq!(nearest, vec![3, 2, 1, 0]);
    let up0 = scalar(get(&g, &expert_tensor_name(0, 0, "up_proj")));
    assert_eq!(
        up0,
        0.0 + 0.5 * (30.0 - 0.0),
        "merged with expert 3 by the router's view"
    );
}

#[test]
fn coordinator_closes_on_all_live_peers_or_timeout_and_rejects_stale_rounds() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut c = coordinator(&m, 2, cfg(), 100.0);
    assert_eq!(c.round(), 1);
    assert!(!c.ready(1000.0), "never closes without an upload");
    c.join(0, 100, false, None, 100.0).unwrap();
    c.join(1, 101, false, None, 100.0).unwrap();
    up(&mut c, &layout, 0, 1.0, 101.0).unwrap();
    c.join(1, 101, false, None, 102.0).unwrap();
    // Node 0 heartbeats on (a server that hears nobody for half a lease presumes itself cut off).
    for t in [103.2, 104.4] {
        c.join(0, 100, false, None, t).unwrap();
    }
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
        .upload(
            0,
            100,
            1,
            upload(&layout, c.scope(), 0, 1.0),
            Work::default(),
            104.0,
        )
        .unwrap_err();
    assert_eq!(e, RoundError::Closed { round: 1, fetch: 1 });
    assert!(e.to_string().contains("load round 1"), "{e}");
    let e = c
        .upload(
            0,
            100,
            3,
            upload(&layout, c.scope(), 0, 1.0),
            Work::default(),
            104.0,
        )
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
    let mut c = unmerged(&m, 2);
    c.join(0, 100, false, None, 0.0).unwrap();
    c.join(1, 101, false, None, 0.0).unwrap();
    // Node 1 dies at t=0. Node 0 heartbeats and keeps uploading; at t=13 node 1's lease has
    // been expired for 10 s, so the close evicts it and node 0 owns every expert from round 2.
    for t in 1..=13 {
        c.join(0, 100, false, None, t as f64).unwrap();
    }
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
    let e = c.join(0, 999, false, None, 14.0).unwrap_err();
    assert!(matches!(e, RoundError::PeerTaken { peer: 0, .. }), "{e:?}");
    assert!(
        e.to_string().contains("peer 0 is held by a live node"),
        "{e}"
    );
    // A stranger needs --join; peer 3 joins and becomes a member from round 3.
    assert_eq!(
        c.join(3, 103, false, None, 14.0),
        Err(RoundError::NotMember { peer: 3 })
    );
    assert_eq!(
        c.join(3, 103, true, None, 14.0),
        Ok(Standing::Joining { from: 3 })
    );
    assert_eq!(
        c.join(9, 1, true, None, 14.0),
        Err(RoundError::OutOfRange { peer: 9, max: 4 })
    );
    // The evicted node comes back: it is admitted like a joiner, without --join.
    assert_eq!(
        c.join(1, 101, false, None, 14.0),
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
fn a_node_behind_is_told_to_load_the_newest_round_not_its_own() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let mut c = unmerged(&m, 2);
    for (round, now) in [(1, 1.0), (2, 2.0)] {
        for p in 0..2 {
            up(&mut c, &layout, p, round as f64, now).unwrap();
        }
        c.close(now);
    }
    // Node 1 was away for rounds 2 and 3: its upload of round 1 names round 2, the newest.
    let e = c
        .upload(
            1,
            101,
            1,
            upload(&layout, c.scope(), 1, 1.0),
            Work::default(),
            2.5,
        )
        .unwrap_err();
    assert_eq!(e, RoundError::Closed { round: 1, fetch: 2 });
}

#[test]
fn a_live_member_that_makes_no_progress_does_not_hold_the_round() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let cfg = SyncConfig {
        round_timeout_s: 300.0,
        stall_s: 20.0,
        ..cfg()
    };
    let mut c = coordinator(&m, 3, cfg, 0.0);
    for p in 0..3 {
        c.join(p, 100 + p as u64, false, None, 0.0).unwrap();
    }
    // Node 0 uploads at once. Every node heartbeats every second; node 1 trains (its counter
    // moves), node 2 is stuck (the same counter every time).
    up(&mut c, &layout, 0, 1.0, 1.0).unwrap();
    for t in 1..=40 {
        let now = t as f64;
        for p in 0..3 {
            c.join(p, 100 + p as u64, false, None, now).unwrap();
        }
        c.report_activity(1, t, now);
        c.report_activity(2, 7, now);
        if t == 35 {
            up(&mut c, &layout, 1, 2.0, now).unwrap();
        }
        assert_eq!(
            c.ready(now),
            t >= 35,
            "t = {t}: the round waits for node 1, which trains, and not for node 2 from t = 21"
        );
        assert_eq!(c.stalled(now).contains(&2), t >= 21, "t = {t}");
    }
    // An upload that begins is progress: the stuck node's header arrives at t = 40.5.
    c.join(2, 102, false, None, 40.5).unwrap();
    c.check_upload(2, 102, 1, 40.5).unwrap();
    assert!(!c.ready(41.0), "node 2's upload is on its way");
    let r = c.close(41.0);
    assert_eq!(r.peers, vec![0, 1]);
    assert_eq!(r.missing, vec![2]);
    assert!(r.evicted.is_empty(), "live nodes are never evicted");
}

#[test]
fn a_server_that_heard_nobody_keeps_waiting_for_the_nodes_live_when_it_went_deaf() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let cfg = SyncConfig {
        round_timeout_s: 300.0,
        ..cfg()
    };
    let mut c = coordinator(&m, 3, cfg, 0.0);
    for p in 0..3 {
        c.join(p, 100 + p as u64, false, None, 10.0).unwrap();
    }
    // Node 0 uploads at 11; then the server hears nobody from 11 to 26 (paused, or its link
    // cut): every lease (3 s) runs out, but the round does not close with node 0 alone.
    up(&mut c, &layout, 0, 1.0, 11.0).unwrap();
    assert!(
        !c.ready(26.0),
        "deaf: the server cannot tell its outage from theirs"
    );
    // Node 1 is heard first when the link is back; node 2 a second later: the round waits for
    // both (a lease after the server heard again), then closes with all three.
    c.join(1, 101, false, None, 26.0).unwrap();
    assert!(!c.ready(26.5), "node 2 was live when the server went deaf");
    c.join(0, 100, false, None, 26.2).unwrap();
    up(&mut c, &layout, 1, 2.0, 26.6).unwrap();
    c.join(2, 102, false, None, 27.0).unwrap();
    assert!(!c.ready(27.0));
    up(&mut c, &layout, 2, 3.0, 27.5).unwrap();
    assert!(c.ready(27.5));
    assert_eq!(c.close(27.5).peers, vec![0, 1, 2]);
    // A node that does not come back is waited for one lease after the server heard again.
    for p in 0..2 {
        up(&mut c, &layout, p, 1.0, 28.0).unwrap();
    }
    assert!(!c.ready(28.0));
    for t in [29.0, 30.0] {
        for p in 0..2 {
            c.join(p, 100 + p as u64, false, None, t).unwrap();
        }
    }
    assert!(
        c.ready(31.0),
        "node 2's lease ran out with the server hearing the others"
    );

    // A silence longer than the round's timeout and than eviction: the timeout does not count
    // it, and the first node back evicts nobody.
    let mut c = coordinator(&m, 2, common::cfg(), 0.0);
    for p in 0..2 {
        c.join(p, 100 + p as u64, false, None, 0.0).unwrap();
    }
    up(&mut c, &layout, 0, 1.0, 1.0).unwrap();
    assert!(!c.ready(30.0), "deaf since 1: no close by timeout");
    c.join(0, 100, false, None, 30.0).unwrap();
    assert!(!c.ready(30.5), "node 1 keeps its place for a lease");
    assert!(c.deadline(30.5) >= 34.0, "{}", c.deadline(30.5));
    let r = c.close(30.5);
    assert!(r.evicted.is_empty(), "{:?}", r.evicted);
}

#[test]
fn a_run_whose_nodes_all_died_admits_a_joiner_at_once_and_evicts_the_dead_later() {
    let m = model(1, 4);
    let mut c = coordinator(&m, 2, cfg(), 0.0);
    // Nobody live, nothing uploaded: the joiner becomes a member of the open round.
    assert_eq!(c.join(2, 7, true, None, 100.0), Ok(Standing::Member));
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
    let mut c = unmerged(&m, 2);
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

#[test]
fn a_delta_upload_must_be_bf16_of_the_right_shape() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let r = SyncConfig {
        wire: Wire::Bf16Delta.into(),
        ..cfg()
    };
    let mut c = coordinator(&m, 2, r, 0.0);
    let fp32 = upload(&layout, c.scope(), 0, 0.0);
    let e = c.upload(0, 100, 1, fp32, Work::default(), 0.0).unwrap_err();
    assert!(e.to_string().contains("expected a bf16 delta"), "{e}");
    let mut wrong: Named = upload(&layout, c.scope(), 0, 0.0)
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(Kind::BFloat16)))
        .collect();
    wrong[0].1 = Tensor::zeros([3], (Kind::BFloat16, Device::Cpu));
    let e = c
        .upload(0, 100, 1, wrong, Work::default(), 0.0)
        .unwrap_err();
    assert!(e.to_string().contains("has shape"), "{e}");
    // A zero delta of everything this node owns is accepted and changes nothing it owns.
    let zero: Named = upload(&layout, c.scope(), 0, 0.0)
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(Kind::BFloat16)))
        .collect();
    c.upload(0, 100, 1, zero, Work::default(), 0.0).unwrap();
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
    let r = SyncConfig {
        wire: Wire::Int4Delta.into(),
        ..cfg()
    };
    let mut c = bounded(&m, 2, r.clone(), Some(1.0), 0.0);
    let good = |c: &Coordinator| -> Named {
        upload(&layout, c.scope(), 0, 0.0)
            .into_iter()
            .flat_map(|(n, t)| Delta::of_change(&(t.randn_like() * 1e-3), &r, 1).into_wire(&n))
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
    cases.push((unpaired, "lacks one of its"));
    for (u, why) in cases {
        let e = c.upload(0, 100, 1, u, Work::default(), 0.0).unwrap_err();
        assert!(e.to_string().contains(why), "{why}: {e}");
        assert!(c.uploaded().is_empty());
    }
    c.upload(0, 100, 1, good(&c), Work::default(), 0.0).unwrap();
}

#[test]
fn the_server_keeps_no_upload_storage() {
    // Uploads may view a mapped file that is unmapped after `upload` returns: overwriting
    // them afterwards must not change the round.
    let m = model(1, 4);
    let layout = Layout::of(&m);
    for wire in [
        Wire::Fp32,
        Wire::Bf16Delta,
        Wire::Int4Delta,
        Wire::SparseDelta,
    ] {
        let r = SyncConfig {
            wire: wire.into(),
            sparse_chunk: 16,
            sparse_k: 3,
            merge_every: 0,
            ..cfg()
        };
        // The same uploads for both runs (made once: other tests share the global RNG).
        let scope = coordinator(&m, 2, r.clone(), 0.0).scope().clone();
        let uploads: Vec<Named> = (0..2)
            .map(|peer| {
                upload(&layout, &scope, peer, 0.0)
                    .into_iter()
                    .flat_map(|(n, t)| {
                        let change = t.randn_like() * 1e-3;
                        match wire {
                            Wire::Fp32 => vec![(n, t + change)],
                            _ => Delta::of_change(&change, &r, 1).into_wire(&n),
                        }
                    })
                    .collect()
            })
            .collect();
        let mut published = Vec::new();
        for clobber in [false, true] {
            let mut c = coordinator(&m, 2, r.clone(), 0.0);
            for (peer, u) in uploads.iter().enumerate() {
                let u = copy(u);
                let views: Vec<Tensor> = u.iter().map(|(_, t)| t.shallow_clone()).collect();
                c.upload(peer, 100 + peer as u64, 1, u, Work::default(), 0.0)
                    .unwrap();
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
                "{wire:?}: `{n}` changed with the upload's storage"
            );
        }
    }
}

/// The weights of a node that held `before` (round `round − 1`) and fetched the round `c` just
/// published whole: a real replica applies it.
fn node_after(c: &Coordinator, round: u64, before: &Named) -> Named {
    let weights = copy(before);
    let mut r = replica(c, 0, &weights, round - 1);
    let (tensors, skipped_own) = c.delta().unwrap().for_peer(0, false);
    r.apply(
        Published {
            round,
            tensors,
            skipped_own,
            after_upload: false,
            trained_since_upload: false,
        },
        &weights,
    )
    .unwrap();
    weights
}

/// Round 1 and 2 of a 2-node run where node 0 uploads 1.0 and node 1 uploads 3.0 everywhere.
fn outer_round(c: &mut Coordinator, layout: &Layout, wire: Wire, now: f64) {
    for peer in 0..2 {
        c.join(peer, 100 + peer as u64, false, None, now).unwrap();
    }
    if wire == Wire::Fp32 {
        up(c, layout, 0, 1.0, now).unwrap();
        up(c, layout, 1, 3.0, now).unwrap();
    } else {
        for (peer, v) in [(0usize, 1.0), (1, 3.0)] {
            let round = c.round();
            let base = copy(c.global().0);
            let wire: Named = upload(layout, c.scope(), peer, v)
                .into_iter()
                .map(|(n, t)| (n.clone(), (t - get(&base, &n)).to_kind(Kind::BFloat16)))
                .collect();
            c.upload(peer, 100 + peer as u64, round, wire, Work::default(), now)
                .unwrap();
        }
    }
    c.close(now + 0.5);
}

#[test]
fn the_outer_optimizer_steps_each_change_with_momentum_and_survives_a_restart() {
    let m = model(1, 4);
    let layout = Layout::of(&m);
    let theta0 = snapshot(&m);
    let shared = "model.embed_tokens.weight";
    let expert = expert_tensor_name(0, 0, "gate_proj"); // node 0's
    for wire in [Wire::Fp32, Wire::Bf16Delta] {
        let r = SyncConfig {
            merge_every: 0,
            wire: wire.into(),
            outer_lr: 0.5,
            outer_momentum: 0.5,
            outer_nesterov: true,
            expert_outer_lr: 2.0,
            expert_outer_momentum: 0.0,
            ..cfg()
        };
        let mut c = coordinator(&m, 2, r.clone(), 0.0);
        outer_round(&mut c, &layout, wire, 1.0);
        let g1 = copy(c.global().0);
        // Δ = mean − θ0 = 2 − θ0; Nesterov: θ0 + lr·(Δ + μ·Δ) = θ0 + 0.75·Δ.
        let t0 = get(&theta0, shared);
        let want = t0 + (t0.neg() + 2.0) * 0.75;
        // bf16 uploads of changes near 2 are exact to ~1 %.
        let tol = if wire == Wire::Fp32 { 1e-5 } else { 2e-2 };
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < tol;
        assert!(close(get(&g1, shared), &want), "{wire:?}: shared round 1");
        // The owner's change 1 − θ0, doubled.
        let e0 = get(&theta0, &expert);
        assert!(close(get(&g1, &expert), &(e0 + (e0.neg() + 1.0) * 2.0)));
        if wire == Wire::Bf16Delta {
            let published = c.delta().unwrap();
            assert!(
                published.verbatim.is_empty(),
                "the server changed the experts"
            );
            let node = node_after(&c, 1, &theta0);
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
                r.clone(),
                None,
                Start {
                    global: copy(&g1),
                    published: 1,
                    gone: BTreeSet::new(),
                    caps: BTreeMap::new(),
                },
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
        let r = SyncConfig {
            merge_every: 0,
            wire: Wire::Bf16Delta.into(),
            outer_norm_preserving: on,
            ..cfg()
        };
        let mut c = coordinator(&m, 4, r, 0.0);
        let mut deltas: Vec<Named> = Vec::new();
        for (peer, v) in values.iter().enumerate() {
            c.join(peer, 100 + peer as u64, false, None, 0.0).unwrap();
            let wire: Named = upload(&layout, c.scope(), peer, *v)
                .into_iter()
                .map(|(n, t)| (n.clone(), (t - get(&theta0, &n)).to_kind(Kind::BFloat16)))
                .collect();
            deltas.push(copy(&wire));
            let round = c.round();
            c.upload(peer, 100 + peer as u64, round, wire, Work::default(), 0.5)
                .unwrap();
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
        let sent = get(&theta0, &expert) + get(&deltas[1], &expert).to_kind(Kind::Float);
        assert!(get(c.global().0, &expert).equal(&sent));
        let node = node_after(&c, 1, &theta0);
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
    let r = SyncConfig {
        merge_every: 0,
        rotate_every_rounds: 2,
        ..cfg()
    };
    let mut c = coordinator(&m, 2, r, 0.0);
    let mut owners = vec![c.scope().owners()];
    for round in 1..=4u64 {
        let now = round as f64;
        for peer in 0..2 {
            c.join(peer, 100 + peer as u64, false, None, now).unwrap();
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
        c.upload(0, 100, round, stale, Work::default(), 5.0),
        Err(RoundError::Invalid { .. })
    ));
}

#[test]
fn only_an_experts_previous_owner_may_hand_it_over() {
    let m = model(1, 6);
    let layout = Layout::of(&m);
    let cfg = SyncConfig {
        merge_every: 0,
        rotate_every_rounds: 1,
        wire: Wire::Bf16Delta.into(),
        ..cfg()
    };
    let mut c = coordinator(&m, 3, cfg.clone(), 0.0);
    // Round 1: nothing changed owner yet.
    assert!(matches!(
        c.check_handover(0, &[0]),
        Err(RoundError::Invalid { .. })
    ));
    let change = |scope: &Scope, peer| -> spes_sync::Named {
        upload(&layout, scope, peer, 1e-3)
            .into_iter()
            .map(|(n, t)| (n, t.to_kind(Kind::BFloat16)))
            .collect()
    };
    for peer in 0..3 {
        let u = change(c.scope(), peer);
        c.upload(peer, 100 + peer as u64, 1, u, Work::default(), 1.0)
            .unwrap();
    }
    c.close(1.5);
    assert_eq!(c.scope().owners(), vec![1, 1, 2, 2, 0, 0]);
    // Peer 0 owned experts 0 and 1 in round 1 and owns 4 and 5 now.
    c.check_handover(0, &[0, 1]).unwrap();
    for (experts, why) in [
        (vec![4], "which it owns"),
        (vec![0, 2], "did not own in round 1"),
        (vec![6], "the model has 6"),
    ] {
        let e = c.check_handover(0, &experts).unwrap_err().to_string();
        assert!(e.contains(why), "{experts:?}: {e}");
    }
    // A handed-over tensor joins its new owner's change, and the expert is no longer published
    // as its owner sent it.
    let name = spes_model::expert_tensor_name(0, 0, spes_model::EXPERT_PARTS[0]);
    let before = get(c.global().0, &name).copy();
    let mut u0 = change(c.scope(), 0);
    u0.push((
        format!("{name}#handover"),
        Tensor::full(
            before.size().as_slice(),
            2e-3,
            (Kind::BFloat16, tch::Device::Cpu),
        ),
    ));
    c.upload(0, 100, 2, u0, Work::default(), 2.0).unwrap();
    for peer in 1..3 {
        let u = change(c.scope(), peer);
        c.upload(peer, 100 + peer as u64, 2, u, Work::default(), 2.0)
            .unwrap();
    }
    c.close(2.5);
    let moved = (get(c.global().0, &name) - &before)
        .mean(Kind::Float)
        .double_value(&[]);
    assert!((moved - 3e-3).abs() < 3e-5, "moved by {moved}");
    assert!(c
        .delta()
        .unwrap()
        .verbatim
        .values()
        .flatten()
        .all(|n| *n != name));
    // Not from a peer that did not own the expert before (peer 1 owned 0 and 1, peer 2 owns
    // them now).
    assert_eq!(c.scope().owners(), vec![2, 2, 0, 0, 1, 1]);
    let mut bad = change(c.scope(), 0);
    bad.push((
        format!("{name}#handover"),
        Tensor::zeros(before.size().as_slice(), (Kind::BFloat16, tch::Device::Cpu)),
    ));
    let e = c.upload(0, 100, 3, bad, Work::default(), 3.0).unwrap_err();
    assert!(matches!(e, RoundError::Invalid { .. }), "{e:?}");
}

/// A coordinator of `peers` contiguous owners at t = 0 that never merges experts.
fn unmerged(m: &MoeModel, peers: usize) -> Coordinator {
    let cfg = SyncConfig {
        merge_every: 0,
        ..cfg()
    };
    coordinator(m, peers, cfg, 0.0)
}

/// Experts per member of the open round.
fn owned_counts(c: &Coordinator, peers: &[usize]) -> Vec<usize> {
    let Scope::Spes(o) = c.scope() else { panic!() };
    peers.iter().map(|&p| o.experts_of(p).len()).collect()
}

#[test]
fn a_node_of_half_the_capacity_owns_half_the_experts_through_eviction_and_rejoin() {
    let m = model(1, 8);
    let layout = Layout::of(&m);
    let mut c = unmerged(&m, 4);
    assert_eq!(
        c.join(3, 103, false, Some(0), 0.0),
        Err(RoundError::NoRoom { peer: 3 })
    );
    for p in 0..3 {
        assert_eq!(
            c.join(p, 100 + p as u64, false, Some(4), 0.0),
            Ok(Standing::Member)
        );
    }
    // Node 3's memory holds one expert but round 1 gives it two, and the others train round
    // 1 already: it sits the round out, and the round does not wait for it.
    assert_eq!(
        c.join(3, 103, false, Some(1), 0.0),
        Ok(Standing::Joining { from: 2 })
    );
    assert_eq!(c.sitting_out(), &BTreeSet::from([3]));
    for p in 0..3 {
        up(&mut c, &layout, p, 1.0, 1.0).unwrap();
    }
    assert!(c.ready(1.0));
    let r = c.close(1.0);
    assert_eq!(r.missing, vec![3]);
    assert!(r.evicted.is_empty());
    // From round 2 it owns half of what each of the others owns.
    assert_eq!(owned_counts(&c, &[0, 1, 2, 3]), vec![3, 2, 2, 1]);
    assert_eq!(c.caps(), &BTreeMap::from([(0, 4), (1, 4), (2, 4), (3, 1)]));
    assert_eq!(
        c.join(3, 103, false, None, 1.5),
        Ok(Standing::Member),
        "a heartbeat"
    );
    for p in 0..4 {
        up(&mut c, &layout, p, 1.0, 2.0).unwrap();
    }
    c.close(2.0);
    assert_eq!(
        owned_counts(&c, &[0, 1, 2, 3]),
        vec![3, 2, 2, 1],
        "nothing moves"
    );
    // Node 0 dies and is evicted: its experts go to the others within their caps.
    for t in [5.0, 10.0, 14.0] {
        for p in 1..4 {
            c.join(p, 100 + p as u64, false, None, t).unwrap();
        }
    }
    for p in 1..4 {
        up(&mut c, &layout, p, 1.0, 16.0).unwrap();
    }
    let r = c.close(16.0);
    assert_eq!(r.evicted, vec![0]);
    assert_eq!(owned_counts(&c, &[1, 2, 3]), vec![4, 3, 1]);
    let Scope::Spes(o) = c.scope() else { panic!() };
    assert!(o.unowned().is_empty(), "4 + 4 + 1 covers 8");
    // Node 0 comes back with room for 2 only: it takes its share within that.
    assert_eq!(
        c.join(0, 100, false, Some(2), 17.0),
        Ok(Standing::Joining { from: 5 })
    );
    for p in 1..4 {
        up(&mut c, &layout, p, 1.0, 17.0).unwrap();
    }
    let r = c.close(17.0);
    assert_eq!(r.joined, vec![0]);
    assert_eq!(owned_counts(&c, &[0, 1, 2, 3]), vec![2, 3, 2, 1]);
    assert_eq!(c.caps()[&0], 2, "the newest declaration counts");
}

#[test]
fn experts_past_the_live_nodes_capacity_are_frozen_and_a_round_all_sit_out_closes_empty() {
    let m = model(1, 8);
    let layout = Layout::of(&m);
    let mut c = unmerged(&m, 2);
    // Both nodes' memory holds fewer than the 4 experts round 1 gives each: both sit it out,
    // and it closes with nothing trained as soon as neither is waited for.
    assert_eq!(
        c.join(0, 100, false, Some(3), 0.0),
        Ok(Standing::Joining { from: 2 })
    );
    assert!(!c.ready(0.0), "node 1 may still come and train");
    assert_eq!(
        c.join(1, 101, false, Some(2), 0.0),
        Ok(Standing::Joining { from: 2 })
    );
    assert!(c.ready(0.0));
    let before = copy(c.global().0);
    let r = c.close(0.5);
    assert!(r.peers.is_empty() && r.evicted.is_empty());
    assert_eq!(r.missing, vec![0, 1]);
    assert!(
        c.global().0.iter().all(|(n, t)| t.equal(get(&before, n))),
        "nothing changed"
    );
    let Scope::Spes(o) = c.scope().clone() else {
        panic!()
    };
    assert_eq!(owned_counts(&c, &[0, 1]), vec![3, 2]);
    assert_eq!(o.unowned().len(), 3, "5 of 8 experts fit the live nodes");
    assert!(o.owners().iter().all(|&p| p == 0 || p == 1 || p == UNOWNED));
    assert_eq!(c.join(0, 100, false, None, 1.0), Ok(Standing::Member));
    // The unowned experts take no upload and keep their values.
    for p in 0..2 {
        up(&mut c, &layout, p, 2.0, 2.0).unwrap();
    }
    c.close(2.0);
    for e in o.unowned() {
        let name = expert_tensor_name(0, e, "up_proj");
        assert!(
            get(c.global().0, &name).equal(get(&before, &name)),
            "{name}"
        );
    }
}

#[test]
fn rounds_by_tokens_give_a_slow_node_fewer_experts_and_noise_moves_none() {
    let m = model(1, 16);
    let layout = Layout::of(&m);
    let by_tokens = SyncConfig {
        merge_every: 0,
        round_by: spes_sync::config::RoundBy::Tokens,
        ..cfg()
    };
    let mut c = coordinator(&m, 4, by_tokens.clone(), 0.0);
    let round = |c: &mut Coordinator, rate: [f64; 4], now: f64| {
        for (p, r) in rate.iter().enumerate() {
            let u = upload(&layout, c.scope(), p, 1.0);
            let work = Work {
                rows: (40.0 * r) as u64,
                compute_s: 10.0,
            };
            c.upload(p, 100 + p as u64, c.round(), u, work, now)
                .unwrap();
        }
        c.close(now);
        owned_counts(c, &[0, 1, 2, 3])
    };
    // Node 0 trains at a quarter of the others' rate: it owns 2 of 16 from round 2.
    assert_eq!(round(&mut c, [1.0, 4.0, 4.0, 4.0], 1.0), vec![2, 5, 5, 4]);
    assert_eq!(round(&mut c, [1.1, 3.9, 4.2, 3.8], 2.0), vec![2, 5, 5, 4]);
    // With own_by = "equal" the split stays even.
    let mut even = coordinator(
        &m,
        4,
        SyncConfig {
            own_by: spes_sync::config::OwnBy::Equal,
            ..by_tokens
        },
        0.0,
    );
    assert_eq!(
        round(&mut even, [1.0, 4.0, 4.0, 4.0], 1.0),
        vec![4, 4, 4, 4]
    );
}

/// The server folds uploads in as they arrive; a round's average must not depend on that order,
/// or two runs of one seed would drift apart (low-rank products carry full fp32 significands,
/// whose fp32 sums round by order).
#[test]
fn a_round_of_low_rank_uploads_averages_to_the_same_bits_in_any_order_of_arrival() {
    let m = sized(1, 4, 64);
    let layout = Layout::of(&m);
    let scope = Scope::Spes(Ownership::resolve(&[], 4, 4).unwrap());
    let cfg = SyncConfig {
        wire: Wire::LowrankDelta.into(),
        rank: 16,
        ..cfg()
    };
    let uploads: Vec<Named> = (0..4)
        .map(|peer| {
            // Changes of every rank and sign, without the global generator parallel tests share.
            upload(&layout, &scope, peer, 0.0)
                .into_iter()
                .map(|(n, t)| {
                    let x = Tensor::arange(t.numel() as i64, (Kind::Float, Device::Cpu));
                    let scale = [1e-3, 3.7e-3, 1.3e-5, 2.9e-2][peer];
                    let change = ((&x * &x * 1e-3 + peer as f64).sin() * scale).view_as(&t);
                    (n, change)
                })
                .collect()
        })
        .collect();
    let average = |order: &[usize]| {
        let mut agg = Aggregator::new(scope.clone(), &cfg).with_spread(true);
        for &peer in order {
            let deltas: Deltas = uploads[peer]
                .iter()
                .map(|(n, t)| (n.clone(), Delta::of_change(t, &cfg, 1)))
                .collect();
            agg.add(&layout, peer, deltas, 1.0).unwrap();
        }
        agg.finish()
    };
    let (a, b) = (average(&[0, 1, 2, 3]), average(&[3, 1, 0, 2]));
    assert_eq!(a.spread, b.spread, "the uploads' spread, summed by peer");
    let (a, b) = (a.averaged, b.averaged);
    let name = "model.layers.0.self_attn.q_proj.weight";
    assert!(matches!(
        Delta::of_change(get(&uploads[0], name), &cfg, 1),
        Delta::LowRank(_)
    ));
    assert_eq!(a.len(), b.len());
    for (n, t) in &a {
        assert_eq!(t.kind(), Kind::Float, "{n}");
        assert!(t.equal(&b[n]), "{n} differs by arrival order");
    }
}
