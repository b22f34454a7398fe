//! spes against Hugging Face transformers (the project's .venv): exported models, upcycled
//! models, and evaluation log-likelihoods must agree within 1e-4.

use spes_hf::{export, upcycle, ExportDtype, ExportOptions, RouterInit, UpcycleOptions};
use spes_model::MoeModel;
use spes_train::{checkpoint, RunConfig, Trainer};
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Device, Kind, Tensor};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs scripts/hf_reference.py with the project's virtualenv.
fn reference(args: &[&str]) {
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("scripts/hf_reference.py"))
        .args(args)
        .output()
        .expect("the project's .venv (scripts/setup.sh) is needed");
    assert!(
        out.status.success(),
        "hf_reference.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn data(dir: &Path) -> PathBuf {
    spes_data::testing::small_corpus(dir, 100000)
}

/// A briefly trained small model's checkpoint (weights away from their init).
fn trained_checkpoint(
    dir: &Path,
    qk_norm: &str,
    heads: usize,
    kv_heads: usize,
    placement: &str,
) -> PathBuf {
    let text = format!(
        r#"
[model]
preset = "tiny"
vocab_size = 512
d_model = 64
n_layers = 2
n_heads = {heads}
n_kv_heads = {kv_heads}
head_dim = {}
n_experts = 6
top_k = 2
expert_hidden = 48
context_length = 64
qk_norm = "{qk_norm}"
normalize_topk = {}
init_std = 0.1
norm_placement = "{placement}"

[data]
path = "{}"

[train]
max_steps = 5
batch_size = 4
seq_len = 64
lr = 1e-2
warmup_steps = 1
"#,
        64 / heads,
        qk_norm == "per_head",
        data(dir).display()
    );
    let cfg = RunConfig::parse(&text, &[]).unwrap();
    let mut tr = Trainer::new(cfg, Device::Cpu, |_| true).unwrap();
    for _ in 0..5 {
        tr.train_step().unwrap();
    }
    tr.save_checkpoint(&dir.join("ck")).unwrap().unwrap()
}

fn spes_model(ck: &Path) -> MoeModel {
    let loaded = checkpoint::load(ck).unwrap();
    let model = MoeModel::new(&loaded.state.config.model, Device::Cpu).unwrap();
    model
        .load(loaded.model.as_ref().unwrap(), "checkpoint")
        .unwrap();
    model
}

fn tokens(vocab: i64) -> (Tensor, String) {
    tch::manual_seed(7);
    let t = Tensor::randint(vocab, [2, 24], (Kind::Int64, Device::Cpu));
    let rows: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&t).unwrap();
    (t, serde_json::to_string(&rows).unwrap())
}

fn hf_logits(model_dir: &Path, tokens_json: &str, dir: &Path) -> Tensor {
    let (tok, out) = (dir.join("tokens.json"), dir.join("logits.npy"));
    std::fs::write(&tok, tokens_json).unwrap();
    reference(&[
        "logits",
        "--model",
        model_dir.to_str().unwrap(),
        "--tokens",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let a: ndarray::ArrayD<f32> = ndarray_npy::read_npy(&out).unwrap();
    let shape: Vec<i64> = a.shape().iter().map(|&d| d as i64).collect();
    Tensor::from_slice(a.as_slice().unwrap()).view(shape.as_slice())
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn exported_models_match_transformers_logits() {
    let cases = [
        ("full", 4, 4, "pre", "OlmoeForCausalLM"),
        ("per_head", 4, 2, "pre", "Qwen3MoeForCausalLM"),
        ("full", 4, 2, "post", "FlexOlmoForCausalLM"),
    ];
    for (qk, heads, kv, placement, arch) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let ck = trained_checkpoint(tmp.path(), qk, heads, kv, placement);
        let out = tmp.path().join("hf");
        let summary = export(&ExportOptions {
            checkpoint: ck.clone(),
            out: out.clone(),
            dtype: ExportDtype::Fp32,
            max_shard_bytes: 400_000,
            tokenizer: None,
        })
        .unwrap();
        assert_eq!(summary.architecture, arch);
        assert!(summary.shards > 1, "sharded above the size limit");
        assert!(
            summary.tokenizer
                && out.join("tokenizer.json").exists()
                && out.join("generation_config.json").exists()
        );
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["max_position_embeddings"], 64);

        let model = spes_model(&ck);
        let (t, json) = tokens(512);
        let (ours, _) = tch::no_grad(|| model.forward(&t));
        let theirs = hf_logits(&out, &json, tmp.path());
        let d = max_diff(&ours, &theirs);
        eprintln!("export {arch}: max |Δlogit| = {d:.2e}");
        assert!(d < 1e-4, "{arch}: max |Δlogit| = {d}");
        assert!(
            ours.abs().max().double_value(&[]) > 0.5,
            "logits are not trivially small"
        );
    }
}

#[test]
fn upcycled_moe_equals_its_dense_source() {
    for arch in ["qwen3", "llama", "qwen2", "olmo2"] {
        let tmp = tempfile::tempdir().unwrap();
        let dense = tmp.path().join("dense");
        reference(&["dense", "--arch", arch, "--out", dense.to_str().unwrap()]);
        let ck = upcycle(&UpcycleOptions {
            from: dense.clone(),
            experts: 4,
            top_k: 2,
            normalize_topk: true,
            noise_std: 0.0,
            noise_fraction: 0.0,
            router: RouterInit::Zeros,
            seed: 0,
            out: tmp.path().join("moe"),
            data: tmp.path().join("no-data"),
        })
        .unwrap();
        let model = spes_model(&ck);
        assert_eq!(model.cfg.n_experts, 4);
        let (t, json) = tokens(300);
        let (ours, _) = tch::no_grad(|| model.forward(&t));
        let theirs = hf_logits(&dense, &json, tmp.path());
        let d = max_diff(&ours, &theirs);
        eprintln!("upcycle {arch}: max |Δlogit| = {d:.2e}");
        assert!(d < 1e-4, "{arch}: max |Δlogit| = {d}");

        // Noise makes the experts differ from the dense MLP (and from each other).
        let noisy = upcycle(&UpcycleOptions {
            from: dense,
            experts: 4,
            top_k: 2,
            normalize_topk: true,
            noise_std: 0.01,
            noise_fraction: 0.5,
            router: RouterInit::Normal(0.02),
            seed: 1,
            out: tmp.path().join("moe-noisy"),
            data: tmp.path().join("no-data"),
        })
        .unwrap();
        let n = checkpoint::load(&noisy).unwrap().model.unwrap();
        let get = |name: &str| n.iter().find(|(k, _)| k == name).unwrap().1.shallow_clone();
        let (e0, e1) = (
            get("model.layers.0.mlp.experts.0.up_proj.weight"),
            get("model.layers.0.mlp.experts.1.up_proj.weight"),
        );
        assert!(!e0.equal(&e1));
        let changed = e0
            .ne_tensor(&e1)
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        assert!(
            changed > 0.5 && changed < 0.9,
            "about half the entries of each expert get noise: {changed}"
        );
    }
    let err =
        spes_hf::upcycle::model_config(&serde_json::json!({"model_type": "gpt2"}), 4, 2, true)
            .unwrap_err()
            .to_string();
    assert!(err.contains("`gpt2` is not supported"), "{err}");
}

#[test]
fn task_and_text_loglikelihoods_match_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = trained_checkpoint(tmp.path(), "full", 4, 4, "pre");
    let out = tmp.path().join("hf");
    export(&ExportOptions {
        checkpoint: ck.clone(),
        out: out.clone(),
        dtype: ExportDtype::Fp32,
        max_shard_bytes: u64::MAX,
        tokenizer: None,
    })
    .unwrap();
    let model = spes_model(&ck);
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let task = spes_eval::load_task(&spes_data::testing::fixture("eval/arc_easy")).unwrap();
    let mut pairs: Vec<(Vec<u32>, Vec<u32>)> = task.requests[..60]
        .iter()
        .map(|r| spes_eval::encode_pair(&tok, &r.context, &r.continuation).unwrap())
        .collect();
    // Text NLL is the same computation: each window's first token is the context.
    let text = std::fs::read_to_string(spes_data::testing::fixture(
        "text/wikitext-2-valid-head.txt",
    ))
    .unwrap();
    let text = &text[..3000];
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    for w in ids.chunks(64) {
        pairs.push((w[..1].to_vec(), w[1..].to_vec()));
    }
    let ours = spes_eval::loglikelihoods(
        &model,
        &pairs,
        0,
        64,
        8,
        Device::Cpu,
        &indicatif::ProgressBar::hidden(),
    );
    let (pairs_file, scores_file) = (
        tmp.path().join("pairs.json"),
        tmp.path().join("scores.json"),
    );
    std::fs::write(&pairs_file, serde_json::to_string(&pairs).unwrap()).unwrap();
    reference(&[
        "loglik",
        "--model",
        out.to_str().unwrap(),
        "--pairs",
        pairs_file.to_str().unwrap(),
        "--ctx",
        "64",
        "--eos",
        "0",
        "--out",
        scores_file.to_str().unwrap(),
    ]);
    let theirs: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(&scores_file).unwrap()).unwrap();
    assert_eq!(ours.len(), theirs.len());
    let worst = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!("{} log-likelihoods: max |Δ| = {worst:.2e}", ours.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            (a - b).abs() < 1e-4,
            "request {i}: spes {a} vs transformers {b}"
        );
    }
    let sc = spes_eval::Scoring {
        tokenizer: tok,
        eos: 0,
        ctx: 64,
        batch: 8,
        device: Device::Cpu,
    };
    let score = spes_eval::score_text(&model, &sc, text).unwrap();
    let text_nll: f64 = -theirs[60..].iter().sum::<f64>();
    assert!(
        (score.nll - text_nll).abs() < 1e-3,
        "{} vs {text_nll}",
        score.nll
    );
    assert!((score.perplexity - (text_nll / score.predicted_tokens as f64).exp()).abs() < 1e-3);
}
