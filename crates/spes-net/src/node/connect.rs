//! Opening the node's link: a gRPC client per server shard ([`crate::dial`]), and asking the
//! server for the run's settings.

use super::transport::{call, retry, Link, Shard};
use super::NodeOptions;
use crate::dial::{client, explain};
use crate::proto::SettingsRequest;
use anyhow::{bail, Context, Result};
use std::time::Duration;

impl Link {
    /// Clients for every `--server` URL (comma-separated, in shard order), on `rt`; no call is
    /// made yet.
    pub fn open(opts: &NodeOptions, rt: &tokio::runtime::Runtime, session: u64) -> Result<Link> {
        let urls: Vec<&str> = opts
            .server
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let shards = urls
            .iter()
            .map(|url| {
                Ok(Shard {
                    client: {
                        // The channel's worker task starts on `rt`.
                        let _entered = rt.enter();
                        client(
                            url,
                            opts.credential.as_deref(),
                            opts.tls_ca.as_deref(),
                            opts.insecure,
                        )?
                    },
                    names: None,
                    full_bytes: 0,
                    delta_max: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if shards.is_empty() {
            bail!("--server names no server");
        }
        Ok(Link {
            handle: rt.handle().clone(),
            shards,
            peer: opts.peer,
            session,
            patience: Duration::from_secs_f64(opts.patience_s),
            out: opts.out.clone(),
            data_parts: Vec::new(),
            max_experts: None,
            activity: Default::default(),
            store: super::transport::StoreLinks::new(),
            read: Default::default(),
        })
    }
}

/// Where a node without a config of its own asks for the run's settings: the server at
/// `server` (shard 0 of a sharded one), as peer `peer`.
pub struct SettingsSource<'a> {
    pub server: &'a str,
    pub peer: usize,
    pub credential: Option<&'a str>,
    pub tls_ca: Option<&'a [u8]>,
    pub insecure: bool,
    /// How long to keep retrying an unreachable server.
    pub patience: Duration,
}

/// The run's settings as the server sends them ([`spes_train::RunConfig::run_settings`]), to
/// be checked by [`spes_train::RunConfig::from_run_settings`].
pub fn run_settings(from: &SettingsSource) -> Result<String> {
    let url = from
        .server
        .split(',')
        .map(str::trim)
        .find(|u| !u.is_empty())
        .context("--server names no server")?;
    let rt = tokio::runtime::Runtime::new()?;
    let client = {
        let _entered = rt.enter();
        client(url, from.credential, from.tls_ca, from.insecure)?
    };
    let peer = from.peer as u32;
    let reply = retry(rt.handle(), from.patience, "settings", || {
        let mut c = client.clone();
        async move { c.settings(call(SettingsRequest { peer })).await }
    })
    .map_err(|s| explain(s, url))?;
    Ok(reply.into_inner().settings_toml)
}
