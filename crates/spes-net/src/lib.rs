//! SPES over the network: the parameter server (`server`, a gRPC shell around spes-sync's
//! `Coordinator`), the node (`node`, a driver around spes-sync's `Replica` and the trainer),
//! and what they share: per-peer credentials and TLS (`auth`), chunked, checksummed
//! safetensors payloads (`payload`), the mapping of round refusals to gRPC statuses
//! (`refusal`), the crash points of the chaos test (`fault`), shaped loopback links to measure
//! sync on (`link`) and the sync planner (`plan`). The SPES logic itself lives in spes-sync;
//! this crate only moves tensors and keeps time.

pub mod auth;
pub mod choose;
mod dial;
pub mod fault;
pub mod link;
pub mod lived;
pub mod measure;
pub mod node;
pub mod payload;
pub mod plan;
pub mod refusal;
pub mod server;
pub mod settings;
pub mod view;

/// Generated gRPC types of `proto/spes.proto`. A chunk is a header or data, the header the
/// larger by far; a chunk is built once per message, so its size does not matter.
#[allow(clippy::large_enum_variant)]
pub mod proto {
    tonic::include_proto!("spes.v1");
}

pub use node::{Node, NodeOptions, NodeSummary, Progress};

pub use server::{Limits, ServerOptions, ServerSummary};
