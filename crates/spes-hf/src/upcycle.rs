//! `spes upcycle`: a dense Hugging Face checkpoint → a spes MoE checkpoint (docs/design/algorithm.md §7).
//! Embeddings, attention, norms and head are copied; every expert is a copy of the dense MLP
//! (gate → W1, up → V1, down → W2), optionally with noise on a random fraction of entries;
//! the router starts at zero or small normal values; optimizer state starts empty.
//!
//! Layouts: Llama and Mistral (pre-norm), Qwen2 (pre-norm, q/k/v biases), Qwen3 (pre-norm,
//! per-head QK-norm) and OLMo2 (norms on each sublayer's output, full QK-norm); each maps onto
//! a spes model variant with exactly the same function.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use spes_model::{ModelConfig, MoeModel, NormPlacement, QkNorm};
use spes_train::checkpoint::{self, TrainState};
use spes_train::{RunConfig, SyncConfig, TrainConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// How the router of the new MoE starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterInit {
    Zeros,
    /// Normal with this standard deviation.
    Normal(f64),
}

pub struct UpcycleOptions {
    /// A Hugging Face folder: config.json + model.safetensors (or a sharded index).
    pub from: PathBuf,
    pub experts: usize,
    pub top_k: usize,
    pub normalize_topk: bool,
    pub noise_std: f64,
    pub noise_fraction: f64,
    pub router: RouterInit,
    pub seed: u64,
    /// Output: a new spes checkpoint directory (model, empty optimizer, state.json).
    pub out: PathBuf,
    /// `data.path` recorded in the checkpoint's config (a `spes tokenize` directory).
    pub data: PathBuf,
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// The spes shapes of a dense config.json (Llama/Mistral/Qwen3).
pub fn model_config(
    hf: &Value,
    experts: usize,
    top_k: usize,
    normalize_topk: bool,
) -> Result<ModelConfig> {
    let kind = hf["model_type"].as_str().unwrap_or("");
    let (qk_norm, norm_placement, qkv_bias) = match kind {
        "llama" | "mistral" => (QkNorm::None, NormPlacement::Pre, false),
        "qwen2" => (QkNorm::None, NormPlacement::Pre, true),
        "qwen3" => (QkNorm::PerHead, NormPlacement::Pre, false),
        "olmo2" => (QkNorm::Full, NormPlacement::Post, false),
        other => bail!(
            "config.json model_type `{other}` is not supported; expected llama, mistral, qwen2, qwen3 or olmo2"
        ),
    };
    if hf["attention_bias"].as_bool() == Some(true) || hf["mlp_bias"].as_bool() == Some(true) {
        bail!("this checkpoint has attention_bias/mlp_bias on every projection, which spes models do not");
    }
    let scaling = &hf["rope_scaling"];
    let scaled =
        scaling.is_object() && scaling["rope_type"].as_str().unwrap_or("default") != "default";
    if scaled {
        bail!("rope_scaling {scaling} is not supported; spes uses plain RoPE");
    }
    let get = |k: &str| -> Result<usize> {
        hf[k]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("config.json: missing integer `{k}`"))
    };
    let (d, heads) = (get("hidden_size")?, get("num_attention_heads")?);
    let theta = hf["rope_theta"]
        .as_f64()
        .or_else(|| hf["rope_parameters"]["rope_theta"].as_f64())
        .unwrap_or(10_000.0);
    let cfg = ModelConfig {
        vocab_size: get("vocab_size")?,
        d_model: d,
        n_layers: get("num_hidden_layers")?,
        n_heads: heads,
        n_kv_heads: hf["num_key_value_heads"]
            .as_u64()
            .map_or(heads, |v| v as usize),
        head_dim: hf["head_dim"].as_u64().map_or(d / heads, |v| v as usize),
        n_experts: experts,
        top_k,
        expert_hidden: get("intermediate_size")?,
        context_length: hf["max_position_embeddings"].as_u64().unwrap_or(2048) as usize,
        rope_theta: theta,
        qk_norm,
        normalize_topk,
        norm_eps: hf["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        init_std: hf["initializer_range"].as_f64().unwrap_or(0.02),
        norm_placement,
        qkv_bias,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// All tensors of an HF folder (single file or sharded), as fp32 CPU tensors.
fn read_weights(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let single = dir.join("model.safetensors");
    let files: Vec<PathBuf> = if single.exists() {
        vec![single]
    } else {
        let index = read_json(&dir.join("model.safetensors.index.json"))?;
        let mut files: Vec<String> = index["weight_map"]
            .as_object()
            .context("model.safetensors.index.json has no weight_map")?
            .values()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        files.sort();
        files.dedup();
        files.into_iter().map(|f| dir.join(f)).collect()
    };
    let mut out = HashMap::new();
    for f in files {
        for (name, t) in
            Tensor::read_safetensors(&f).with_context(|| format!("cannot read {}", f.display()))?
        {
            out.insert(name, t.to_kind(Kind::Float));
        }
    }
    Ok(out)
}

/// Builds the MoE checkpoint and returns its directory.
pub fn upcycle(o: &UpcycleOptions) -> Result<PathBuf> {
    if o.noise_fraction < 0.0 || o.noise_fraction > 1.0 || o.noise_std < 0.0 {
        bail!("--noise-fraction must be in [0, 1] and --noise-std >= 0");
    }
    let hf = read_json(&o.from.join("config.json"))?;
    let cfg = model_config(&hf, o.experts, o.top_k, o.normalize_topk)?;
    let dense = read_weights(&o.from)?;
    let take = |name: &str| -> Result<Tensor> {
        dense
            .get(name)
            .map(|t| t.shallow_clone())
            .with_context(|| format!("{}: missing tensor `{name}`", o.from.display()))
    };
    tch::manual_seed(o.seed as i64);
    let model = MoeModel::new(&cfg, Device::Cpu)?;
    let mut named: Vec<(String, Tensor)> = Vec::new();
    for p in model.params() {
        let name = p.name.clone();
        let t = if let Some(rest) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once(".mlp.experts."))
        {
            let (layer, tail) = rest;
            let part = tail.split('.').nth(1).context("expert tensor name")?;
            let dense_mlp = take(&format!("model.layers.{layer}.mlp.{part}.weight"))?;
            let noisy = o.noise_std > 0.0 && o.noise_fraction > 0.0;
            if noisy {
                let mask = dense_mlp
                    .rand_like()
                    .lt(o.noise_fraction)
                    .to_kind(Kind::Float);
                &dense_mlp + dense_mlp.randn_like() * o.noise_std * mask
            } else {
                dense_mlp.copy()
            }
        } else if name.ends_with(".mlp.gate.weight") {
            match o.router {
                RouterInit::Zeros => p.tensor.zeros_like(),
                RouterInit::Normal(std) => p.tensor.randn_like() * std,
            }
        } else if name == "lm_head.weight" && !dense.contains_key("lm_head.weight") {
            take("model.embed_tokens.weight")?.copy() // tied embeddings become an untied head
        } else {
            take(&name)?
        };
        named.push((name, t.detach()));
    }
    model.load(&named, &o.from.display().to_string())?;

    let run = RunConfig {
        model: cfg.clone(),
        data: spes_train::config::DataConfig {
            path: o.data.clone(),
            sources: Vec::new(),
            partition: Default::default(),
            share: Default::default(),
        },
        train: TrainConfig {
            seq_len: cfg.context_length.min(2048),
            seed: o.seed,
            ..TrainConfig::default()
        },
        sync: SyncConfig::default(),
        derived: Vec::new(),
    };
    let state = TrainState::fresh(run);
    let tensors: Vec<(String, Tensor)> = model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor))
        .collect();
    if o.out.exists() {
        bail!("{} already exists; choose a new --out", o.out.display());
    }
    // Written as a checkpoint root's step-0, then moved into place whole.
    let root = o.out.with_extension("upcycle-tmp");
    let _ = std::fs::remove_dir_all(&root);
    let dir = checkpoint::save(&root, state, &tensors, &[], 1)?;
    std::fs::rename(&dir, &o.out).with_context(|| format!("cannot create {}", o.out.display()))?;
    std::fs::remove_dir_all(&root)?;
    Ok(o.out.clone())
}
