//! `spes server`: the parameter server of a decentralized run (spes-net's `server`), behind the
//! checks that keep credentials and models off the network in plaintext.

use crate::args::{ConfigArgs, RuntimeArgs, StoreArgs};
use crate::auth::secret_from;
use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Run the SPES (or DiLoCo) parameter server of a decentralized run.
/// The config needs a [sync] section with mode = "spes" or "diloco".
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Address to serve on. Anything but loopback needs TLS (or --insecure).
    #[arg(long, default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,
    /// Output directory: metrics.jsonl, global/, checkpoints/, server.json (restart point);
    /// with --store, a working copy of what the store keeps.
    #[arg(long)]
    pub out: PathBuf,
    /// File whose first line is the run secret that node credentials derive from
    /// (`spes auth secret`; else the SPES_SECRET environment variable).
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Accept calls without a credential (only on a network you trust).
    #[arg(long)]
    pub no_auth: bool,
    /// Serve plaintext on a non-loopback address (only on a network you trust).
    #[arg(long)]
    pub insecure: bool,
    /// Uploads received at once; more wait for a slot.
    #[arg(long, default_value_t = 4)]
    pub max_concurrent_uploads: usize,
    /// Cut a stream that sends nothing for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout_s: f64,
    /// PEM certificate chain, to serve TLS.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Initial weights (model.safetensors with this model's tensor names) instead of a fresh init.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// After the last round, wait this long for every node to fetch it.
    #[arg(long, default_value_t = 120.0)]
    pub linger_s: f64,
    /// Serve shard i of k (`0/2`, `1/2`): a deterministic slice of whole layers and
    /// tensors; nodes take every shard's URL in order (`--server URL0,URL1`).
    #[arg(long, default_value = "0/1", value_parser = parse_shard)]
    pub shard: (usize, usize),
    /// Serve the operator's view over HTTP here: the live run page at `/`, `/api/run` and
    /// Prometheus `/metrics`. Loopback is open to the machine; any other address needs TLS
    /// (--tls-cert) and the viewer credential (`spes auth credential --viewer`) on every request.
    #[arg(long)]
    pub http: Option<SocketAddr>,
    /// Take each round's wire and overlap from an adaptive run's `choices.json` instead of
    /// choosing them: a rerun of that run reproduces it.
    #[arg(long)]
    pub replay_choices: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// `spes server`: serves until the last round is published and fetched; prints the summary.
pub fn run(a: Args) -> Result<()> {
    let Args {
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
        http,
        replay_choices,
        store,
        runtime,
    } = a;
    let cfg = config.load()?;
    let secret = secret_from(secret_file.as_deref(), "SPES_SECRET")?;
    if secret.is_none() && !no_auth {
        anyhow::bail!(
            "the server needs the run secret: --secret-file FILE (spes auth secret makes \
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
                 the network unencrypted. Give --tls-cert/--tls-key (spes auth cert makes \
                 them), listen on 127.0.0.1, or pass --insecure on a network you trust"
        );
    }
    if !(idle_timeout_s > 0.0 && idle_timeout_s.is_finite()) {
        anyhow::bail!("--idle-timeout-s must be a positive number of seconds");
    }
    let http = match http {
        Some(addr) => {
            let opts = spes_net::view::http::HttpOptions {
                tls: tls.clone(),
                token: (!addr.ip().is_loopback())
                    .then(|| secret.as_deref().map(spes_net::auth::viewer_credential))
                    .flatten(),
            };
            opts.check(addr)?;
            let listener = std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen on {addr} for --http"))?;
            Some((listener, opts))
        }
        None => None,
    };
    // Checked by `open` (with --store; without it, the default).
    let opened = store.open(shard)?;
    let url_lifetime = std::time::Duration::from_secs_f64(store.store_url_lifetime_s);
    let store = opened;
    if let Some(s) = &store {
        tracing::info!(
            "keeping the run's state in {} besides {}",
            s.url(),
            out.display()
        );
    }
    let replay = replay_choices
        .as_deref()
        .map(spes_net::settings::Choices::read)
        .transpose()?;
    let opts = spes_net::ServerOptions {
        store,
        replay,
        cfg,
        out,
        secret,
        tls,
        init,
        device: runtime.device()?,
        linger_s,
        shard,
        http,
        limits: spes_net::Limits {
            max_concurrent_uploads,
            idle_timeout: std::time::Duration::from_secs_f64(idle_timeout_s),
            url_lifetime,
            ..Default::default()
        },
    };
    let summary = spes_net::server::run(opts, listen)?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
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
