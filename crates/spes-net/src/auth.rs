//! Shared-secret bearer tokens on every call, and TLS material (PEM files).

use anyhow::{bail, Context, Result};
use std::path::Path;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Reads a token: the first line of a file, trimmed. Empty tokens are refused.
pub fn read_token(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read token file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_owned();
    if token.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    Ok(token)
}

/// Compares in time independent of where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Server side: rejects calls without `authorization: Bearer <token>` (if a token is set).
#[derive(Clone)]
pub struct CheckToken {
    pub expected: Option<String>,
}

impl Interceptor for CheckToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(t) if same(t.as_bytes(), expected.as_bytes()) => Ok(req),
            _ => {
                let from = req.remote_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::warn!("rejected a call with a missing or wrong token from {from}");
                Err(Status::unauthenticated("missing or wrong token"))
            }
        }
    }
}

/// Client side: adds the bearer token to every call.
#[derive(Clone)]
pub struct AddToken {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl AddToken {
    pub fn new(token: Option<&str>) -> Result<Self> {
        let header = token
            .map(|t| format!("Bearer {t}").parse())
            .transpose()
            .context("the token must be printable ASCII")?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_check() {
        let mut check = CheckToken {
            expected: Some("s3cret".into()),
        };
        let mut add = AddToken::new(Some("s3cret")).unwrap();
        assert!(check.call(add.call(Request::new(())).unwrap()).is_ok());
        let mut wrong = AddToken::new(Some("s3cres")).unwrap();
        let err = check
            .call(wrong.call(Request::new(())).unwrap())
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(check.call(Request::new(())).is_err());
        let mut open = CheckToken { expected: None };
        assert!(open.call(Request::new(())).is_ok());
    }
}
