//! A run's files in object storage, named by URL: `s3://bucket/prefix` (AWS S3 and S3-compatible
//! stores: Cloudflare R2, MinIO, SeaweedFS), `gs://` and `az://` with the `gcs` and `azure`
//! features, or a plain path on local disk. Built on the `object_store` crate; this crate owns
//! what every backend must do the same way (docs/design/server-state.md#in-a-store):
//!
//! - a file is written whole or not at all (one PUT, or a multipart upload above [`PART`] bytes,
//!   each part with its SHA-256 on S3), read to a temp file, fsynced and renamed;
//! - manifests are created, never rewritten ([`RunStore::create`] sends `If-None-Match: *`), so a
//!   second writer of the same run is found, not silently overwritten;
//! - every call retries with backoff for at most [`RETRY_TIMEOUT`], each retry logged;
//! - keys come from the environment or an owner-only file ([`StoreOptions::credentials`]),
//!   never from a URL, and nothing here logs or displays them;
//! - [`RunStore::check`] turns wrong keys and a skewed clock into one clear error at start.
//!
//! The API is blocking: each call runs on the store's own runtime, so callers on plain threads,
//! in `spawn_blocking` or (at start-up) in an async task use it directly.

mod credentials;
pub mod links;

use credentials::Credentials;

/// The byte buffers calls take and return.
pub use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as Key;
use object_store::signer::Signer;
use object_store::{
    ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig,
    WriteMultipart,
};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Files above this size go up as a multipart upload in parts of this size (S3 takes at most
/// 5 GB in one PUT and 10,000 parts: 640 GB).
pub const PART: usize = 64 << 20;
/// The most one PUT takes (S3's limit: 5 GB); larger files go up in parts.
pub const MAX_PUT: u64 = 5_000_000_000;
/// The longest one call keeps retrying a store that fails or does not answer.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(120);
/// A clock further than this from the store's is refused (S3 refuses signatures past 15 min).
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);
/// Parts of a multipart upload in flight at once.
const PARTS_IN_FLIGHT: usize = 4;

/// How to reach a store beyond its URL.
#[derive(Clone, Debug, Default)]
pub struct StoreOptions {
    /// Accept a plain `http://` endpoint (a store on loopback or a network you trust).
    pub allow_http: bool,
    /// An owner-only TOML file with the store's keys; without it they come from the
    /// environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, ...).
    pub credentials: Option<PathBuf>,
}

/// What went wrong with a store, by kind; the message names the store and the object.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {url}: {what}")]
    Config { url: String, what: String },
    #[error(
        "store {url} refused the keys spes used ({why}); check AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY (or --store-credentials) and that they may read, write, list \
         and delete under the run's prefix"
    )]
    Denied { url: String, why: &'static str },
    #[error(
        "this machine's clock is {skew_s:+.0} s off the clock of store {url}; signed requests \
         fail past 15 minutes: set the clock (NTP) and start again"
    )]
    Clock { url: String, skew_s: f64 },
    #[error("store {url}: {op} {key}: {source}")]
    Call {
        url: String,
        op: &'static str,
        key: String,
        source: Box<object_store::Error>,
    },
    #[error("{}: {source}", path.display())]
    Local {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What [`RunStore::create`] found.
#[derive(Debug, PartialEq)]
pub enum Created {
    /// The object was written.
    Written,
    /// An object of that name was there already: its content.
    Exists(Bytes),
}

/// One object under the run's prefix.
#[derive(Clone, Debug, PartialEq)]
pub struct Listed {
    /// Relative to the prefix.
    pub key: String,
    /// Its size.
    pub bytes: u64,
}

/// A run's folder in a store.
pub struct RunStore {
    inner: Arc<dyn ObjectStore>,
    /// What presigns GET URLs (`None`: a store without them, local disk).
    signer: Option<Arc<dyn Signer>>,
    /// Bytes this process put in the store (whole files and parts), for the run's egress.
    bytes_put: AtomicU64,
    prefix: Key,
    url: String,
    /// Where a signed request would go, for the clock check (`None`: not an HTTP store).
    endpoint: Option<String>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for RunStore {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which an async context forbids; nothing is left to wait for.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl std::fmt::Debug for RunStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunStore({})", self.url)
    }
}

impl RunStore {
    /// The store named by `url`: `s3://bucket/prefix`, `gs://…`, `az://…`, `file:///path` or a
    /// plain path (created if missing).
    pub fn open(url: &str, opts: &StoreOptions) -> Result<RunStore, StoreError> {
        let config = |what: String| StoreError::Config {
            url: url.to_owned(),
            what,
        };
        let (scheme, rest) = url.split_once("://").unwrap_or(("file", url));
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if scheme != "file" && bucket.is_empty() {
            return Err(config("no bucket named".into()));
        }
        if scheme != "file" && bucket.contains('@') {
            return Err(config(
                "keys in the URL would be shown wherever the URL is: give them in the \
                 environment or --store-credentials"
                    .into(),
            ));
        }
        if opts.credentials.is_some() && (scheme == "gs" || scheme == "az") {
            return Err(config(format!(
                "--store-credentials holds S3 keys; a {scheme}:// store takes its own from the environment"
            )));
        }
        let ((inner, signer), endpoint, prefix): (WithSigner, _, _) = match scheme {
            "s3" => {
                let (s3, endpoint) = s3(bucket, opts).map_err(config)?;
                let s3 = Arc::new(s3);
                ((s3.clone(), Some(s3)), Some(endpoint), prefix)
            }
            "gs" => (gcs(bucket).map_err(config)?, None, prefix),
            "az" => (azure(bucket).map_err(config)?, None, prefix),
            "file" => {
                let dir = PathBuf::from(rest);
                std::fs::create_dir_all(&dir).map_err(|e| StoreError::Local {
                    path: dir.clone(),
                    source: e,
                })?;
                let local = LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| config(e.to_string()))?
                    .with_automatic_cleanup(true)
                    // A manifest must never outlive the files it names on a power loss.
                    .with_fsync(true);
                ((Arc::new(local), None), None, "")
            }
            other => {
                return Err(config(format!(
                    "unknown scheme `{other}://`; expected s3://, gs://, az://, file:// or a path"
                )))
            }
        };
        Ok(RunStore {
            inner,
            signer,
            bytes_put: AtomicU64::new(0),
            prefix: Key::from(prefix),
            url: url.to_owned(),
            endpoint,
            rt: Some(runtime()),
        })
    }

    /// A store in memory, for unit tests.
    #[cfg(test)]
    pub fn memory() -> RunStore {
        RunStore {
            inner: Arc::new(object_store::memory::InMemory::new()),
            signer: None,
            bytes_put: AtomicU64::new(0),
            prefix: Key::default(),
            url: "memory://".into(),
            endpoint: None,
            rt: Some(runtime()),
        }
    }

    /// The URL it was opened with (no keys are ever part of it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Bytes this process has put in the store so far.
    pub fn bytes_put(&self) -> u64 {
        self.bytes_put.load(Ordering::Relaxed)
    }

    /// Whether [`RunStore::presign_get`] can hand out URLs (S3, GCS and Azure stores can).
    pub fn presigns(&self) -> bool {
        self.signer.is_some()
    }

    /// A URL that lets its holder GET `key`, and nothing else, for `lifetime`; `None` for a
    /// store that cannot presign. Signed locally: no call to the store. The URL is a
    /// credential until it expires: log it only through [`links::redact`].
    pub fn presign_get(&self, key: &str, lifetime: Duration) -> Result<Option<String>, StoreError> {
        self.presign(object_store::signer::Method::GET, key, lifetime)
    }

    /// As [`RunStore::presign_get`], a URL that lets its holder PUT `key` (one object of at
    /// most [`MAX_PUT`] bytes).
    pub fn presign_put(&self, key: &str, lifetime: Duration) -> Result<Option<String>, StoreError> {
        self.presign(object_store::signer::Method::PUT, key, lifetime)
    }

    fn presign(
        &self,
        method: object_store::signer::Method,
        key: &str,
        lifetime: Duration,
    ) -> Result<Option<String>, StoreError> {
        let Some(signer) = &self.signer else {
            return Ok(None);
        };
        let k = self.key(key);
        self.block(signer.signed_url(method, &k, lifetime))
            .map(|u| Some(u.to_string()))
            .map_err(|e| self.call("presign", key, e))
    }

    /// At start: that this machine's clock is within [`MAX_CLOCK_SKEW`] of the store's, and
    /// that the keys may write, read and delete under the prefix (one small probe object).
    pub fn check(&self) -> Result<(), StoreError> {
        match (self.clock_skew(), &self.endpoint) {
            (Some(skew_s), _) if skew_s.abs() > MAX_CLOCK_SKEW.as_secs_f64() => {
                return Err(StoreError::Clock {
                    url: self.url.clone(),
                    skew_s,
                })
            }
            (None, Some(endpoint)) => tracing::warn!(
                "{endpoint} sent no Date to check this machine's clock against; not checked"
            ),
            _ => {}
        }
        let probe = format!("probes/{:016x}", rand::random::<u64>());
        let denied = |e: StoreError| {
            let why = match &e {
                StoreError::Call { source, .. } => match **source {
                    object_store::Error::PermissionDenied { .. } => "permission denied",
                    object_store::Error::Unauthenticated { .. } => "not authenticated",
                    _ => return e,
                },
                _ => return e,
            };
            // The store's own answer (its XML) is for whoever debugs the policy.
            tracing::debug!("{e}");
            StoreError::Denied {
                url: self.url.clone(),
                why,
            }
        };
        self.put(&probe, Bytes::from_static(b"spes"))
            .map_err(denied)?;
        let back = self.get(&probe).map_err(denied)?;
        self.delete(&probe).map_err(denied)?;
        if back.as_deref() != Some(b"spes".as_slice()) {
            return Err(StoreError::Config {
                url: self.url.clone(),
                what: format!("{probe} read back other bytes than were written"),
            });
        }
        Ok(())
    }

    /// Seconds this machine's clock is ahead of the store's, from the `Date` of an unsigned
    /// request; `None` if not an HTTP store or it did not answer.
    fn clock_skew(&self) -> Option<f64> {
        let endpoint = self.endpoint.clone()?;
        let date = self.block(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .ok()?;
            let reply = client.head(&endpoint).send().await.ok()?;
            let date = reply.headers().get("date")?.to_str().ok()?;
            httpdate::parse_http_date(date).ok()
        })?;
        let now = SystemTime::now();
        Some(match now.duration_since(date) {
            Ok(ahead) => ahead.as_secs_f64(),
            Err(behind) => -behind.duration().as_secs_f64(),
        })
    }

    /// Writes `bytes` to `key`, replacing what is there.
    pub fn put(&self, key: &str, bytes: Bytes) -> Result<(), StoreError> {
        let k = self.key(key);
        self.retrying("put", key, || {
            self.block(self.inner.put(&k, PutPayload::from(bytes.clone())))
                .map(drop)
                .map_err(|e| self.call("put", key, e))
        })?;
        self.bytes_put
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Creates `key` with `bytes` unless an object of that name exists; then returns its
    /// content, so a caller can tell its own earlier write (retried) from another writer's.
    pub fn create(&self, key: &str, bytes: Bytes) -> Result<Created, StoreError> {
        let k = self.key(key);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        let put = || self.block(self.inner.put_opts(&k, bytes.clone().into(), opts.clone()));
        let created = self.retrying("create", key, || match put() {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(self.call("create", key, e)),
        })?;
        if created {
            self.bytes_put
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            return Ok(Created::Written);
        }
        match self.get(key)? {
            Some(there) => Ok(Created::Exists(there)),
            // Deleted between the two calls: nothing is there now, so try again.
            None => self.create(key, bytes),
        }
    }

    /// Uploads the local file `path` to `key`: one PUT up to [`PART`] bytes, else a multipart
    /// upload (aborted if a part fails, and started over).
    pub fn put_file(&self, key: &str, path: &Path) -> Result<(), StoreError> {
        let local = |source| StoreError::Local {
            path: path.to_owned(),
            source,
        };
        let size = std::fs::metadata(path).map_err(local)?.len();
        if size as usize <= PART {
            let bytes = std::fs::read(path).map_err(local)?;
            return self.put(key, Bytes::from(bytes));
        }
        let k = self.key(key);
        self.retrying("put", key, || {
            let mut file = std::fs::File::open(path).map_err(local)?;
            self.block(async {
                let upload = self
                    .inner
                    .put_multipart(&k)
                    .await
                    .map_err(|e| self.call("put", key, e))?;
                let mut w = WriteMultipart::new_with_chunk_size(upload, PART);
                let mut buf = vec![0u8; PART];
                loop {
                    let n = match read_full(&mut file, &mut buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) => {
                            let _ = w.abort().await;
                            return Err(local(e));
                        }
                    };
                    if let Err(e) = w.wait_for_capacity(PARTS_IN_FLIGHT).await {
                        let _ = w.abort().await;
                        return Err(self.call("put a part of", key, e));
                    }
                    w.write(&buf[..n]);
                }
                w.finish()
                    .await
                    .map(drop)
                    .map_err(|e| self.call("put", key, e))
            })
        })?;
        self.bytes_put.fetch_add(size, Ordering::Relaxed);
        Ok(())
    }

    /// The content of `key`; `None` if there is no such object.
    pub fn get(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        let k = self.key(key);
        self.retrying("get", key, || {
            match self.block(async { self.inner.get(&k).await?.bytes().await }) {
                Ok(b) => Ok(Some(b)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.call("get", key, e)),
            }
        })
    }

    /// Downloads `key` to `path` through a temp file (fsynced, renamed, directory fsynced),
    /// in ranges of [`PART`] bytes, each retried on its own, so a long download of a large
    /// file resumes where a failure stopped it; `false` if there is no such object.
    pub fn get_file(&self, key: &str, path: &Path) -> Result<bool, StoreError> {
        let local = |source| StoreError::Local {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(local)?;
        }
        let k = self.key(key);
        let Some(size) = self.size(key)? else {
            return Ok(false);
        };
        let tmp = temp_sibling(path);
        let written = (|| {
            let mut out = std::fs::File::create(&tmp).map_err(local)?;
            let mut at = 0;
            while at < size {
                let range = at..(at + PART as u64).min(size);
                let chunk = self.retrying("get", key, || {
                    self.block(self.inner.get_range(&k, range.clone()))
                        .map_err(|e| self.call("get", key, e))
                })?;
                out.write_all(&chunk).map_err(local)?;
                at = range.end;
            }
            out.sync_all().map_err(local)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, path).map_err(local)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(local)?;
        }
        Ok(true)
    }

    /// The size of `key`; `None` if there is no such object.
    pub fn size(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let k = self.key(key);
        self.retrying("head", key, || match self.block(self.inner.head(&k)) {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.call("head", key, e)),
        })
    }

    /// Every object under `dir` (relative to the prefix), by key.
    pub fn list(&self, dir: &str) -> Result<Vec<Listed>, StoreError> {
        let k = self.key(dir);
        let strip = self.prefix.parts().count();
        let mut listed = self.retrying("list", dir, || {
            self.block(async {
                let mut out = Vec::new();
                let mut items = self.inner.list(Some(&k));
                while let Some(item) = items.next().await {
                    let meta = item.map_err(|e| self.call("list", dir, e))?;
                    let key: Vec<String> = meta
                        .location
                        .parts()
                        .skip(strip)
                        .map(|p| p.as_ref().to_owned())
                        .collect();
                    out.push(Listed {
                        key: key.join("/"),
                        bytes: meta.size,
                    });
                }
                Ok(out)
            })
        })?;
        listed.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(listed)
    }

    /// Deletes `key`; an object already gone is not an error.
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let k = self.key(key);
        self.retrying("delete", key, || match self.block(self.inner.delete(&k)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.call("delete", key, e)),
        })
    }

    /// Runs `call` until it succeeds, fails for a reason a retry cannot mend (a missing
    /// object, refused keys, a lost condition), or [`RETRY_TIMEOUT`] passed; logs each retry.
    fn retrying<T>(
        &self,
        op: &str,
        key: &str,
        mut call: impl FnMut() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        // The budget counts from the first failure, not the call's start: a long transfer
        // that fails late is retried as any other.
        let mut failing_since: Option<Instant> = None;
        let mut pause = Duration::from_secs(1);
        loop {
            let result = call();
            let started = *failing_since.get_or_insert_with(Instant::now);
            match result {
                Err(e) if transient(&e) && started.elapsed() + pause < RETRY_TIMEOUT => {
                    tracing::warn!(
                        "store {}: {op} {key} failed, retrying in {} s: {e}",
                        self.url,
                        pause.as_secs()
                    );
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(15));
                }
                Err(e) if transient(&e) => {
                    tracing::error!(
                        "store {}: {op} {key} still failing after {:.0} s: {e}",
                        self.url,
                        started.elapsed().as_secs_f64()
                    );
                    return Err(e);
                }
                done => return done,
            }
        }
    }

    fn key(&self, key: &str) -> Key {
        key.split('/')
            .filter(|p| !p.is_empty())
            .fold(self.prefix.clone(), |k, p| k.join(p))
    }

    fn call(&self, op: &'static str, key: &str, source: object_store::Error) -> StoreError {
        StoreError::Call {
            url: self.url.clone(),
            op,
            key: key.to_owned(),
            source: Box::new(source),
        }
    }

    fn block<F>(&self, f: F) -> F::Output
    where
        F: std::future::Future + Send,
        F::Output: Send,
    {
        let rt = self.rt.as_ref().expect("a runtime until dropped");
        if tokio::runtime::Handle::try_current().is_err() {
            return rt.block_on(f);
        }
        // Inside another runtime (an async task, or its `spawn_blocking`), `block_on` panics:
        // the call blocks a thread of its own instead.
        std::thread::scope(|s| {
            s.spawn(|| rt.block_on(f))
                .join()
                .expect("a store call panicked")
        })
    }
}

/// The store's own runtime: two threads, enough for parts in flight.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("spes-store")
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Whether a store error may pass if the call is made again (the store was unreachable or
/// failed; object_store's own retries of it ran out).
fn transient(e: &StoreError) -> bool {
    matches!(e, StoreError::Call { source, .. } if matches!(**source, object_store::Error::Generic { .. }))
}

/// `<path>.tmp-<pid>` beside `path`: the repository's temp name, which no reader of the folder
/// takes for a real file.
fn temp_sibling(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Reads until `buf` is full or the file ends.
fn read_full(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// An S3 client for `bucket` and the endpoint its signed requests go to.
fn s3(bucket: &str, opts: &StoreOptions) -> Result<(object_store::aws::AmazonS3, String), String> {
    // reqwest's rustls takes the process's crypto provider; tonic's is ring too.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(path) = &opts.credentials {
        let c = Credentials::read(path)?;
        b = b
            .with_access_key_id(c.access_key_id)
            .with_secret_access_key(c.secret_access_key);
        if let Some(t) = c.session_token {
            b = b.with_token(t);
        }
        if let Some(e) = c.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(r) = c.region {
            b = b.with_region(r);
        }
    }
    let endpoint = match b.get_config_value(&AmazonS3ConfigKey::Endpoint) {
        Some(e) => e,
        None => {
            let region = b
                .get_config_value(&AmazonS3ConfigKey::Region)
                .unwrap_or_else(|| "us-east-1".into());
            format!("https://s3.{region}.amazonaws.com")
        }
    };
    if endpoint.starts_with("http://") && !opts.allow_http {
        return Err(format!(
            "endpoint {endpoint} is plain HTTP: keys are signed but models cross the network \
             unencrypted; use https, or pass --store-allow-http for a store on a network you trust"
        ));
    }
    let s3 = b
        // Client options replace the builder's own, AWS_ALLOW_HTTP among them: plain HTTP
        // only by the explicit flag.
        .with_client_options(
            ClientOptions::new()
                .with_allow_http(opts.allow_http)
                .with_connect_timeout(Duration::from_secs(10))
                .with_timeout(Duration::from_secs(600)),
        )
        .with_config(AmazonS3ConfigKey::Checksum, "sha256")
        // A blip is retried inside the client; an outage by [`RunStore`], which logs it.
        .with_retry(RetryConfig {
            retry_timeout: Duration::from_secs(10),
            max_retries: 3,
            ..RetryConfig::default()
        })
        .build()
        .map_err(|e| e.to_string())?;
    Ok((s3, endpoint))
}

/// A store and its URL signer, one client.
type WithSigner = (Arc<dyn ObjectStore>, Option<Arc<dyn Signer>>);

#[cfg(feature = "gcs")]
fn gcs(bucket: &str) -> Result<WithSigner, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let s = object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .build()
        .map_err(|e| e.to_string())?;
    let s = Arc::new(s);
    Ok((s.clone(), Some(s)))
}

#[cfg(not(feature = "gcs"))]
fn gcs(_: &str) -> Result<WithSigner, String> {
    Err("this spes was built without GCS: cargo build --features spes-store/gcs".into())
}

#[cfg(feature = "azure")]
fn azure(container: &str) -> Result<WithSigner, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let s = object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_container_name(container)
        .build()
        .map_err(|e| e.to_string())?;
    let s = Arc::new(s);
    Ok((s.clone(), Some(s)))
}

#[cfg(not(feature = "azure"))]
fn azure(_: &str) -> Result<WithSigner, String> {
    Err("this spes was built without Azure: cargo build --features spes-store/azure".into())
}

#[cfg(test)]
mod tests;
