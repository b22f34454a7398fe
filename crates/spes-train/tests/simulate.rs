//! `spes simulate`'s engine: a decentralized run of a micro model in one process.

use spes_train::simulate::{simulate, SimOptions};
use spes_train::RunConfig;
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
    let again = run(&["sync.wire=lowrank_delta", "sync.rank=2"], 1);
    // The same run twice: the same bits, whatever the order of threads.
    assert_eq!(low.final_val_loss, again.final_val_loss);
    assert!(low.final_val_loss.is_finite());
    assert!(
        low.bytes_per_round < dense.bytes_per_round / 4.0,
        "{} vs {}",
        low.bytes_per_round,
        dense.bytes_per_round
    );
    // A delay of a round or more, or one without overlap, is refused with the key to change.
    let cfg = config(&data, &["sync.overlap=false"]);
    let opts = SimOptions {
        delay_steps: 1,
        eval_every: 0,
        dump_changes: None,
    };
    let e = simulate(&cfg, Device::Cpu, &opts).unwrap_err().to_string();
    assert!(e.contains("sync.overlap = true"), "{e}");
    let cfg = config(&data, &[]);
    let opts = SimOptions {
        delay_steps: 2,
        eval_every: 0,
        dump_changes: None,
    };
    let e = simulate(&cfg, Device::Cpu, &opts).unwrap_err().to_string();
    assert!(e.contains("shorter than a round"), "{e}");
}
