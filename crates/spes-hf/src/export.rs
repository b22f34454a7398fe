//! `spes export-hf`: a spes checkpoint → a Hugging Face model folder that `transformers` loads
//! with `AutoModelForCausalLM.from_pretrained` and no custom code.
//!
//! | spes model | transformers class |
//! |---|---|
//! | `qk_norm = "full"`, `n_heads·head_dim = d_model` (the OLMoE presets) | `OlmoeForCausalLM` |
//! | `qk_norm = "per_head"` (the 9B / Qwen3 layout) | `Qwen3MoeForCausalLM` |
//! | `qk_norm = "full"`, `norm_placement = "post"` (upcycled OLMo2) | `FlexOlmoForCausalLM` |
//!
//! spes already names tensors as these classes' checkpoints do, so tensors are copied as they
//! are (or rounded to bf16), shard by shard: memory stays around twice the shard size.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, View};
use serde::Serialize;
use serde_json::{json, Value};
use spes_data::shard::write_atomic;
use spes_model::{ModelConfig, NormPlacement, QkNorm};
use spes_train::checkpoint;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Element type of the exported weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    Fp32,
    Bf16,
}

pub struct ExportOptions {
    /// A spes checkpoint directory (`model.safetensors` + `state.json`).
    pub checkpoint: PathBuf,
    pub out: PathBuf,
    pub dtype: ExportDtype,
    /// Largest shard; a larger model is split into `model-0000i-of-0000n.safetensors`.
    pub max_shard_bytes: u64,
    /// tokenizer.json to ship; default: the one of the checkpoint's training data.
    pub tokenizer: Option<PathBuf>,
}

/// What an export wrote.
#[derive(Debug, Serialize)]
pub struct ExportSummary {
    pub architecture: String,
    pub shards: usize,
    pub total_bytes: u64,
    pub tokenizer: bool,
}

/// The transformers config for a spes model, or why none of the standard classes fits.
pub fn hf_config(
    m: &ModelConfig,
    max_positions: usize,
    eos: Option<u32>,
    dtype: ExportDtype,
) -> Result<Value> {
    let torch_dtype = match dtype {
        ExportDtype::Fp32 => "float32",
        ExportDtype::Bf16 => "bfloat16",
    };
    let common = json!({
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": false,
        "attention_dropout": 0.0,
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.normalize_topk,
        "output_router_logits": false,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": false,
        "initializer_range": m.init_std,
        "use_cache": true,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "bos_token_id": null,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    });
    if m.qkv_bias {
        bail!("no standard transformers MoE class has q/k/v biases without a shared expert (Qwen2 layout); such models train and evaluate in spes but cannot be exported");
    }
    let post = m.norm_placement == NormPlacement::Post;
    let specific = match m.qk_norm {
        QkNorm::Full if post && m.n_heads * m.head_dim == m.d_model => json!({
            "architectures": ["FlexOlmoForCausalLM"],
            "model_type": "flex_olmo",
            "intermediate_size": m.expert_hidden,
        }),
        QkNorm::PerHead | QkNorm::None if post => {
            bail!("post-norm models export only with qk_norm = \"full\" (FlexOlmo)")
        }
        QkNorm::Full if m.n_heads * m.head_dim == m.d_model => json!({
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "intermediate_size": m.expert_hidden,
            "clip_qkv": null,
        }),
        QkNorm::Full => bail!(
            "OLMoE derives head_dim from d_model/n_heads; this model has head_dim {} with d_model {} and {} heads",
            m.head_dim,
            m.d_model,
            m.n_heads
        ),
        QkNorm::PerHead => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": m.head_dim,
            "intermediate_size": m.expert_hidden,
            "moe_intermediate_size": m.expert_hidden,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "sliding_window": null,
        }),
        QkNorm::None => bail!(
            "no standard transformers MoE class matches qk_norm = \"none\" with these tensors; \
             export supports qk_norm = \"full\" (OLMoE) and \"per_head\" (Qwen3-MoE)"
        ),
    };
    let mut cfg = common;
    for (k, v) in specific.as_object().expect("object") {
        cfg[k] = v.clone();
    }
    Ok(cfg)
}

/// A tensor of an output shard.
struct OutTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &OutTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// A checkpoint tensor: name, shape and byte range in the file.
struct SourceTensor {
    name: String,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// Every checkpoint tensor (all fp32), sorted by name.
fn tensor_index(path: &Path) -> Result<Vec<SourceTensor>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: read-only map of a checkpoint file that is not modified while we read it.
    let map = unsafe { Mmap::map(&file) }?;
    let st = safetensors::SafeTensors::deserialize(&map)
        .map_err(|e| anyhow::anyhow!("{} is not valid safetensors: {e:?}", path.display()))?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
        .map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
    let infos = meta.tensors();
    let mut out = Vec::new();
    for name in st.names() {
        let info = infos[name.as_str()];
        if info.dtype != Dtype::F32 {
            bail!(
                "{}: tensor `{name}` is {:?}, expected F32",
                path.display(),
                info.dtype
            );
        }
        let base = 8 + header_len;
        out.push(SourceTensor {
            name: name.clone(),
            shape: info.shape.clone(),
            start: base + info.data_offsets.0,
            end: base + info.data_offsets.1,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Writes the model folder and returns what it holds.
pub fn export(o: &ExportOptions) -> Result<ExportSummary> {
    let state = checkpoint::read_state(&o.checkpoint)?;
    if !state.files.contains_key(checkpoint::MODEL_FILE) {
        anyhow::bail!(
            "{} holds no model: a SPES node's mid-run checkpoints leave the weights to the \
             server; export the node's last checkpoint (step = train.max_steps)",
            o.checkpoint.display()
        );
    }
    let cfg = &state.config;
    let manifest = spes_data::Manifest::load(cfg.data.primary()).ok();
    let eos = manifest.as_ref().map(|m| m.eos_id);
    let hf = hf_config(&cfg.model, cfg.train.seq_len, eos, o.dtype)?;
    std::fs::create_dir_all(&o.out)
        .with_context(|| format!("cannot create {}", o.out.display()))?;

    let source = o.checkpoint.join(checkpoint::MODEL_FILE);
    let index = tensor_index(&source)?;
    let out_bytes = |n: usize| match o.dtype {
        ExportDtype::Fp32 => n as u64,
        ExportDtype::Bf16 => n as u64 / 2,
    };
    // Greedy sharding in name order.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in index.iter().enumerate() {
        let n = out_bytes(t.end - t.start);
        if size > 0 && size + n > o.max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().unwrap().push(i);
        size += n;
    }
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (s, members) in shards.iter().enumerate() {
        let name = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, count)
        };
        let file = std::fs::File::open(&source)?;
        // SAFETY: as in `tensor_index`; mapped per shard so pages leave RSS once copied.
        let map = unsafe { Mmap::map(&file) }?;
        let mut tensors = Vec::with_capacity(members.len());
        for &i in members {
            let src = &index[i];
            let bytes = &map[src.start..src.end];
            let (dtype, data) = match o.dtype {
                ExportDtype::Fp32 => (Dtype::F32, bytes.to_vec()),
                ExportDtype::Bf16 => (
                    Dtype::BF16,
                    bytes
                        .chunks_exact(4)
                        .flat_map(|c| {
                            let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                            half::bf16::from_f32(x).to_le_bytes()
                        })
                        .collect(),
                ),
            };
            total += data.len() as u64;
            weight_map.insert(src.name.clone(), name.clone());
            let shape = src.shape.clone();
            tensors.push((src.name.clone(), OutTensor { dtype, shape, data }));
        }
        drop(map);
        let path = o.out.join(&name);
        let tmp = o.out.join(format!("{name}.tmp"));
        let meta = Some(
            [("format".to_string(), "pt".to_string())]
                .into_iter()
                .collect(),
        );
        safetensors::tensor::serialize_to_file(
            tensors.iter().map(|(n, t)| (n.as_str(), t)),
            &meta,
            &tmp,
        )
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e:?}", tmp.display()))?;
        std::fs::rename(&tmp, &path)?;
    }
    if count > 1 {
        let idx = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_atomic(
            &o.out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&idx)?.as_bytes(),
        )?;
    }
    write_atomic(
        &o.out.join("config.json"),
        serde_json::to_string_pretty(&hf)?.as_bytes(),
    )?;
    let generation = json!({"eos_token_id": eos, "pad_token_id": eos, "do_sample": false});
    write_atomic(
        &o.out.join("generation_config.json"),
        serde_json::to_string_pretty(&generation)?.as_bytes(),
    )?;

    let tokenizer = o.tokenizer.clone().or_else(|| {
        let m = manifest.as_ref()?;
        Some(cfg.data.primary().join(&m.tokenizer))
    });
    let shipped = match tokenizer {
        Some(t) if t.exists() => {
            std::fs::copy(&t, o.out.join("tokenizer.json"))
                .with_context(|| format!("cannot copy {}", t.display()))?;
            let eos_token = manifest.as_ref().and_then(|m| eos_name(&t, m.eos_id));
            let tc = json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos_token,
                "pad_token": eos_token,
                "model_max_length": cfg.train.seq_len,
                "clean_up_tokenization_spaces": false,
            });
            write_atomic(
                &o.out.join("tokenizer_config.json"),
                serde_json::to_string_pretty(&tc)?.as_bytes(),
            )?;
            true
        }
        _ => {
            tracing::warn!("no tokenizer found for this checkpoint; pass --tokenizer to ship one");
            false
        }
    };
    Ok(ExportSummary {
        architecture: hf["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        shards: count,
        total_bytes: total,
        tokenizer: shipped,
    })
}

/// The string of token `id` in a tokenizer.json's added tokens or vocabulary.
fn eos_name(tokenizer: &Path, id: u32) -> Option<String> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(tokenizer).ok()?).ok()?;
    let added = v["added_tokens"].as_array()?;
    if let Some(t) = added.iter().find(|t| t["id"].as_u64() == Some(id as u64)) {
        return t["content"].as_str().map(str::to_owned);
    }
    let vocab = v["model"]["vocab"].as_object()?;
    vocab
        .iter()
        .find(|(_, i)| i.as_u64() == Some(id as u64))
        .map(|(k, _)| k.clone())
}
