//! Opening the node's link: a gRPC client per server shard, with TLS where the URL asks for it
//! and keepalives that find a black-holed connection; the credential never goes in plaintext to
//! a host that is not loopback unless the operator says so.

use super::transport::{call, explain, retry, Client, Link, Shard};
use super::NodeOptions;
use crate::auth::{is_loopback_url, AddToken};
use crate::payload;
use crate::proto::spes_client::SpesClient;
use crate::proto::SettingsRequest;
use anyhow::{bail, Context, Result};
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// A client of the server at `url` that sends `credential` with every call (a node's, or the
/// viewer's for `spes status`), trusting `tls_ca` (else the web PKI roots) for `https`.
/// Refuses to send a credential in plaintext off loopback unless `insecure`.
pub(crate) fn client(
    url: &str,
    credential: Option<&str>,
    tls_ca: Option<&[u8]>,
    insecure: bool,
) -> Result<Client> {
    if url.starts_with("http://") && credential.is_some() && !insecure && !is_loopback_url(url) {
        bail!(
            "refusing to send the credential in plaintext to {url}: use https:// (the \
             server needs --tls-cert/--tls-key), or pass --insecure on a network you trust"
        );
    }
    // Keepalive pings find a black-holed connection within ~15 s; the channel then reconnects.
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .with_context(|| format!("--server `{url}` is not a valid URL"))?
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .tcp_keepalive(Some(Duration::from_secs(30)));
    if url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        tls = match tls_ca {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(ca)),
            None => tls.with_webpki_roots(),
        };
        endpoint = endpoint
            .tls_config(tls)
            .context("invalid TLS configuration")?;
    }
    let channel = endpoint.connect_lazy();
    Ok(
        SpesClient::with_interceptor(channel, AddToken::new(credential)?)
            .max_decoding_message_size(payload::MAX_MESSAGE_BYTES),
    )
}

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
