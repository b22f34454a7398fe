//! Who this node is: its peer id and credential, its output directory (held by a lock file, so
//! two nodes never share one), its process identity (`<out>/session`, so a restarted node takes
//! its peer id back at once while any other process is refused until the lease expires), the
//! flag the heartbeat raises when another process took the peer id, and the config it runs
//! with (the server's, checked against its own).

use super::transport::Link;
use super::NodeOptions;
use crate::auth::credential_peer;
use crate::proto::refusal::Kind as Refused;
use crate::proto::JoinRequest;
use crate::refusal;
use crate::view::report_to_proto;
use anyhow::{bail, Context, Result};
use spes_train::config::Partition;
use spes_train::metrics::NodeReport;
use spes_train::RunConfig;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::Request;

/// A node's identity and what holds it.
pub(super) struct Session {
    pub peer: usize,
    /// Process identity, sent with every lease-taking call.
    pub id: u64,
    pub out: PathBuf,
    /// Set by the heartbeat when another process took this peer id.
    pub lost: Arc<Mutex<Option<String>>>,
    /// Owns the runtime that the link and the heartbeat run on.
    pub rt: tokio::runtime::Runtime,
    _lock: std::fs::File,
}

impl Session {
    /// Checks the credential is this peer's, takes `<out>` and the process identity.
    pub fn open(opts: &NodeOptions) -> Result<Session> {
        let peer = opts.peer;
        if let Some(c) = &opts.credential {
            match credential_peer(c) {
                Some(p) if p == peer => {}
                Some(p) => bail!("this credential is for peer {p}, but --peer is {peer}"),
                None => bail!("the credential file does not hold a spes peer credential (spes auth credential makes one)"),
            }
        }
        std::fs::create_dir_all(&opts.out)
            .with_context(|| format!("cannot create {}", opts.out.display()))?;
        let lock = lock_out(&opts.out)?;
        Ok(Session {
            peer,
            id: session_of(&opts.out)?,
            out: opts.out.clone(),
            lost: Arc::new(Mutex::new(None)),
            rt: tokio::runtime::Runtime::new()?,
            _lock: lock,
        })
    }

    /// Renews the lease at every shard every `lease/4` (and right after each sync, when
    /// `synced` wakes it) on the runtime's worker threads, with the node's newest `report` and
    /// its activity counter;
    /// sets [`Session::lost`] when another process took this peer id.
    pub fn start_heartbeat(
        &self,
        link: &Link,
        lease_ms: u64,
        report: Arc<Mutex<Option<NodeReport>>>,
        synced: Arc<tokio::sync::Notify>,
    ) {
        let every = Duration::from_millis((lease_ms / 4).max(50));
        for shard in &link.shards {
            let (peer, session, client, lost, report, synced, activity) = (
                self.peer as u32,
                self.id,
                shard.client.clone(),
                self.lost.clone(),
                report.clone(),
                synced.clone(),
                link.activity.clone(),
            );
            link.handle.spawn(async move {
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(every) => {}
                        _ = synced.notified() => {}
                    }
                    let mut c = client.clone();
                    let mut req = Request::new(JoinRequest {
                        peer,
                        session,
                        join: false,
                        data_parts: Vec::new(),
                        max_experts: None,
                        report: report.lock().unwrap().as_ref().map(report_to_proto),
                        activity: activity.load(std::sync::atomic::Ordering::Relaxed),
                        protocol: crate::settings::PROTOCOL,
                    });
                    req.set_timeout(every.max(Duration::from_secs(2)));
                    match c.heartbeat(req).await {
                        Ok(_) => {}
                        Err(s) if refusal::kind(&s) == Some(Refused::PeerTaken) => {
                            *lost.lock().unwrap() = Some(s.message().to_owned());
                            return;
                        }
                        Err(s) => tracing::debug!("heartbeat: {}", s.message()),
                    }
                }
            });
        }
    }

    /// Serves the node's own Prometheus `/metrics` (its newest report) on `listener` for as
    /// long as the node runs.
    pub fn serve_metrics(
        &self,
        listener: std::net::TcpListener,
        report: Arc<Mutex<Option<NodeReport>>>,
    ) -> Result<()> {
        let peer = self.peer;
        tracing::info!(
            "node {peer}: metrics on http://{}/metrics",
            listener.local_addr()?
        );
        let endpoints = crate::view::http::Endpoints {
            metrics: Box::new(move || {
                crate::view::prom::render_nodes(&[crate::view::NodeView {
                    peer,
                    report: report.lock().unwrap().clone(),
                    ..Default::default()
                }])
            }),
            run_json: None,
        };
        let opts = crate::view::http::HttpOptions::default();
        self.rt.spawn(async move {
            let forever = std::future::pending::<()>();
            if let Err(e) = crate::view::http::serve(listener, opts, endpoints, forever).await {
                tracing::error!("node {peer}: the metrics listener failed: {e:#}");
            }
        });
        Ok(())
    }

    /// Fails once another process took this peer id.
    pub fn check_lost(&self) -> Result<()> {
        if let Some(why) = self.lost.lock().unwrap().clone() {
            bail!(
                "node {}: another process took this peer id: {why}",
                self.peer
            );
        }
        Ok(())
    }

    /// The config this node runs: the server's (as its join reply sends it), with this node's
    /// own data and node-local keys ([`RunConfig::for_node`]).
    pub fn config(&self, local: &RunConfig, server_toml: &str) -> Result<RunConfig> {
        let server = RunConfig::parse(server_toml, &[]).context("the server's config")?;
        RunConfig::for_node(server, local, self.peer)
    }
}

/// What a node's data is, for the server to check at join.
pub(super) struct DataClaim {
    /// `data.partition = "disjoint"`: the part each source holds; empty when shuffling.
    pub parts: Vec<String>,
    pub tokenizer_xxh3: String,
}

impl DataClaim {
    /// Reads the node's own `[data]` manifests.
    pub fn of(cfg: &RunConfig) -> Result<DataClaim> {
        let mut parts = Vec::new();
        let mut tokenizer_xxh3 = String::new();
        for source in cfg.data.sources() {
            let m = spes_data::Manifest::load(&source.path)?;
            if tokenizer_xxh3.is_empty() {
                tokenizer_xxh3 = m.tokenizer_xxh3.clone();
            }
            if cfg.data.partition == Partition::Disjoint {
                let id = m.part_id().with_context(|| {
                    format!(
                        "data.partition = \"disjoint\" but {} holds a whole corpus: give each \
                         node a part (spes tokenize --part p/N)",
                        source.path.display()
                    )
                })?;
                parts.push(id);
            }
        }
        Ok(DataClaim {
            parts,
            tokenizer_xxh3,
        })
    }

    /// Refuses to train on data tokenized otherwise than the server's.
    pub fn check(&self, cfg: &RunConfig, server_xxh3: &str) -> Result<()> {
        if !server_xxh3.is_empty() && server_xxh3 != self.tokenizer_xxh3 {
            bail!(
                "this node's data ({}) was tokenized with another tokenizer than the server's \
                 (checksum {} against {server_xxh3}): tokenize it with the server's tokenizer.json",
                cfg.data.primary().display(),
                self.tokenizer_xxh3
            );
        }
        Ok(())
    }
}

/// The node's process identity, kept in `<out>/session`.
fn session_of(out: &Path) -> Result<u64> {
    let path = out.join("session");
    if let Ok(text) = std::fs::read_to_string(&path) {
        if let Ok(s) = u64::from_str_radix(text.trim(), 16) {
            return Ok(s);
        }
    }
    let s = rand::random::<u64>() | 1;
    spes_data::shard::write_secret(&path, format!("{s:016x}\n").as_bytes())?;
    Ok(s)
}

/// Holds `<out>/lock` exclusively, so two nodes never share an output directory.
fn lock_out(out: &Path) -> Result<std::fs::File> {
    let path = out.join("lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    f.try_lock().map_err(|_| {
        anyhow::anyhow!(
            "another spes node is running with --out {}: give each node its own directory",
            out.display()
        )
    })?;
    Ok(f)
}
