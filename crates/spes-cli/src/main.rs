//! `spes`: pretrain mixture-of-experts language models.

mod demo;
mod device;
mod experiment;
mod link_bench;
mod local_ranks;
mod plan_memory;
mod plan_sync;
mod report;
mod step_bench;
mod sync_bench;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use device::DeviceChoice;
use spes_data::{TokenizeOptions, TokenizerSource};
use spes_model::{ModelConfig, PRESETS};
use spes_train::{MoeKernelChoice, Precision, RunConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(
    name = "spes",
    version,
    about = "Pretrain mixture-of-experts language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where and how wide tensors compute.
#[derive(clap::Args)]
struct RuntimeArgs {
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// CPU threads for tensor math (default: libtorch's choice, all cores).
    #[arg(long)]
    threads: Option<i32>,
}

impl RuntimeArgs {
    fn device(&self) -> Result<tch::Device> {
        if let Some(n) = self.threads {
            tch::set_num_threads(n.max(1));
        }
        device::select(self.device)
    }
}

/// This process's device and, when a launcher started it as one of several ranks (a
/// WORLD_SIZE above 1 in its environment), its rendezvous: CUDA ranks take GPU LOCAL_RANK (round-robin when
/// there are more ranks than GPUs), CPU ranks an even share of the cores.
fn rank_setup(
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
        device = tch::Device::Cuda(local_rank % gpus);
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

/// `spes train` in this process: alone, or as one rank of a data-parallel node when a
/// launcher's environment (WORLD_SIZE > 1) says so; only rank 0 prints the summary.
fn train(
    cfg: RunConfig,
    out: &Path,
    resume: bool,
    init: Option<&Path>,
    runtime: &RuntimeArgs,
    ranks: &RanksArgs,
) -> Result<()> {
    use spes_train::data_parallel::DataParallel;
    let (device, rendezvous) = rank_setup(runtime, ranks)?;
    let dp = rendezvous
        .as_ref()
        .map(|r| DataParallel::join(r, device))
        .transpose()?;
    let first = dp.as_ref().is_none_or(DataParallel::is_first);
    tracing::info!(?device, "training {}", out.display());
    let summary = spes_train::run(cfg, out, device, resume, init, first, dp)?;
    if first {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}

/// Data parallel inside one machine.
#[derive(clap::Args)]
struct RanksArgs {
    /// Data parallel on this machine: start this many ranks (one per GPU, or CPU
    /// processes), each with `train.batch_size` rows per micro-batch. A launcher such as
    /// torchrun can start the ranks instead (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    #[arg(long, value_name = "G")]
    local_ranks: Option<usize>,
    /// Seconds a rank waits for the others at a collective before failing (a dead rank).
    #[arg(long, default_value_t = 300)]
    dist_timeout: u64,
    /// The c10d backend between ranks. Named explicitly, it also makes a group of one rank
    /// when a launcher sets WORLD_SIZE=1 (to check a backend on one GPU).
    #[arg(long, value_enum, default_value_t = local_ranks::DistBackend::Auto)]
    dist_backend: local_ranks::DistBackend,
}

/// A run configuration file and its overrides.
#[derive(clap::Args)]
struct ConfigArgs {
    /// Run configuration: TOML with [model], [data], [train] and, decentralized, [sync].
    #[arg(long)]
    config: PathBuf,
    /// Override a config key, e.g. --set train.max_steps=40 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
}

impl ConfigArgs {
    fn load(&self) -> Result<RunConfig> {
        RunConfig::load(&self.config, &self.overrides)
    }
}

/// A secret read from a file, or else from an environment variable.
fn secret_from(file: Option<&Path>, env: &str) -> Result<Option<String>> {
    match (file, std::env::var(env)) {
        (Some(path), _) => Ok(Some(spes_net::auth::read_token(path)?)),
        (None, Ok(t)) if !t.trim().is_empty() => Ok(Some(t.trim().to_owned())),
        _ => Ok(None),
    }
}

/// 32 random bytes from the OS-seeded CSPRNG, as hex: a run secret.
pub(crate) fn new_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
enum ProgressArg {
    Bar,
    Json,
    Quiet,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text into .npy token shards, a validation split and a manifest.
    Tokenize {
        /// Input files or globs: .txt (documents separated by blank lines), .jsonl, .jsonl.gz.
        #[arg(long, required = true, num_args = 1..)]
        input: Vec<String>,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// A Hugging Face tokenizer.json to use.
        #[arg(
            long,
            conflicts_with = "train_tokenizer",
            required_unless_present = "train_tokenizer"
        )]
        tokenizer: Option<PathBuf>,
        /// Train a byte-level BPE of this vocabulary size on the input instead.
        #[arg(long)]
        train_tokenizer: Option<usize>,
        /// JSON field holding the text in .jsonl inputs.
        #[arg(long, default_value = "text")]
        text_field: String,
        /// Share of documents held out for validation.
        #[arg(long, default_value_t = 0.02)]
        val_fraction: f64,
        /// Tokens per shard file.
        #[arg(long, default_value_t = 100_000_000)]
        shard_tokens: usize,
        /// End-of-text token of a loaded tokenizer, if not one of the usual spellings.
        #[arg(long)]
        eos_token: Option<String>,
    },
    /// Train a model on one machine (every parameter), resumable.
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// Output directory: metrics.jsonl, config.toml, checkpoints/.
        #[arg(long)]
        out: PathBuf,
        /// Continue from the newest checkpoint in <out>/checkpoints.
        #[arg(long)]
        resume: bool,
        /// Start a fresh run from these weights (a checkpoint directory, e.g. from `spes
        /// upcycle`, or a model.safetensors); the optimizer starts empty.
        #[arg(long, conflicts_with = "resume")]
        init: Option<PathBuf>,
        #[command(flatten)]
        ranks: RanksArgs,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Write a freshly initialised checkpoint of a config to <out>/step-0 (e.g. to try export-hf).
    Init {
        #[command(flatten)]
        config: ConfigArgs,
        /// The checkpoint directory to create.
        #[arg(long)]
        out: PathBuf,
    },
    /// Export a checkpoint as a Hugging Face model folder (OLMoE, Qwen3-MoE or FlexOlmo).
    ExportHf {
        /// A spes checkpoint directory (model.safetensors + state.json).
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
        dtype: String,
        /// Largest shard in GB (10^9 bytes).
        #[arg(long, default_value_t = 5.0)]
        max_shard_gb: f64,
        /// tokenizer.json to ship (default: the one of the checkpoint's training data).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
    /// Build a MoE checkpoint from a dense Hugging Face model (Llama, Mistral, Qwen2, Qwen3, OLMo2).
    Upcycle {
        /// The dense model folder (config.json + safetensors).
        #[arg(long)]
        from: PathBuf,
        #[arg(long)]
        experts: usize,
        #[arg(long)]
        top_k: usize,
        /// Combine with the raw top-k probabilities instead of renormalising them.
        #[arg(long)]
        raw_topk: bool,
        #[arg(long, default_value_t = 0.0)]
        noise_std: f64,
        #[arg(long, default_value_t = 0.0)]
        noise_fraction: f64,
        #[arg(long, value_parser = ["zeros", "normal"], default_value = "zeros")]
        router: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Tokenized data (a `spes tokenize` directory made with the dense model's tokenizer).
        #[arg(long)]
        data: PathBuf,
        /// The checkpoint directory to create.
        #[arg(long)]
        out: PathBuf,
    },
    /// Score a checkpoint: perplexity and bits per byte of a text, or downstream tasks.
    Eval {
        #[arg(long)]
        checkpoint: PathBuf,
        /// A text file, tokenized whole and scored in windows of the training context.
        #[arg(long, conflicts_with = "tasks", required_unless_present = "tasks")]
        text: Option<PathBuf>,
        /// Task directories with requests.jsonl.gz, comma-separated.
        #[arg(long, value_delimiter = ',')]
        tasks: Vec<PathBuf>,
        /// Score only the first N documents of each task.
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long, default_value_t = 16)]
        batch_size: usize,
        /// tokenizer.json to use (default: the one of the checkpoint's training data).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Write the JSON here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Run the SPES (or DiLoCo) parameter server of a decentralized run.
    /// The config needs a [sync] section with mode = "spes" or "diloco".
    Server {
        #[command(flatten)]
        config: ConfigArgs,
        /// Address to serve on. Anything but loopback needs TLS (or --insecure).
        #[arg(long, default_value = "0.0.0.0:50051")]
        listen: SocketAddr,
        /// Output directory: metrics.jsonl, global/, checkpoints/, server.json (restart point).
        #[arg(long)]
        out: PathBuf,
        /// File whose first line is the run secret that node credentials derive from
        /// (`spes gen-secret`; else the SPES_SECRET environment variable).
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// Accept calls without a credential (only on a network you trust).
        #[arg(long)]
        no_auth: bool,
        /// Serve plaintext on a non-loopback address (only on a network you trust).
        #[arg(long)]
        insecure: bool,
        /// Uploads received at once; more wait for a slot.
        #[arg(long, default_value_t = 4)]
        max_concurrent_uploads: usize,
        /// Cut a stream that sends nothing for this many seconds.
        #[arg(long, default_value_t = 60.0)]
        idle_timeout_s: f64,
        /// PEM certificate chain, to serve TLS.
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Initial weights (model.safetensors with this model's tensor names) instead of a fresh init.
        #[arg(long)]
        init: Option<PathBuf>,
        /// After the last round, wait this long for every node to fetch it.
        #[arg(long, default_value_t = 120.0)]
        linger_s: f64,
        /// Serve shard i of k (`0/2`, `1/2`): a deterministic slice of whole layers and
        /// tensors; nodes take every shard's URL in order (`--server URL0,URL1`).
        #[arg(long, default_value = "0/1", value_parser = parse_shard)]
        shard: (usize, usize),
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Run one node of a decentralized run: trains the shared parameters and its own experts.
    /// Its config's data.path is used; model, sync and training keys must match the server's.
    Node {
        #[command(flatten)]
        config: ConfigArgs,
        /// http://HOST:PORT, or https://HOST:PORT for a TLS server; for a sharded server
        /// (`--shard i/k`), every shard's URL in shard order, comma-separated.
        #[arg(long)]
        server: String,
        /// This node's peer id (default: the one its credential is for).
        #[arg(long)]
        peer: Option<usize>,
        /// Output directory: metrics.jsonl, checkpoints/, summary.json.
        #[arg(long)]
        out: PathBuf,
        /// File holding this node's credential (`spes credential`; else the SPES_CREDENTIAL
        /// environment variable).
        #[arg(long)]
        credential_file: Option<PathBuf>,
        /// Join a running run as a new member (peer ids beyond the configured nodes).
        #[arg(long)]
        join: bool,
        /// Send the credential in plaintext to a non-loopback http:// server.
        #[arg(long)]
        insecure: bool,
        /// PEM CA certificate to trust for https (default: the web PKI roots).
        #[arg(long)]
        tls_ca: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = ProgressArg::Bar)]
        progress: ProgressArg,
        /// Keep retrying an unreachable server this many seconds before giving up.
        #[arg(long, default_value_t = 3600.0)]
        patience_s: f64,
        #[command(flatten)]
        ranks: RanksArgs,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Write a new random run secret (owner-only) for `spes server --secret-file`.
    GenSecret {
        #[arg(long)]
        out: PathBuf,
    },
    /// Derive node credentials from the run secret: each authorizes exactly one peer id.
    /// Prints them, or writes DIR/node-<peer>.credential (owner-only) with --out.
    Credential {
        #[arg(long)]
        secret_file: PathBuf,
        #[arg(long, num_args = 1.., required = true)]
        peer: Vec<usize>,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write a self-signed TLS certificate and key (cert.pem, key.pem) for `spes server`.
    GenCert {
        #[arg(long)]
        out: PathBuf,
        /// Host names or IP addresses the certificate is valid for.
        #[arg(long, num_args = 1.., default_value = "localhost")]
        host: Vec<String>,
    },
    /// Measure tokens/s and peak memory of training steps of a preset (random tokens).
    Bench(step_bench::BenchArgs),
    /// The same steps side by side with the model written in plain PyTorch
    /// (scripts/bench_pytorch.py, eager, fused AdamW and torch.compile), alternated over
    /// several rounds: tokens/s, spes's ratio, peak memory and MFU in one table.
    BenchVsPytorch(step_bench::VsPytorchArgs),
    /// Per-node memory and traffic of SPES vs DiLoCo for presets, the server's measured
    /// aggregation throughput (bytes of uploads per second, on the first preset), and measured
    /// peak RSS of a SPES node vs a DiLoCo node training `tiny` (each in its own process).
    BenchSync {
        #[arg(long, value_delimiter = ',', default_value = "tiny,1b")]
        presets: Vec<String>,
        #[arg(long, default_value_t = 4)]
        nodes: usize,
        /// Bytes per value on the wire: 4 (fp32) or 2 (bf16).
        #[arg(long, default_value_t = 4)]
        wire_bytes: u64,
        /// Rounds of the server-aggregation measurement (on the first preset).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Micro-batch of the measured steps.
        #[arg(long, default_value_t = 8)]
        batch_size: usize,
        #[arg(long, default_value_t = 256)]
        seq_len: usize,
    },
    /// Print the parameter counts of the built-in model presets.
    Presets,
    /// Decentralized training on loopback: one server and 4 nodes (separate processes) train
    /// the tiny preset with SPES on the embedded corpus; writes report.md with plots.
    Demo {
        #[arg(long, default_value = "runs/demo")]
        out: PathBuf,
        /// Override a key of the embedded configs/spes-tiny.toml (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
        /// Put every node behind its own shaped loopback link, e.g. `100mbit,40ms` or
        /// `up=20mbit,down=100mbit,rtt=40ms,loss=0.1%` (rtt is the round trip).
        #[arg(long)]
        link: Option<spes_net::link::LinkSpec>,
    },
    /// Run named variants of one config (centralized, SPES, DiLoCo, overrides) on the same data
    /// and tokens for several seeds, one after another on loopback, and write a table and a
    /// plot of their validation loss (experiments/tiny-ablation.toml). Resumes.
    Experiment {
        /// The experiment spec (TOML).
        #[arg(long)]
        spec: PathBuf,
        #[arg(long, default_value = "runs/experiment")]
        out: PathBuf,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
    },
    /// What a round costs on given links, for every wire option: a discrete-event model of
    /// compute, uploads and downloads over per-node links and the server's shared link.
    PlanSync(plan_sync::Args),
    /// What one rank of a node needs in device memory, by category, with and without
    /// activation checkpointing; whether it fits, and the largest micro-batch that does.
    PlanMemory(plan_memory::Args),
    /// Measures sync on `tiny` over shaped loopback links for every wire option (server and 4
    /// nodes as processes) and prints it next to the planner's prediction.
    BenchLink(link_bench::Args),
}

/// `i/k` with `i < k`.
fn parse_shard(s: &str) -> Result<(usize, usize), String> {
    let parsed = s
        .split_once('/')
        .and_then(|(i, k)| Some((i.trim().parse().ok()?, k.trim().parse().ok()?)));
    match parsed {
        Some((i, k)) if i < k => Ok((i, k)),
        _ => Err(format!(
            "`{s}` is not a shard `i/k` with i < k, such as 0/2"
        )),
    }
}

/// A freshly initialised checkpoint (`<out>/step-0`) of a config; needs no data.
fn init_checkpoint(cfg: &RunConfig, out: &Path) -> Result<PathBuf> {
    tch::manual_seed(cfg.train.seed as i64);
    let model = spes_model::MoeModel::new(&cfg.model, tch::Device::Cpu)?;
    let tensors: Vec<(String, tch::Tensor)> = model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor))
        .collect();
    let state = spes_train::checkpoint::TrainState::fresh(cfg.clone());
    spes_train::checkpoint::save(out, state, &tensors, &[], 1)
}

/// `spes eval`: a text's perplexity and bits per byte, or task accuracies, as JSON.
fn eval(
    checkpoint: &Path,
    text: Option<&Path>,
    tasks: &[PathBuf],
    limit: Option<usize>,
    batch: usize,
    tokenizer: Option<&Path>,
    device: tch::Device,
) -> Result<serde_json::Value> {
    let ck = spes_train::checkpoint::load(checkpoint)?;
    let cfg = &ck.state.config;
    let model = spes_model::MoeModel::new(&cfg.model, device)?;
    let named: Vec<(String, tch::Tensor)> = ck
        .model
        .into_iter()
        .map(|(n, t)| (n, t.to_device(device)))
        .collect();
    model.load(&named, &checkpoint.display().to_string())?;
    let sc = scoring(cfg, tokenizer, batch, device)?;
    if let Some(path) = text {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        return Ok(serde_json::to_value(spes_eval::score_text(
            &model, &sc, &text,
        )?)?);
    }
    let mut results = Vec::new();
    for dir in tasks {
        let task = spes_eval::load_task(dir)?;
        results.push(spes_eval::score_task(&model, &sc, &task, limit, true)?);
    }
    Ok(serde_json::json!({ "tasks": results }))
}

/// How a model of `cfg` is scored: its training data's tokenizer (or `tokenizer`) and
/// windows of its training context.
fn scoring(
    cfg: &RunConfig,
    tokenizer: Option<&Path>,
    batch: usize,
    device: tch::Device,
) -> Result<spes_eval::Scoring> {
    let manifest = spes_data::Manifest::load(&cfg.data.path).ok();
    let tok_path = match (tokenizer, &manifest) {
        (Some(t), _) => t.to_owned(),
        (None, Some(m)) => cfg.data.path.join(&m.tokenizer),
        (None, None) => anyhow::bail!(
            "the checkpoint's data directory {} is gone; pass --tokenizer",
            cfg.data.path.display()
        ),
    };
    let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tok_path.display()))?;
    Ok(spes_eval::Scoring {
        tokenizer,
        eos: manifest.map_or(0, |m| m.eos_id),
        ctx: cfg.train.seq_len,
        batch,
        device,
    })
}

fn gen_cert(out: &Path, hosts: Vec<String>) -> Result<()> {
    let cert =
        rcgen::generate_simple_self_signed(hosts).context("cannot generate a certificate")?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    spes_data::shard::write_atomic(&out.join("cert.pem"), cert.cert.pem().as_bytes())?;
    spes_data::shard::write_secret(
        &out.join("key.pem"),
        cert.signing_key.serialize_pem().as_bytes(),
    )?;
    println!(
        "wrote {0}/cert.pem and {0}/key.pem: serve with --tls-cert/--tls-key, give nodes --tls-ca {0}/cert.pem",
        out.display()
    );
    Ok(())
}

fn credentials(secret_file: &Path, peers: &[usize], out: Option<&Path>) -> Result<()> {
    let secret = spes_net::auth::read_token(secret_file)?;
    for &p in peers {
        let c = spes_net::auth::credential(&secret, p);
        match out {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
                let path = dir.join(format!("node-{p}.credential"));
                spes_data::shard::write_secret(&path, c.as_bytes())?;
                println!("{}", path.display());
            }
            None => println!("{c}"),
        }
    }
    Ok(())
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    match s {
        "auto" => Ok(Precision::Auto),
        "fp32" => Ok(Precision::Fp32),
        "bf16" => Ok(Precision::Bf16),
        _ => Err(format!("expected auto, fp32 or bf16, got `{s}`")),
    }
}

fn parse_moe_kernel(s: &str) -> Result<MoeKernelChoice, String> {
    match s {
        "auto" => Ok(MoeKernelChoice::Auto),
        "loop" => Ok(MoeKernelChoice::Loop),
        "grouped" => Ok(MoeKernelChoice::Grouped),
        _ => Err(format!("expected auto, loop or grouped, got `{s}`")),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tokenize {
            input,
            out,
            tokenizer,
            train_tokenizer,
            text_field,
            val_fraction,
            shard_tokens,
            eos_token,
        } => {
            let source = match (tokenizer, train_tokenizer) {
                (Some(path), _) => TokenizerSource::File(path),
                (None, Some(vocab)) => TokenizerSource::Train(vocab),
                (None, None) => unreachable!("clap requires one of them"),
            };
            let mut opts = TokenizeOptions::new(input, out.clone(), source);
            opts.text_field = text_field;
            opts.val_fraction = val_fraction;
            opts.shard_tokens = shard_tokens;
            opts.eos_token = eos_token;
            let m = spes_data::tokenize(&opts)?;
            println!(
                "{}: {} train tokens in {} shards, {} validation tokens, vocab {} ({:?}), eos {}",
                out.display(),
                m.train_tokens,
                m.train.len(),
                m.val_tokens,
                m.vocab_size,
                m.dtype,
                m.eos_id
            );
        }
        Command::Train {
            config,
            out,
            resume,
            init,
            ranks,
            runtime,
        } => {
            let cfg = config.load()?;
            if let Some(g) = ranks.local_ranks.filter(|&g| g > 1) {
                return local_ranks::launch(g);
            }
            train(cfg, &out, resume, init.as_deref(), &runtime, &ranks)?;
        }
        Command::Bench(args) => step_bench::run_bench(&args)?,
        Command::BenchVsPytorch(args) => step_bench::run_vs_pytorch(&args)?,
        Command::BenchSync {
            presets,
            nodes,
            wire_bytes,
            batch_size,
            seq_len,
            rounds,
        } => {
            sync_bench::traffic_table(&presets, nodes, wire_bytes)?;
            sync_bench::aggregation(&presets[0], nodes, rounds)?;
            sync_bench::measured_rss("tiny", nodes, batch_size, seq_len)?;
        }
        Command::Presets => {
            println!("| preset | total | active | shared | per expert |");
            println!("|---|---|---|---|---|");
            for name in PRESETS {
                let n = ModelConfig::preset(name)?.param_counts();
                let b = |x: u64| format!("{:.3} B", x as f64 / 1e9);
                println!(
                    "| {name} | {} | {} | {} | {:.2} M |",
                    b(n.total),
                    b(n.active),
                    b(n.shared),
                    n.per_expert as f64 / 1e6
                );
            }
        }
        Command::Server {
            config,
            listen,
            out,
            secret_file,
            no_auth,
            insecure,
            max_concurrent_uploads,
            idle_timeout_s,
            tls_cert,
            tls_key,
            init,
            linger_s,
            shard,
            runtime,
        } => {
            let cfg = config.load()?;
            let secret = secret_from(secret_file.as_deref(), "SPES_SECRET")?;
            if secret.is_none() && !no_auth {
                anyhow::bail!(
                    "the server needs the run secret: --secret-file FILE (spes gen-secret makes \
                     one) or SPES_SECRET (or --no-auth to accept anyone)"
                );
            }
            let tls = match (tls_cert, tls_key) {
                (Some(c), Some(k)) => Some((
                    spes_net::auth::read_pem(&c, "TLS certificate")?,
                    spes_net::auth::read_pem(&k, "TLS key")?,
                )),
                _ => None,
            };
            if tls.is_none() && !listen.ip().is_loopback() && !insecure {
                anyhow::bail!(
                    "refusing to serve {listen} in plaintext: credentials and models would cross \
                     the network unencrypted. Give --tls-cert/--tls-key (spes gen-cert makes \
                     them), listen on 127.0.0.1, or pass --insecure on a network you trust"
                );
            }
            if !(idle_timeout_s > 0.0 && idle_timeout_s.is_finite()) {
                anyhow::bail!("--idle-timeout-s must be a positive number of seconds");
            }
            let opts = spes_net::ServerOptions {
                cfg,
                out,
                secret,
                tls,
                init,
                device: runtime.device()?,
                linger_s,
                shard,
                limits: spes_net::Limits {
                    max_concurrent_uploads,
                    idle_timeout: std::time::Duration::from_secs_f64(idle_timeout_s),
                    ..Default::default()
                },
            };
            let summary = spes_net::server::run(opts, listen)?;
            println!("{}", serde_json::to_string_pretty(&summary)?);
        }
        Command::Node {
            config,
            server,
            peer,
            out,
            credential_file,
            join,
            insecure,
            tls_ca,
            progress,
            patience_s,
            ranks,
            runtime,
        } => {
            let cfg = config.load()?;
            if let Some(g) = ranks.local_ranks.filter(|&g| g > 1) {
                return local_ranks::launch(g);
            }
            let (device, rendezvous) = rank_setup(&runtime, &ranks)?;
            let data_parallel = match rendezvous {
                Some(r) => {
                    let dp = spes_train::data_parallel::DataParallel::join(&r, device)?;
                    if !dp.is_first() {
                        // Rank 0 talks to the server; the other ranks train with it.
                        return spes_train::follow(dp, device);
                    }
                    Some(dp)
                }
                None => None,
            };
            let credential = secret_from(credential_file.as_deref(), "SPES_CREDENTIAL")?;
            let peer = match (
                peer,
                credential
                    .as_deref()
                    .and_then(spes_net::auth::credential_peer),
            ) {
                (Some(p), _) | (None, Some(p)) => p,
                (None, None) => {
                    anyhow::bail!("give --peer, or a --credential-file to take it from")
                }
            };
            let opts = spes_net::NodeOptions {
                cfg,
                server,
                peer,
                out,
                credential,
                tls_ca: tls_ca
                    .map(|p| spes_net::auth::read_pem(&p, "TLS CA certificate"))
                    .transpose()?,
                device,
                progress: match progress {
                    ProgressArg::Bar => spes_net::Progress::Bar,
                    ProgressArg::Json => spes_net::Progress::Json,
                    ProgressArg::Quiet => spes_net::Progress::Quiet,
                },
                patience_s,
                join,
                insecure,
                data_parallel,
            };
            let summary = spes_net::Node::connect(opts)?.run()?;
            if progress != ProgressArg::Json {
                println!("{}", serde_json::to_string_pretty(&summary)?);
            }
        }
        Command::GenSecret { out } => {
            if out.exists() {
                anyhow::bail!(
                    "{} exists; remove it first to make a new secret",
                    out.display()
                );
            }
            spes_data::shard::write_secret(&out, new_secret().as_bytes())?;
            println!("wrote {} (owner-only): give it to `spes server --secret-file` and make node credentials with `spes credential`", out.display());
        }
        Command::Credential {
            secret_file,
            peer,
            out,
        } => credentials(&secret_file, &peer, out.as_deref())?,
        Command::GenCert { out, host } => gen_cert(&out, host)?,
        Command::Init { config, out } => {
            let dir = init_checkpoint(&config.load()?, &out)?;
            println!("{}", dir.display());
        }
        Command::ExportHf {
            checkpoint,
            out,
            dtype,
            max_shard_gb,
            tokenizer,
        } => {
            let summary = spes_hf::export(&spes_hf::ExportOptions {
                checkpoint,
                out,
                dtype: if dtype == "bf16" {
                    spes_hf::ExportDtype::Bf16
                } else {
                    spes_hf::ExportDtype::Fp32
                },
                max_shard_bytes: (max_shard_gb * 1e9) as u64,
                tokenizer,
            })?;
            println!("{}", serde_json::to_string_pretty(&summary)?);
        }
        Command::Upcycle {
            from,
            experts,
            top_k,
            raw_topk,
            noise_std,
            noise_fraction,
            router,
            seed,
            data,
            out,
        } => {
            let dir = spes_hf::upcycle(&spes_hf::UpcycleOptions {
                from,
                experts,
                top_k,
                normalize_topk: !raw_topk,
                noise_std,
                noise_fraction,
                router: if router == "normal" {
                    spes_hf::RouterInit::Normal(0.02)
                } else {
                    spes_hf::RouterInit::Zeros
                },
                seed,
                out,
                data,
            })?;
            println!("wrote {}", dir.display());
        }
        Command::Eval {
            checkpoint,
            text,
            tasks,
            limit,
            batch_size,
            tokenizer,
            out,
            runtime,
        } => {
            let device = runtime.device()?;
            let result = eval(
                &checkpoint,
                text.as_deref(),
                &tasks,
                limit,
                batch_size,
                tokenizer.as_deref(),
                device,
            )?;
            let json = serde_json::to_string_pretty(&result)?;
            match out {
                Some(path) => spes_data::shard::write_atomic(&path, json.as_bytes())?,
                None => println!("{json}"),
            }
        }
        Command::PlanSync(args) => plan_sync::run(args)?,
        Command::PlanMemory(args) => plan_memory::run(args)?,
        Command::BenchLink(args) => link_bench::run(args)?,
        Command::Experiment { spec, out, device } => {
            let name = device.to_possible_value().expect("named");
            let dev = device::select(device)?;
            experiment::run(&spec, &out, dev, name.get_name()).context("experiment failed")?;
        }
        Command::Demo {
            out,
            overrides,
            device,
            link,
        } => {
            let device = device
                .to_possible_value()
                .expect("named")
                .get_name()
                .to_owned();
            demo::run(&out, &overrides, &device, link).context("demo failed")?;
        }
    }
    Ok(())
}
