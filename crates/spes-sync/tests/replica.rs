//! The node's half of SPES against the server's, with no network: a `Coordinator` and several
//! `Replica`s exchange the very tensors spes-net moves (wire tensors in, published deltas
//! out), and every node must hold the server's global model bit for bit.

mod common;

use common::*;
use spes_model::Role;
use spes_sync::{
    Applied, AverageBy, Coordinator, Feedback, Follow, Layout, Named, Published, Replica,
    ReplicaError, RoundBy, SyncConfig, Wire, Work,
};
use tch::{Kind, Tensor};

/// A node as the tests drive it: its replica and its model's weights.
struct Node {
    replica: Replica,
    weights: Named,
    /// Rounds are prepared ahead ([`Replica::preparer`]), as a node on CPU does while it
    /// trains on, instead of applied in place.
    ahead: bool,
}

/// A node of peer `peer` that starts from the coordinator's θ⁰ (round 0).
fn node(c: &Coordinator, peer: usize, cfg: &SyncConfig) -> Node {
    let layout = Layout::new(
        c.layout().entries.clone(),
        c.layout().n_layers,
        c.layout().n_experts,
    );
    let weights = copy(c.global().0);
    let mut replica = Replica::new(peer, cfg.clone(), layout);
    replica.hold(c.global().1, &weights);
    let members: Vec<usize> = c.scope().members().into_iter().collect();
    replica.follow(&c.scope().owners(), &members, &weights);
    Node {
        replica,
        weights,
        ahead: false,
    }
}

fn role_of(c: &Coordinator, name: &str) -> Role {
    let l = c.layout();
    l.entries[l.position(name).unwrap()].1
}

/// A coordinator of two peers and their nodes, each following the first layout.
fn two_nodes(m: &spes_model::MoeModel, cfg: &SyncConfig) -> (Coordinator, Vec<Node>) {
    let c = coordinator(m, 2, cfg.clone(), 0.0);
    let nodes = (0..2).map(|p| node(&c, p, cfg)).collect();
    (c, nodes)
}

/// "Training": every tensor the node trains moves by a small random step (RMS `size`).
fn train(c: &Coordinator, n: &mut Node, size: f64) {
    train_where(c, n, size, |_| true);
}

/// [`train`], but only the tensors whose role `moves` picks.
fn train_where(c: &Coordinator, n: &mut Node, size: f64, moves: impl Fn(Role) -> bool) {
    tch::no_grad(|| {
        for (name, w) in &n.weights {
            let role = role_of(c, name);
            if n.replica.trains(role) && moves(role) {
                let _ = w.shallow_clone().g_add_(&(w.randn_like() * size));
            }
        }
    });
}

/// Uploads node `n`'s trained tensors for the open round, as the node would.
fn upload(c: &mut Coordinator, n: &mut Node, now: f64) {
    let peer = n.replica.peer();
    let round = c.round();
    let wire = n.replica.upload(&n.weights, round, false).unwrap();
    c.upload(peer, 100 + peer as u64, round, wire, Work::default(), now)
        .unwrap();
}

/// Brings node `n` to the round `c` published last, as the node would fetch it: a delta
/// (without its own experts when the server published them as sent) or the whole model; then
/// follows the next round's ownership.
fn deliver(c: &Coordinator, n: &mut Node, after_upload: bool, trained_since: bool) -> Applied {
    deliver_then(c, n, after_upload, trained_since, None)
}

/// [`deliver`], taking the settings `next` the round announces between applying it and
/// following its ownership, as the node does.
fn deliver_then(
    c: &Coordinator,
    n: &mut Node,
    after_upload: bool,
    trained_since: bool,
    next: Option<spes_sync::RoundSettings>,
) -> Applied {
    let (global, round) = c.global();
    let applied = if c.cfg().wire().is_delta() {
        let plan = n.replica.fetch_plan(Some(round), after_upload);
        assert!(plan.have_previous, "round {round}: a delta will do");
        let (tensors, skipped_own) = c.delta().unwrap().for_peer(n.replica.peer(), plan.skip_own);
        let published = Published {
            round,
            tensors,
            skipped_own,
            after_upload,
            trained_since_upload: trained_since,
        };
        if n.ahead {
            let prepared = n.replica.preparer(&n.weights, true).prepare(published);
            n.replica
                .finish(prepared.unwrap(), &n.weights, trained_since)
                .unwrap()
        } else {
            n.replica.apply(published, &n.weights).unwrap()
        }
    } else {
        for ((_, w), (_, g)) in n.weights.iter().zip(global) {
            w.shallow_clone().copy_(g);
        }
        n.replica.hold(round, &n.weights);
        Applied {
            kept_progress: false,
        }
    };
    if let Some(s) = next {
        n.replica.follow_settings(s);
    }
    let members: Vec<usize> = c.scope().members().into_iter().collect();
    n.replica.follow(&c.scope().owners(), &members, &n.weights);
    applied
}

/// The node holds the server's model exactly: its base (delta wires) everywhere it trains,
/// its weights everywhere else and, when nothing is carried beyond the round, everywhere.
fn assert_identical(c: &Coordinator, n: &Node, what: &str) {
    let keeps = c.cfg().keeps_progress();
    for ((name, w), (_, g)) in n.weights.iter().zip(c.global().0) {
        let trained = n.replica.base_of(name).is_some();
        if let Some(b) = n.replica.base_of(name) {
            assert!(
                b.equal(g),
                "{what}: base of `{name}` differs from the server's"
            );
        }
        if !(trained && keeps) {
            assert!(w.equal(g), "{what}: `{name}` differs from the server's");
        }
        assert_eq!(w.kind(), Kind::Float);
    }
}

fn wire_cfg(wire: Wire) -> SyncConfig {
    SyncConfig {
        wire: spes_sync::Choice::Pinned(wire),
        // The test model's embedding is 44 values: two chunks and a tail of 12.
        sparse_chunk: 16,
        sparse_k: 4,
        overlap: false,
        ..cfg()
    }
}

#[test]
fn every_wire_keeps_every_node_bit_identical_to_the_server() {
    let _draws = draws();
    let m = model(2, 4);
    // The low-rank wire has its own test below.
    for wire in Wire::ALL.into_iter().filter(|&w| w != Wire::LowrankDelta) {
        let cfg = wire_cfg(wire);
        let (mut c, mut nodes) = two_nodes(&m, &cfg);
        tch::manual_seed(7);
        for round in 1..=4u64 {
            let now = round as f64;
            for n in &mut nodes {
                train(&c, n, 1e-3);
                upload(&mut c, n, now);
            }
            let report = c.close(now + 0.5);
            // Merges at steps 20 and 40 re-encode every expert; other rounds publish each
            // owner's experts as it sent them, and the owner does not fetch them back.
            let merged = !report.merges.is_empty();
            assert_eq!(merged, round % 2 == 0, "{wire:?}");
            if wire.is_delta() {
                let verbatim = &c.delta().unwrap().verbatim;
                assert_eq!(verbatim.is_empty(), merged, "{wire:?} round {round}");
            }
            for (peer, n) in nodes.iter_mut().enumerate() {
                let applied = deliver(&c, n, true, false);
                assert_eq!(applied.kept_progress, wire.is_lossy());
                assert_identical(&c, n, &format!("{wire:?} round {round} peer {peer}"));
            }
        }
        // The fp32 masters carry more than bf16 precision: rounding them would change them.
        let embed = get(c.global().0, "model.embed_tokens.weight");
        let rounded = embed.to_kind(Kind::BFloat16).to_kind(Kind::Float);
        assert!(!rounded.equal(embed), "{wire:?}");
    }
}

#[test]
fn the_low_rank_wire_keeps_every_node_bit_identical_and_carries_what_it_left_out_over() {
    let _draws = draws();
    let m = sized(2, 4, 32);
    let cfg = SyncConfig {
        rank: 2,
        ..wire_cfg(Wire::LowrankDelta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    let name = "model.layers.0.self_attn.q_proj.weight";
    let mut ideal = get(c.global().0, name).copy();
    let mut behind = Vec::new();
    tch::manual_seed(5);
    for round in 1..=4u64 {
        let now = round as f64;
        for n in &mut nodes {
            let before = get(&n.weights, name).copy();
            // A change of rank one (plus the low-rank wire's own remainder, in the weights).
            let step = Tensor::randn([32, 1], (Kind::Float, tch::Device::Cpu))
                .matmul(&Tensor::randn([1, 32], (Kind::Float, tch::Device::Cpu)))
                * 1e-3;
            train(&c, n, 1e-4);
            let _ = get(&n.weights, name).shallow_clone().g_add_(&step);
            ideal += (get(&n.weights, name) - before) / 2.0;
            upload(&mut c, n, now);
        }
        let report = c.close(now + 0.5);
        assert_eq!(!report.merges.is_empty(), round % 2 == 0);
        if report.merges.is_empty() {
            assert!(!c.delta().unwrap().verbatim.is_empty(), "round {round}");
        }
        let factors = c
            .delta()
            .unwrap()
            .delta
            .iter()
            .filter(|(n, _)| n.ends_with("#q"))
            .count();
        assert!(factors > 0, "round {round}: no matrix travelled in factors");
        for (peer, n) in nodes.iter_mut().enumerate() {
            let applied = deliver(&c, n, true, false);
            assert!(applied.kept_progress);
            assert_identical(&c, n, &format!("low rank, round {round} peer {peer}"));
        }
        behind.push(
            (get(c.global().0, name) - &ideal)
                .square()
                .mean(Kind::Float)
                .sqrt()
                .double_value(&[]),
        );
    }
    // The two nodes' rank-one changes need rank 2 to average: the global follows their mean
    // change (RMS ≈ 1.4e-3 a round) up to the full-rank noise they add (RMS 1e-4 a round),
    // which waits in the error feedback, and the 4-bit rounding of the factors.
    assert!(
        behind.iter().all(|b| *b < 4e-4) && behind[3] < 2.0 * behind[0] + 1e-4,
        "the global lags the nodes by {behind:?}"
    );
}

/// Four rounds of 2 nodes on a lossy wire (merges on even rounds), each node checked against
/// the server after every round. Returns, per round, how many entries of the embedding the
/// global model has moved, and the RMS of what the embedding's global has not yet absorbed of
/// the nodes' mean change.
fn lossy_rounds(wire: Wire) -> (Vec<i64>, Vec<f64>) {
    let m = model(2, 4);
    let cfg = wire_cfg(wire);
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    let embed = "model.embed_tokens.weight";
    let theta0 = get(c.global().0, embed).copy();
    // θ⁰ plus the nodes' mean change so far: where an exact wire would be.
    let mut ideal = theta0.copy();
    let (mut moved, mut behind) = (Vec::new(), Vec::new());
    tch::manual_seed(3);
    for round in 1..=4u64 {
        let now = round as f64;
        for n in &mut nodes {
            let before = get(&n.weights, embed).copy();
            train(&c, n, 1e-3);
            ideal += (get(&n.weights, embed) - before) / 2.0;
            upload(&mut c, n, now);
        }
        c.close(now + 0.5);
        for n in &mut nodes {
            deliver(&c, n, true, false);
            assert_identical(&c, n, &format!("{wire:?} round {round}"));
        }
        let global = get(c.global().0, embed);
        moved.push((global - &theta0).ne(0.0).sum(Kind::Int64).int64_value(&[]));
        behind.push(
            (global - &ideal)
                .square()
                .mean(Kind::Float)
                .sqrt()
                .double_value(&[]),
        );
    }
    (moved, behind)
}

#[test]
fn lossy_wires_carry_what_they_left_out_over() {
    let _draws = draws();
    let (moved, _) = lossy_rounds(Wire::SparseDelta);
    // Each round publishes at most a quarter of the entries, and what was held back reaches
    // the global model in later rounds.
    let n = get(&snapshot(&model(2, 4)), "model.embed_tokens.weight").numel() as i64;
    assert!(moved[0] <= n / 4 + 1, "{moved:?} of {n}");
    assert!(moved[3] > moved[0], "{moved:?}");
    for wire in [Wire::Int8Delta, Wire::Int4Delta, Wire::Int2Delta] {
        let (_, behind) = lossy_rounds(wire);
        // Error feedback: the global lags the nodes' mean change by about one round's
        // rounding, which does not grow (four rounds of steps of RMS 1e-3, averaged over two
        // nodes, move the ideal by RMS ≈ 1.4e-3).
        let limit = match wire {
            Wire::Int8Delta => 2e-5,
            Wire::Int4Delta => 2e-4,
            _ => 1.1e-3,
        };
        assert!(
            behind.iter().all(|b| *b < limit) && behind[3] < 2.0 * behind[0],
            "{wire:?}: the global lags the nodes by {behind:?}"
        );
    }
}

/// The wire changes between rounds as the server announces it, the round before: int4 for two
/// rounds, low rank for two, then bf16. Every node holds the server's model bit for bit after
/// every round, with what the lossy rounds held back kept in its weights or its buffer, and the
/// first bf16 round sends all of it: the global model then lags the nodes' mean change by that
/// round's bf16 rounding alone, and every node's weights are the global model exactly.
#[test]
fn the_wire_changes_between_rounds_and_every_node_stays_bit_identical() {
    use spes_sync::{Choice, RoundSettings};
    let _draws = draws();
    let m = sized(2, 4, 32);
    let schedule = [
        Wire::Int4Delta,
        Wire::Int4Delta,
        Wire::LowrankDelta,
        Wire::LowrankDelta,
        Wire::Bf16Delta,
        Wire::Bf16Delta,
    ];
    for feedback in [Feedback::Weights, Feedback::Buffer] {
        let cfg = SyncConfig {
            rank: 2,
            feedback,
            feedback_decay: 1.0,
            // Experts change hands where the wire turns lossless: a node's unsent change of
            // the experts it loses must be handed over, not left in its weights.
            rotate_every_rounds: 4,
            ..wire_cfg(schedule[0])
        };
        let (mut c, mut nodes) = two_nodes(&m, &cfg);
        let embed = "model.embed_tokens.weight";
        let mut ideal = get(c.global().0, embed).copy();
        let mut behind = Vec::new();
        tch::manual_seed(17);
        for round in 1..=schedule.len() as u64 {
            let wire = schedule[round as usize - 1];
            assert_eq!(c.cfg().wire(), wire, "round {round}");
            let now = round as f64;
            for n in &mut nodes {
                assert_eq!(n.replica.cfg().wire(), wire, "round {round}");
                let before = get(&n.weights, embed).copy();
                train(&c, n, 1e-3);
                ideal += (get(&n.weights, embed) - before) / 2.0;
                upload(&mut c, n, now);
            }
            let next = RoundSettings {
                wire: *schedule.get(round as usize).unwrap_or(&wire),
                overlap: false,
                overlap_steps: 0,
            };
            c.set_next(next).unwrap();
            let report = c.close(now + 0.5);
            assert_eq!(report.settings, next);
            for (peer, n) in nodes.iter_mut().enumerate() {
                // As a node does: apply the round, take the next round's settings, then follow
                // its ownership.
                let applied = deliver_then(&c, n, true, false, Some(report.settings));
                let what = format!("{feedback:?} round {round} ({wire:?}) peer {peer}");
                assert_eq!(
                    applied.kept_progress,
                    wire.is_lossy() && feedback == Feedback::Weights,
                    "{what}"
                );
                for ((name, w), (_, g)) in n.weights.iter().zip(c.global().0) {
                    match n.replica.base_of(name) {
                        Some(b) => assert!(b.equal(g), "{what}: base of `{name}`"),
                        None => assert!(w.equal(g), "{what}: `{name}`"),
                    }
                    if !applied.kept_progress {
                        assert!(w.equal(g), "{what}: `{name}` is not the global model");
                    }
                }
            }
            if !wire.is_lossy() {
                // A lossless round flushes every residual the server held back.
                let carried = c.carried();
                assert!(carried.iter().all(|(n, _)| !n.starts_with("residual/")));
            }
            behind.push(
                (get(c.global().0, embed) - &ideal)
                    .square()
                    .mean(Kind::Float)
                    .sqrt()
                    .double_value(&[]),
            );
        }
        // Lossy rounds hold back what they leave out (the embedding's change is of full rank);
        // the first bf16 round sends it, rounded to bf16 once.
        assert!(behind[3] > 1e-5, "{feedback:?}: {behind:?}");
        assert!(
            behind[4] < behind[3] / 10.0 && behind[4] < 1e-5,
            "{feedback:?}: {behind:?}"
        );
        // A pinned config would refuse nothing but a change of kind: a delta round cannot
        // follow with the fp32 wire's values.
        let fp32 = RoundSettings {
            wire: Wire::Fp32,
            overlap: false,
            overlap_steps: 0,
        };
        assert!(c.set_next(fp32).is_err());
        assert_eq!(cfg.for_round(fp32).wire, Choice::Pinned(Wire::Fp32));
    }
}

#[test]
fn buffer_feedback_trains_from_the_global_model_and_sends_what_it_held_back_later() {
    let _draws = draws();
    let m = model(2, 4);
    let cfg = SyncConfig {
        feedback: Feedback::Buffer,
        feedback_decay: 1.0,
        merge_every: 0,
        ..wire_cfg(Wire::SparseDelta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    let embed = "model.embed_tokens.weight";
    let theta0 = get(c.global().0, embed).copy();
    tch::manual_seed(13);
    // One round of training, then rounds with none: the buffer alone moves the global model.
    for round in 1..=12u64 {
        let now = round as f64;
        for n in &mut nodes {
            if round == 1 {
                train(&c, n, 1e-3);
            }
            upload(&mut c, n, now);
        }
        c.close(now + 0.5);
        for (peer, n) in nodes.iter_mut().enumerate() {
            let applied = deliver(&c, n, true, false);
            assert!(!applied.kept_progress);
            // Every tensor is the global model exactly, trained ones included.
            for ((name, w), (_, g)) in n.weights.iter().zip(c.global().0) {
                assert!(w.equal(g), "round {round} peer {peer}: `{name}`");
            }
            assert_identical(&c, n, &format!("round {round} peer {peer}"));
        }
    }
    // A quarter of the entries a round, through the nodes' buffers and the server's residual:
    // after twelve rounds every entry has reached the global model.
    let moved = (get(c.global().0, embed) - &theta0)
        .ne(0.0)
        .sum(Kind::Int64);
    assert_eq!(moved.int64_value(&[]), theta0.numel() as i64);
    // The buffer is the replica's state: a restored node sends the same next upload.
    let n = &mut nodes[0];
    train(&c, n, 1e-3);
    let state = n.replica.state(&n.weights).unwrap();
    assert!(!state.feedback.is_empty());
    let layout = Layout::new(c.layout().entries.clone(), 2, 4);
    let mut again = Replica::new(0, cfg.clone(), layout);
    let weights = copy(&n.weights);
    let remainder = copy(&state.remainder);
    let saved = spes_sync::ReplicaState {
        base_round: state.base_round,
        owned: state.owned.clone(),
        remainder,
        feedback: copy(&state.feedback),
        handover: Vec::new(),
    };
    again.restore(saved, copy(c.global().0), &weights).unwrap();
    let back = again.state(&weights).unwrap();
    assert_eq!(back.feedback.len(), state.feedback.len());
    for ((na, ta), (nb, tb)) in back.feedback.iter().zip(&state.feedback) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "feedback of `{na}`");
    }
}

#[test]
fn a_strided_wire_sends_each_value_every_stride_rounds_and_stays_bit_identical() {
    let _draws = draws();
    let m = model(2, 4);
    let cfg = SyncConfig {
        stride: 4,
        merge_every: 0,
        ..wire_cfg(Wire::Int2Delta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    let embed = "model.embed_tokens.weight";
    let theta0 = get(c.global().0, embed).copy();
    let n = theta0.numel() as i64;
    tch::manual_seed(17);
    let mut moved = Vec::new();
    for round in 1..=4u64 {
        let now = round as f64;
        for n in &mut nodes {
            train(&c, n, 1e-3);
            upload(&mut c, n, now);
        }
        c.close(now + 0.5);
        for (peer, n) in nodes.iter_mut().enumerate() {
            assert!(deliver(&c, n, true, false).kept_progress);
            assert_identical(&c, n, &format!("round {round} peer {peer}"));
        }
        let changed = (get(c.global().0, embed) - &theta0).ne(0.0);
        moved.push(changed.sum(Kind::Int64).int64_value(&[]));
        // Round r moves only values at r mod 4 (of the flattened tensor) for the first time.
        if round == 1 {
            let flat = changed.view([-1]);
            let off: Vec<i64> = (0..n).filter(|i| i % 4 != 1).collect();
            let others = flat.index_select(0, &tch::Tensor::from_slice(&off));
            assert!(!bool::try_from(others.any()).unwrap());
        }
    }
    assert!(moved[0] <= (n + 3) / 4, "{moved:?} of {n}");
    // By round 4 every offset had its round. (Not every value: 2 bits round some changes to
    // nothing, and how many depends on the draws, which other tests in the process share.)
    let changed = (get(c.global().0, embed) - &theta0).ne(0.0).view([-1]);
    for k in 0..4 {
        let at: Vec<i64> = (0..n).filter(|i| i % 4 == k).collect();
        let class = changed.index_select(0, &tch::Tensor::from_slice(&at));
        assert!(
            bool::try_from(class.any()).unwrap(),
            "offset {k} never moved: {moved:?}"
        );
    }
    assert!(moved.windows(2).all(|w| w[0] <= w[1]), "{moved:?}");
}

#[test]
fn a_round_prepared_ahead_gives_the_bits_of_one_applied_in_place() {
    let _draws = draws();
    let m = sized(2, 4, 32);
    for wire in Wire::ALL.into_iter().filter(|w| w.is_delta()) {
        for feedback in [Feedback::Weights, Feedback::Buffer] {
            if feedback == Feedback::Buffer && !wire.is_lossy() {
                continue;
            }
            let cfg = SyncConfig {
                overlap: true,
                rank: 2,
                feedback,
                // Experts change hands between rounds prepared ahead.
                rotate_every_rounds: 2,
                ..wire_cfg(wire)
            };
            let what = format!("{wire:?} {feedback:?}");
            let (mut c, mut nodes) = two_nodes(&m, &cfg);
            // Each node's twin takes the same steps, and encodes its upload and prepares every
            // round ahead, as a node does while it trains on.
            let mut twins: Vec<Node> = (0..2).map(|p| node(&c, p, &cfg)).collect();
            tch::manual_seed(5);
            let step_both = |c: &Coordinator, n: &mut Node, t: &mut Node| {
                tch::no_grad(|| {
                    for ((name, w), (_, v)) in n.weights.iter().zip(&t.weights) {
                        if n.replica.trains(role_of(c, name)) {
                            let r = w.randn_like() * 1e-3;
                            let _ = w.shallow_clone().g_add_(&r);
                            let _ = v.shallow_clone().g_add_(&r);
                        }
                    }
                })
            };
            for round in 1..=4u64 {
                let now = round as f64;
                let mut ahead = Vec::new();
                for (n, t) in nodes.iter_mut().zip(&mut twins) {
                    step_both(&c, n, t);
                    // As the node does: the upload is taken, then the preparer made; both
                    // run while the node trains on.
                    let uploader = t.replica.take_upload(&t.weights, c.round(), false, true);
                    let preparer = t.replica.preparer(&t.weights, true);
                    let peer = n.replica.peer();
                    let wire = n.replica.upload(&n.weights, c.round(), false).unwrap();
                    let sent: Named = wire.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
                    c.upload(
                        peer,
                        100 + peer as u64,
                        c.round(),
                        wire,
                        Work::default(),
                        now,
                    )
                    .unwrap();
                    ahead.push((uploader.unwrap(), preparer, sent));
                }
                c.close(now + 0.5);
                let (_, r) = c.global();
                let members: Vec<usize> = c.scope().members().into_iter().collect();
                // Every other round lands before the node trains on.
                let since = round % 2 == 1;
                let twinned = nodes.iter_mut().zip(&mut twins).zip(ahead);
                for (peer, ((n, t), (uploader, mut preparer, sent))) in twinned.enumerate() {
                    let at = format!("{what} round {round} peer {peer}");
                    if since {
                        step_both(&c, n, t);
                    }
                    // Encoded after the node trained on: the bits it sent all the same.
                    let (wire, upload_left) = uploader.encode();
                    assert_eq!(wire.len(), sent.len(), "{at}");
                    for ((a, x), (b, y)) in wire.iter().zip(&sent) {
                        assert!(a == b && x.equal(y), "{at}: wire `{a}` differs from `{b}`");
                    }
                    preparer.with_upload(&upload_left);
                    let a = deliver(&c, n, true, since);
                    let plan = t.replica.fetch_plan(Some(r), true);
                    let (tensors, skipped_own) = c.delta().unwrap().for_peer(peer, plan.skip_own);
                    let prepared = preparer
                        .prepare(Published {
                            round: r,
                            tensors,
                            skipped_own,
                            after_upload: true,
                            trained_since_upload: since,
                        })
                        .unwrap();
                    // Told back at the boundary that settles the round, before its finish.
                    t.replica.sent(upload_left);
                    let b = t.replica.finish(prepared, &t.weights, since).unwrap();
                    t.replica.follow(&c.scope().owners(), &members, &t.weights);
                    assert_eq!(a, b, "{at}");
                    assert_identical(&c, t, &at);
                    assert_eq!(n.replica.owned(), t.replica.owned(), "{at}");
                    for ((name, w), (_, v)) in n.weights.iter().zip(&t.weights) {
                        assert!(w.equal(v), "{at}: `{name}` differs");
                        let (x, y) = (n.replica.base_of(name), t.replica.base_of(name));
                        assert_eq!(x.is_some(), y.is_some(), "{at}: `{name}`");
                        if let (Some(x), Some(y)) = (x, y) {
                            assert!(x.equal(y), "{at}: base of `{name}`");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn overlap_keeps_the_progress_made_since_the_upload() {
    let _draws = draws();
    let m = model(1, 4);
    let cfg = SyncConfig {
        overlap: true,
        merge_every: 0,
        ..wire_cfg(Wire::Bf16Delta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    tch::manual_seed(11);
    for n in &mut nodes {
        train(&c, n, 1e-3);
        upload(&mut c, n, 1.0);
    }
    // Both train on while the round is aggregated: node 0 by `extra`.
    let uploaded = copy(&nodes[0].weights);
    train(&c, &mut nodes[0], 1e-3);
    let extra: Named = nodes[0]
        .weights
        .iter()
        .zip(&uploaded)
        .map(|((n, a), (_, b))| (n.clone(), a - b))
        .collect();
    c.close(1.5);
    // Node 0's upload counted: it lands on the global plus what it trained since (up to the
    // bf16 rounding of what it sent, which is carried too).
    let applied = deliver(&c, &mut nodes[0], true, true);
    assert!(applied.kept_progress);
    assert_identical(&c, &nodes[0], "overlap");
    for (name, w) in &nodes[0].weights {
        let g = get(c.global().0, name);
        if nodes[0].replica.base_of(name).is_some() {
            let want = g + get(&extra, name);
            let step = get(&uploaded, name) - get(&snapshot(&m), name);
            let slack = step.abs().max().double_value(&[]) / 128.0 + 1e-9;
            let off = (w - want).abs().max().double_value(&[]);
            assert!(off <= slack, "`{name}` is off by {off} (slack {slack})");
        } else {
            assert!(w.equal(g), "frozen `{name}` must be the global value");
        }
    }
    // Node 1 had not trained since: it takes the round exactly.
    let applied = deliver(&c, &mut nodes[1], true, false);
    assert!(!applied.kept_progress);
    assert_identical(&c, &nodes[1], "no progress since");
    for ((name, w), (_, g)) in nodes[1].weights.iter().zip(c.global().0) {
        assert!(w.equal(g), "`{name}`");
    }
}

#[test]
fn an_expert_that_changes_owner_keeps_what_its_old_owner_had_not_sent() {
    let _draws = draws();
    let m = model(2, 4);
    // 2-bit deltas leave much of each change in the owner's weights; ownership rotates after
    // every round, so each expert changes owner at every close.
    let cfg = SyncConfig {
        rotate_every_rounds: 1,
        merge_every: 0,
        ..wire_cfg(Wire::Int2Delta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    let name = spes_model::expert_tensor_name(0, 0, spes_model::EXPERT_PARTS[0]);
    let mut ideal = get(c.global().0, &name).copy();
    tch::manual_seed(9);
    // What the server has not published yet of a tensor, and what nodes hold back of it.
    let residual = |c: &Coordinator| {
        c.carried()
            .into_iter()
            .find(|(n, _)| *n == format!("residual/{name}"))
            .map(|(_, t)| t)
    };
    let held_back = |n: &Node| {
        let state = n.replica.state(&n.weights).unwrap();
        let handed = state.handover.into_iter().find(|(x, _)| *x == name);
        let kept = state.remainder.into_iter().find(|(x, _)| *x == name);
        handed.or(kept).map(|(_, t)| t)
    };
    for round in 1..=3u64 {
        let now = round as f64;
        for n in &mut nodes {
            let before = get(&n.weights, &name).copy();
            train(&c, n, 1e-3);
            ideal += get(&n.weights, &name) - before;
            upload(&mut c, n, now);
        }
        c.close(now + 0.5);
        if round > 1 {
            // The expert's previous owner handed over what it had not sent: not verbatim.
            let verbatim = &c.delta().unwrap().verbatim;
            assert!(verbatim.values().flatten().all(|n| !n.starts_with(&name)));
        }
        for n in &mut nodes {
            deliver(&c, n, true, false);
            assert_identical(&c, n, &format!("round {round}"));
        }
        // Every expert changed owner: each node hands over the two it trained.
        let owned_before = |p: usize| {
            if (round + p as u64) % 2 == 1 {
                [0, 1]
            } else {
                [2, 3]
            }
        };
        for (p, n) in nodes.iter().enumerate() {
            assert_eq!(
                n.replica.handing_over(round + 1),
                owned_before(p),
                "round {round}"
            );
            assert!(n.replica.handing_over(round).is_empty());
        }
        // Nothing is lost: the global model, the server's residual and what the nodes hold
        // back add up to θ⁰ plus everything trained (up to the bf16 rounding of a handover).
        let mut total = get(c.global().0, &name).copy();
        for t in residual(&c)
            .into_iter()
            .chain(nodes.iter().filter_map(held_back))
        {
            total += t;
        }
        let err = (&total - &ideal).abs().max().double_value(&[]);
        let scale = (&ideal - get(&snapshot(&m), &name))
            .abs()
            .max()
            .double_value(&[]);
        assert!(err < 1e-2 * scale, "round {round}: {err} lost of {scale}");
    }
}

/// A handover names whole experts, since the server sizes an upload by every tensor of each
/// expert it names: where a dropped expert did not change (a layer whose router sent it no
/// token), its tensors travel as zeros.
#[test]
fn a_handover_carries_every_tensor_of_each_expert_it_names() {
    let _draws = draws();
    let m = model(2, 4);
    let cfg = SyncConfig {
        rotate_every_rounds: 1,
        merge_every: 0,
        ..wire_cfg(Wire::Int2Delta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    tch::manual_seed(21);
    let in_layer_1 = |role: Role| matches!(role, Role::Expert { layer: 1, .. });
    for n in &mut nodes {
        // Every trained tensor moves but layer 1's experts.
        train_where(&c, n, 1e-3, |role| !in_layer_1(role));
        upload(&mut c, n, 1.0);
    }
    c.close(1.5);
    for n in &mut nodes {
        deliver(&c, n, true, false);
    }
    let entries = c.layout().entries.clone();
    for n in &mut nodes {
        let handed = n.replica.handing_over(2);
        assert_eq!(
            handed.len(),
            2,
            "each node hands over the two experts it trained"
        );
        let state = n.replica.state(&n.weights).unwrap();
        let wire = n.replica.upload(&n.weights, 2, false).unwrap();
        for (name, role, _) in &entries {
            let Role::Expert { index, .. } = *role else {
                continue;
            };
            if !handed.contains(&index) {
                continue;
            }
            let (_, held) = state
                .handover
                .iter()
                .find(|(x, _)| x == name)
                .unwrap_or_else(|| panic!("`{name}` of a handed expert is not held"));
            let moved = held.abs().max().double_value(&[]) > 0.0;
            assert_eq!(moved, !in_layer_1(*role), "`{name}`");
            let on_wire = format!("{name}#handover");
            assert!(
                wire.iter().any(|(x, _)| *x == on_wire),
                "the upload lacks `{on_wire}`"
            );
        }
        c.upload(
            n.replica.peer(),
            100 + n.replica.peer() as u64,
            2,
            wire,
            Work::default(),
            2.0,
        )
        .unwrap();
    }
}

#[test]
fn an_ownership_change_trains_the_new_experts_and_resets_the_dropped_ones() {
    let _draws = draws();
    let m = model(2, 4);
    // Lossy, so weights carry what was not sent, and ownership rotates after every round.
    let cfg = SyncConfig {
        rotate_every_rounds: 1,
        merge_every: 0,
        ..wire_cfg(Wire::Int4Delta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    assert_eq!(nodes[0].replica.owned(), &[true, true, false, false]);
    tch::manual_seed(5);
    for round in 1..=3u64 {
        let now = round as f64;
        for n in &mut nodes {
            train(&c, n, 1e-3);
            upload(&mut c, n, now);
        }
        c.close(now + 0.5);
        for n in &mut nodes {
            let before = n.replica.owned().to_vec();
            deliver(&c, n, true, false);
            let now_owned = n.replica.owned().to_vec();
            assert_ne!(before, now_owned, "round {round}: the experts rotated");
            assert_identical(&c, n, &format!("round {round}"));
            // A dropped expert holds the global value: its progress is its new owner's.
            for (name, w) in &n.weights {
                if let Role::Expert { index, .. } = role_of(&c, name) {
                    if before[index] && !now_owned[index] {
                        assert!(w.equal(get(c.global().0, name)), "dropped `{name}`");
                        assert!(n.replica.base_of(name).is_none());
                    }
                    if now_owned[index] {
                        let b = n.replica.base_of(name).expect("a base for a new expert");
                        assert!(b.equal(get(c.global().0, name)));
                    }
                }
            }
        }
        assert_eq!(
            nodes[0].replica.owned(),
            if round % 2 == 1 {
                &[false, false, true, true]
            } else {
                &[true, true, false, false]
            }
        );
    }
    // Following the same ownership again changes nothing.
    let (owners, members) = (c.scope().owners(), vec![0, 1]);
    let n = &mut nodes[0];
    let f = n.replica.follow(&owners, &members, &n.weights);
    assert!(matches!(f, Follow::Member { changed: false, .. }), "{f:?}");
    // Not a member of the next round: the node must ask to join again.
    let f = n.replica.follow(&owners, &[1], &n.weights);
    assert_eq!(f, Follow::NotMember);
}

#[test]
fn a_node_that_rejoins_or_restores_its_state_stays_bit_identical() {
    let _draws = draws();
    let m = model(1, 4);
    let cfg = SyncConfig {
        merge_every: 0,
        ..wire_cfg(Wire::Int4Delta)
    };
    let (mut c, mut nodes) = two_nodes(&m, &cfg);
    tch::manual_seed(9);
    let round_of = |c: &mut Coordinator, nodes: &mut [Node], round: u64| {
        for n in nodes.iter_mut() {
            train(c, n, 1e-3);
            upload(c, n, round as f64);
        }
        c.close(round as f64 + 0.5);
        for n in nodes.iter_mut() {
            deliver(c, n, true, false);
            assert_identical(c, n, &format!("round {round}"));
        }
    };
    round_of(&mut c, &mut nodes, 1);
    round_of(&mut c, &mut nodes, 2);
    // Node 1 restarts from nothing: it takes the newest whole model and holds that round.
    let mut fresh = Replica::new(1, cfg.clone(), Layout::of(&m));
    let weights = copy(c.global().0);
    fresh.hold(c.global().1, &weights);
    fresh.follow(&c.scope().owners(), &[0, 1], &weights);
    assert_eq!(fresh.owned(), nodes[1].replica.owned());
    nodes[1] = Node {
        replica: fresh,
        weights,
        ahead: false,
    };
    // Node 0 restarts from its saved state alone plus the global model of its base round.
    let state = nodes[0].replica.state(&nodes[0].weights).unwrap();
    assert_eq!(state.base_round, 2);
    assert!(
        !state.remainder.is_empty(),
        "a lossy wire carries a remainder"
    );
    let saved = copy(&nodes[0].weights);
    let mut restored = Replica::new(0, cfg.clone(), Layout::of(&m));
    let weights = snapshot(&m); // whatever the model held
    restored
        .restore(state, copy(c.global().0), &weights)
        .unwrap();
    for ((name, a), (_, b)) in weights.iter().zip(&saved) {
        let off = (a - b).abs().max().double_value(&[]);
        assert!(off < 1e-6, "`{name}` restored off by {off}");
    }
    // It prepares its rounds ahead from here, as the node on CPU does.
    nodes[0] = Node {
        replica: restored,
        weights,
        ahead: true,
    };
    assert_identical(&c, &nodes[0], "restored");
    round_of(&mut c, &mut nodes, 3);
    // A delta on top of a round the node does not hold is refused, not applied.
    let (tensors, _) = c.delta().unwrap().for_peer(0, false);
    let n = &mut nodes[0];
    let e = n
        .replica
        .apply(
            Published {
                round: 3,
                tensors,
                skipped_own: false,
                after_upload: false,
                trained_since_upload: false,
            },
            &n.weights,
        )
        .unwrap_err();
    assert!(matches!(e, ReplicaError::NotHeld { round: 3, .. }), "{e}");
    // Decayed load balancing scales the node's own experts only.
    let lb = SyncConfig {
        decayed_lb: true,
        decayed_lb_start: 0.5,
        decayed_lb_fraction: 0.5,
        ..cfg
    };
    let r = Replica::new(0, lb, Layout::of(&m));
    let mut r = r;
    r.follow(&[0, 0, 1, 1], &[0, 1], &snapshot(&m));
    let scale = r.lb_scale(25, 100, tch::Device::Cpu).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(&scale).unwrap(),
        vec![0.75, 0.75, 1.0, 1.0]
    );
}

/// Node p moves tensor `name` by `moves[p]` and uploads the open round, reporting `work[p]`.
fn move_and_upload(
    c: &mut Coordinator,
    nodes: &mut [Node],
    name: &str,
    moves: &[f64],
    work: [Work; 2],
    now: f64,
) {
    let round = c.round();
    for (p, n) in nodes.iter_mut().enumerate() {
        let _ = tch::no_grad(|| {
            get(&n.weights, name)
                .shallow_clone()
                .g_add_scalar_(moves[p])
        });
        let wire = n.replica.upload(&n.weights, round, false).unwrap();
        c.upload(p, 100 + p as u64, round, wire, work[p], now)
            .unwrap();
    }
}

/// A round by tokens: the server splits the next round's rows by the throughput each upload
/// reports, every node follows its share over the round's steps, and with `average_by =
/// "tokens"` the shared tensors are the rows-weighted mean of the changes.
#[test]
fn a_round_by_tokens_gives_the_faster_node_more_rows_and_weighs_its_change_by_them() {
    let _draws = draws();
    let m = model(2, 4);
    let cfg = SyncConfig {
        round_by: RoundBy::Tokens,
        average_by: AverageBy::Tokens,
        ..wire_cfg(Wire::Bf16Delta)
    };
    // 10 steps of 4 rows a round at the run's batch.
    let nominal = 40;
    let mut c = coordinator(&m, 2, cfg.clone(), 0.0).with_round_rows(nominal);
    let mut nodes: Vec<Node> = (0..2).map(|p| node(&c, p, &cfg)).collect();
    for n in &nodes {
        assert_eq!(n.replica.round_rows(nominal), nominal, "no budget yet");
        assert_eq!(n.replica.step_rows(3, nominal), 4);
    }
    let before = copy(c.global().0);
    let embed = "model.embed_tokens.weight";
    // Node 0 moves the embedding by +1, node 1 by +4; node 0 trained 3× the rows/s.
    let moves = [1.0, 4.0];
    let round_work = [
        Work {
            rows: 40,
            compute_s: 1.0,
        },
        Work {
            rows: 40,
            compute_s: 3.0,
        },
    ];
    move_and_upload(&mut c, &mut nodes, embed, &moves, round_work, 1.0);
    let report = c.close(1.5);
    let budget: Vec<u64> = report.budget.values().copied().collect();
    assert_eq!(
        budget,
        vec![60, 20],
        "3:1 by throughput, 2 × 40 rows in all"
    );
    assert_eq!(report.work.len(), 2);
    assert!(
        (report.work[0].weight - 0.5).abs() < 1e-12,
        "equal rows, equal weights"
    );
    // Equal rows this round: the weighted mean is the plain mean, (1 + 4) / 2.
    let moved = get(c.global().0, embed) - get(&before, embed);
    assert!((scalar(&moved) - 2.5).abs() < 1e-2, "{}", scalar(&moved));
    let members: Vec<usize> = c.scope().members().into_iter().collect();
    for n in &mut nodes {
        deliver(&c, n, true, false);
        n.replica.follow_budget(&members, &budget);
        assert_eq!(
            n.replica.round_rows(nominal),
            nominal,
            "from the next round on"
        );
        n.replica.start_round();
    }
    let per_step: Vec<u64> = (0..10)
        .map(|k| nodes[0].replica.step_rows(k, nominal))
        .collect();
    assert_eq!(per_step, vec![6; 10]);
    assert_eq!(
        (0..10)
            .map(|k| nodes[1].replica.step_rows(k, nominal))
            .sum::<u64>(),
        20
    );

    // The next round weighs node 0's change by its 60 rows against node 1's 20.
    let before = copy(c.global().0);
    let round_work = [0, 1].map(|p| Work {
        rows: nodes[p].replica.round_rows(nominal),
        compute_s: 1.0,
    });
    move_and_upload(&mut c, &mut nodes, embed, &moves, round_work, 2.0);
    let report = c.close(2.5);
    assert!((report.work[0].weight - 0.75).abs() < 1e-12);
    let moved = get(c.global().0, embed) - get(&before, embed);
    assert!(
        (scalar(&moved) - 1.75).abs() < 1e-2,
        "(60·1 + 20·4) / 80, got {}",
        scalar(&moved)
    );

    // A server that sends no budget (or a round by steps) leaves the node at the run's batch.
    nodes[0].replica.follow_budget(&members, &[]);
    nodes[0].replica.start_round();
    assert_eq!(nodes[0].replica.round_rows(nominal), nominal);
    let mut by_steps = Replica::new(0, wire_cfg(Wire::Bf16Delta), c.layout().clone());
    by_steps.follow_budget(&members, &[60, 20]);
    by_steps.start_round();
    assert_eq!(by_steps.round_rows(nominal), nominal);
}
