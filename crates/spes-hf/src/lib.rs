//! Hugging Face interop: export spes checkpoints as standard transformers MoE folders
//! (`export`), and build spes MoE checkpoints from dense Llama, Qwen2, Qwen3 and OLMo2
//! checkpoints (`upcycle`).

pub mod export;
pub mod upcycle;

pub use export::{export, ExportDtype, ExportOptions, ExportSummary};
pub use upcycle::{upcycle, RouterInit, UpcycleOptions};
