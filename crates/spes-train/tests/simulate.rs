//! `spes simulate`'s engine: a decentralized run of a micro model in one process.

use spes_train::oracle::Oracle;
use spes_train::simulate::{simulate, SimOptions};
use spes_train::RunConfig;
use spes_train::Trainer;
use std::path::Path;
use tch::Device;

fn config(data: &Path, extra: &[&str]) -> RunConfig {
    let text = format!(
        r#"
[model]
preset = "micro"
n_experts = 4

[data]
path = "{}"

[train]
max_steps = 8
batch_size = 4
seq_len = 32
lr = 3e-3
warmup_steps = 2
eval_every = 4
eval_batches = 2

[sync]
mode = "spes"
nodes = 2
sync_steps = 2
merge_every = 4
merge_until = 8
merge_alpha = 0.05
"#,
        data.display()
    );
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, &extra).unwrap()
}

#[test]
fn a_simulated_run_is_reproducible_and_the_low_rank_wire_sends_less() {
    let dir = tempfile::tempdir().unwrap();
    let data = spes_data::testing::small_corpus(dir.path(), 60_000);
    let run = |extra: &[&str], delay| {
        simulate(
            &config(&data, extra),
            Device::Cpu,
            &SimOptions {
                delay_steps: delay,
                eval_every: 0,
                dump_changes: None,
                ..SimOptions::default()
            },
        )
        .unwrap()
    };
    let dense = run(&["sync.wire=bf16_delta", "sync.overlap=false"], 0);
    // What a node trained in a round, as it would upload it before the wire compresses it.
    let dumped = dir.path().join("changes");
    std::fs::create_dir_all(&dumped).unwrap();
    let opts = SimOptions {
        delay_steps: 0,
        eval_every: 0,
        dump_changes: Some((dumped.clone(), vec![2])),
        ..SimOptions::default()
    };
    simulate(&config(&data, &["sync.overlap=false"]), Device::Cpu, &opts).unwrap();
    let change = tch::Tensor::read_safetensors(dumped.join("round-2-node-1.safetensors")).unwrap();
    let names: Vec<&str> = change.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"lm_head.weight"), "{names:?}");
    // Node 1 owns experts 2 and 3 of 4, and no other.
    assert!(names.iter().any(|n| n.contains("experts.2.")));
    assert!(!names.iter().any(|n| n.contains("experts.0.")));
    assert!(!dumped.join("round-1-node-0.safetensors").exists());
    assert_eq!(dense.curve.iter().map(|c| c.0).collect::<Vec<_>>(), [4, 8]);
    assert!(dense.curve[1].1 < dense.curve[0].1, "{:?}", dense.curve);
    let low = run(&["sync.wire=lowrank_delta", "sync.rank=2"], 1);
    assert!(low.final_val_loss.is_finite());
    // The first rounds' settings pinned, and the same run with the keys a server would choose
    // left adaptive: without links simulate runs the first rounds' settings throughout. The
    // same bits, whatever the order of threads.
    let first = spes_sync::FIRST_ROUNDS;
    let wire = format!("sync.wire={}", first.wire.name());
    let steps = format!("sync.overlap_steps={}", first.overlap_steps);
    let pinned = run(&[&wire, &steps], 1);
    let again = run(&["sync.wire=adaptive", "sync.overlap_steps=adaptive"], 1);
    assert_eq!(pinned.final_val_loss, again.final_val_loss);
    assert!(pinned.final_val_loss.is_finite());
    assert!(
        low.bytes_per_round < dense.bytes_per_round / 4.0,
        "{} vs {}",
        low.bytes_per_round,
        dense.bytes_per_round
    );
    // A delay of more than a round, or one without overlap, is refused with the key to change.
    let cfg = config(&data, &["sync.overlap=false"]);
    let opts = SimOptions {
        delay_steps: 1,
        ..SimOptions::default()
    };
    let e = simulate(&cfg, Device::Cpu, &opts).unwrap_err().to_string();
    assert!(e.contains("sync.overlap = true"), "{e}");
    let cfg = config(&data, &[]);
    let opts = SimOptions {
        delay_steps: 3,
        ..SimOptions::default()
    };
    let e = simulate(&cfg, Device::Cpu, &opts).unwrap_err().to_string();
    assert!(e.contains("at most a round"), "{e}");
}

/// The oracles are what they claim. Under DiLoCo at one step a round on the fp32 wire, two
/// nodes reading the centralized run's batch between them (interleaved) at its rate, the mean
/// of the nodes' AdamW updates with every statistic of the union is the centralized update, so
/// the global model's validation loss follows the centralized run's to fp32 rounding; leave
/// any one statistic local and it does not.
#[test]
fn with_every_union_statistic_diloco_at_one_step_a_round_is_the_centralized_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = spes_data::testing::small_corpus(dir.path(), 60_000);
    // Clipping that always acts and a load-balancing loss that weighs, so each statistic
    // moves the losses well past rounding.
    let shared = [
        "train.max_steps=6",
        "train.eval_every=1",
        "train.grad_clip=0.05",
        "train.lb_loss_weight=0.5",
        "train.lr=1e-2",
        "data.partition=interleave",
    ];
    let sim = |oracle: &[&str]| {
        let mut keys: Vec<&str> = shared.to_vec();
        keys.extend([
            "sync.mode=diloco",
            "sync.sync_steps=1",
            "sync.wire=fp32",
            "sync.overlap=false",
            "sync.merge_every=0",
            // A node's own step with the union's second moment can be far from the mean step
            // (its gradient over the union's, coordinate by coordinate): unchecked.
            "sync.max_update_factor=0",
            "train.node_lr_scale=1",
            "train.expert_lr_scale=1",
            "train.second_moment=own",
        ]);
        let names: Vec<String> = oracle.iter().map(|s| s.to_string()).collect();
        let opts = SimOptions {
            eval_every: 1,
            oracle: Oracle::parse(&names).unwrap(),
            ..SimOptions::default()
        };
        let r = simulate(&config(&data, &keys), Device::Cpu, &opts).unwrap();
        r.curve.iter().map(|c| c.1).collect::<Vec<f64>>()
    };
    let centralized = {
        let mut keys: Vec<&str> = shared.to_vec();
        keys.extend(["sync.mode=centralized", "train.batch_size=8"]);
        let cfg = config(&data, &keys);
        let val = spes_data::ValWindows::open_mixture(&cfg.data.sources(), 32).unwrap();
        let mut t = Trainer::new(cfg, Device::Cpu, |_| true).unwrap();
        (0..6)
            .map(|_| {
                t.train_step().unwrap();
                // The windows the simulation scores: a node's batch of 4, 2 batches.
                spes_train::validation_stats(&t.model, &val, 4, 2, Device::Cpu).0
            })
            .collect::<Vec<f64>>()
    };
    let gap = |curve: &[f64]| {
        curve
            .iter()
            .zip(&centralized)
            .map(|(a, b)| ((a - b) / b).abs())
            .fold(0.0, f64::max)
    };
    let all = sim(&["all"]);
    assert_eq!(all.len(), 6);
    // Measured: 4e-8 with every statistic of the union, 2e-4 to 1e-2 with one left local.
    assert!(gap(&all) < 1e-6, "{all:?} vs {centralized:?}");
    for local in [
        vec!["clip", "load-balance"],
        vec!["second-moment", "load-balance"],
        vec!["second-moment", "clip"],
        vec![],
    ] {
        let curve = sim(&local);
        assert!(
            gap(&curve) > 5e-5,
            "with only {local:?}: {curve:?} vs {centralized:?}"
        );
    }
}

/// A SPES run with the union estimate, the default, trains (ownership, merges and the wire as
/// usual) and takes other steps than with each node's own second moment; a centralized
/// config is refused it.
#[test]
fn the_union_estimate_runs_in_a_spes_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = spes_data::testing::small_corpus(dir.path(), 60_000);
    let run = |extra: &[&str]| {
        simulate(&config(&data, extra), Device::Cpu, &SimOptions::default())
            .unwrap()
            .final_val_loss
    };
    let own = run(&["train.second_moment=own"]);
    let estimate = run(&["train.second_moment=union_estimate"]);
    assert!(
        estimate.is_finite() && estimate != own,
        "{estimate} vs {own}"
    );
    assert_eq!(run(&[]).to_bits(), estimate.to_bits(), "the default");
    let e = RunConfig::parse(
        &format!(
            "[model]\npreset = \"micro\"\n[data]\npath = \"{}\"\n[train]\nseq_len = 32\nsecond_moment = \"union_estimate\"\n",
            data.display()
        ),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("train.second_moment"), "{e}");
}
