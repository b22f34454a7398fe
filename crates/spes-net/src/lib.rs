//! SPES over the network: the parameter server (`server`), the node (`node`), and what they
//! share: bearer-token auth and TLS (`auth`) and chunked, checksummed safetensors payloads
//! (`payload`). The SPES logic itself lives in spes-sync; this crate only moves tensors.

pub mod auth;
pub mod node;
pub mod payload;
pub mod server;

/// Generated gRPC types of `proto/spes.proto`.
pub mod proto {
    tonic::include_proto!("spes.v1");
}

pub use node::{Node, NodeOptions, NodeSummary, Progress};
pub use server::{ServerOptions, ServerSummary};

/// Builds what nodes upload and how the server combines it, from the run's `[sync]` section.
pub fn scope_of(cfg: &spes_train::RunConfig) -> anyhow::Result<spes_sync::Scope> {
    use spes_train::Mode;
    let s = &cfg.sync;
    Ok(match s.mode {
        Mode::Spes => spes_sync::Scope::Spes(spes_sync::Ownership::resolve(
            &s.ownership,
            cfg.model.n_experts,
            s.nodes,
        )?),
        Mode::Diloco => spes_sync::Scope::Diloco { peers: s.nodes },
        Mode::Centralized => anyhow::bail!(
            "sync.mode = \"centralized\" trains with `spes train`; set sync.mode = \"spes\" or \"diloco\""
        ),
    })
}
