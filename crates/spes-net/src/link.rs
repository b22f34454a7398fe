//! Shaped links on loopback, to measure sync as it would run over a home or cloud link: a TCP
//! relay between a node and the server that limits bandwidth per direction, adds a round-trip
//! delay and models packet loss. Traffic stays on 127.0.0.1; nothing needs root (`tc netem` is
//! not in every kernel, and namespaces need privileges). `spes demo --link` and
//! `spes bench link` put one relay in front of every node.
//!
//! The model per direction: bytes leave at the link's rate (every connection of a relay shares
//! it, as they share a real uplink), arrive half the round trip later, and in order. A lost
//! packet holds back its chunk and everything after it for a retransmission timeout, like TCP's
//! head-of-line blocking.

use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// A link's shape: `100mbit,40ms`, `up=20mbit,down=100mbit,rtt=40ms,loss=0.1%`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkSpec {
    /// Node → server, bits per second (`f64::INFINITY`: unlimited).
    pub up_bps: f64,
    /// Server → node, bits per second.
    pub down_bps: f64,
    /// Round-trip time added (half each way).
    pub rtt: Duration,
    /// Probability that a packet (1460 bytes of payload) is lost and retransmitted.
    pub loss: f64,
}

/// A rate like `100mbit`, `1gbit`, `500kbit` or `10gbps`, in bits per second.
pub fn parse_rate(s: &str) -> Result<f64> {
    let s = s.trim().to_ascii_lowercase();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let n: f64 = num
        .parse()
        .with_context(|| format!("`{s}` is not a rate such as 100mbit"))?;
    let scale = match unit.trim_end_matches("ps").trim_end_matches("it") {
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "b" | "" => 1.0,
        _ => bail!("`{s}`: unknown rate unit (use kbit, mbit or gbit)"),
    };
    if !(n > 0.0 && n.is_finite()) {
        bail!("`{s}`: a rate must be positive");
    }
    Ok(n * scale)
}

fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let (num, scale) = if let Some(ms) = s.strip_suffix("ms") {
        (ms, 1e-3)
    } else if let Some(sec) = s.strip_suffix('s') {
        (sec, 1.0)
    } else {
        bail!("`{s}` is not a duration such as 40ms");
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("`{s}` is not a duration such as 40ms"))?;
    if !(v >= 0.0 && v.is_finite()) {
        bail!("`{s}`: a duration must be ≥ 0");
    }
    Ok(Duration::from_secs_f64(v * scale))
}

impl FromStr for LinkSpec {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<LinkSpec> {
        let mut spec = LinkSpec {
            up_bps: f64::INFINITY,
            down_bps: f64::INFINITY,
            rtt: Duration::ZERO,
            loss: 0.0,
        };
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item.split_once('=').unwrap_or(("", item));
            match key {
                "up" => spec.up_bps = parse_rate(value)?,
                "down" => spec.down_bps = parse_rate(value)?,
                "rtt" => spec.rtt = parse_duration(value)?,
                "loss" => {
                    let (v, pct) = match value.strip_suffix('%') {
                        Some(v) => (v, 100.0),
                        None => (value, 1.0),
                    };
                    spec.loss = v
                        .parse::<f64>()
                        .with_context(|| format!("--link loss `{value}` is not a number"))?
                        / pct;
                    if !(0.0..1.0).contains(&spec.loss) {
                        bail!("--link loss must be in [0, 100%)");
                    }
                }
                "" if value.ends_with('s') && !value.ends_with("bps") => {
                    spec.rtt = parse_duration(value)?
                }
                "" => {
                    let r = parse_rate(value)?;
                    spec.up_bps = r;
                    spec.down_bps = r;
                }
                other => bail!("--link: unknown key `{other}` (up, down, rtt, loss)"),
            }
        }
        Ok(spec)
    }
}

/// Retransmission timeout after a loss (Linux's minimum RTO).
const RTO: Duration = Duration::from_millis(200);
const PACKET: f64 = 1460.0;
const READ_BYTES: usize = 16 * 1024;

/// One direction of a link, shared by all of a relay's connections.
struct Pipe {
    bytes_per_s: f64,
    delay: Duration,
    loss: f64,
    rto: Duration,
    /// When the link finishes sending what it has been given so far.
    busy_until: Mutex<Instant>,
}

impl Pipe {
    fn new(bps: f64, spec: &LinkSpec) -> Arc<Pipe> {
        Arc::new(Pipe {
            bytes_per_s: bps / 8.0,
            delay: spec.rtt / 2,
            loss: spec.loss,
            rto: RTO.max(spec.rtt * 2),
            busy_until: Mutex::new(Instant::now()),
        })
    }

    /// When `n` bytes handed over now arrive at the other end.
    fn arrival(&self, n: usize) -> Instant {
        let now = Instant::now();
        let sent = {
            let mut busy = self.busy_until.lock().unwrap();
            let start = (*busy).max(now);
            let wire = if self.bytes_per_s.is_finite() {
                Duration::from_secs_f64(n as f64 / self.bytes_per_s)
            } else {
                Duration::ZERO
            };
            *busy = start + wire;
            *busy
        };
        let packets = (n as f64 / PACKET).ceil();
        let lost = self.loss > 0.0 && rand::random::<f64>() < 1.0 - (1.0 - self.loss).powf(packets);
        sent + self.delay + if lost { self.rto } else { Duration::ZERO }
    }
}

/// Copies `from` to `to` through `pipe`, in order, each chunk released at its arrival time.
async fn shape(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    pipe: Arc<Pipe>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Instant, Vec<u8>)>(64);
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; READ_BYTES];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let at = pipe.arrival(n);
            if tx.send((at, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    });
    let mut last = Instant::now();
    while let Some((at, bytes)) = rx.recv().await {
        // In order: a chunk held back by a loss holds back the ones after it.
        last = last.max(at);
        tokio::time::sleep_until(last).await;
        if to.write_all(&bytes).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
    reader.abort();
}

/// A running relay: connect to `addr` to reach the upstream through the shaped link.
pub struct Relay {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Listens on an ephemeral loopback port and relays every connection to `upstream`.
    pub async fn start(spec: LinkSpec, upstream: SocketAddr) -> Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (up, down) = (
            Pipe::new(spec.up_bps, &spec),
            Pipe::new(spec.down_bps, &spec),
        );
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (up, down) = (up.clone(), down.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(shape(cr, sw, up), shape(sr, cw, down));
                });
            }
        });
        Ok(Relay { addr, task })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `n` relays to one upstream on a runtime of their own, for callers without one (`spes
/// demo`); they stop when this is dropped.
pub struct RelaySet {
    relays: Vec<Relay>,
    _rt: tokio::runtime::Runtime,
}

impl RelaySet {
    pub fn start(spec: LinkSpec, upstream: SocketAddr, n: usize) -> Result<RelaySet> {
        let rt = tokio::runtime::Runtime::new()?;
        let relays = (0..n)
            .map(|_| rt.block_on(Relay::start(spec, upstream)))
            .collect::<Result<_>>()?;
        Ok(RelaySet { relays, _rt: rt })
    }

    /// Where to connect to reach the upstream through relay `i`.
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.relays[i].addr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_specs_parse() {
        let s: LinkSpec = "100mbit,40ms".parse().unwrap();
        assert_eq!(
            (s.up_bps, s.down_bps, s.rtt),
            (1e8, 1e8, Duration::from_millis(40))
        );
        let s: LinkSpec = "up=20mbit, down=1gbit, rtt=0.1s, loss=0.5%"
            .parse()
            .unwrap();
        assert_eq!((s.up_bps, s.down_bps), (2e7, 1e9));
        assert_eq!(s.rtt, Duration::from_millis(100));
        assert!((s.loss - 0.005).abs() < 1e-12);
        assert!("100parsecs".parse::<LinkSpec>().is_err());
        assert!("loss=2".parse::<LinkSpec>().is_err());
        assert!("speed=3mbit".parse::<LinkSpec>().is_err());
    }

    #[test]
    fn a_relay_delivers_everything_at_the_link_rate_after_the_delay() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let up_addr = upstream.local_addr().unwrap();
            let echo = tokio::spawn(async move {
                let (mut s, _) = upstream.accept().await.unwrap();
                let mut got = Vec::new();
                s.read_to_end(&mut got).await.unwrap();
                got
            });
            // 8 Mbit/s = 1 MB/s; 100 ms round trip.
            let spec: LinkSpec = "8mbit,100ms".parse().unwrap();
            let relay = Relay::start(spec, up_addr).await.unwrap();
            let data: Vec<u8> = (0..500_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let t0 = Instant::now();
            let mut c = TcpStream::connect(relay.addr).await.unwrap();
            c.write_all(&data).await.unwrap();
            c.shutdown().await.unwrap();
            let got = echo.await.unwrap();
            let took = t0.elapsed().as_secs_f64();
            assert_eq!(got, data, "every byte, in order");
            // 0.5 s on the wire + 0.05 s one way; allow scheduling slack, never faster.
            assert!((0.54..1.2).contains(&took), "took {took:.3} s");
        });
    }
}
