//! The training loop: micro-batches, clipping, AdamW, evaluation, metrics, checkpoints, resume.

pub mod lead;
mod second_moment;
mod step;
mod union;

pub use second_moment::UnionEstimate;
pub use step::{backward_batches, step_on_batches, Backward, StepOptions};

use crate::checkpoint::{self, TrainState};
use crate::config::{MoeKernelChoice, Precision, RunConfig};
use crate::data_parallel::DataParallel;
use crate::metrics::{MetricsLog, StepLosses, StepRecord};
use crate::optim::{lr_at, AdamW, Retarget};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use lead::Op;
use spes_data::{Loader, ValWindows};
use spes_model::{LossWeights, MoeKernel, MoeModel, Role};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// What one optimizer step measured.
#[derive(Clone, Debug)]
pub struct StepStats {
    pub losses: StepLosses,
    pub tokens: u64,
    pub seconds: f64,
    /// Training tokens drawn from each `[data]` source so far; empty for a single source.
    pub source_tokens: Vec<u64>,
}

impl StepStats {
    /// The `metrics.jsonl` record of this step: `tokens` so far and the measured `tokens_per_s`.
    pub fn record(&self, step: u64, tokens: u64, tokens_per_s: f64) -> StepRecord {
        StepRecord {
            step,
            losses: Some(self.losses.clone()),
            tokens,
            tokens_per_s: Some(tokens_per_s),
            source_tokens: self.source_tokens.clone(),
            ..StepRecord::default()
        }
    }
}

/// A model, its optimizer over the trainable tensors, and the data stream.
pub struct Trainer {
    pub cfg: RunConfig,
    pub model: MoeModel,
    pub opt: AdamW,
    pub device: Device,
    pub(crate) loader: Loader,
    val: ValWindows,
    /// Optimizer steps done.
    pub step: u64,
    /// Training tokens consumed (by every rank of the node together).
    pub tokens: u64,
    options: StepOptions,
    /// The node's data-parallel group, when it has several ranks.
    pub(crate) dp: Option<DataParallel>,
    /// Rank 0 of a led group ([`Trainer::lead`]): announces each collective to the followers.
    pub(crate) leads: bool,
}

/// The MoE kernel a choice means on `device` computing in `kind`. `auto` takes PyTorch's
/// grouped kernel only where it is fast and correct ([`grouped_kernel_native`]); elsewhere
/// `_grouped_mm` syncs with the host and runs one matmul per expert (fp32, cards before SM 9,
/// such as A100 and L40S), or reports non-zero gradients for experts that got no token (SM 10,
/// pytorch#172439), so `auto` takes the loop there. `grouped` is honoured everywhere, the CPU
/// included, where its twin is tested.
pub fn moe_kernel(choice: MoeKernelChoice, device: Device, kind: Kind) -> MoeKernel {
    match choice {
        MoeKernelChoice::Loop => MoeKernel::Loop,
        MoeKernelChoice::Grouped => MoeKernel::Grouped,
        MoeKernelChoice::Auto if grouped_kernel_native(device, kind) => MoeKernel::Grouped,
        MoeKernelChoice::Auto => MoeKernel::Loop,
    }
}

/// Whether `device` runs the grouped MoE kernel natively in `kind`: bf16 on a GPU of compute
/// capability 9.x (H100, H200), as spes-ext's CUDA part reports it.
pub fn grouped_kernel_native(device: Device, kind: Kind) -> bool {
    match device {
        Device::Cuda(i) if kind == Kind::BFloat16 => match spes_ext::nccl::cuda_device(i) {
            Ok(d) => d.major == 9,
            Err(e) => {
                tracing::warn!("cannot tell CUDA device {i}'s compute capability ({e}): the MoE layers run the loop kernel");
                false
            }
        },
        _ => false,
    }
}

/// bf16 where it pays (CUDA) unless the config says otherwise.
pub fn compute_kind(precision: Precision, device: Device) -> Kind {
    match (precision, device) {
        (Precision::Fp32, _) | (Precision::Auto, Device::Cpu) => Kind::Float,
        _ => Kind::BFloat16,
    }
}

/// Whether frozen experts are resident in bf16 (`train.frozen_experts_bf16`): unset, on CUDA.
pub fn frozen_experts_bf16(choice: Option<bool>, device: Device) -> bool {
    choice.unwrap_or(device.is_cuda())
}

impl Trainer {
    /// A fresh model from `cfg.train.seed`, training the parameters for which `trainable` holds.
    pub fn new(cfg: RunConfig, device: Device, trainable: impl Fn(Role) -> bool) -> Result<Self> {
        let model = MoeModel::seeded(&cfg.model, device, cfg.train.seed)?;
        Self::with_model(cfg, device, model, trainable, 0)
    }

    /// Wraps an existing model; the data stream starts at `data_position` windows.
    pub fn with_model(
        cfg: RunConfig,
        device: Device,
        mut model: MoeModel,
        trainable: impl Fn(Role) -> bool,
        data_position: u64,
    ) -> Result<Self> {
        let manifest = spes_data::Manifest::load(cfg.data.primary())?;
        if manifest.vocab_size > cfg.model.vocab_size {
            bail!(
                "data {} has a {}-token vocabulary but model.vocab_size is {}",
                cfg.data.primary().display(),
                manifest.vocab_size,
                cfg.model.vocab_size
            );
        }
        let kind = compute_kind(cfg.train.precision, device);
        model.set_compute_kind(kind);
        model.set_moe_kernel(moe_kernel(cfg.train.moe_kernel, device, kind));
        model.set_frozen_experts_bf16(frozen_experts_bf16(cfg.train.frozen_experts_bf16, device));
        model.set_trainable(trainable);
        let opt = AdamW::new(model.trainable_params(), &cfg.train);
        let seq = cfg.train.seq_len;
        let sources = cfg.data.sources();
        let loader =
            Loader::open_share(&sources, seq, cfg.train.seed, data_position, cfg.data.share)?;
        let val = ValWindows::open_mixture(&sources, seq)?;
        let options = StepOptions {
            estimate: UnionEstimate::of(&cfg),
            ..StepOptions::from_config(&cfg.train)
        };
        Ok(Trainer {
            cfg,
            model,
            opt,
            device,
            loader,
            val,
            step: 0,
            tokens: 0,
            options,
            dp: None,
            leads: false,
        })
    }

    fn batch_tensor(&self, rows: usize, flat: Vec<i64>) -> Tensor {
        Tensor::from_slice(&flat)
            .view([rows as i64, (self.cfg.train.seq_len + 1) as i64])
            .to_device(self.device)
    }

    /// Makes this trainer one rank of a data-parallel node: from now on it trains on its own
    /// rows of each batch and averages gradients with the other ranks. Every rank starts from
    /// rank 0's weights and optimizer state.
    pub fn set_data_parallel(&mut self, mut dp: DataParallel) -> Result<()> {
        let mut state: Vec<Tensor> = self.model.params().into_iter().map(|p| p.tensor).collect();
        state.extend(self.opt.moment_tensors());
        // A resumed `union_estimate` node's noise averages: rank 0's, for the same tensors.
        let noisy = dp.broadcast_ints(self.opt.noise_held())?;
        state.extend(self.opt.noise_tensors(&noisy));
        dp.broadcast_from_first(&state)?;
        self.model.refresh_resident();
        let (steps, started) = self.opt.clock();
        let clock = dp.broadcast_ints([vec![steps], started].concat())?;
        self.opt.set_clock(clock[0], &clock[1..]);
        // ZeRO-1: keep the moments of this rank's share only.
        self.opt.retarget(dp.shard(self.model.trainable_params()));
        self.dp = Some(dp);
        Ok(())
    }

    /// The data-parallel group, if any.
    pub fn data_parallel(&self) -> Option<&DataParallel> {
        self.dp.as_ref()
    }

    /// Whether this process writes the node's files: the only rank, or rank 0.
    pub fn is_first_rank(&self) -> bool {
        self.dp.as_ref().is_none_or(DataParallel::is_first)
    }

    /// One optimizer step over `grad_accum` micro-batches from the data stream. With several
    /// ranks, each micro-batch is `batch_size` rows per rank: the node reads
    /// `ranks × batch_size` rows and this rank takes its own slice.
    pub fn train_step(&mut self) -> Result<StepStats> {
        self.train_rows(self.cfg.train.batch_size * self.cfg.train.grad_accum)
    }

    /// The node's ranks: 1, or its data-parallel group's size.
    pub fn ranks(&self) -> usize {
        self.dp.as_ref().map_or(1, DataParallel::world)
    }

    /// One optimizer step over `rows` rows per rank (a round by tokens gives a node more or
    /// fewer than the run's batch), in micro-batches of at most `micro_batch` (else
    /// `batch_size`) rows so memory stays what the node chose; the loss is the mean over the
    /// rows.
    pub fn train_rows(&mut self, rows: usize) -> Result<StepStats> {
        if rows == 0 {
            bail!("a training step needs at least one row");
        }
        self.announce_step(rows)?;
        let batches = self.draw_rows(rows);
        let lr = lr_at(self.step, &self.cfg.train);
        let slowdown = self.cfg.train.slowdown;
        let cpu_before = (slowdown > 1.0).then(crate::process::thread_cpu_seconds);
        let mut s = step_on_batches(
            &self.model,
            &mut self.opt,
            &self.options,
            self.dp.as_ref(),
            lr,
            &batches,
        )?;
        if let Some(cpu_before) = cpu_before {
            // Stands for a slower card: the step takes `slowdown` times as long, its CPU free.
            // Scaled from the time the step computed, not its wall time: a process paused
            // mid-step (SIGSTOP, a suspended VM) would otherwise sleep `slowdown` times its pause.
            let busy = s
                .seconds
                .min(crate::process::thread_cpu_seconds() - cpu_before);
            let extra = busy.max(0.0) * (slowdown - 1.0);
            std::thread::sleep(std::time::Duration::from_secs_f64(extra));
            s.seconds += extra;
        }
        Ok(self.count_step(s))
    }

    /// The next step's `rows` rows per rank from the data stream, in micro-batches of at most
    /// `micro_batch` rows (this rank's slice of each).
    fn draw_rows(&mut self, rows: usize) -> Vec<Tensor> {
        let micro = self.cfg.train.micro_rows();
        let (rank, world) = self.dp.as_ref().map_or((0, 1), |d| (d.rank(), d.world()));
        let row_len = self.cfg.train.seq_len + 1;
        (0..rows.div_ceil(micro))
            .map(|i| {
                let rows = micro.min(rows - i * micro);
                let flat = self.loader.next_batch(rows * world);
                let mine = flat[rank * rows * row_len..(rank + 1) * rows * row_len].to_vec();
                self.batch_tensor(rows, mine)
            })
            .collect()
    }

    /// Counts a finished step: the step and token counters, and the tokens of each source.
    fn count_step(&mut self, mut s: StepStats) -> StepStats {
        if self.loader.drawn().len() > 1 {
            let seq = self.cfg.train.seq_len as u64;
            s.source_tokens = self.loader.drawn().iter().map(|w| w * seq).collect();
        }
        self.step += 1;
        self.tokens += s.tokens;
        s
    }

    /// Fails unless every rank holds rank 0's trainable weights bit for bit; a no-op alone.
    pub fn check_ranks_in_sync(&self) -> Result<()> {
        let Some(dp) = &self.dp else {
            return Ok(());
        };
        self.announce(Op::Check, vec![])?;
        dp.check_in_sync()
    }

    /// Trains the parameters for which `trainable` holds from now on (a node's ownership
    /// changed): kept tensors keep their AdamW moments, adopted ones start fresh. With
    /// several ranks every rank must call it (a led group's followers do so on their own).
    pub fn set_trainable(&mut self, trainable: impl Fn(Role) -> bool) -> Result<Retarget> {
        let mask = self
            .model
            .params()
            .iter()
            .map(|p| trainable(p.role) as i64)
            .collect();
        self.announce(Op::Retrain, mask)?;
        self.model.set_trainable(trainable);
        match &mut self.dp {
            Some(dp) => dp.reshard(&mut self.opt, self.model.trainable_params()),
            None => Ok(self.opt.retarget(self.model.trainable_params())),
        }
    }

    /// Mean token cross-entropy on up to `eval_batches` validation batches.
    pub fn evaluate(&self) -> f64 {
        let t = &self.cfg.train;
        validation_loss(
            &self.model,
            &self.val,
            t.batch_size,
            t.eval_batches,
            self.device,
        )
    }

    /// Named model tensors, for saving.
    pub fn model_tensors(&self) -> Vec<(String, Tensor)> {
        self.model
            .params()
            .into_iter()
            .map(|p| (p.name, p.tensor))
            .collect()
    }

    /// Writes a checkpoint of the current state under `root`.
    /// With several ranks every rank must call it: the optimizer moments are gathered to
    /// rank 0, which alone writes (the others return `None`).
    pub fn save_checkpoint(&self, root: &Path) -> Result<Option<PathBuf>> {
        let Some(moments) = self.optimizer_state()? else {
            return Ok(None);
        };
        let dir = checkpoint::save(
            root,
            self.train_state(),
            &self.model_tensors(),
            &moments,
            self.cfg.train.keep_checkpoints,
        )?;
        Ok(Some(dir))
    }

    /// A copy of the current state to write under `root` while training goes on, keeping the
    /// newest `keep` checkpoints there; the weights only `with_model` (a SPES node's mid-run
    /// checkpoints leave them to the server). With several ranks every rank must call it;
    /// rank 0 gets the copy, the others `None`.
    pub fn snapshot(
        &self,
        root: &Path,
        with_model: bool,
        keep: usize,
    ) -> Result<Option<checkpoint::Snapshot>> {
        let Some(moments) = self.optimizer_state()? else {
            return Ok(None);
        };
        let model = with_model.then(|| self.model_tensors());
        Ok(Some(checkpoint::Snapshot::new(
            root,
            self.train_state(),
            model.as_deref(),
            &moments,
            keep,
        )))
    }

    /// Goes on from optimizer step `step` (a SPES node that rejoins at the current round): the
    /// learning-rate schedule follows the step, and the data stream skips the windows of the
    /// steps in between, so none is read twice.
    pub fn skip_to(&mut self, step: u64) -> Result<()> {
        if step <= self.step {
            return Ok(());
        }
        let rows = (self.cfg.train.batch_size * self.cfg.train.grad_accum * self.ranks()) as u64;
        let position = self.loader.position() + (step - self.step) * rows;
        self.loader = spes_data::Loader::open_share(
            &self.cfg.data.sources(),
            self.cfg.train.seq_len,
            self.cfg.train.seed,
            position,
            self.cfg.data.share,
        )?;
        self.step = step;
        Ok(())
    }

    /// Every rank's optimizer moments, on rank 0; `None` on the others.
    pub(crate) fn optimizer_state(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        match &self.dp {
            Some(dp) => {
                self.announce(Op::Gather, vec![])?;
                dp.gather_optimizer_state(&self.opt)
            }
            None => Ok(Some(self.opt.state())),
        }
    }

    fn train_state(&self) -> TrainState {
        TrainState {
            format_version: checkpoint::FORMAT_VERSION,
            step: self.step,
            tokens: self.tokens,
            data_position: self.loader.position(),
            seed: self.cfg.train.seed,
            optimizer_steps: self.opt.steps,
            config: self.cfg.clone(),
            files: Default::default(),
        }
    }

    /// Restores model, optimizer, step, token count and data position from a checkpoint (one
    /// without weights leaves the model freshly initialised).
    pub fn resume_from(
        cfg: RunConfig,
        device: Device,
        dir: &Path,
        trainable: impl Fn(Role) -> bool,
    ) -> Result<Self> {
        let ck = checkpoint::load(dir)?;
        // Its values are overwritten; seeded only so it draws from libtorch's generator under
        // the lock another role's (or test's) seeded model takes.
        let model = MoeModel::seeded(&cfg.model, device, cfg.train.seed)?;
        Self::from_checkpoint(cfg, device, dir, ck, model, trainable)
    }

    /// Like [`Trainer::resume_from`], training exactly the tensors whose moments the checkpoint
    /// holds (a node's ownership can change between rounds).
    pub fn resume_as_saved(cfg: RunConfig, device: Device, dir: &Path) -> Result<Self> {
        let ck = checkpoint::load(dir)?;
        let trained: std::collections::HashSet<String> = ck
            .optimizer
            .iter()
            .filter_map(|(n, _)| n.strip_prefix("exp_avg.").map(str::to_owned))
            .collect();
        // Its values are overwritten; seeded only so it draws from libtorch's generator under
        // the lock another role's (or test's) seeded model takes.
        let model = MoeModel::seeded(&cfg.model, device, cfg.train.seed)?;
        let roles: Vec<Role> = model
            .params()
            .into_iter()
            .filter(|p| trained.contains(&p.name))
            .map(|p| p.role)
            .collect();
        Self::from_checkpoint(cfg, device, dir, ck, model, |r| roles.contains(&r))
    }

    fn from_checkpoint(
        cfg: RunConfig,
        device: Device,
        dir: &Path,
        ck: checkpoint::Checkpoint,
        model: MoeModel,
        trainable: impl Fn(Role) -> bool,
    ) -> Result<Self> {
        // Without weights (a SPES node's mid-run checkpoint) the model keeps its fresh
        // values until the server's model is loaded.
        if let Some(weights) = &ck.model {
            let source = dir.join(checkpoint::MODEL_FILE);
            model.load(weights, &source.display().to_string())?;
        }
        let mut tr = Self::with_model(cfg, device, model, trainable, ck.state.data_position)?;
        let source = dir.join(checkpoint::OPTIMIZER_FILE);
        let optimizer = ck
            .optimizer
            .into_iter()
            .map(|(n, t)| (n, t.to_device(device)))
            .collect();
        tr.opt.load_state(
            optimizer,
            ck.state.optimizer_steps,
            &source.display().to_string(),
        )?;
        tr.step = ck.state.step;
        tr.tokens = ck.state.tokens;
        Ok(tr)
    }
}

/// Mean token cross-entropy of `model` on up to `max_batches` validation batches of `batch`.
pub fn validation_loss(
    model: &MoeModel,
    val: &ValWindows,
    batch: usize,
    max_batches: usize,
    device: Device,
) -> f64 {
    validation_stats(model, val, batch, max_batches, device).0
}

/// Mean token cross-entropy of `model` on every window of the validation split, 16 a batch:
/// the score `spes experiment` and `spes simulate` give a run's final model.
pub fn every_window_loss(model: &MoeModel, val: &ValWindows, device: Device) -> f64 {
    validation_loss(model, val, 16, usize::MAX / 32, device)
}

/// Validation loss and each layer's share of top-k assignments per expert (`[layers][E]`).
pub fn validation_stats(
    model: &MoeModel,
    val: &ValWindows,
    batch: usize,
    max_batches: usize,
    device: Device,
) -> (f64, Vec<Vec<f64>>) {
    let (mut total, mut n) = (0f64, 0usize);
    let mut counts: Option<Tensor> = None;
    tch::no_grad(|| {
        for (rows, flat) in val.batches(batch, max_batches) {
            let seq = flat.len() / rows;
            let batch = Tensor::from_slice(&flat)
                .view([rows as i64, seq as i64])
                .to_device(device);
            let l = model.loss_values(&batch, &LossWeights::default());
            total += l.ce.double_value(&[]) * rows as f64;
            n += rows;
            let c = l.expert_counts.to_kind(Kind::Double);
            counts = Some(match counts.take() {
                Some(acc) => acc + c,
                None => c,
            });
        }
    });
    let load = counts
        .map(|c| {
            let share = &c / c.sum_dim_intlist(1, true, Kind::Double);
            Vec::<Vec<f64>>::try_from(&share.to_device(Device::Cpu)).unwrap_or_default()
        })
        .unwrap_or_default();
    (total / n as f64, load)
}

/// Outcome of [`run`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunSummary {
    pub initial_val_loss: Option<f64>,
    pub final_val_loss: f64,
    pub steps: u64,
    pub tokens: u64,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    /// AdamW moments this process holds (with several ranks, its ZeRO-1 share).
    pub optimizer_state_bytes: u64,
}

/// `spes train`: centralized training of every parameter, resumable from `<out>/checkpoints`.
/// A fresh run starts from `init` (a checkpoint directory or model.safetensors) when given.
/// With `dp`, this process is one rank of a data-parallel node: every rank trains, rank 0
/// alone writes metrics and checkpoints, and ranks are checked to hold identical weights at
/// every logged step.
pub fn run(
    cfg: RunConfig,
    out: &Path,
    device: Device,
    resume: bool,
    init: Option<&Path>,
    progress: bool,
    dp: Option<DataParallel>,
) -> Result<RunSummary> {
    if cfg.sync.mode != crate::config::Mode::Centralized {
        bail!(
            "sync.mode = {:?} is decentralized: start `spes server` and one `spes node` per peer",
            cfg.sync.mode
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let ck_root = out.join("checkpoints");
    let latest = checkpoint::latest(&ck_root)?;
    let mut tr = match (&latest, resume) {
        (Some(dir), true) => {
            tracing::info!("resuming from {}", dir.display());
            Trainer::resume_from(cfg.clone(), device, dir, |_| true)?
        }
        (Some(dir), false) => bail!(
            "{} already holds checkpoint {}; pass --resume to continue it, or choose another --out",
            out.display(),
            dir.display()
        ),
        (None, _) => {
            let tr = Trainer::new(cfg.clone(), device, |_| true)?;
            if let Some(init) = init {
                let file = checkpoint::model_file(init);
                let named = Tensor::read_safetensors(&file)
                    .with_context(|| format!("cannot read initial weights {}", file.display()))?;
                tr.model.load(&named, &file.display().to_string())?;
            }
            tr
        }
    };
    if let Some(dp) = dp {
        tr.set_data_parallel(dp)?;
    }
    let first = tr.is_first_rank();
    let progress = progress && first;
    let tasks = crate::task_hook::TaskHook::load(&cfg, device)?;
    let mut log = None;
    if first {
        let config = cfg.to_toml()?;
        spes_data::shard::write_atomic(&out.join("config.toml"), config.as_bytes())?;
        log = Some(
            MetricsLog::open(out, latest.as_ref().map(|_| tr.step))?
                .with_tensorboard(cfg.train.tensorboard.as_deref(), "train")?,
        );
    }
    let mut write = |record: StepRecord| -> Result<()> {
        match &mut log {
            Some(log) => log.write(&record),
            None => Ok(()),
        }
    };
    let t = cfg.train.clone();
    let start = Instant::now();
    let initial_val_loss = if tr.step == 0 {
        let v = tr.evaluate();
        write(StepRecord {
            val_loss: Some(v),
            ..StepRecord::default()
        })?;
        Some(v)
    } else {
        None
    };
    let bar = progress_bar(progress, t.max_steps, tr.step);
    let (mut window_tokens, mut window_s) = (0u64, 0f64);
    let mut final_val_loss = initial_val_loss.unwrap_or(f64::NAN);
    let first_tokens = tr.tokens;
    while tr.step < t.max_steps {
        let s = tr.train_step()?;
        if !s.losses.loss.is_finite() {
            bail!(
                "loss became {} at step {}; lower train.lr or check the data",
                s.losses.loss,
                tr.step
            );
        }
        window_tokens += s.tokens;
        window_s += s.seconds;
        let mut record = None;
        if tr.step % t.log_every == 0 || tr.step == t.max_steps {
            let tps = window_tokens as f64 / window_s.max(1e-9);
            record = Some(s.record(tr.step, tr.tokens, tps));
            bar.set_message(format!("loss {:.3} | {:.0} tok/s", s.losses.loss, tps));
            (window_tokens, window_s) = (0, 0.0);
            tr.check_ranks_in_sync()?;
        }
        if tr.step % t.eval_every == 0 || tr.step == t.max_steps {
            final_val_loss = tr.evaluate();
            let r = record.get_or_insert_with(|| eval_record(tr.step, tr.tokens));
            r.val_loss = Some(final_val_loss);
            bar.println(format!("step {:>6}  val_loss {final_val_loss:.4}", tr.step));
        }
        if let Some(hook) = tasks.as_ref().filter(|h| h.due(tr.step)) {
            let scores = hook.score(&tr.model)?;
            let r = record.get_or_insert_with(|| eval_record(tr.step, tr.tokens));
            r.tasks = Some(scores);
        }
        if let Some(r) = record {
            write(r)?;
        }
        if tr.step % t.checkpoint_every == 0 || tr.step == t.max_steps {
            tr.save_checkpoint(&ck_root)?;
        }
        bar.set_position(tr.step);
    }
    bar.finish_and_clear();
    let wall_s = start.elapsed().as_secs_f64();
    let trained = tr.tokens - first_tokens;
    Ok(RunSummary {
        initial_val_loss,
        final_val_loss,
        steps: tr.step,
        tokens: tr.tokens,
        wall_s,
        tokens_per_s: trained as f64 / wall_s.max(1e-9),
        optimizer_state_bytes: tr.opt.state_bytes(),
    })
}

/// A line for evaluations at a step that logged no losses.
fn eval_record(step: u64, tokens: u64) -> StepRecord {
    StepRecord {
        step,
        tokens,
        ..StepRecord::default()
    }
}

fn progress_bar(show: bool, max_steps: u64, at: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(max_steps);
    bar.set_style(
        ProgressStyle::with_template("step {pos}/{len} [{bar:30}] {msg} | eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_position(at);
    bar
}
