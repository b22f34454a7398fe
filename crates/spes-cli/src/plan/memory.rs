//! `spes plan memory`: what one rank of a node needs in memory (spes-train's `memory_plan`),
//! by category, with and without activation checkpointing, whether it fits a card, and the
//! largest micro-batch that does.

use anyhow::{bail, Result};
use spes_model::ModelConfig;
use spes_train::memory_plan::{
    experts_that_fit, largest_micro_batch, plan, MemoryInput, MemoryPlan,
};
use spes_train::trainer::UnionEstimate;
use spes_train::{Mode, Precision, RunConfig};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A run config: its model, sync.nodes and mode, batch_size, seq_len, precision.
    #[arg(long, conflicts_with = "preset")]
    config: Option<PathBuf>,
    /// A built-in preset instead of a config.
    #[arg(long)]
    preset: Option<String>,
    /// Nodes of the SPES run (each trains n_experts / nodes experts per layer).
    #[arg(long)]
    nodes: Option<usize>,
    /// Every node trains every expert (DiLoCo, or centralized with --nodes 1).
    #[arg(long)]
    diloco: bool,
    /// Data-parallel ranks per node (`--local-ranks`): the AdamW moments are split among them.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Memory of one device in GiB.
    #[arg(long)]
    gpu_mem: f64,
    /// Sequences per micro-batch (default: the config's batch_size, or 1).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Tokens per sequence (default: the config's seq_len, or the model's context length).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Matmul precision: bf16 (mixed precision, the default on CUDA) or fp32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp32"])]
    precision: String,
    /// MoE kernel: auto (grouped with bf16, as on CUDA; the loop with fp32, as on CPU), loop
    /// or grouped.
    #[arg(long, default_value = "auto", value_parser = ["auto", "loop", "grouped"])]
    moe_kernel: String,
    /// Frozen experts on the device: auto (bf16 with bf16 matmuls, as
    /// `train.frozen_experts_bf16` is on CUDA; their fp32 masters in host memory), bf16 or fp32.
    #[arg(long, default_value = "auto", value_parser = ["auto", "bf16", "fp32"])]
    frozen_experts: String,
    /// What a node's second moment is fed (`train.second_moment`; default: the config's, or
    /// as the rule chooses, union_estimate with --nodes above 1): union_estimate keeps two
    /// more fp32 values per averaged tensor.
    #[arg(long, value_parser = ["own", "union_estimate"])]
    second_moment: Option<String>,
    /// GiB in use before the first tensor: CUDA context, cuBLAS/cuDNN workspaces, kernels.
    #[arg(long, default_value_t = 1.0)]
    runtime_gb: f64,
    /// Headroom for the allocator's fragmentation, as a fraction of the rest (0.1: 10 %).
    #[arg(long, default_value_t = 0.1)]
    slack: f64,
    /// Print the plans as JSON.
    #[arg(long)]
    json: bool,
}

/// A table row: its label and the plan's bytes for it.
type Row = (&'static str, fn(&MemoryPlan) -> u64);

const GIB: f64 = (1u64 << 30) as f64;

/// The planner's input from the arguments (and config).
fn input(a: &Args) -> Result<MemoryInput> {
    let cfg = match &a.config {
        Some(path) => Some(RunConfig::load(path, &[])?),
        None => None,
    };
    let model = match (&cfg, &a.preset) {
        (Some(c), _) => c.model.clone(),
        (None, Some(p)) => ModelConfig::preset(p)?,
        (None, None) => bail!("give --config or --preset"),
    };
    let nodes = a
        .nodes
        .or(cfg.as_ref().map(|c| c.sync.nodes))
        .unwrap_or(1)
        .max(1);
    let all = a.diloco || cfg.as_ref().is_some_and(|c| c.sync.mode != Mode::Spes);
    if !all && nodes > model.n_experts {
        bail!(
            "--nodes {nodes}: a SPES node owns at least one expert, and the model has {}",
            model.n_experts
        );
    }
    let compute_bytes = match (
        a.precision.as_str(),
        cfg.as_ref().map(|c| c.train.precision),
    ) {
        (_, Some(Precision::Fp32)) | ("fp32", None) => 4,
        _ => 2,
    };
    Ok(MemoryInput {
        own_experts: if all {
            model.n_experts
        } else {
            model.n_experts.div_ceil(nodes)
        },
        ranks: a.ranks.max(1),
        micro_batch: a
            .micro_batch
            .or(cfg.as_ref().map(|c| c.train.batch_size))
            .unwrap_or(1),
        seq_len: a
            .seq_len
            .or(cfg.as_ref().map(|c| c.train.seq_len))
            .unwrap_or(model.context_length),
        compute_bytes,
        activation_checkpointing: false,
        grouped_experts: match a.moe_kernel.as_str() {
            "auto" => compute_bytes == 2,
            kernel => kernel == "grouped",
        },
        frozen_bf16: match a.frozen_experts.as_str() {
            "auto" => compute_bytes == 2,
            f => f == "bf16",
        },
        estimate: match (a.second_moment.as_deref(), &cfg) {
            (Some("union_estimate"), _) => Some(UnionEstimate {
                nodes,
                experts: all,
            }),
            (Some(_), _) => None,
            (None, Some(c)) => UnionEstimate::of(c),
            (None, None) => (nodes > 1).then_some(UnionEstimate {
                nodes,
                experts: all,
            }),
        },
        logits_chunk: 1 << 26,
        runtime_bytes: (a.runtime_gb * GIB) as u64,
        slack: a.slack.max(0.0),
        model,
    })
}

pub fn run(a: Args) -> Result<()> {
    let base = input(&a)?;
    let budget = (a.gpu_mem * GIB) as u64;
    let variants: Vec<(bool, MemoryPlan, Option<usize>)> = [false, true]
        .into_iter()
        .map(|ckpt| {
            let i = MemoryInput {
                activation_checkpointing: ckpt,
                ..base.clone()
            };
            (ckpt, plan(&i), largest_micro_batch(&i, budget))
        })
        .collect();
    if a.json {
        let rows: Vec<serde_json::Value> = variants
            .iter()
            .map(|(ckpt, p, best)| {
                serde_json::json!({
                    "activation_checkpointing": ckpt, "plan": p, "total": p.total(),
                    "fits": p.total() <= budget, "largest_micro_batch": best,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let m = &base.model;
    println!(
        "{} experts per layer trained of {}, {} rank(s), micro-batch {} × {} tokens, {}, on a {} GiB device:\n",
        base.own_experts,
        m.n_experts,
        base.ranks,
        base.micro_batch,
        base.seq_len,
        if base.compute_bytes == 2 { "bf16 matmuls" } else { "fp32" },
        a.gpu_mem
    );
    let (plain, ckpt) = (&variants[0].1, &variants[1].1);
    println!("| GiB per rank | plain | activation checkpointing |");
    println!("|---|---|---|");
    let rows: [Row; 11] = [
        ("frozen expert weights", |p| p.frozen_weights),
        ("trainable weights (fp32)", |p| p.trainable_weights),
        ("AdamW moments", |p| p.adamw_moments),
        ("gradients", |p| p.gradients),
        (
            "weight copies (the step's bf16 copies; fp32 grouped: expert stacks)",
            |p| p.weight_copies,
        ),
        ("activations of a micro-batch", |p| p.activations),
        ("workspace (LM-head chunk, backward buffers)", |p| {
            p.workspace
        }),
        (
            "second-moment estimate (noise average, gradient copy)",
            |p| p.second_moment_estimate,
        ),
        ("runtime (CUDA context, kernels)", |p| p.runtime),
        ("allocator headroom", |p| p.slack),
        ("**total**", MemoryPlan::total),
    ];
    for (name, f) in rows {
        println!(
            "| {name} | {:.2} | {:.2} |",
            f(plain) as f64 / GIB,
            f(ckpt) as f64 / GIB
        );
    }
    if plain.host_frozen_masters > 0 {
        println!(
            "\nHost memory for the frozen experts' fp32 masters: {:.2} GiB.",
            plain.host_frozen_masters as f64 / GIB
        );
    }
    for (ckpt, p, best) in &variants {
        let how = if *ckpt { "with checkpointing" } else { "plain" };
        let fits = if p.total() <= budget {
            "fits"
        } else {
            "does NOT fit"
        };
        match best {
            Some(b) => println!(
                "{how}: {fits}; the largest micro-batch that fits is {b} × {} tokens",
                base.seq_len
            ),
            None => println!("{how}: {fits}; not even a micro-batch of 1 fits"),
        }
    }
    if !a.diloco && base.own_experts < m.n_experts {
        match experts_that_fit(&base, budget) {
            Ok(k) => println!(
                "\nExperts per layer a node can own in {} GiB (plain): {k}; with \
                 train.memory_gib = {} the server gives it no more.",
                a.gpu_mem, a.gpu_mem
            ),
            Err(one) => println!(
                "\nNo expert fits in {} GiB (plain): owning one needs {:.2} GiB.",
                a.gpu_mem,
                one as f64 / GIB
            ),
        }
    }
    Ok(())
}
