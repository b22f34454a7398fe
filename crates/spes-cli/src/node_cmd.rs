//! `spes node`: one node of a decentralized run (spes-net's `node`), alone or as rank 0 of
//! several data-parallel ranks (the others train beside it).

use crate::args::{rank_setup, ConfigArgs, RanksArgs, RuntimeArgs};
use crate::auth::secret_from;
use crate::local_ranks;
use anyhow::{bail, Result};
use spes_train::RunConfig;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How a node shows its progress.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
pub enum ProgressArg {
    Bar,
    Json,
    Quiet,
}

/// Run one node of a decentralized run: trains the shared parameters and its own experts.
/// The run's settings come from the server; the node names its own data
/// (`--set data.path=DIR`). With `--config`, that file's model, sync and training keys must
/// match the server's.
#[derive(clap::Args)]
pub struct Args {
    /// A config file of the run (optional): its data and node-local keys are used, its other
    /// keys checked against the server's. Without it the node takes the run's settings from
    /// the server and writes them to <out>/run-settings.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. --set data.path=runs/data (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// http://HOST:PORT, or https://HOST:PORT for a TLS server; for a sharded server
    /// (`--shard i/k`), every shard's URL in shard order, comma-separated.
    #[arg(long)]
    pub server: String,
    /// This node's peer id (default: the one its credential is for).
    #[arg(long)]
    pub peer: Option<usize>,
    /// Output directory: metrics.jsonl, checkpoints/, summary.json.
    #[arg(long)]
    pub out: PathBuf,
    /// File holding this node's credential (`spes auth credential`; else the SPES_CREDENTIAL
    /// environment variable).
    #[arg(long)]
    pub credential_file: Option<PathBuf>,
    /// Join a running run as a new member (peer ids beyond the configured nodes).
    #[arg(long)]
    pub join: bool,
    /// Send the credential in plaintext to a non-loopback http:// server.
    #[arg(long)]
    pub insecure: bool,
    /// PEM CA certificate to trust for https (default: the web PKI roots).
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = ProgressArg::Bar)]
    pub progress: ProgressArg,
    /// Keep retrying an unreachable server this many seconds before giving up.
    #[arg(long, default_value_t = 3600.0)]
    pub patience_s: f64,
    /// Serve this node's own Prometheus `/metrics` on a loopback address (what it also
    /// reports to the server with each heartbeat).
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub ranks: RanksArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// `spes node`: trains until the run's last round; prints the summary (unless `--progress json`).
pub fn run(a: Args) -> Result<()> {
    let Args {
        config,
        overrides,
        server,
        peer,
        out,
        credential_file,
        join,
        insecure,
        tls_ca,
        progress,
        patience_s,
        metrics_listen,
        ranks,
        runtime,
    } = a;
    let local = config
        .map(|config| ConfigArgs {
            config,
            overrides: overrides.clone(),
        })
        .map(|c| c.load())
        .transpose()?;
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
    let tls_ca = tls_ca
        .map(|p| spes_net::auth::read_pem(&p, "TLS CA certificate"))
        .transpose()?;
    let cfg = match local {
        Some(cfg) => cfg,
        None => {
            let from = spes_net::node::SettingsSource {
                server: &server,
                peer,
                credential: credential.as_deref(),
                tls_ca: tls_ca.as_deref(),
                insecure,
                patience: Duration::from_secs_f64(patience_s),
            };
            config_from_server(&from, &overrides, &out)?
        }
    };
    let metrics_listener = match metrics_listen {
        Some(addr) => {
            spes_net::view::http::HttpOptions::default().check(addr)?;
            Some(std::net::TcpListener::bind(addr).map_err(|e| {
                anyhow::anyhow!("cannot listen on {addr} for --metrics-listen: {e}")
            })?)
        }
        None => None,
    };
    let opts = spes_net::NodeOptions {
        cfg,
        server,
        peer,
        out,
        credential,
        tls_ca,
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
        metrics_listener,
    };
    let summary = spes_net::Node::connect(opts)?.run()?;
    if progress != ProgressArg::Json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}

/// The config of a node started without one: the run's settings from its server with this
/// node's `--set`, recorded in `<out>/run-settings.toml`. A node that holds a checkpoint refuses
/// settings that changed since it recorded them, naming the key.
fn config_from_server(
    from: &spes_net::node::SettingsSource,
    overrides: &[String],
    out: &Path,
) -> Result<RunConfig> {
    let settings = spes_net::node::run_settings(from)?;
    let cfg = RunConfig::from_run_settings(&settings, overrides)?;
    if cfg.data.path.as_os_str().is_empty() && cfg.data.sources.is_empty() {
        bail!(
            "this node names no data: add --set data.path=DIR (its own copy of the run's \
             tokenized corpus), or give --config with a [data] section"
        );
    }
    let recorded = out.join("run-settings.toml");
    let holds = spes_train::checkpoint::latest(&out.join("checkpoints"))?.is_some();
    if let Some(change) = RunConfig::keep_settings(&recorded, &settings, holds)? {
        bail!(
            "the run's settings changed since this node's checkpoint in {}: {change}; \
             start the node with a new --out, or the server with the run's config",
            out.display()
        );
    }
    tracing::info!(
        "node {}: the run's settings from {} (kept in {}):\n{settings}",
        from.peer,
        from.server,
        recorded.display()
    );
    Ok(cfg)
}
