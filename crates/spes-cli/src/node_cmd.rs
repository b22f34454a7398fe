//! `spes node`: one node of a decentralized run (spes-net's `node`), alone or as rank 0 of
//! several data-parallel ranks (the others train beside it).

use crate::args::{rank_setup, ConfigArgs, RanksArgs, RuntimeArgs};
use crate::local_ranks;
use crate::secrets::secret_from;
use anyhow::Result;
use std::path::PathBuf;

/// How a node shows its progress.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
pub enum ProgressArg {
    Bar,
    Json,
    Quiet,
}

/// Run one node of a decentralized run: trains the shared parameters and its own experts.
/// Its config's data.path is used; model, sync and training keys must match the server's.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
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
    /// File holding this node's credential (`spes credential`; else the SPES_CREDENTIAL
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
        metrics_listener,
    };
    let summary = spes_net::Node::connect(opts)?.run()?;
    if progress != ProgressArg::Json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}
