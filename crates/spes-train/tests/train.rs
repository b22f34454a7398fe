use spes_model::Role;
use spes_train::{checkpoint, RunConfig, Trainer};
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

/// A small tokenized slice of the repository's corpus.
fn data(dir: &Path) -> PathBuf {
    spes_data::testing::small_corpus(dir, 150000)
}

fn config(data: &Path, extra: &[&str]) -> RunConfig {
    let text = format!(
        r#"
[model]
preset = "micro"
n_experts = 4

[data]
path = "{}"

[train]
max_steps = 6
batch_size = 4
seq_len = 32
lr = 3e-3
warmup_steps = 2
log_every = 1
eval_every = 3
eval_batches = 2
checkpoint_every = 3
keep_checkpoints = 5
"#,
        data.display()
    );
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, &extra).unwrap()
}

fn named(tr: &Trainer) -> Vec<(String, Tensor)> {
    tr.model_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect()
}

fn assert_bit_identical(a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len());
    let sorted = |v: &[(String, Tensor)]| {
        let mut v: Vec<(String, Tensor)> = v
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        v.sort_by(|x, y| x.0.cmp(&y.0));
        v
    };
    for ((na, ta), (nb, tb)) in sorted(a).iter().zip(&sorted(b)) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na} differs");
    }
}

fn losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["loss"].is_number())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn resume_reproduces_the_uninterrupted_run_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let full = tmp.path().join("full");
    spes_train::run(
        config(&data, &[]),
        &full,
        Device::Cpu,
        false,
        None,
        false,
        None,
    )
    .unwrap();

    // A run that died after its step-3 checkpoint: that checkpoint and the metrics so far.
    let crashed = tmp.path().join("crashed");
    std::fs::create_dir_all(crashed.join("checkpoints")).unwrap();
    let src = full.join("checkpoints/step-3");
    let dst = crashed.join("checkpoints/step-3");
    std::fs::create_dir(&dst).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dst.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::copy(full.join("metrics.jsonl"), crashed.join("metrics.jsonl")).unwrap();

    let err = spes_train::run(
        config(&data, &[]),
        &crashed,
        Device::Cpu,
        false,
        None,
        false,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--resume"),
        "refuses to overwrite a run: {err}"
    );
    let s = spes_train::run(
        config(&data, &[]),
        &crashed,
        Device::Cpu,
        true,
        None,
        false,
        None,
    )
    .unwrap();
    assert_eq!(s.steps, 6);
    assert_eq!(
        losses(&crashed),
        losses(&full),
        "per-step losses, bit for bit"
    );
    assert_eq!(losses(&full).len(), 6);

    let a = checkpoint::load(&full.join("checkpoints/step-6")).unwrap();
    let b = checkpoint::load(&crashed.join("checkpoints/step-6")).unwrap();
    assert_bit_identical(a.model.as_ref().unwrap(), b.model.as_ref().unwrap());
    assert_bit_identical(&a.optimizer, &b.optimizer);
    assert_eq!(a.state.data_position, b.state.data_position);
}

#[test]
fn checkpoint_round_trip_is_exact_and_corruption_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(&data, &[]);
    let mut tr = Trainer::new(cfg.clone(), Device::Cpu, |_| true).unwrap();
    tr.train_step().unwrap();
    tr.train_step().unwrap();
    let root = tmp.path().join("ck");
    let dir = tr.save_checkpoint(&root).unwrap().unwrap();
    let back = Trainer::resume_from(cfg.clone(), Device::Cpu, &dir, |_| true).unwrap();
    assert_bit_identical(&named(&tr), &named(&back));
    assert_bit_identical(&tr.opt.state(), &back.opt.state());
    assert_eq!((back.step, back.tokens, back.opt.steps), (2, tr.tokens, 2));
    // No temp directory is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(leftovers, vec!["step-2".to_string()]);

    let model_file = dir.join(checkpoint::MODEL_FILE);
    let bytes = std::fs::read(&model_file).unwrap();
    std::fs::write(&model_file, &bytes[..bytes.len() - 100]).unwrap();
    let err = format!("{:#}", checkpoint::load(&dir).err().unwrap());
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&model_file, &bytes).unwrap();
    checkpoint::load(&dir).unwrap();

    std::fs::write(dir.join(checkpoint::STATE_FILE), "{\"step\": ").unwrap();
    let err = format!("{:#}", checkpoint::load(&dir).err().unwrap());
    assert!(
        err.contains("state.json") && err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn frozen_experts_stay_bit_identical_with_no_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let own = |r: Role| match r {
        Role::Shared => true,
        Role::Expert { index, .. } => index == 1 || index == 2,
    };
    let mut tr = Trainer::new(config(&data, &[]), Device::Cpu, own).unwrap();
    let before = named(&tr);
    for _ in 0..4 {
        tr.train_step().unwrap();
    }
    let after = named(&tr);
    let roles: Vec<Role> = tr.model.params().iter().map(|p| p.role).collect();
    let mut trainable_bytes = 0;
    for (((name, b), (_, a)), role) in before.iter().zip(&after).zip(&roles) {
        if own(*role) {
            assert!(!a.equal(b), "{name} is trained and must change");
            trainable_bytes += (a.numel() * 4) as u64;
        } else {
            assert!(a.equal(b), "{name} is frozen and must not change");
            assert!(
                !tr.opt.param_names().any(|n| n == name),
                "{name} has optimizer state"
            );
        }
    }
    assert_eq!(
        tr.opt.state_bytes(),
        2 * trainable_bytes,
        "two fp32 moments per trainable value"
    );
    let frozen = roles.iter().filter(|r| !own(**r)).count();
    assert_eq!(
        frozen,
        2 * 2 * 3,
        "2 layers × 2 frozen experts × 3 matrices"
    );
}

/// Every token of one split of a tokenized directory, in stream order.
fn split_tokens(dir: &Path, val: bool) -> Vec<u16> {
    let m = spes_data::Manifest::load(dir).unwrap();
    let mut out = Vec::new();
    for info in if val { &m.val } else { &m.train } {
        let shard = spes_data::shard::Shard::open(dir, info, m.dtype).unwrap();
        shard.read_into(0, shard.len() as usize, &mut out);
    }
    out.into_iter().map(|t| t as u16).collect()
}

#[test]
fn token_files_of_other_tools_train_as_spes_shards() {
    use spes_data::import::{import, write_megatron, ImportOptions};
    let tmp = tempfile::tempdir().unwrap();
    let ours = data(tmp.path());
    // The same stream another tool would have written: train tokens, then validation tokens.
    let mut tokens = split_tokens(&ours, false);
    let val = split_tokens(&ours, true);
    tokens.extend_from_slice(&val);
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let raw = tmp.path().join("memmap.npy");
    std::fs::write(&raw, &bytes).unwrap();
    let npy = spes_data::shard::write_shard(
        tmp.path(),
        "numpy",
        &tokens.iter().map(|&t| t as u32).collect::<Vec<_>>(),
        spes_data::TokenDtype::Uint16,
    )
    .unwrap();
    let mega = tmp.path().join("mega_text_document");
    let docs: Vec<Vec<u16>> = tokens.chunks(1000).map(<[u16]>::to_vec).collect();
    write_megatron(&mega, &docs).unwrap();
    let inputs = [
        (raw, Some(spes_data::TokenDtype::Uint16)),
        (tmp.path().join(npy.file), None),
        (mega.with_extension("bin"), None),
    ];

    let train = |dir: &Path| -> Vec<f64> {
        let mut tr = Trainer::new(config(dir, &[]), Device::Cpu, |_| true).unwrap();
        let mut l: Vec<f64> = (0..3)
            .map(|_| tr.train_step().unwrap().losses.loss)
            .collect();
        l.push(tr.evaluate());
        l
    };
    let expected = train(&ours);
    for (i, (input, dtype)) in inputs.into_iter().enumerate() {
        let out = tmp.path().join(format!("imported-{i}"));
        import(&ImportOptions {
            inputs: vec![input],
            out: out.clone(),
            tokenizer: ours.join("tokenizer.json"),
            eos_token: None,
            dtype,
            val_tokens: val.len() as u64,
        })
        .unwrap();
        assert_eq!(train(&out), expected, "layout {i}");
    }
}

/// A step of more rows than the batch (a round by tokens) is cut into micro-batches of at most
/// `batch_size`, weighed by their rows: 6 rows as 4 + 2 give the cross-entropy of the same 6
/// rows taken at once (weighing the two halves equally would not).
#[test]
fn a_step_of_uneven_micro_batches_is_the_mean_over_its_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let all = |_: Role| true;
    let mut whole = Trainer::new(config(&data, &["train.batch_size=6"]), Device::Cpu, all).unwrap();
    let mut cut = Trainer::new(config(&data, &[]), Device::Cpu, all).unwrap();
    let a = whole.train_step().unwrap();
    let b = cut.train_rows(6).unwrap();
    assert_eq!((a.tokens, b.tokens), (6 * 32, 6 * 32));
    assert!(
        (a.losses.ce - b.losses.ce).abs() < 1e-5,
        "{} vs {}",
        a.losses.ce,
        b.losses.ce
    );
    // A node's own micro-batch cuts the same rows in passes of 2: the same cross-entropy, a
    // load-balancing loss of its own (it is per pass).
    let small = config(&data, &["train.micro_batch=2"]);
    assert_eq!(small.train.micro_rows(), 2);
    let mut halves = Trainer::new(small, Device::Cpu, all).unwrap();
    let c = halves.train_rows(6).unwrap();
    assert!((a.losses.ce - c.losses.ce).abs() < 1e-5);
    assert_ne!(a.losses.lb_loss, c.losses.lb_loss, "three passes, not one");
    assert!(cut.train_rows(0).is_err(), "a step needs a row");
}

/// A DiLoCo node's union estimate of the second moment from two data-parallel ranks (each
/// rank's gradient against their mean) equals one process's from the two halves of the same
/// rows: the same losses, weights and noise averages, also after the trained set changes
/// mid-run, which moves tensors, their moments and their noise averages between the ranks;
/// with gradients reduced stage by stage during backward (the default) or after it.
#[test]
fn two_ranks_estimate_the_second_moment_as_one_process_of_both_halves() {
    use spes_train::data_parallel::{Backend, DataParallel, Rendezvous};
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let sets = |more: &[&str]| {
        let estimate = "train.second_moment=union_estimate";
        let diloco = [
            "sync.mode=diloco",
            "sync.nodes=4",
            "sync.sync_steps=3",
            estimate,
        ];
        config(&data, &[&diloco[..], more].concat())
    };
    // Six steps; after the third, the experts of index 0 freeze.
    let run = |mut tr: Trainer, root: PathBuf| {
        let mut losses = Vec::new();
        for step in 0..6 {
            if step == 3 {
                tr.set_trainable(|r| !matches!(r, Role::Expert { index: 0, .. }))
                    .unwrap();
            }
            losses.push(tr.train_step().unwrap().losses.loss);
        }
        let saved = tr.save_checkpoint(&root).unwrap();
        (losses, named(&tr), saved)
    };
    let one = Trainer::new(sets(&["train.batch_size=4"]), Device::Cpu, |_| true).unwrap();
    let (losses_one, weights_one, dir_one) = run(one, tmp.path().join("one"));
    for overlap in ["true", "false"] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let reduce = format!("train.overlap_grad_reduce={overlap}");
                let cfg = sets(&["train.batch_size=2", &reduce]);
                let root = tmp.path().join(format!("two-{overlap}"));
                std::thread::spawn(move || {
                    let r = Rendezvous {
                        host: "127.0.0.1".into(),
                        port,
                        rank,
                        world: 2,
                        timeout: std::time::Duration::from_secs(60),
                        backend: Backend::Gloo,
                    };
                    let dp = DataParallel::join(&r, Device::Cpu).unwrap();
                    let mut tr = Trainer::new(cfg, Device::Cpu, |_| true).unwrap();
                    tr.set_data_parallel(dp).unwrap();
                    run(tr, root)
                })
            })
            .collect();
        let mut ranks: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        let (losses_two, weights_two, dir_two) = ranks.remove(0);
        let close = |a: &Tensor, b: &Tensor, tol: f64, what: &str| {
            let scale = a.abs().max().double_value(&[]).max(1e-12);
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(
                diff <= tol * scale,
                "{what} differs by {diff} (scale {scale})"
            );
        };
        for (step, (a, b)) in losses_one.iter().zip(&losses_two).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "step {}: {a} vs {b}",
                step + 1
            );
        }
        for ((n, a), (m, b)) in weights_one.iter().zip(&weights_two) {
            assert_eq!(n, m);
            close(a, b, 1e-5, n);
        }
        let noise = |dir: Option<PathBuf>| -> Vec<(String, Tensor)> {
            let file = dir.unwrap().join(checkpoint::OPTIMIZER_FILE);
            let mut v: Vec<(String, Tensor)> = Tensor::read_safetensors(&file)
                .unwrap()
                .into_iter()
                .filter(|(n, _)| n.starts_with("noise."))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let (a, b) = (noise(dir_one.clone()), noise(dir_two));
        assert!(a.len() > 10, "{} noise averages", a.len());
        assert!(!a.iter().any(|(n, _)| n.contains(".experts.0.")), "frozen");
        assert_eq!(a.len(), b.len());
        for ((n, x), (m, y)) in a.iter().zip(&b) {
            assert_eq!(n, m);
            close(x, y, 1e-4, n);
        }
    }
}
