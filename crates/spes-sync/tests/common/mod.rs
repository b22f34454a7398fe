//! Helpers of the spes-sync tests: a micro model, its tensors, uploads of constant values and
//! a coordinator over it.
#![allow(dead_code)]

use spes_model::{ModelConfig, MoeModel, NormPlacement, QkNorm};
use spes_sync::{
    Choice, Coordinator, Layout, Mode, Named, Ownership, RoundError, Scope, Start, SyncConfig,
    Wire, Work,
};
use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};
use tch::{Device, Kind, Tensor};

pub fn model(n_layers: usize, n_experts: usize) -> MoeModel {
    sized(n_layers, n_experts, 4)
}

/// [`model`] of width `d`: with `d` = 32 its matrices are large enough to travel in low-rank
/// factors.
pub fn sized(n_layers: usize, n_experts: usize, d: usize) -> MoeModel {
    let cfg = ModelConfig {
        vocab_size: if d > 4 { 2 * d } else { 11 },
        d_model: d,
        n_layers,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: d,
        n_experts,
        top_k: 1,
        expert_hidden: if d > 4 { d } else { 2 },
        context_length: 8,
        rope_theta: 10_000.0,
        qk_norm: QkNorm::Full,
        normalize_topk: false,
        norm_eps: 1e-6,
        init_std: 0.02,
        norm_placement: NormPlacement::Pre,
        qkv_bias: false,
    };
    MoeModel::seeded(&cfg, Device::Cpu, 0).unwrap()
}

pub fn snapshot(m: &MoeModel) -> Named {
    m.params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect()
}

/// The tensors `peer` uploads under `scope`, each filled with `value`.
pub fn upload(layout: &Layout, scope: &Scope, peer: usize, value: f64) -> Named {
    layout
        .entries
        .iter()
        .filter(|(_, role, _)| scope.uploads(peer, *role))
        .map(|(n, _, shape)| {
            (
                n.clone(),
                Tensor::full(shape.as_slice(), value, (Kind::Float, Device::Cpu)),
            )
        })
        .collect()
}

pub fn get<'a>(named: &'a Named, name: &str) -> &'a Tensor {
    &named.iter().find(|(n, _)| n == name).unwrap().1
}

pub fn copy(named: &Named) -> Named {
    named.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
}

pub fn scalar(t: &Tensor) -> f64 {
    t.flatten(0, -1).get(0).double_value(&[])
}

/// SPES rounds of 10 steps, a 5 s timeout, 3 s leases, eviction 10 s after expiry, merges at
/// steps 20, 40, … (α 0.1 falling to 0 at step 100, 2 neighbours), fp32 values.
pub fn cfg() -> SyncConfig {
    SyncConfig {
        mode: Mode::Spes,
        sync_steps: 10,
        round_timeout_s: 5.0,
        lease_s: 3.0,
        evict_after_s: 10.0,
        merge_every: 20,
        merge_alpha: 0.1,
        merge_until: 100,
        merge_top_k: 2,
        wire: Choice::Pinned(Wire::Fp32),
        ..SyncConfig::default()
    }
}

/// A coordinator over `m`'s θ⁰ with `peers` contiguous owners, uploads unbounded.
pub fn coordinator(m: &MoeModel, peers: usize, cfg: SyncConfig, now: f64) -> Coordinator {
    bounded(m, peers, cfg, None, now)
}

/// [`coordinator`] refusing uploads that move a tensor by more than RMS `bound`.
pub fn bounded(
    m: &MoeModel,
    peers: usize,
    cfg: SyncConfig,
    bound: Option<f64>,
    now: f64,
) -> Coordinator {
    let scope = Scope::Spes(Ownership::resolve(&[], m.cfg.n_experts, peers).unwrap());
    Coordinator::new(
        Layout::of(m),
        scope,
        cfg,
        bound,
        Start {
            global: snapshot(m),
            published: 0,
            gone: BTreeSet::new(),
            caps: Default::default(),
        },
        now,
    )
}

/// Uploads `value` for `peer` under the coordinator's open round and ownership (fp32 wire).
pub fn up(
    c: &mut Coordinator,
    layout: &Layout,
    peer: usize,
    value: f64,
    now: f64,
) -> Result<(), RoundError> {
    let u = upload(layout, c.scope(), peer, value);
    let round = c.round();
    c.upload(peer, 100 + peer as u64, round, u, Work::default(), now)
}

/// Held for the whole of every test that draws from libtorch's process-wide generator: a
/// binary's tests run on parallel threads, and another test's draws (or a model's seeding)
/// in the middle of a seeded sequence would change what a test measures from run to run.
pub fn draws() -> MutexGuard<'static, ()> {
    static DRAWS: Mutex<()> = Mutex::new(());
    DRAWS.lock().unwrap_or_else(|e| e.into_inner())
}
