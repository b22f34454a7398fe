//! The spes model: an OLMoE-style mixture-of-experts decoder in tch, its presets and the
//! parameter roles (shared vs expert) that SPES trains, freezes and synchronises.

pub mod config;
pub mod model;

pub use config::{ModelConfig, NormPlacement, ParamCounts, QkNorm, PRESETS};
pub use model::{
    define_grads, expert_tensor_name, load_balancing_loss, router_tensor_name, LossWeights, Losses,
    MoeKernel, MoeModel, Param, Role, Stage, EXPERT_PARTS,
};
