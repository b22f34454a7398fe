//! The live page read as a user's browser and a scraper read it: a plain HTTP/1.1 GET, and
//! headless Chromium's DOM after the page's script ran. `spes bench view` and the view tests
//! both read the page through these, so the benchmark measures what the tests check.

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// An HTTP reply: status code, body (chunking undone) and how long the exchange took.
pub struct Reply {
    pub code: u16,
    pub body: Vec<u8>,
    pub elapsed: Duration,
}

impl Reply {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// GET `path` from `addr` over plain HTTP/1.1 (one connection, closed after the reply).
pub fn get(addr: SocketAddr, path: &str) -> Result<Reply> {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).with_context(|| format!("cannot connect to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let elapsed = t.elapsed();
    let at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("GET {path}: no HTTP reply"))?;
    let head = String::from_utf8_lossy(&raw[..at]).to_ascii_lowercase();
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("GET {path}: no status code in `{head}`"))?;
    let body = &raw[at + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body).with_context(|| format!("GET {path}: bad chunked body"))?
    } else {
        body.to_vec()
    };
    Ok(Reply {
        code,
        body,
        elapsed,
    })
}

/// A chunked body's payload.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("a chunk without its size line")?;
        let size = std::str::from_utf8(&rest[..line])?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)?;
        if n == 0 {
            return Ok(out);
        }
        let data = rest
            .get(line + 2..line + 2 + n)
            .context("a chunk shorter than its size")?;
        out.extend_from_slice(data);
        rest = rest.get(line + 4 + n..).unwrap_or_default();
    }
}

/// The browser to read pages with: `$CHROMIUM`, else Debian's `/usr/bin/chromium` (what
/// `scripts/setup.sh --tests` installs).
pub fn chromium() -> PathBuf {
    std::env::var_os("CHROMIUM").map_or_else(|| "/usr/bin/chromium".into(), PathBuf::from)
}

/// The DOM of `url` after headless Chromium (`bin`, with a fresh profile in `profile`) ran the
/// page's script; with `virtual_time_ms`, the page's clock runs that far ahead so timers fire
/// at once (for tests; a benchmark timing the render leaves it off).
pub fn headless_dom(
    bin: &Path,
    url: &str,
    profile: &Path,
    virtual_time_ms: Option<u32>,
) -> Result<String> {
    let mut c = Command::new(bin);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    if let Some(ms) = virtual_time_ms {
        c.arg(format!("--virtual-time-budget={ms}"));
    }
    let o = c.args(["--dump-dom", url]).output().with_context(|| {
        format!(
            "cannot run {} (scripts/setup.sh --tests installs chromium)",
            bin.display()
        )
    })?;
    if !o.status.success() {
        bail!(
            "{} failed ({}): {}",
            bin.display(),
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::dechunk;

    #[test]
    fn chunked_bodies_are_joined() {
        let body = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        assert_eq!(dechunk(body).unwrap(), b"hello, world");
        assert!(dechunk(b"5\r\nhel").is_err());
    }
}
