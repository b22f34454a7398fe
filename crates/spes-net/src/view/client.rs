//! `spes status`'s side: the server's [`RunView`] over the `Status` call, with a node's
//! credential rules (TLS off loopback; a peer's or the viewer credential).

use super::RunView;
use crate::dial::{client, explain};
use crate::proto::StatusRequest;
use anyhow::{Context, Result};
use std::time::Duration;

/// Asks the server at `url` for its view of the run.
pub async fn status(
    url: &str,
    credential: Option<&str>,
    tls_ca: Option<&[u8]>,
    insecure: bool,
) -> Result<RunView> {
    let mut client = client(url, credential, tls_ca, insecure)?;
    let mut req = tonic::Request::new(StatusRequest {});
    req.set_timeout(Duration::from_secs(20));
    let reply = client
        .status(req)
        .await
        .map_err(|s| match s.code() {
            tonic::Code::Unauthenticated => anyhow::anyhow!(
                "{url} needs a credential of the run: --credential-file with the viewer's \
                 (spes auth credential --viewer) or a node's"
            ),
            _ => explain(s, url),
        })?
        .into_inner();
    serde_json::from_str(&reply.run_json).context("the server's status is not a spes RunView")
}
