//! The gRPC handlers: join and heartbeat (leases), fetch (a published round as a delta or a
//! whole model), upload (header checked before the body is read, then folded into the open
//! round and kept in `pending/` until it is published) and done.

use super::store::{hex_of, parse_hex, DeltaPart, Staged, Stored};
use super::State;
use crate::auth::{authorize, check_peer, Caller};
use crate::proto::refusal::Kind;
use crate::proto::spes_server::Spes;
use crate::proto::{
    Chunk, DoneReply, DoneRequest, FetchRequest, HeartbeatReply, JoinReply, JoinRequest,
    PayloadHeader, SettingsReply, SettingsRequest, StageReply, StageRequest, StatusReply,
    StatusRequest, UploadReply,
};
use crate::{payload, refusal};
use spes_data::shard::write_atomic;
use spes_sync::{Standing, Work};
use spes_train::metrics::UploadTiming;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

pub(super) struct Service {
    pub state: Arc<State>,
}

fn standing_from(standing: Standing) -> u64 {
    match standing {
        Standing::Member => 0,
        Standing::Joining { from } => from,
    }
}

#[tonic::async_trait]
impl Spes for Service {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let s = &self.state;
        let peer = authorize(&req, req.get_ref().peer)?;
        s.check_protocol(peer, req.get_ref().protocol)?;
        let r = req.get_ref().clone();
        // A join may make the restart point durable (disk, and a store): off the runtime.
        let state = s.clone();
        let (standing, scope, published_round, settings) = tokio::task::spawn_blocking(move || {
            state.join(
                peer,
                r.session,
                r.join,
                Some(&r.data_parts),
                r.max_experts.map(|k| k as usize),
            )
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        let owned = (0..s.cfg.model.n_experts)
            .filter(|&e| {
                standing == Standing::Member
                    && scope.uploads(peer, spes_model::Role::Expert { layer: 0, index: e })
            })
            .map(|e| e as u32)
            .collect();
        match standing {
            Standing::Member => tracing::info!("node {peer} joined"),
            Standing::Joining { from } => {
                tracing::info!("node {peer} joins the run from round {from}")
            }
        }
        Ok(Response::new(JoinReply {
            config_toml: toml::to_string(&s.cfg).map_err(|e| Status::internal(e.to_string()))?,
            peers: scope.members().len() as u32,
            owned_experts: owned,
            published_round,
            lease_ms: (s.cfg.sync.lease_s * 1000.0) as u64,
            member_from: standing_from(standing),
            shard: s.shard.0 as u32,
            shards: s.shard.1 as u32,
            tokenizer_xxh3: s.tokenizer_xxh3.clone(),
            settings: Some(crate::settings::to_proto(settings)),
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<JoinRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let s = &self.state;
        let peer = authorize(&req, req.get_ref().peer)?;
        s.check_protocol(peer, req.get_ref().protocol)?;
        let (state, session) = (s.clone(), req.get_ref().session);
        let (standing, _, published_round, _) =
            tokio::task::spawn_blocking(move || state.join(peer, session, false, None, None))
                .await
                .map_err(|e| Status::internal(e.to_string()))??;
        s.coord
            .lock()
            .unwrap()
            .report_activity(peer, req.get_ref().activity, s.now());
        if let Some(report) = &req.get_ref().report {
            let checked = crate::view::report_of(report);
            let mut watch = s.watch.lock().unwrap();
            match checked {
                Ok(r) => watch.peers.entry(peer).or_default().report = Some((r, s.now())),
                Err(e) => {
                    watch.counters.bad_reports += 1;
                    tracing::warn!("dropped node {peer}'s report: {e}");
                }
            }
        }
        Ok(Response::new(HeartbeatReply {
            published_round,
            member_from: standing_from(standing),
        }))
    }

    type FetchStream = ReceiverStream<Result<Chunk, Status>>;

    async fn fetch(
        &self,
        req: Request<FetchRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let s = self.state.clone();
        let peer = authorize(&req, req.get_ref().peer)?;
        let r = req.into_inner();
        let mut rx = s.published.subscribe();
        let round = if r.newest {
            *rx.borrow()
        } else {
            let wait = Duration::from_millis(r.wait_ms as u64).min(s.limits.max_wait);
            match tokio::time::timeout(wait, rx.wait_for(|&p| p >= r.round)).await {
                Ok(Ok(_)) => r.round,
                _ => {
                    return Err(refusal::status(
                        Code::Unavailable,
                        Kind::Retry,
                        r.round,
                        format!("round {} is not published yet", r.round),
                    ))
                }
            }
        };
        let gone = || {
            Status::not_found(format!(
                "round {round} is no longer kept; the newest is {}",
                *s.published.borrow()
            ))
        };
        let Some(meta) = s.progress.read().0.round(round).cloned() else {
            return Err(gone());
        };
        // A delta only for a node that holds the round before it, exactly.
        let as_delta = r.have_previous && round == r.round && !meta.parts.is_empty();
        let skip = |p: &DeltaPart| r.skip_own && p.own == Some(peer);
        let sent: Vec<(Stored, u64)> = if as_delta {
            meta.parts
                .iter()
                .filter(|p| !skip(p))
                .map(|p| (p.stored.clone(), p.offset))
                .collect()
        } else {
            let state = s.clone();
            let whole = tokio::task::spawn_blocking(move || state.whole_model(round))
                .await
                .map_err(|e| Status::internal(e.to_string()))?;
            vec![(whole.ok_or_else(gone)?, 0)]
        };
        let skipped_own = as_delta && meta.parts.iter().any(skip);
        let url = if r.links {
            let state = s.clone();
            let file = sent[0].0.file.clone();
            let one_file = sent.iter().all(|(p, _)| p.file == file);
            tokio::task::spawn_blocking(move || one_file.then(|| state.link(&file)).flatten())
                .await
                .map_err(|e| Status::internal(e.to_string()))?
        } else {
            None
        };
        let parts: Vec<crate::proto::Part> = sent
            .iter()
            .map(|(p, offset)| crate::proto::Part {
                offset: if url.is_some() { *offset } else { 0 },
                ..payload::part(p.bytes, parse_hex(&p.xxh3))
            })
            .collect();
        let header = PayloadHeader {
            peer: peer as u32,
            round,
            total_bytes: parts.iter().map(|p| p.bytes).sum(),
            parts,
            session: 0,
            owners: meta.owners.iter().map(|&o| o as u32).collect(),
            members: meta.members.iter().map(|&m| m as u32).collect(),
            delta: as_delta,
            skipped_own,
            budget: meta.budget.clone(),
            url: url.clone().unwrap_or_default(),
            settings: Some(crate::settings::to_proto(
                meta.settings.unwrap_or_else(|| s.cfg.sync.settings()),
            )),
            ..PayloadHeader::default()
        };
        // What leaves this process: the header, and the bytes unless the store sends them.
        let out_bytes = prost::Message::encoded_len(&header) as u64
            + if url.is_some() { 0 } else { header.total_bytes };
        {
            let mut io = s.io.lock().unwrap();
            io.bytes_out += out_bytes;
            io.links += u64::from(url.is_some());
            io.fallbacks += u64::from(r.fell_back);
        }
        {
            let mut watch = s.watch.lock().unwrap();
            watch.peers.entry(peer).or_default().bytes_out += out_bytes;
            watch.counters.links += u64::from(url.is_some());
            watch.counters.fallbacks += u64::from(r.fell_back);
        }
        if r.fell_back {
            tracing::info!("node {peer} takes round {round} from the server: the store failed it");
        }
        let files = if url.is_some() {
            Vec::new()
        } else {
            sent.iter()
                .map(|(p, offset)| payload::Source::Range {
                    path: s.store.out.join(&p.file),
                    offset: *offset,
                    len: p.bytes,
                })
                .collect()
        };
        Ok(Response::new(payload::send(files, header, |_| {})))
    }

    async fn stage(&self, req: Request<StageRequest>) -> Result<Response<StageReply>, Status> {
        let s = self.state.clone();
        let peer = authorize(&req, req.get_ref().peer)?;
        let r = req.into_inner();
        let handover: Vec<usize> = r.handover.iter().map(|&e| e as usize).collect();
        s.check_upload_header(peer, r.session, r.round, r.bytes, &handover)?;
        let key = format!(
            "{}{:016x}.safetensors",
            staged_prefix(r.round, peer),
            rand::random::<u64>()
        );
        let state = s.clone();
        let k = key.clone();
        let url = tokio::task::spawn_blocking(move || state.upload_link(&k, r.bytes))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(match url {
            Some(url) => StageReply { url, key },
            None => StageReply::default(),
        }))
    }

    async fn done(&self, req: Request<DoneRequest>) -> Result<Response<DoneReply>, Status> {
        let s = &self.state;
        let peer = authorize(&req, req.get_ref().peer)?;
        s.io.lock().unwrap().done.insert(peer);
        tracing::info!("node {peer} finished");
        Ok(Response::new(DoneReply {}))
    }

    async fn settings(
        &self,
        req: Request<SettingsRequest>,
    ) -> Result<Response<SettingsReply>, Status> {
        authorize(&req, req.get_ref().peer)?;
        let settings_toml = self
            .state
            .cfg
            .run_settings()
            .map_err(|e| Status::internal(format!("{e:#}")))?;
        Ok(Response::new(SettingsReply { settings_toml }))
    }

    async fn status(&self, _req: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        // The interceptor already admitted any valid credential (a peer's or the viewer's);
        // without auth, anyone who can connect reads the status.
        let state = self.state.clone();
        let view = tokio::task::spawn_blocking(move || state.view())
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(StatusReply {
            run_json: serde_json::to_string(&view).map_err(|e| Status::internal(e.to_string()))?,
        }))
    }

    async fn upload(
        &self,
        req: Request<Streaming<Chunk>>,
    ) -> Result<Response<UploadReply>, Status> {
        let s = self.state.clone();
        let idle = s.limits.idle_timeout;
        let authed = req.extensions().get::<Caller>().copied();
        let mut stream = req.into_inner();
        let mut claimed = (u32::MAX, 0);
        let result = async {
            let header = payload::read_header(&mut stream, idle).await?;
            // The body's bytes follow the header at the node's rate, whatever this side does
            // meanwhile (the stream's window holds them).
            let t = Instant::now();
            claimed = (header.peer, header.round);
            let peer = check_peer(authed, header.peer)?;
            // Everything the header allows is checked before any data is read.
            let handover: Vec<usize> = header.handover.iter().map(|&e| e as usize).collect();
            s.check_upload_header(
                peer,
                header.session,
                header.round,
                header.total_bytes,
                &handover,
            )?;
            if !header.staged.is_empty()
                && !header
                    .staged
                    .starts_with(&staged_prefix(header.round, peer))
            {
                return Err(refusal::status(
                    Code::InvalidArgument,
                    Kind::Invalid,
                    0,
                    format!(
                        "`{}` is not where peer {peer} stages round {}",
                        header.staged, header.round
                    ),
                ));
            }
            if !(header.compute_s.is_finite() && header.compute_s >= 0.0) {
                return Err(refusal::status(
                    Code::InvalidArgument,
                    Kind::Invalid,
                    0,
                    format!(
                        "the upload reports {} s of compute: expected a finite number ≥ 0",
                        header.compute_s
                    ),
                ));
            }
            let waiting = Instant::now();
            let _slot = tokio::time::timeout(s.limits.slot_wait, s.upload_slots.acquire())
                .await
                .map_err(|_| {
                    refusal::status(
                        Code::ResourceExhausted,
                        Kind::Retry,
                        0,
                        "every upload slot is busy; try again",
                    )
                })?
                .map_err(|_| Status::unavailable("the server is stopping"))?;
            // Not the node's: while it waited for a slot, the stream's window stopped its bytes.
            let slot_wait = waiting.elapsed();
            let part = s.store.out.join("incoming").join(format!(
                "round-{:06}-peer-{peer}-{:016x}.part",
                header.round,
                rand::random::<u64>()
            ));
            let received = if header.staged.is_empty() {
                payload::receive_body(&mut stream, &part, &header, idle)
                    .await
                    .map(|()| None)
            } else {
                let (state, h, p) = (s.clone(), header.clone(), part.clone());
                tokio::task::spawn_blocking(move || state.read_staged(&h, &p).map(Some))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
            };
            let staged = match received {
                Ok(staged) => staged,
                Err(e) => {
                    let _ = std::fs::remove_file(&part);
                    return Err(e);
                }
            };
            let receive_s = staged
                .is_none()
                .then(|| t.elapsed().saturating_sub(slot_wait).as_secs_f64());
            s.io.lock().unwrap().bytes_in += header.total_bytes;
            let state = s.clone();
            let (round, bytes) = (header.round, header.total_bytes);
            tokio::task::spawn_blocking(move || {
                state.accept(peer, &header, &part, staged, receive_s)
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
            {
                let mut watch = s.watch.lock().unwrap();
                let w = watch.peers.entry(peer).or_default();
                w.uploads += 1;
                w.bytes_in += bytes;
            }
            let _ = s.wake.try_send(());
            crate::fault::point_soon("acked", round);
            Ok(UploadReply { round })
        }
        .await;
        result
            .map(Response::new)
            .map_err(|e| s.reject(claimed.0, claimed.1, e))
    }
}

/// Where peer `peer` stages its uploads of `round` in the store: a prefix its key must have.
fn staged_prefix(round: u64, peer: usize) -> String {
    format!("incoming/round-{round:06}-peer-{peer}-")
}

impl State {
    /// Checks what an upload's header (or a request to stage one) says before any data moves:
    /// membership, round, session, duplicate, handover and the exact size.
    fn check_upload_header(
        &self,
        peer: usize,
        session: u64,
        round: u64,
        bytes: u64,
        handover: &[usize],
    ) -> Result<(), Status> {
        let expected = {
            let mut coord = self.coord.lock().unwrap();
            coord
                .check_upload(peer, session, round, self.now())
                .map_err(|e| refusal::of_round_error(&e))?;
            coord
                .check_handover(peer, handover)
                .map_err(|e| refusal::of_round_error(&e))?;
            self.expected_upload_bytes(coord.cfg(), coord.scope(), peer, round, handover)
        };
        if bytes != expected {
            return Err(refusal::status(
                Code::InvalidArgument,
                Kind::Invalid,
                0,
                format!(
                    "upload announces {bytes} bytes; peer {peer}'s tensors take exactly {expected}"
                ),
            ));
        }
        Ok(())
    }

    /// A presigned PUT URL of `key` for an upload of `bytes`; `None` without a store that
    /// presigns, or for an upload too large for one PUT (it is streamed).
    fn upload_link(&self, key: &str, bytes: u64) -> Option<String> {
        let m = self.store.mirror.as_ref()?;
        if bytes > spes_store::MAX_PUT {
            return None;
        }
        m.presign_put(key, self.limits.url_lifetime)
    }

    /// Reads the upload `header` says was staged in the store into `part`, checking its size
    /// and every part's checksum; returns the record a restored server fetches it by.
    fn read_staged(&self, header: &PayloadHeader, part: &Path) -> Result<Staged, Status> {
        let Some(m) = self.store.mirror.as_ref() else {
            return Err(Status::failed_precondition(
                "this server has no store to read uploads from",
            ));
        };
        let key = &header.staged;
        let unusable = |why: String| {
            refusal::status(
                Code::FailedPrecondition,
                Kind::Staged,
                0,
                format!("{key}: {why}"),
            )
        };
        let unreadable =
            |e: anyhow::Error| Status::unavailable(format!("cannot read {key}: {e:#}"));
        if crate::fault::active("drop-staged", header.round) {
            tracing::warn!("{}: deleting {key} before reading it", crate::fault::ENV);
            m.delete(key);
        }
        // Its size first: a presigned PUT takes any size, and a wrong one is not worth reading.
        match m.size(key).map_err(unreadable)? {
            Some(n) if n == header.total_bytes => {}
            Some(n) => {
                return Err(unusable(format!(
                    "{n} bytes, announced {}",
                    header.total_bytes
                )))
            }
            None => return Err(unusable("nothing is staged there".into())),
        }
        if !m.get_file(key, part).map_err(unreadable)? {
            return Err(unusable("nothing is staged there".into()));
        }
        let checked = std::fs::File::open(part)
            .map_err(|e| e.to_string())
            .and_then(|f| {
                let size = f.metadata().map_err(|e| e.to_string())?.len();
                if size != header.total_bytes {
                    return Err(format!("{size} bytes, announced {}", header.total_bytes));
                }
                payload::check_parts(&mut std::io::BufReader::new(f), &header.parts)
            });
        let (bytes, xxh3) = checked.map_err(unusable)?;
        Ok(Staged {
            key: key.clone(),
            bytes,
            xxh3: hex_of(xxh3),
        })
    }

    /// Parses a received upload, folds it into the open round and keeps its file in
    /// `pending/` (and the store) until the round is published, so an acknowledged upload
    /// survives a crash, and with a store the loss of the machine. `staged`: the record of an
    /// upload its node put in the store, kept beside it.
    /// Folds an upload received (`receive_s`: how long its body took, when streamed) into
    /// the round and keeps it.
    fn accept(
        &self,
        peer: usize,
        header: &PayloadHeader,
        part: &Path,
        staged: Option<Staged>,
        receive_s: Option<f64>,
    ) -> Result<(), Status> {
        let accepted: Result<(), Status> = (|| {
            let mut coord = self.coord.lock().unwrap();
            let now = self.now();
            let work = Work {
                rows: header.rows,
                compute_s: header.compute_s,
            };
            let fold = |named| coord.upload(peer, header.session, header.round, named, work, now);
            let t = Instant::now();
            // Safety: `Coordinator::upload` keeps none of an upload's storage, and `part` is
            // this call's own file.
            unsafe { payload::with_mapped(part, fold) }
                .map_err(|e| {
                    refusal::status(Code::InvalidArgument, Kind::Invalid, 0, format!("{e:#}"))
                })?
                .map_err(|e| refusal::of_round_error(&e))?;
            // Under the coordinator's lock, so the round this upload went into counts it.
            {
                let mut io = self.io.lock().unwrap();
                io.staged += u64::from(staged.is_some());
                io.uploads.push(UploadTiming {
                    peer,
                    bytes: header.total_bytes,
                    receive_s,
                    fold_s: t.elapsed().as_secs_f64(),
                });
            }
            let kept = self.store.pending_path(header.round, peer);
            let work = serde_json::to_vec(&work).expect("a Work serialises");
            write_atomic(&self.store.pending_work_path(header.round, peer), &work)
                .map_err(|e| Status::internal(format!("cannot keep the upload: {e:#}")))?;
            std::fs::rename(part, &kept)
                .and_then(|_| spes_data::shard::sync_dir(&kept))
                .map_err(|e| Status::internal(format!("cannot keep the upload: {e}")))?;
            // After the upload it describes: a record is never left without its upload.
            let staged_path = self.store.pending_staged_path(header.round, peer);
            match &staged {
                None => {
                    let _ = std::fs::remove_file(&staged_path);
                }
                Some(st) => {
                    let json = serde_json::to_vec(st).expect("a Staged serialises");
                    write_atomic(&staged_path, &json)
                        .map_err(|e| Status::internal(format!("cannot keep the upload: {e:#}")))?;
                }
            }
            Ok(())
        })();
        let _ = std::fs::remove_file(part);
        accepted?;
        // Outside the coordinator's lock: a store call may retry for minutes.
        self.store
            .mirror_pending(header.round, peer)
            .map_err(|e| Status::unavailable(format!("cannot keep the upload in the store: {e:#}")))
    }
}
