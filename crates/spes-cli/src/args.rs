//! Flags several commands share: the device and threads, data parallel ranks, a config file with
//! overrides, and the parsers of precision and MoE kernel names.

use crate::device::{self, DeviceChoice};
use crate::local_ranks;
use anyhow::{bail, Result};
use spes_train::{MoeKernelChoice, Precision, RunConfig};
use std::path::PathBuf;

/// Where and how wide tensors compute.
#[derive(clap::Args)]
pub struct RuntimeArgs {
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// CPU threads for tensor math (default: libtorch's choice, all cores).
    #[arg(long)]
    pub threads: Option<i32>,
}

impl RuntimeArgs {
    pub fn device(&self) -> Result<tch::Device> {
        if let Some(n) = self.threads {
            tch::set_num_threads(n.max(1));
        }
        device::select(self.device)
    }
}

/// This process's device and, when a launcher started it as one of several ranks (a
/// WORLD_SIZE above 1 in its environment), its rendezvous: CUDA ranks take GPU LOCAL_RANK (round-robin when
/// there are more ranks than GPUs), CPU ranks an even share of the cores.
pub fn rank_setup(
    runtime: &RuntimeArgs,
    ranks: &RanksArgs,
) -> Result<(tch::Device, Option<spes_train::data_parallel::Rendezvous>)> {
    let mut device = runtime.device()?;
    let mut rendezvous = spes_train::data_parallel::rendezvous_from_env(
        std::time::Duration::from_secs(ranks.dist_timeout),
        ranks.dist_backend != local_ranks::DistBackend::Auto,
    )?;
    let env = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    let local_rank = env("LOCAL_RANK").unwrap_or(0);
    let Some(r) = &mut rendezvous else {
        return Ok((device, None));
    };
    let local = env("LOCAL_WORLD_SIZE").unwrap_or(r.world);
    if let tch::Device::Cuda(_) = device {
        let gpus = tch::Cuda::device_count().max(1) as usize;
        let gpu = local_rank % gpus;
        device = tch::Device::Cuda(gpu);
        // Else every rank opens a context on GPU 0 and NCCL guesses each rank's device.
        spes_ext::set_device(gpu)?;
        r.backend = ranks.dist_backend.resolve(local, gpus)?;
    } else {
        if ranks.dist_backend == local_ranks::DistBackend::Nccl {
            bail!("--dist-backend nccl needs CUDA ranks, but this rank runs on the CPU");
        }
        if runtime.threads.is_none() {
            // Oversubscribed OpenMP threads spin-wait on each other and run many times slower.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            tch::set_num_threads((cores / local.max(1)).max(1) as i32);
        }
    }
    tracing::info!(rank = r.rank, world = r.world, backend = ?r.backend, ?device, "data parallel");
    Ok((device, rendezvous))
}

/// Data parallel inside one machine.
#[derive(clap::Args)]
pub struct RanksArgs {
    /// Data parallel on this machine: start this many ranks (one per GPU, or CPU
    /// processes), each with `train.batch_size` rows per micro-batch. A launcher such as
    /// torchrun can start the ranks instead (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    #[arg(long, value_name = "G")]
    pub local_ranks: Option<usize>,
    /// Seconds a rank waits for the others at a collective before failing (a dead rank).
    #[arg(long, default_value_t = 300)]
    pub dist_timeout: u64,
    /// The c10d backend between ranks. Named explicitly, it also makes a group of one rank
    /// when a launcher sets WORLD_SIZE=1 (to check a backend on one GPU).
    #[arg(long, value_enum, default_value_t = local_ranks::DistBackend::Auto)]
    pub dist_backend: local_ranks::DistBackend,
}

/// A run configuration file and its overrides.
#[derive(clap::Args)]
pub struct ConfigArgs {
    /// Run configuration: TOML with [model], [data], [train] and, decentralized, [sync].
    #[arg(long)]
    pub config: PathBuf,
    /// Override a config key, e.g. --set train.max_steps=40 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl ConfigArgs {
    /// Reads the config, logging each value a rule derived.
    pub fn load(&self) -> Result<RunConfig> {
        let cfg = RunConfig::load(&self.config, &self.overrides)?;
        for d in &cfg.derived {
            tracing::info!("config: {d}");
        }
        Ok(cfg)
    }
}

pub fn parse_precision(s: &str) -> Result<Precision, String> {
    match s {
        "auto" => Ok(Precision::Auto),
        "fp32" => Ok(Precision::Fp32),
        "bf16" => Ok(Precision::Bf16),
        _ => Err(format!("expected auto, fp32 or bf16, got `{s}`")),
    }
}

pub fn parse_moe_kernel(s: &str) -> Result<MoeKernelChoice, String> {
    match s {
        "auto" => Ok(MoeKernelChoice::Auto),
        "loop" => Ok(MoeKernelChoice::Loop),
        "grouped" => Ok(MoeKernelChoice::Grouped),
        _ => Err(format!("expected auto, loop or grouped, got `{s}`")),
    }
}

/// Where the server keeps the run's state besides `--out`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct StoreArgs {
    /// Keep the run's state in object storage too (`s3://bucket/prefix`; `gs://`, `az://` in
    /// builds with those features; a path): a new server on another machine with an empty
    /// --out resumes from it. Keys come from the environment (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION) or --store-credentials.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// An owner-only TOML file with the store's keys (access_key_id, secret_access_key,
    /// optional endpoint, region, session_token).
    #[arg(long, value_name = "FILE", requires = "store")]
    pub store_credentials: Option<PathBuf>,
    /// Accept a plain http:// store endpoint (loopback, or a network you trust).
    #[arg(long, requires = "store")]
    pub store_allow_http: bool,
    /// Nodes download rounds from the store (S3, GCS, Azure) through presigned GET URLs the
    /// server hands out, valid this long (seconds); a node whose URL expired asks again.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 600.0,
        requires = "store"
    )]
    pub store_url_lifetime_s: f64,
}

impl StoreArgs {
    /// The store of server shard `i` of `k` (its own prefix when `k` > 1), its keys and clock
    /// checked; `None` without `--store`.
    pub fn open(&self, (i, k): (usize, usize)) -> Result<Option<spes_store::RunStore>> {
        let Some(url) = &self.store else {
            return Ok(None);
        };
        let lifetime = self.store_url_lifetime_s;
        // S3 signs for at most 7 days.
        if !(1.0..=604_800.0).contains(&lifetime) {
            anyhow::bail!("--store-url-lifetime-s {lifetime}: expected 1 to 604800 seconds");
        }
        let url = if k > 1 {
            format!("{}/shard-{i}-of-{k}", url.trim_end_matches('/'))
        } else {
            url.clone()
        };
        let opts = spes_store::StoreOptions {
            allow_http: self.store_allow_http,
            credentials: self.store_credentials.clone(),
        };
        let store = spes_store::RunStore::open(&url, &opts)?;
        store.check()?;
        Ok(Some(store))
    }

    /// The same flags, for a `spes server` this process starts.
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> = Vec::new();
        if let Some(url) = &self.store {
            a.extend(["--store".into(), url.into()]);
        }
        if let Some(c) = &self.store_credentials {
            a.extend(["--store-credentials".into(), c.into()]);
        }
        if self.store_allow_http {
            a.push("--store-allow-http".into());
        }
        if self.store.is_some() {
            a.extend([
                "--store-url-lifetime-s".into(),
                self.store_url_lifetime_s.to_string().into(),
            ]);
        }
        a
    }
}
