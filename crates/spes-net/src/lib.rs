//! SPES over the network: the parameter server (`server`), the node (`node`), and what they
//! share: per-peer credentials and TLS (`auth`), chunked, checksummed safetensors payloads
//! (`payload`), the mapping of round refusals to gRPC statuses (`refusal`) and the crash points
//! of the chaos test (`fault`), and shaped loopback links to measure sync on (`link`). The SPES logic itself lives in spes-sync; this crate only moves
//! tensors and keeps time.

pub mod auth;
pub mod fault;
pub mod link;
pub mod node;
pub mod payload;
pub mod plan;
pub mod refusal;
pub mod server;

/// Generated gRPC types of `proto/spes.proto`.
pub mod proto {
    tonic::include_proto!("spes.v1");
}

pub use node::{Node, NodeOptions, NodeSummary, Progress};

/// Held while a model is initialised from libtorch's process-wide generator, so a server
/// (or a shard) seeding it gets θ⁰ exactly even when other roles share the process (tests).
pub(crate) static INIT_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
pub use server::{Limits, ServerOptions, ServerSummary};

/// Builds what nodes upload and how the server combines it, from the run's `[sync]` section:
/// the initial members are peers `0..sync.nodes`.
pub fn scope_of(cfg: &spes_train::RunConfig) -> anyhow::Result<spes_sync::Scope> {
    use spes_train::Mode;
    let s = &cfg.sync;
    Ok(match s.mode {
        Mode::Spes => spes_sync::Scope::Spes(spes_sync::Ownership::resolve(
            &s.ownership,
            cfg.model.n_experts,
            s.nodes,
        )?),
        Mode::Diloco => spes_sync::Scope::Diloco {
            members: (0..s.nodes).collect(),
        },
        Mode::Centralized => anyhow::bail!(
            "sync.mode = \"centralized\" trains with `spes train`; set sync.mode = \"spes\" or \"diloco\""
        ),
    })
}

/// The server's outer optimizer rules of the run's `sync.outer_*` and `sync.expert_outer_*`.
pub fn outer_rules(sync: &spes_train::SyncConfig) -> spes_sync::OuterRules {
    let rule = |lr, momentum| spes_sync::OuterRule {
        lr,
        momentum,
        nesterov: sync.outer_nesterov,
    };
    spes_sync::OuterRules {
        averaged: rule(sync.outer_lr, sync.outer_momentum),
        owned: rule(sync.expert_outer_lr, sync.expert_outer_momentum),
        norm_preserving: sync.outer_norm_preserving,
    }
}

/// The wire form of the run's `sync.wire`, as spes-sync validates and publishes it.
pub fn wire_form(sync: &spes_train::SyncConfig) -> spes_sync::WireForm {
    use spes_sync::WireForm;
    use spes_train::Wire;
    match sync.wire {
        Wire::Fp32 => WireForm::Values,
        Wire::Bf16Delta => WireForm::Bf16Delta,
        Wire::SparseDelta => WireForm::Sparse {
            density: sync.sparse_density,
        },
        Wire::Int8Delta | Wire::Int4Delta | Wire::Int2Delta => WireForm::Quantized {
            bits: sync.wire.quantized_bits().unwrap_or(8),
        },
    }
}
