//! `spes bench step`: tokens/s and peak memory of training steps of a preset on random tokens.

use crate::config::{MoeKernelChoice, Precision, TrainConfig};
use crate::optim::AdamW;
use crate::process;
use crate::trainer::{compute_kind, frozen_experts_bf16, moe_kernel, step_on_batches, StepOptions};
use anyhow::Result;
use serde::Serialize;
use spes_model::{LossWeights, ModelConfig, MoeKernel, MoeModel, Role};
use tch::{Device, Kind, Tensor};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub model: ModelConfig,
    pub device: Device,
    pub precision: Precision,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Timed steps, after `warmup` untimed ones.
    pub steps: usize,
    pub warmup: usize,
    /// Experts per layer this process trains (SPES node); `None` trains all of them.
    pub own_experts: Option<usize>,
    /// Recompute blocks during backward (`train.activation_checkpointing`).
    pub activation_checkpointing: bool,
    /// How MoE layers run their experts (`train.moe_kernel`).
    pub moe_kernel: MoeKernelChoice,
    /// Frozen experts resident in bf16 (`train.frozen_experts_bf16`; unset: on for CUDA).
    pub frozen_experts_bf16: Option<bool>,
    /// Before timing, run one batch through both MoE kernels and report how far apart
    /// their losses and gradients are.
    pub compare_moe_kernels: bool,
    /// Before timing, run one batch with the step's compute copies and with per-matmul casts
    /// ([`MoeModel::begin_step`]) and report how far apart they are.
    pub compare_step_paths: bool,
    /// Count the timed steps' top-level ATen operator calls by phase.
    pub count_ops: bool,
    /// Before timing, run one batch with the LM head's gradient accumulated inside its
    /// product (fp32 output, CUDA bf16) and as each chunk's product added, and report how far
    /// apart they are.
    pub compare_head: bool,
}

/// One benchmark result row.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub total_params: u64,
    pub trainable_params: u64,
    pub optimizer_state_bytes: u64,
    pub tokens_per_step: u64,
    pub step_ms: f64,
    /// Median time of the optimizer alone (clip, AdamW update, zeroing), included in `step_ms`.
    pub optimizer_ms: f64,
    pub tokens_per_s: f64,
    /// Peak resident set size of this process (VmHWM).
    pub peak_rss_mb: f64,
    /// Resident set size once libtorch's kernels have run (a miniature model's training step,
    /// before this benchmark's tensors): what `spes plan memory` calls the runtime on CPU.
    pub runtime_rss_mb: f64,
    /// Where the device memory figures come from: `"cuda_caching_allocator"` (the allocator's
    /// own statistics, peaks since the model was built) or `"rss"` (a CPU has no device
    /// allocator: its memory is the process's, `peak_rss_mb`).
    pub device_memory_source: &'static str,
    /// CUDA: the most the tensors took at once, and the most the allocator held from the
    /// driver (what `nvidia-smi` shows), in MiB; `None` on CPU.
    pub device_peak_allocated_mb: Option<f64>,
    pub device_peak_reserved_mb: Option<f64>,
    /// With `compare_moe_kernels`: the grouped kernel against the loop on one batch.
    pub moe_kernels: Option<KernelDiff>,
    /// With `compare_step_paths`: the step's compute copies against per-matmul casts.
    pub step_paths: Option<KernelDiff>,
    /// With `compare_head`: the head's fused fp32 accumulation against its CPU twin's.
    pub head_paths: Option<KernelDiff>,
    /// With `count_ops`: top-level ATen calls per optimizer step, by phase.
    pub op_counts: Option<StepOps>,
}

/// Top-level ATen operator calls per optimizer step, by phase (`spes_ext::count`).
#[derive(Clone, Debug, Serialize)]
pub struct StepOps {
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
    /// Compute copies of the weights and moving their gradients to the masters.
    pub bookkeeping: f64,
    /// Unmarked: making the batch, reading the losses back.
    pub other: f64,
}

impl StepOps {
    /// Calls outside forward and backward: optimizer, bookkeeping and the rest.
    pub fn outside_forward_backward(&self) -> f64 {
        self.optimizer + self.bookkeeping + self.other
    }
}

/// How far two ways of computing one batch are apart (b against a).
#[derive(Clone, Debug, Serialize)]
pub struct KernelDiff {
    /// |loss_b − loss_a| / |loss_a|.
    pub loss_rel: f64,
    /// The largest, over trainable tensors, of max|g_b − g_a| / max|g_a|.
    pub grad_rel: f64,
}

/// Runs the benchmark in this process; peak RSS covers everything the process did before too.
pub fn bench(o: &BenchOptions) -> Result<BenchResult> {
    let runtime_rss_mb = runtime_rss_mb(o)?;
    let cuda = match o.device {
        Device::Cuda(i) => Some(i),
        _ => None,
    };
    if let Some(i) = cuda {
        spes_ext::reset_peak_memory(i)?;
    }
    tch::manual_seed(0);
    let mut model = MoeModel::new(&o.model, o.device)?;
    model.set_compute_kind(compute_kind(o.precision, o.device));
    model.set_moe_kernel(moe_kernel(
        o.moe_kernel,
        o.device,
        compute_kind(o.precision, o.device),
    ));
    model.set_frozen_experts_bf16(frozen_experts_bf16(o.frozen_experts_bf16, o.device));
    let own = o.own_experts;
    model.set_trainable(|r| match (r, own) {
        (Role::Expert { index, .. }, Some(n)) => index < n,
        _ => true,
    });
    let t = TrainConfig::default();
    let mut opt = AdamW::new(model.trainable_params(), &t);
    let step = StepOptions {
        checkpoint: o.activation_checkpointing,
        ..StepOptions::from_config(&t)
    };
    let vocab = o.model.vocab_size as i64;
    let shape = [o.batch_size as i64, o.seq_len as i64 + 1];
    let moe_kernels = o
        .compare_moe_kernels
        .then(|| {
            let batch = Tensor::randint(vocab, shape, (Kind::Int64, o.device));
            let d = compare_moe_kernels(&mut model, &batch, &step.weights);
            model.set_moe_kernel(moe_kernel(
                o.moe_kernel,
                o.device,
                compute_kind(o.precision, o.device),
            ));
            d
        })
        .transpose()?;
    let step_paths = o
        .compare_step_paths
        .then(|| {
            let batch = Tensor::randint(vocab, shape, (Kind::Int64, o.device));
            compare_step_paths(&model, &batch, &step.weights)
        })
        .transpose()?;
    let head_paths = o
        .compare_head
        .then(|| {
            let batch = Tensor::randint(vocab, shape, (Kind::Int64, o.device));
            model.set_fused_head_accumulate(false);
            model.begin_step();
            let (a, ga) = loss_and_grads(&model, &batch, &step.weights);
            model.set_fused_head_accumulate(true);
            let (b, gb) = loss_and_grads(&model, &batch, &step.weights);
            model.end_step();
            diff(a, &ga, b, &gb, "a head path")
        })
        .transpose()?;
    let mut timed = Vec::new();
    for i in 0..o.warmup + o.steps {
        if o.count_ops && i == o.warmup {
            spes_ext::count::start()?;
        }
        let batch = Tensor::randint(vocab, shape, (Kind::Int64, o.device));
        let s = step_on_batches(&model, &mut opt, &step, None, 1e-4, &[batch])?;
        if i >= o.warmup {
            timed.push(s.seconds);
        }
    }
    let op_counts = if o.count_ops {
        spes_ext::count::stop()?;
        let c = spes_ext::count::counts();
        let per_step = |p| c.of(p) as f64 / o.steps as f64;
        use spes_ext::count::Phase;
        Some(StepOps {
            forward: per_step(Phase::Forward),
            backward: per_step(Phase::Backward),
            optimizer: per_step(Phase::Optimizer),
            bookkeeping: per_step(Phase::Bookkeeping),
            other: per_step(Phase::Other),
        })
    } else {
        None
    };
    let median = median(timed);
    let optimizer_ms = 1e3 * optimizer_seconds(&model, &mut opt, &step.weights, o)?;
    let tokens = (o.batch_size * o.seq_len) as u64;
    let params = model.params();
    let trainable = model.trainable_params();
    let device = cuda.map(spes_ext::device_memory).transpose()?;
    let mb = |bytes: i64| bytes as f64 / (1u64 << 20) as f64;
    Ok(BenchResult {
        total_params: params.iter().map(|p| p.tensor.numel() as u64).sum(),
        trainable_params: trainable.iter().map(|p| p.tensor.numel() as u64).sum(),
        optimizer_state_bytes: opt.state_bytes(),
        tokens_per_step: tokens,
        step_ms: median * 1e3,
        optimizer_ms,
        tokens_per_s: tokens as f64 / median,
        peak_rss_mb: process::peak_rss_mb(std::process::id()),
        runtime_rss_mb,
        device_memory_source: if device.is_some() {
            "cuda_caching_allocator"
        } else {
            "rss"
        },
        device_peak_allocated_mb: device.map(|d| mb(d.peak_allocated)),
        device_peak_reserved_mb: device.map(|d| mb(d.peak_reserved)),
        moe_kernels,
        step_paths,
        head_paths,
        op_counts,
    })
}

/// The loss of one forward and backward of `batch` and the gradients it left (cleared after).
fn loss_and_grads(model: &MoeModel, batch: &Tensor, weights: &LossWeights) -> (f64, Vec<Tensor>) {
    let loss = model
        .backward(batch, weights, 1.0, false)
        .total
        .double_value(&[]);
    let grads: Vec<Tensor> = model
        .trainable_params()
        .iter()
        .map(|p| {
            let g = p.tensor.grad();
            if !g.defined() {
                // No token reached this expert.
                return p.tensor.zeros_like();
            }
            let copy = g.copy();
            let _ = g.shallow_clone().zero_();
            copy
        })
        .collect();
    (loss, grads)
}

/// One forward and backward of `batch` with each MoE kernel; gradients are cleared after.
fn compare_moe_kernels(
    model: &mut MoeModel,
    batch: &Tensor,
    weights: &LossWeights,
) -> Result<KernelDiff> {
    model.set_moe_kernel(MoeKernel::Loop);
    let (a, ga) = loss_and_grads(model, batch, weights);
    model.set_moe_kernel(MoeKernel::Grouped);
    let (b, gb) = loss_and_grads(model, batch, weights);
    diff(a, &ga, b, &gb, "a MoE kernel")
}

/// One forward and backward of `batch` with per-matmul casts, then with the step's compute
/// copies (bf16 copies made once, q/k/v and gate/up fused); gradients are cleared after.
fn compare_step_paths(
    model: &MoeModel,
    batch: &Tensor,
    weights: &LossWeights,
) -> Result<KernelDiff> {
    let (a, ga) = loss_and_grads(model, batch, weights);
    model.begin_step();
    let (b, gb) = loss_and_grads(model, batch, weights);
    model.end_step();
    diff(a, &ga, b, &gb, "a step path")
}

/// How far `b`'s loss and gradients are from `a`'s.
fn diff(a: f64, ga: &[Tensor], b: f64, gb: &[Tensor], what: &str) -> Result<KernelDiff> {
    let grad_rel = ga
        .iter()
        .zip(gb)
        .map(|(x, y)| {
            let scale = x.abs().max().double_value(&[]).max(1e-30);
            (x - y).abs().max().double_value(&[]) / scale
        })
        .fold(0.0, f64::max);
    if !(a.is_finite() && b.is_finite()) {
        anyhow::bail!("{what} gave a non-finite loss: {a} and {b}");
    }
    Ok(KernelDiff {
        loss_rel: (a - b).abs() / a.abs().max(1e-30),
        grad_rel,
    })
}

/// VmRSS after one training step of a miniature model of the same kind on the same device:
/// the process and libtorch with its thread pools and kernels' own buffers initialised.
fn runtime_rss_mb(o: &BenchOptions) -> Result<f64> {
    let cfg = ModelConfig {
        vocab_size: 256,
        d_model: 64,
        n_layers: 1,
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 32,
        n_experts: 4,
        top_k: o.model.top_k.min(4),
        expert_hidden: 64,
        ..o.model.clone()
    };
    {
        let mut model = MoeModel::new(&cfg, o.device)?;
        model.set_compute_kind(compute_kind(o.precision, o.device));
        model.set_moe_kernel(moe_kernel(
            o.moe_kernel,
            o.device,
            compute_kind(o.precision, o.device),
        ));
        model.set_trainable(|_| true);
        let t = TrainConfig::default();
        let mut opt = AdamW::new(model.trainable_params(), &t);
        let batch = Tensor::randint(256, [2, 33], (Kind::Int64, o.device));
        step_on_batches(
            &model,
            &mut opt,
            &StepOptions::from_config(&t),
            None,
            1e-4,
            &[batch],
        )?;
    }
    Ok(process::rss_mb(std::process::id()))
}

/// The middle value (the upper one of an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Median seconds of the optimizer's part of a step, timed apart from forward and backward
/// (with a device sync on CUDA, where kernels run asynchronously).
fn optimizer_seconds(
    model: &MoeModel,
    opt: &mut AdamW,
    weights: &LossWeights,
    o: &BenchOptions,
) -> Result<f64> {
    let shape = [o.batch_size as i64, o.seq_len as i64 + 1];
    let batch = Tensor::randint(o.model.vocab_size as i64, shape, (Kind::Int64, o.device));
    model.backward(&batch, weights, 1.0, o.activation_checkpointing);
    let sync = || {
        if let Device::Cuda(i) = o.device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    let mut times = Vec::new();
    for _ in 0..o.steps.max(3) {
        sync();
        let start = std::time::Instant::now();
        let _ = opt.clip_grad_norm(1.0)?;
        opt.step(1e-4)?;
        opt.zero_grad()?;
        sync();
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// The best FLOP/s of a square matmul in `kind` on `device` over a few tries (n = 2048 on
/// CPU, 8192 on CUDA): the peak that MFU figures are measured against.
pub fn matmul_peak_flops(device: Device, kind: Kind) -> f64 {
    let n: i64 = if device.is_cuda() { 8192 } else { 2048 };
    let a = Tensor::randn([n, n], (kind, device));
    let b = Tensor::randn([n, n], (kind, device));
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    let _ = a.matmul(&b);
    let mut best = f64::INFINITY;
    for _ in 0..if device.is_cuda() { 20 } else { 4 } {
        sync();
        let start = std::time::Instant::now();
        let _ = a.matmul(&b);
        sync();
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * (n as f64).powi(3) / best
}
