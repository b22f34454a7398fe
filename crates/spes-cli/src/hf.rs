//! `spes export-hf` and `spes upcycle`: to and from Hugging Face model folders (spes-hf).

use anyhow::Result;
use std::path::PathBuf;

/// Export a checkpoint as a Hugging Face model folder (OLMoE, Qwen3-MoE or FlexOlmo).
#[derive(clap::Args)]
pub struct ExportArgs {
    /// A spes checkpoint directory (model.safetensors + state.json).
    #[arg(long)]
    pub checkpoint: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    pub dtype: String,
    /// Largest shard in GB (10^9 bytes).
    #[arg(long, default_value_t = 5.0)]
    pub max_shard_gb: f64,
    /// tokenizer.json to ship (default: the one of the checkpoint's training data).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// `spes export-hf`: prints what it wrote.
pub fn export(a: ExportArgs) -> Result<()> {
    let ExportArgs {
        checkpoint,
        out,
        dtype,
        max_shard_gb,
        tokenizer,
    } = a;
    let summary = spes_hf::export(&spes_hf::ExportOptions {
        checkpoint,
        out,
        dtype: if dtype == "bf16" {
            spes_hf::ExportDtype::Bf16
        } else {
            spes_hf::ExportDtype::Fp32
        },
        max_shard_bytes: (max_shard_gb * 1e9) as u64,
        tokenizer,
    })?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}

/// Build a MoE checkpoint from a dense Hugging Face model (Llama, Mistral, Qwen2, Qwen3, OLMo2).
#[derive(clap::Args)]
pub struct UpcycleArgs {
    /// The dense model folder (config.json + safetensors).
    #[arg(long)]
    pub from: PathBuf,
    #[arg(long)]
    pub experts: usize,
    #[arg(long)]
    pub top_k: usize,
    /// Combine with the raw top-k probabilities instead of renormalising them.
    #[arg(long)]
    pub raw_topk: bool,
    #[arg(long, default_value_t = 0.0)]
    pub noise_std: f64,
    #[arg(long, default_value_t = 0.0)]
    pub noise_fraction: f64,
    #[arg(long, value_parser = ["zeros", "normal"], default_value = "zeros")]
    pub router: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokenized data (a `spes tokenize` directory made with the dense model's tokenizer).
    #[arg(long)]
    pub data: PathBuf,
    /// The checkpoint directory to create.
    #[arg(long)]
    pub out: PathBuf,
}

/// `spes upcycle`: prints the checkpoint directory it wrote.
pub fn upcycle(a: UpcycleArgs) -> Result<()> {
    let UpcycleArgs {
        from,
        experts,
        top_k,
        raw_topk,
        noise_std,
        noise_fraction,
        router,
        seed,
        data,
        out,
    } = a;
    let dir = spes_hf::upcycle(&spes_hf::UpcycleOptions {
        from,
        experts,
        top_k,
        normalize_topk: !raw_topk,
        noise_std,
        noise_fraction,
        router: if router == "normal" {
            spes_hf::RouterInit::Normal(0.02)
        } else {
            spes_hf::RouterInit::Zeros
        },
        seed,
        out,
        data,
    })?;
    println!("wrote {}", dir.display());
    Ok(())
}
