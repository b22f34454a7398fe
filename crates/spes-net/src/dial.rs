//! Dialing the server: a gRPC client with TLS where the URL asks for it and keepalives that
//! find a black-holed connection, the credential never sent in plaintext to a host that is not
//! loopback unless the operator says so; and what a failed call means to a user. Nodes
//! ([`crate::node`]) and `spes status` ([`crate::view::client`]) both dial through here.

use crate::auth::{is_loopback_url, AddToken};
use crate::payload;
use crate::proto::spes_client::SpesClient;
use anyhow::{bail, Context, Result};
use std::time::Duration;
use tonic::codegen::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

/// A client of the server that sends a credential with every call.
pub(crate) type Client = SpesClient<InterceptedService<Channel, AddToken>>;

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

/// Turns a final gRPC failure into an error that says what to do.
pub(crate) fn explain(s: Status, server: &str) -> anyhow::Error {
    match s.code() {
        Code::Unauthenticated => anyhow::anyhow!(
            "{server} rejected this node's credential: check --credential-file (made by `spes auth credential` from the run secret)"
        ),
        Code::Unavailable => anyhow::anyhow!("cannot reach {server}: {}", s.message()),
        _ => anyhow::anyhow!("{server} refused: {}", s.message()),
    }
}
