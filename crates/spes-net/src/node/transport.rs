//! The node's calls to the server and their retries: one [`Link`] over every server shard
//! (`spes server --shard i/k`; one shard when unsharded), talked to in parallel. Uploads and
//! fetches stream payload files ([`crate::payload`]); a failed call is retried while it may
//! still succeed ([`transient`]) and the node's patience lasts.

use crate::dial::Client;
use crate::proto::refusal::Kind as Refused;
use crate::proto::{
    DoneRequest, FetchRequest, JoinReply, JoinRequest, PayloadHeader, StageRequest,
};
use crate::{fault, payload, refusal};
use anyhow::Result;
use spes_store::links::{redact, LinkError, LinkReader};
use spes_sync::delta::tensor_of;
use spes_sync::{FetchPlan, Named, Work};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::{Code, Request, Status};

/// How long a stream may stay silent, and how long unary calls may take.
const IDLE: Duration = Duration::from_secs(20);
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a fetch asks the server to wait for an unpublished round.
const FETCH_WAIT: Duration = Duration::from_secs(20);
/// URLs a fetch tries (the first expired, a download broke or failed its checksum) before
/// it takes the bytes from the server.
const STORE_TRIES: usize = 2;
/// How long after that the store counts as unreachable from this node.
const STORE_DOWN: Duration = Duration::from_secs(300);

/// Whether a failed call may succeed later (server restarting or busy, round not published).
pub(super) fn transient(s: &Status) -> bool {
    match refusal::kind(s) {
        Some(k) => k == Refused::Retry,
        None => matches!(
            s.code(),
            Code::Unavailable
                | Code::Unknown
                | Code::Cancelled
                | Code::DeadlineExceeded
                | Code::Aborted
                | Code::Internal
                | Code::ResourceExhausted
        ),
    }
}

/// A unary request with a deadline.
pub(super) fn call<T>(msg: T) -> Request<T> {
    let mut req = Request::new(msg);
    req.set_timeout(CALL_TIMEOUT);
    req
}

/// Joins (or rejoins) the run with `req`, retrying through outages.
pub(super) fn join_run(
    rt: &tokio::runtime::Handle,
    client: &Client,
    patience: Duration,
    req: &JoinRequest,
) -> Result<JoinReply, Status> {
    retry(rt, patience, "join", || {
        let mut c = client.clone();
        let req = req.clone();
        async move { c.join(call(req)).await }
    })
    .map(|r| r.into_inner())
}

/// The upload for one server shard, in memory (kept for retries): its bytes and checksum.
#[derive(Clone)]
pub(super) struct Upload {
    pub bytes: Arc<Vec<u8>>,
    pub xxh3: u64,
    /// The experts whose unsent change it hands over (`PayloadHeader::handover`).
    pub handover: Vec<u32>,
}

/// Where a shard's fetched payload landed: a round's delta in memory (applied at once), a
/// whole model (rare: joining, falling behind) in a file.
enum Body {
    Memory(Vec<u8>),
    File(PathBuf),
}

/// One round from every server shard: the merged header (shard 0's, with every shard's total
/// and whether any left this node's own experts out) and each shard's header and body.
pub(super) struct Fetched {
    pub header: PayloadHeader,
    bodies: Vec<(PayloadHeader, Body)>,
    /// Seconds the slowest shard's body took from its header to its last byte: the download,
    /// without the wait for the round to be published.
    pub transfer_s: f64,
}

impl Fetched {
    /// Every shard's tensors; files are removed.
    pub fn read(&self) -> Result<Named> {
        let mut out = Vec::new();
        for (h, body) in &self.bodies {
            let named = match body {
                Body::Memory(bytes) => payload::decode_parts(bytes, &h.parts),
                Body::File(path) => {
                    let named = payload::read_parts(path, &h.parts);
                    let _ = std::fs::remove_file(path);
                    named
                }
            };
            out.extend(named?);
        }
        Ok(out)
    }
}

/// An upload as the node timed it: its bytes, and the seconds from its start to the server's
/// acknowledgement (retries, a slot's wait and staging in the store included).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sent {
    pub bytes: u64,
    pub seconds: f64,
}

/// How an upload and the fetch after it went.
pub(super) enum Exchange {
    Fetched { fetched: Box<Fetched>, up: Sent },
    UploadRefused(Status),
    FetchFailed { status: Status, up: Sent },
}

/// One server shard (`spes server --shard i/k`; the whole model when unsharded).
#[derive(Clone)]
pub(super) struct Shard {
    pub client: Client,
    /// The tensors it owns; `None`: all of them.
    pub names: Option<Arc<HashSet<String>>>,
    /// The exact size of its whole fp32 slice on the wire; another announced size is refused.
    pub full_bytes: u64,
    /// The most a delta of its slice may take: every tensor in bf16 (sparse and quantized
    /// deltas take less), with room for the parts' headers.
    pub delta_max: u64,
}

/// The node's side of the network: the server shards and what calls need. Cloneable, so the
/// overlap thread can run an exchange while the node trains.
#[derive(Clone)]
pub(super) struct Link {
    pub handle: tokio::runtime::Handle,
    pub shards: Vec<Shard>,
    pub peer: usize,
    pub session: u64,
    pub patience: Duration,
    pub out: PathBuf,
    /// The data parts this node reads (`data.partition = "disjoint"`), declared at each join.
    pub data_parts: Vec<String>,
    /// The most experts per layer this node's memory holds (`train.memory_gib`), told at join.
    pub max_experts: Option<usize>,
    /// Steps trained and payload chunks moved by this process, which heartbeats report: the
    /// server waits for a member only while it changes (`sync.stall_s`).
    pub activity: Arc<AtomicU64>,
    /// Downloads from the run's store, when the server hands out URLs (`None`: never asks).
    pub store: Option<StoreLinks>,
    /// Payload bytes read so far, by source.
    pub read: Downloads,
}

/// Payload bytes a node read: from the run's store, and streamed by the server.
#[derive(Clone, Default)]
pub struct Downloads {
    store: Arc<AtomicU64>,
    server: Arc<AtomicU64>,
}

impl Downloads {
    /// (from the store, from the server) so far.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.store.load(Ordering::Relaxed),
            self.server.load(Ordering::Relaxed),
        )
    }
}

/// A node's downloads through the presigned URLs a server with a store hands out.
#[derive(Clone)]
pub struct StoreLinks {
    reader: LinkReader,
    /// Until when the store counts as unreachable from this node.
    down_until: Arc<Mutex<Option<Instant>>>,
    /// The GETs made of the store.
    pub gets: Arc<AtomicU64>,
}

impl StoreLinks {
    /// `None` (logged) if no HTTP client can be made: every download then comes from the server.
    pub fn new() -> Option<StoreLinks> {
        match LinkReader::new() {
            Ok(reader) => Some(StoreLinks {
                reader,
                down_until: Arc::default(),
                gets: Arc::default(),
            }),
            Err(e) => {
                tracing::warn!("downloads come from the server only: {e}");
                None
            }
        }
    }

    fn up(&self) -> bool {
        self.down_until
            .lock()
            .unwrap()
            .is_none_or(|t| Instant::now() >= t)
    }

    fn mark_down(&self) {
        *self.down_until.lock().unwrap() = Some(Instant::now() + STORE_DOWN);
    }

    /// Reads the parts `header` lists from its URL, a delta into memory and a whole model into
    /// `dest`, and checks every part's checksum. `activity` moves with every chunk read.
    fn download(
        &self,
        rt: &tokio::runtime::Handle,
        header: &PayloadHeader,
        dest: &Path,
        (read_bytes, activity): (&AtomicU64, &AtomicU64),
    ) -> Result<Body, StoreFailure> {
        let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
        for p in &header.parts {
            match ranges.last_mut() {
                Some(r) if r.end == p.offset => r.end += p.bytes,
                _ => ranges.push(p.offset..p.offset + p.bytes),
            }
        }
        let counted = |n| {
            read_bytes.fetch_add(n, Ordering::Relaxed);
            activity.fetch_add(1, Ordering::Relaxed);
        };
        let read = |sink: &mut dyn std::io::Write| {
            let gets = rt
                .block_on(self.reader.read(&header.url, &ranges, sink, counted))
                .map_err(|e| match e {
                    LinkError::Unreachable(_) => StoreFailure::Down(e.to_string()),
                    _ => StoreFailure::Renew(e.to_string()),
                })?;
            self.gets.fetch_add(gets, Ordering::Relaxed);
            Ok::<_, StoreFailure>(())
        };
        if header.delta {
            let mut bytes = Vec::with_capacity(header.total_bytes.min(1 << 30) as usize);
            read(&mut bytes)?;
            payload::check_parts(&mut bytes.as_slice(), &header.parts)
                .map_err(StoreFailure::Renew)?;
            return Ok(Body::Memory(bytes));
        }
        let io =
            |e: std::io::Error| StoreFailure::Down(format!("cannot write {}: {e}", dest.display()));
        let mut file = std::io::BufWriter::new(std::fs::File::create(dest).map_err(io)?);
        read(&mut file)?;
        let file = file.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        let mut back = std::io::BufReader::new(std::fs::File::open(dest).map_err(io)?);
        payload::check_parts(&mut back, &header.parts).map_err(StoreFailure::Renew)?;
        Ok(Body::File(dest.to_owned()))
    }
}

/// Why a download from the store failed, and what the node does next.
enum StoreFailure {
    /// The URL was refused (expired) or the bytes failed their checksums: ask for a new URL.
    Renew(String),
    /// The store did not answer, or the node cannot write: take the round from the server.
    Down(String),
}

impl Link {
    /// The shard that owns a tensor (or a sparse delta's part of it).
    pub fn shard_of(&self, wire_name: &str) -> usize {
        let name = tensor_of(wire_name);
        self.shards
            .iter()
            .position(|s| s.names.as_ref().is_none_or(|n| n.contains(name)))
            .unwrap_or(0)
    }

    /// Runs `f` for every shard at once, results in shard order.
    pub fn on_all<T: Send>(
        &self,
        f: impl Fn(usize, &Shard) -> Result<T, Status> + Sync,
    ) -> Vec<Result<T, Status>> {
        if self.shards.len() == 1 {
            return vec![f(0, &self.shards[0])];
        }
        std::thread::scope(|scope| {
            let f = &f;
            let running: Vec<_> = self
                .shards
                .iter()
                .enumerate()
                .map(|(i, s)| scope.spawn(move || f(i, s)))
                .collect();
            running
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(Status::internal("a shard call panicked")))
                })
                .collect()
        })
    }

    /// Joins (or renews) at every shard; returns shard 0's reply after checking each shard
    /// sits where `--server` lists it.
    pub fn join(&self, join: bool) -> Result<JoinReply, Status> {
        let k = self.shards.len();
        let replies = self.on_all(|i, s| {
            let req = JoinRequest {
                peer: self.peer as u32,
                session: self.session,
                join,
                data_parts: self.data_parts.clone(),
                report: None,
                max_experts: self.max_experts.map(|k| k as u32),
                activity: self.activity.load(Ordering::Relaxed),
                protocol: crate::settings::PROTOCOL,
            };
            let reply = join_run(&self.handle, &s.client, self.patience, &req)?;
            let (shard, shards) = (reply.shard as usize, (reply.shards as usize).max(1));
            if (shard, shards) != (i, k) {
                return Err(Status::failed_precondition(format!(
                    "server {} of --server is shard {shard} of {shards}; list all {shards} shards' URLs in shard order",
                    i + 1
                )));
            }
            Ok(reply)
        });
        let mut replies = replies.into_iter().collect::<Result<Vec<_>, _>>()?;
        Ok(replies.swap_remove(0))
    }

    /// Uploads every shard's file for `round`, which trained `work`; the first refusal (in
    /// shard order) wins.
    pub fn upload(&self, round: u64, uploads: &[Upload], work: Work) -> Result<(), Status> {
        let results = self.on_all(|i, s| {
            let u = &uploads[i];
            let staged = self.stage(s, round, u);
            let sent = self.send_upload(s, round, u, work, staged.clone());
            match (staged, sent) {
                (Some(key), Err(st)) if refusal::kind(&st) == Some(Refused::Staged) => {
                    tracing::warn!(
                        "node {}: the server cannot use round {round}'s upload staged at {key}: {}; sending it to the server instead",
                        self.peer,
                        st.message()
                    );
                    self.send_upload(s, round, u, work, None)
                }
                (_, sent) => sent,
            }
        });
        results.into_iter().collect()
    }

    /// Sends upload `u` of `round` to shard `s`: its header naming where it is staged, or the
    /// header and the bytes.
    fn send_upload(
        &self,
        s: &Shard,
        round: u64,
        u: &Upload,
        work: Work,
        staged: Option<String>,
    ) -> Result<(), Status> {
        let size = u.bytes.len() as u64;
        let header = PayloadHeader {
            rows: work.rows,
            compute_s: work.compute_s,
            handover: u.handover.clone(),
            staged: staged.unwrap_or_default(),
            ..payload::upload_header(self.peer, self.session, round, size, u.xxh3)
        };
        retry(&self.handle, self.patience, "upload", || {
            let (mut c, bytes, header) = (s.client.clone(), u.bytes.clone(), header.clone());
            let activity = self.activity.clone();
            async move {
                let sources = match header.staged.is_empty() {
                    true => vec![payload::Source::Bytes(bytes)],
                    false => {
                        fault::point("upload", round);
                        Vec::new()
                    }
                };
                let stream = payload::send(sources, header, move |i| {
                    if i == 0 {
                        fault::point("upload", round);
                    }
                    activity.fetch_add(1, Ordering::Relaxed);
                });
                let stream = tokio_stream::StreamExt::filter_map(stream, |r| r.ok());
                c.upload(stream).await
            }
        })
        .map(|_| ())
    }

    /// Puts upload `u` of `round` in the run's store through a URL the shard hands out;
    /// returns its key there. `None`: the shard has no such store, or the store failed this
    /// node (logged): the upload is streamed.
    fn stage(&self, s: &Shard, round: u64, u: &Upload) -> Option<String> {
        let store = self.store.as_ref().filter(|st| st.up())?;
        let req = StageRequest {
            peer: self.peer as u32,
            session: self.session,
            round,
            bytes: u.bytes.len() as u64,
            handover: u.handover.clone(),
        };
        // A refusal here is the upload's own: streaming it gets the same answer, acted on there.
        let reply = retry(&self.handle, self.patience, "stage", || {
            let (mut c, req) = (s.client.clone(), req.clone());
            async move { c.stage(call(req)).await }
        })
        .ok()?
        .into_inner();
        if reply.url.is_empty() {
            return None;
        }
        let bytes = spes_store::Bytes::from_owner(payload::ArcBytes(u.bytes.clone()));
        // The server waits for a member only while its activity moves: it does while the PUT
        // runs, which reports no progress of its own.
        let (done, ticks) = std::sync::mpsc::channel::<()>();
        let put = std::thread::scope(|scope| {
            let activity = &self.activity;
            scope.spawn(move || {
                while let Err(RecvTimeoutError::Timeout) =
                    ticks.recv_timeout(Duration::from_millis(500))
                {
                    activity.fetch_add(1, Ordering::Relaxed);
                }
            });
            let put = self.handle.block_on(store.reader.put(&reply.url, bytes));
            drop(done);
            put
        });
        match put {
            Ok(()) => Some(reply.key),
            Err(e) => {
                store.mark_down();
                tracing::warn!(
                    "node {}: round {round}'s upload to the store ({}): {e}; sending it to the server instead",
                    self.peer,
                    redact(&reply.url)
                );
                None
            }
        }
    }

    /// Fetches a round from shard `i` (waiting for it): a delta into memory, a whole model
    /// into `<out>/global-<i>.part`; from the run's store when the server hands out a URL,
    /// from the server when it does not or the store fails this node.
    /// Also returns the seconds from the header to the body's last byte.
    fn fetch_one(&self, i: usize, ask: &FetchPlan) -> Result<(PayloadHeader, Body, f64), Status> {
        let dest = self.out.join(format!("global-{i}.part"));
        let mut failed = 0;
        loop {
            let store = self
                .store
                .as_ref()
                .filter(|s| failed < STORE_TRIES && s.up());
            let fell_back = self.store.is_some() && store.is_none();
            let (header, body, took) =
                self.fetch_stream(i, &dest, ask, store.is_some(), fell_back)?;
            let (Some(store), None) = (store, &body) else {
                return match body {
                    Some(body) => Ok((header, body, took)),
                    None => Err(Status::internal(
                        "the server sent a URL the node did not ask for",
                    )),
                };
            };
            fault::pause("store-wait", header.round, Duration::from_secs(3));
            let counters = (self.read.store.as_ref(), self.activity.as_ref());
            let t = Instant::now();
            match store.download(&self.handle, &header, &dest, counters) {
                Ok(body) => return Ok((header, body, t.elapsed().as_secs_f64())),
                Err(failure) => {
                    let e = match failure {
                        StoreFailure::Renew(e) => {
                            failed += 1;
                            e
                        }
                        StoreFailure::Down(e) => {
                            failed = STORE_TRIES;
                            e
                        }
                    };
                    let next = if failed < STORE_TRIES {
                        "asking the server for a new URL"
                    } else {
                        store.mark_down();
                        "taking it from the server instead"
                    };
                    tracing::warn!(
                        "node {}: round {} from the store ({}): {e}; {next}",
                        self.peer,
                        header.round,
                        redact(&header.url)
                    );
                }
            }
        }
    }

    /// One fetch call to shard `i`: the header and the body it streamed (with the seconds
    /// from the header to its last byte), or only the header when it answered with a URL
    /// (`links`: the node may read from the store).
    fn fetch_stream(
        &self,
        i: usize,
        dest: &Path,
        ask: &FetchPlan,
        links: bool,
        fell_back: bool,
    ) -> Result<(PayloadHeader, Option<Body>, f64), Status> {
        let s = &self.shards[i];
        let (peer, full, delta_max) = (self.peer, s.full_bytes, s.delta_max);
        let ask = *ask;
        retry(&self.handle, self.patience, "fetch", || {
            let mut c = s.client.clone();
            let d = dest.to_owned();
            let activity = self.activity.clone();
            let streamed = self.read.server.clone();
            async move {
                let mut req = Request::new(FetchRequest {
                    peer: peer as u32,
                    round: ask.round.unwrap_or(0),
                    newest: ask.round.is_none(),
                    wait_ms: FETCH_WAIT.as_millis() as u32,
                    have_previous: ask.have_previous,
                    skip_own: ask.skip_own,
                    links,
                    fell_back,
                });
                req.set_timeout(FETCH_WAIT + CALL_TIMEOUT);
                let stream = c.fetch(req).await?.into_inner();
                let mut stream = tokio_stream::StreamExt::map(stream, move |chunk| {
                    activity.fetch_add(1, Ordering::Relaxed);
                    chunk
                });
                let header = payload::read_header(&mut stream, IDLE).await?;
                let t = Instant::now();
                let fits = if header.delta {
                    ask.have_previous && header.total_bytes <= delta_max
                } else {
                    header.total_bytes == full
                };
                if !fits {
                    return Err(Status::invalid_argument(format!(
                        "the server announces a {}-byte {}; this model takes exactly {full} \
                         bytes in fp32 and at most {delta_max} as a delta",
                        header.total_bytes,
                        if header.delta { "delta" } else { "model" },
                    )));
                }
                fault::point("download", header.round);
                if !header.url.is_empty() {
                    return Ok((header, None, 0.0));
                }
                let body = if header.delta {
                    Body::Memory(payload::receive_to_memory(&mut stream, &header, IDLE).await?)
                } else {
                    payload::receive_body(&mut stream, &d, &header, IDLE).await?;
                    Body::File(d)
                };
                streamed.fetch_add(header.total_bytes, Ordering::Relaxed);
                Ok((header, Some(body), t.elapsed().as_secs_f64()))
            }
        })
    }

    /// Fetches a round from every shard: the newest means shard 0's newest, which the others
    /// then send as well. The shards must agree on the round, its form and who trains next.
    pub fn fetch(&self, ask: &FetchPlan) -> Result<Fetched, Status> {
        let mut ask = *ask;
        let first = match ask.round {
            None if self.shards.len() > 1 => {
                let f = self.fetch_one(0, &ask)?;
                ask.round = Some(f.0.round);
                Some(f)
            }
            _ => None,
        };
        let skip = usize::from(first.is_some());
        let rest = self.on_all(|i, _| {
            if i < skip {
                return Err(Status::cancelled("fetched first"));
            }
            self.fetch_one(i, &ask)
        });
        let mut each: Vec<Result<_, Status>> = first.into_iter().map(Ok).collect();
        each.extend(rest.into_iter().skip(skip));
        let (mut bodies, mut transfer_s) = (Vec::new(), 0.0f64);
        for r in each {
            let (header, body, took) = r?;
            transfer_s = transfer_s.max(took);
            bodies.push((header, body));
        }
        let h0 = &bodies[0].0;
        let agree = bodies.iter().all(|(h, _)| {
            (h.round, h.delta, &h.owners, &h.members)
                == (h0.round, h0.delta, &h0.owners, &h0.members)
        });
        if !agree {
            return Err(Status::failed_precondition(
                "the server shards disagree on the round, its form or its members",
            ));
        }
        let header = PayloadHeader {
            total_bytes: bodies.iter().map(|(h, _)| h.total_bytes).sum(),
            skipped_own: bodies.iter().any(|(h, _)| h.skipped_own),
            parts: Vec::new(),
            ..h0.clone()
        };
        Ok(Fetched {
            header,
            bodies,
            transfer_s,
        })
    }

    /// Uploads round `round` (which trained `work`), then fetches it as `ask` says.
    pub fn exchange(
        &self,
        round: u64,
        uploads: Vec<Upload>,
        work: Work,
        ask: FetchPlan,
    ) -> Exchange {
        let t = Instant::now();
        let sent = self.upload(round, &uploads, work);
        let up = match sent {
            Ok(()) => Sent {
                bytes: uploads.iter().map(|u| u.bytes.len() as u64).sum(),
                seconds: t.elapsed().as_secs_f64(),
            },
            Err(s) if refusal::kind(&s) == Some(Refused::Duplicate) => Sent::default(),
            Err(s) => return Exchange::UploadRefused(s),
        };
        match self.fetch(&ask) {
            Ok(fetched) => Exchange::Fetched {
                fetched: Box::new(fetched),
                up,
            },
            Err(status) => Exchange::FetchFailed { status, up },
        }
    }
}

/// Runs `call` until it succeeds, fails for good, or `patience` ran out on transient errors.
pub(super) fn retry<T, F, Fut>(
    rt: &tokio::runtime::Handle,
    patience: Duration,
    what: &str,
    mut call: F,
) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let start = Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match rt.block_on(call()) {
            Ok(v) => return Ok(v),
            Err(s) if transient(&s) && start.elapsed() < patience => {
                tracing::debug!("{what}: {} (retrying)", s.message());
                // The server already waited for an unpublished round; ask again at once.
                let waited =
                    s.code() == Code::Unavailable && refusal::kind(&s) == Some(Refused::Retry);
                if !waited {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
            Err(s) => return Err(s),
        }
    }
}

impl Link {
    /// Tells every shard this node is done (best effort: a server already gone has nothing
    /// left to wait for).
    pub fn done(&self) {
        let peer = self.peer;
        let said = self.on_all(|_, s| {
            retry(&self.handle, Duration::from_secs(10), "done", || {
                let mut c = s.client.clone();
                async move { c.done(call(DoneRequest { peer: peer as u32 })).await }
            })
        });
        if let Some(Err(s)) = said.into_iter().find(|r| r.is_err()) {
            tracing::warn!(
                "node {peer}: could not tell the server it is done: {}",
                s.message()
            );
        }
    }

    /// Splits wire tensors by the shard that owns them and encodes each shard's upload in
    /// memory (floats stored as `kind`).
    pub fn encode_upload(&self, wire: Named, kind: tch::Kind, handover: &[usize]) -> Vec<Upload> {
        let mut per_shard: Vec<Named> = (0..self.shards.len()).map(|_| Vec::new()).collect();
        for (name, t) in wire {
            per_shard[self.shard_of(&name)].push((name, t));
        }
        per_shard
            .into_iter()
            .map(|named| {
                let (bytes, xxh3) = payload::encode(&named, kind);
                Upload {
                    bytes: Arc::new(bytes),
                    xxh3,
                    handover: handover.iter().map(|&e| e as u32).collect(),
                }
            })
            .collect()
    }
}

impl Link {
    /// Learns from the model's layout which tensors each shard owns and the payload sizes it
    /// may announce.
    pub fn set_layout(&mut self, layout: &spes_sync::Layout) {
        let k = self.shards.len();
        for (i, shard) in self.shards.iter_mut().enumerate() {
            let slice = layout.shard(i, k);
            let entries = |kind| {
                slice
                    .entries
                    .iter()
                    .map(move |(n, _, s)| (n.as_str(), s.as_slice(), kind))
            };
            shard.full_bytes = payload::expected_size(entries(tch::Kind::Float));
            // Dense bf16 deltas; sparse (density ≤ 0.3: ≤ 1.8 bytes per value) and quantized
            // ones (≤ 1.04 bytes per value) take less.
            shard.delta_max = 2 * payload::expected_size(entries(tch::Kind::BFloat16));
            shard.names =
                (k > 1).then(|| Arc::new(slice.entries.into_iter().map(|(n, _, _)| n).collect()));
        }
    }
}
