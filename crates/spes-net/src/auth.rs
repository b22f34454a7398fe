//! Who may call the server, and TLS material (PEM files).
//!
//! The operator keeps one run secret. Each node gets a credential for exactly one peer id,
//! `spes-peer-<id>-<hex HMAC-SHA256(secret, "spes peer credential v1/<id>")>` (`spes auth credential`).
//! The server recomputes the MAC on every call, so it stores nothing per node, and a leaked
//! credential lets its holder act as that one peer only. Every request must name the peer its
//! credential authorizes ([`authorize`]).
//!
//! The run also has one read-only *viewer* credential, `spes-viewer-<hex HMAC-SHA256(secret,
//! "spes viewer credential v1")>` (`spes auth credential --viewer`), for watching a run: it may read
//! the run's status (the `Status` call, the HTTP listener's `/metrics` and `/api/run`) and
//! nothing else.

use anyhow::{bail, Context, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::Path;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

const PREFIX: &str = "spes-peer-";

fn mac(secret: &str, peer: usize) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    m.update(format!("spes peer credential v1/{peer}").as_bytes());
    m
}

const VIEWER_PREFIX: &str = "spes-viewer-";

fn viewer_mac(secret: &str) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    m.update(b"spes viewer credential v1");
    m
}

/// The read-only viewer credential of the run whose secret is `secret`.
pub fn viewer_credential(secret: &str) -> String {
    let tag = hex::encode(viewer_mac(secret).finalize().into_bytes());
    format!("{VIEWER_PREFIX}{tag}")
}

/// Whether `credential` is the run's viewer credential (checked in constant time).
pub fn is_viewer(secret: &str, credential: &str) -> bool {
    credential
        .strip_prefix(VIEWER_PREFIX)
        .and_then(|tag| hex::decode(tag).ok())
        .is_some_and(|tag| viewer_mac(secret).verify_slice(&tag).is_ok())
}

/// The credential of `peer` in the run whose secret is `secret`.
pub fn credential(secret: &str, peer: usize) -> String {
    let tag = hex::encode(mac(secret, peer).finalize().into_bytes());
    format!("{PREFIX}{peer}-{tag}")
}

/// The peer id a credential claims (not verified: only the server can).
pub fn credential_peer(credential: &str) -> Option<usize> {
    let rest = credential.strip_prefix(PREFIX)?;
    let (peer, tag) = rest.split_once('-')?;
    (tag.len() == 64).then_some(())?;
    peer.parse().ok()
}

/// Whether `credential` is the one the secret gives its peer; returns that peer.
fn verify(secret: &str, credential: &str) -> Option<usize> {
    let peer = credential_peer(credential)?;
    let tag = hex::decode(credential.rsplit_once('-')?.1).ok()?;
    mac(secret, peer).verify_slice(&tag).ok()?;
    Some(peer)
}

/// Reads a secret or credential: the first line of a file, trimmed. Empty ones are refused.
pub fn read_token(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read token file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_owned();
    if token.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    Ok(token)
}

/// Who a request's credential authorizes, set by [`CheckCredential`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    Peer(usize),
    /// The read-only viewer credential.
    Viewer,
}

/// Server side: rejects calls without a valid `authorization: Bearer <credential>` (when the
/// server has a secret) and records who it authorizes.
#[derive(Clone)]
pub struct CheckCredential {
    pub secret: Option<String>,
}

impl Interceptor for CheckCredential {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let Some(secret) = &self.secret else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let caller = given.and_then(|c| match verify(secret, c) {
            Some(peer) => Some(Caller::Peer(peer)),
            None => is_viewer(secret, c).then_some(Caller::Viewer),
        });
        match caller {
            Some(caller) => {
                req.extensions_mut().insert(caller);
                Ok(req)
            }
            None => {
                let from = req.remote_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::warn!("rejected a call with a missing or wrong credential from {from}");
                Err(Status::unauthenticated("missing or wrong credential"))
            }
        }
    }
}

/// Refuses a request that names a peer other than the one its credential authorizes, and
/// every peer's call made with the viewer credential.
pub fn authorize<T>(req: &Request<T>, claimed: u32) -> Result<usize, Status> {
    check_peer(req.extensions().get::<Caller>().copied(), claimed)
}

/// [`authorize`] for a request already taken apart.
pub fn check_peer(caller: Option<Caller>, claimed: u32) -> Result<usize, Status> {
    let claimed = claimed as usize;
    match caller {
        Some(Caller::Peer(p)) if p != claimed => Err(Status::permission_denied(format!(
            "this credential is for peer {p}, not peer {claimed}"
        ))),
        Some(Caller::Viewer) => Err(Status::permission_denied(
            "the viewer credential may only read the run's status",
        )),
        _ => Ok(claimed),
    }
}

/// Client side: adds the credential to every call.
#[derive(Clone)]
pub struct AddToken {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl AddToken {
    pub fn new(token: Option<&str>) -> Result<Self> {
        let header = token
            .map(|t| format!("Bearer {t}").parse())
            .transpose()
            .context("the credential must be printable ASCII")?;
        Ok(AddToken { header })
    }
}

impl Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// Reads a PEM file for TLS, naming it on error.
pub fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))
}

/// Whether `url`'s host is a loopback name or address (safe for plaintext).
pub fn is_loopback_url(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_authorize_one_peer() {
        let c3 = credential("s3cret", 3);
        assert_eq!(credential_peer(&c3), Some(3));
        assert_eq!(verify("s3cret", &c3), Some(3));
        assert_eq!(verify("other", &c3), None, "another run's secret");
        let forged = c3.replacen("peer-3-", "peer-4-", 1);
        assert_eq!(verify("s3cret", &forged), None, "renumbered credential");
        assert_eq!(verify("s3cret", "spes-peer-3-00"), None);

        let mut check = CheckCredential {
            secret: Some("s3cret".into()),
        };
        let mut add = AddToken::new(Some(&c3)).unwrap();
        let req = check.call(add.call(Request::new(())).unwrap()).unwrap();
        assert_eq!(authorize(&req, 3).unwrap(), 3);
        let e = authorize(&req, 2).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("for peer 3, not peer 2"),
            "{}",
            e.message()
        );
        let mut wrong = AddToken::new(Some("s3cret")).unwrap();
        let err = check
            .call(wrong.call(Request::new(())).unwrap())
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(check.call(Request::new(())).is_err());
        let viewer = viewer_credential("s3cret");
        assert!(is_viewer("s3cret", &viewer) && !is_viewer("other", &viewer));
        assert!(!is_viewer("s3cret", &c3) && credential_peer(&viewer).is_none());
        let mut as_viewer = AddToken::new(Some(&viewer)).unwrap();
        let req = check
            .call(as_viewer.call(Request::new(())).unwrap())
            .unwrap();
        assert_eq!(req.extensions().get::<Caller>(), Some(&Caller::Viewer));
        let e = authorize(&req, 3).unwrap_err();
        assert_eq!(
            e.code(),
            tonic::Code::PermissionDenied,
            "a viewer acts as no peer"
        );
        let mut open = CheckCredential { secret: None };
        let req = open.call(Request::new(())).unwrap();
        assert!(authorize(&req, 5).is_ok(), "--no-auth: any peer");
    }

    #[test]
    fn loopback_urls() {
        for u in [
            "http://127.0.0.1:5",
            "http://localhost:50051",
            "http://[::1]:9",
            "http://127.8.0.1",
        ] {
            assert!(is_loopback_url(u), "{u}");
        }
        for u in [
            "http://10.0.0.1:5",
            "http://example.org:50051",
            "http://[2001:db8::1]:9",
        ] {
            assert!(!is_loopback_url(u), "{u}");
        }
    }
}
