//! The optional HTTP listener of a server (`--http ADDR`: the live page at `/`, `/api/run`,
//! `/metrics`) or of a node (`--metrics-listen ADDR`: its `/metrics`), on axum.
//!
//! Off unless asked for. On loopback it is open to the machine; anywhere else it needs TLS
//! (the server's certificate) and the run's read-only viewer credential on every data route
//! (`Authorization: Bearer <viewer>`, which Prometheus's `authorization` scrape setting sends;
//! the page passes on a `?token=` it was opened with). The page itself holds no data and no
//! credential. Connections are bounded in number and in how long their headers may take.

use anyhow::{bail, Context, Result};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The live run page; it draws everything itself (no asset from anywhere else).
pub const PAGE: &str = include_str!("page.html");

/// Connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 64;

/// What a listener serves.
pub struct Endpoints {
    /// The Prometheus text of `/metrics`.
    pub metrics: Box<dyn Fn() -> String + Send + Sync>,
    /// The JSON of `/api/run`; with it, the page is served at `/`.
    pub run_json: Option<Box<dyn Fn() -> String + Send + Sync>>,
}

/// How to listen.
#[derive(Clone, Default)]
pub struct HttpOptions {
    /// PEM certificate chain and key: serve HTTPS.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    /// The credential data routes require; `None` serves them to anyone who can connect.
    pub token: Option<String>,
}

impl HttpOptions {
    /// The listener's rules: anything but loopback needs TLS and a credential.
    pub fn check(&self, listen: SocketAddr) -> Result<()> {
        if !listen.ip().is_loopback() && (self.tls.is_none() || self.token.is_none()) {
            bail!(
                "refusing an HTTP listener on {}: off loopback it needs TLS (--tls-cert/--tls-key) \
                 and the run secret, whose viewer credential (spes auth credential --viewer) it then \
                 asks for; or listen on 127.0.0.1 and tunnel to it",
                listen
            );
        }
        Ok(())
    }
}

struct Shared {
    endpoints: Endpoints,
    token: Option<String>,
}

impl Shared {
    /// Whether a request carries the listener's credential (always, without one).
    fn allowed(&self, headers: &HeaderMap) -> bool {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        self.matches(given)
    }

    fn matches(&self, given: Option<&str>) -> bool {
        match &self.token {
            None => true,
            Some(token) => given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())),
        }
    }
}

/// The page's empty slot for the embedded view.
const INITIAL_SLOT: &str = r#"<script id="initial" type="application/json"></script>"#;

/// The page with `json` embedded for its first render; `</` is escaped so the JSON cannot
/// end the script element whatever its strings hold.
fn page_with(json: &str) -> String {
    let safe = json.replace("</", "<\\/");
    PAGE.replacen(
        INITIAL_SLOT,
        &format!(r#"<script id="initial" type="application/json">{safe}</script>"#),
        1,
    )
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn reply(content_type: &'static str, body: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        ],
        body,
    )
        .into_response()
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "this listener needs the run's viewer credential: Authorization: Bearer <spes auth credential --viewer>\n",
    )
        .into_response()
}

async fn metrics(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if !s.allowed(&headers) {
        return unauthorized();
    }
    match off_runtime(&s, |e| Some((e.metrics)())).await {
        Some(text) => reply(super::prom::CONTENT_TYPE, text),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Runs `f` on the blocking pool: building a view takes the server's locks, which a round's
/// close can hold for seconds, and the runtime's workers also serve gRPC.
async fn off_runtime(
    s: &Arc<Shared>,
    f: impl FnOnce(&Endpoints) -> Option<String> + Send + 'static,
) -> Option<String> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || f(&s.endpoints))
        .await
        .ok()
        .flatten()
}

async fn run_json(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if !s.allowed(&headers) {
        return unauthorized();
    }
    if s.endpoints.run_json.is_none() {
        return StatusCode::NOT_FOUND.into_response();
    }
    match off_runtime(&s, |e| e.run_json.as_ref().map(|f| f())).await {
        Some(json) => reply("application/json", json),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn page(
    State(s): State<Arc<Shared>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if s.endpoints.run_json.is_none() {
        return reply(
            "text/plain; charset=utf-8",
            "a spes node: see /metrics\n".into(),
        );
    }
    // With the credential (a header, or the `?token=` the page was opened with) the page
    // comes with the view inside; without it, an empty page that asks with the token.
    let allowed = s.allowed(&headers) || s.matches(query.get("token").map(String::as_str));
    let view = match allowed {
        true => off_runtime(&s, |e| e.run_json.as_ref().map(|f| f())).await,
        false => None,
    };
    let html = match view {
        Some(json) => page_with(&json),
        None => PAGE.to_owned(),
    };
    let mut r = reply("text/html; charset=utf-8", html);
    // The page may talk to this listener only, and load nothing from anywhere.
    r.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src data:",
        ),
    );
    r
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/run", get(run_json))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

fn tls_acceptor(cert: &[u8], key: &[u8]) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .context("the TLS certificate is not PEM")?;
    let key = PrivateKeyDer::from_pem_slice(key).context("the TLS key is not a PEM private key")?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("the TLS certificate does not match its key")?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Serves `endpoints` on a bound `listener` until `shutdown` resolves.
pub async fn serve(
    listener: std::net::TcpListener,
    opts: HttpOptions,
    endpoints: Endpoints,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    opts.check(listener.local_addr()?)?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let tls = opts
        .tls
        .as_ref()
        .map(|(c, k)| tls_acceptor(c, k))
        .transpose()?;
    let app = router(Arc::new(Shared {
        endpoints,
        token: opts.token.clone(),
    }));
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            p = slots.clone().acquire_owned() => p.expect("the semaphore stays open"),
        };
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("http listener: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (app, tls) = (app.clone(), tls.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let svc = hyper_util::service::TowerToHyperService::new(app);
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10));
            let served = match tls {
                Some(acceptor) => {
                    match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(s)) => builder.serve_connection(TokioIo::new(s), svc).await,
                        _ => return,
                    }
                }
                None => builder.serve_connection(TokioIo::new(stream), svc).await,
            };
            if let Err(e) = served {
                tracing::debug!("http connection: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_loopback_needs_tls_and_a_credential() {
        let check = |a: &str, tls: bool, token: bool| {
            HttpOptions {
                tls: tls.then(|| (Vec::new(), Vec::new())),
                token: token.then(|| "t".to_owned()),
            }
            .check(a.parse().unwrap())
        };
        assert!(check("127.0.0.1:0", false, false).is_ok());
        assert!(check("[::1]:0", false, false).is_ok());
        for (tls, token) in [(false, false), (true, false), (false, true)] {
            let e = check("0.0.0.0:9090", tls, token).unwrap_err();
            assert!(e.to_string().contains("needs TLS"), "{e}");
        }
        assert!(check("0.0.0.0:9090", true, true).is_ok());
    }

    #[test]
    fn data_needs_the_credential_and_the_page_embeds_the_view_safely() {
        let shared = |token: Option<&str>| Shared {
            endpoints: Endpoints {
                metrics: Box::new(String::new),
                run_json: None,
            },
            token: token.map(str::to_owned),
        };
        let mut headers = HeaderMap::new();
        assert!(shared(None).allowed(&headers), "loopback: open");
        assert!(!shared(Some("v")).allowed(&headers));
        headers.insert(header::AUTHORIZATION, "Bearer w".parse().unwrap());
        assert!(!shared(Some("v")).allowed(&headers));
        headers.insert(header::AUTHORIZATION, "Bearer v".parse().unwrap());
        assert!(shared(Some("v")).allowed(&headers));
        assert!(shared(Some("v")).matches(Some("v")) && !shared(Some("v")).matches(None));
        assert!(PAGE.contains(INITIAL_SLOT), "the page has its slot");
        let page = page_with(r#"{"text":"</script><b>"}"#);
        assert!(
            page.contains(r#"{"text":"<\/script><b>"}</script>"#),
            "escaped"
        );
        assert!(constant_time_eq(b"abc", b"abc") && !constant_time_eq(b"abc", b"abd"));
    }
}
