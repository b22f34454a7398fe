//! spes training: the run configuration, AdamW over the trainable tensors only, the training
//! step and loop (centralized mode), checkpoints, the typed metrics records every role writes,
//! in-training task scoring and the step benchmark.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data_parallel;
pub mod memory_plan;
pub mod metrics;
pub mod optim;
pub mod oracle;
pub mod process;
pub mod simulate;
pub mod task_hook;
pub mod tensorboard;
pub mod trainer;

pub use config::{
    AggregateRule, Mode, MoeKernelChoice, Precision, RunConfig, SecondMoment, SyncConfig,
    TrainConfig, Wire,
};
pub use trainer::lead::follow;
pub use trainer::{
    compute_kind, every_window_loss, grouped_kernel_native, moe_kernel, run, validation_loss,
    validation_stats, RunSummary, StepOptions, StepStats, Trainer,
};
