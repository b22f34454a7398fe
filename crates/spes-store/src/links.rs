//! Reading objects through presigned URLs ([`crate::RunStore::presign_get`]) on a machine that
//! holds no store keys: a node downloads a published round straight from the store. Each URL is
//! a credential until it expires, so it is shown only through [`redact`], and errors never
//! carry it.

use std::ops::Range;
use std::time::Duration;

/// The longest a download may wait for a connection or for its next bytes.
const IDLE: Duration = Duration::from_secs(20);
/// Tries per range: a broken transfer resumes where it stopped.
const TRIES: usize = 3;

/// Why a URL could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The store refused the URL: it expired, or the key that signed it no longer may read.
    #[error("the store refused the URL (HTTP {status}): expired or no longer valid")]
    Refused { status: u16 },
    /// No such object (deleted since the URL was signed).
    #[error("the store has no such object (HTTP 404)")]
    Missing,
    /// The store could not be reached or kept failing.
    #[error("the store did not answer: {0}")]
    Unreachable(String),
}

/// A URL without its query string, which holds the signature: what logs may show.
pub fn redact(url: &str) -> &str {
    url.split('?').next().unwrap_or_default()
}

/// An HTTP client for presigned URLs.
#[derive(Clone)]
pub struct LinkReader {
    client: reqwest::Client,
}

impl LinkReader {
    pub fn new() -> Result<LinkReader, LinkError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .connect_timeout(IDLE)
            .read_timeout(IDLE)
            .build()
            .map_err(|e| LinkError::Unreachable(e.without_url().to_string()))?;
        Ok(LinkReader { client })
    }

    /// Reads the byte `ranges` of the object at `url`, in order, into `sink`, one range GET
    /// each; a transfer that breaks after moving some bytes resumes from its last byte, and a
    /// request lost on a closed kept-alive connection is sent again (at most [`TRIES`] GETs a
    /// range); one the store does not answer is an error at once. Returns the GETs it made;
    /// `on_bytes` sees every chunk's size as it arrives.
    pub async fn read(
        &self,
        url: &str,
        ranges: &[Range<u64>],
        sink: &mut dyn std::io::Write,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<u64, LinkError> {
        let mut gets = 0;
        for range in ranges {
            let mut at = range.start;
            let mut tries = 0;
            while at < range.end {
                tries += 1;
                gets += 1;
                match self.get(url, at..range.end, sink, &mut on_bytes).await {
                    Ok(n) => at += n,
                    Err(Broken { read, error, again }) => {
                        at += read;
                        // Only a transfer that moved, or a request lost on a connection the
                        // store had closed, is tried again: a store that does not answer (or
                        // refuses) is the caller's to route around, at once.
                        if !(again || read > 0) || tries >= TRIES {
                            return Err(error);
                        }
                        tracing::debug!("{}: {error}; resuming at byte {at}", redact(url));
                    }
                }
            }
        }
        Ok(gets)
    }

    /// PUTs `bytes` to `url` (one object, at most [`crate::MAX_PUT`] bytes), retried up to
    /// [`TRIES`] times while the store fails or does not answer.
    pub async fn put(&self, url: &str, bytes: bytes::Bytes) -> Result<(), LinkError> {
        let mut tries = 0;
        loop {
            tries += 1;
            let sent = self.client.put(url).body(bytes.clone()).send().await;
            let error = match sent {
                Ok(r) if r.status().is_success() => return Ok(()),
                Ok(r) => match r.status().as_u16() {
                    status @ (400 | 401 | 403) => return Err(LinkError::Refused { status }),
                    status => LinkError::Unreachable(format!("HTTP {status} for a PUT")),
                },
                Err(e) if e.is_connect() => {
                    return Err(LinkError::Unreachable(e.without_url().to_string()))
                }
                Err(e) => LinkError::Unreachable(e.without_url().to_string()),
            };
            if tries >= TRIES {
                return Err(error);
            }
            tracing::debug!("{}: {error}; putting it again", redact(url));
        }
    }

    /// One GET of `range`: the bytes it wrote, or how many it wrote before it broke.
    async fn get(
        &self,
        url: &str,
        range: Range<u64>,
        sink: &mut dyn std::io::Write,
        on_bytes: &mut impl FnMut(u64),
    ) -> Result<u64, Broken> {
        let mut read = 0u64;
        let unreachable = |e: reqwest::Error| LinkError::Unreachable(e.without_url().to_string());
        let broken = |read, error| Broken {
            read,
            error,
            again: false,
        };
        let reply = self
            .client
            .get(url)
            .header(
                reqwest::header::RANGE,
                format!("bytes={}-{}", range.start, range.end - 1),
            )
            .send()
            .await
            .map_err(|e| Broken {
                read: 0,
                // Connected, but the request got no answer: a kept-alive connection the store
                // closed meanwhile, which a new connection replaces.
                again: !e.is_connect() && !e.is_timeout(),
                error: unreachable(e),
            })?;
        let status = reply.status().as_u16();
        match status {
            206 => {}
            // A whole-object answer to a range request would misplace every byte.
            200 if range.start == 0 => {}
            400 | 401 | 403 => return Err(broken(0, LinkError::Refused { status })),
            404 => return Err(broken(0, LinkError::Missing)),
            _ => {
                return Err(broken(
                    0,
                    LinkError::Unreachable(format!("HTTP {status} for a range GET")),
                ))
            }
        }
        let want = range.end - range.start;
        let mut reply = reply;
        while read < want {
            match reply.chunk().await {
                Ok(Some(chunk)) => {
                    let take = (chunk.len() as u64).min(want - read) as usize;
                    sink.write_all(&chunk[..take]).map_err(|e| {
                        broken(read, LinkError::Unreachable(format!("cannot write: {e}")))
                    })?;
                    read += take as u64;
                    on_bytes(take as u64);
                }
                Ok(None) => {
                    return Err(broken(
                        read,
                        LinkError::Unreachable(format!(
                            "the answer ended at {read} of {want} bytes"
                        )),
                    ))
                }
                Err(e) => return Err(broken(read, unreachable(e))),
            }
        }
        Ok(read)
    }
}

/// A GET that failed after writing `read` bytes; `again`: worth another GET even if none
/// moved.
struct Broken {
    read: u64,
    error: LinkError,
    again: bool,
}
