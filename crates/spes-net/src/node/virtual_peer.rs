//! A peer that speaks the node's own transport without training: it joins, and each round
//! uploads a fixed delta and fetches the round back without its own experts, through the same
//! [`Link`] (calls, retries, payload checks) a node uses. `spes bench load` drives many of them
//! against one server, so what it measures is what nodes cost the server.

use super::transport::{Exchange, Link, Shard, StoreLinks, Upload};
use crate::dial::client;
use anyhow::{anyhow, Result};
use spes_sync::{FetchPlan, Layout, Named, Work};
use std::path::PathBuf;
use std::time::Duration;

/// One virtual peer: its link and its upload, encoded once.
pub struct VirtualPeer {
    link: Link,
    uploads: Vec<Upload>,
}

impl VirtualPeer {
    /// Peer `peer` of the unsharded server at `url` (`credential`: `None` for `--no-auth`) on
    /// `rt`, uploading `wire` (floats as `kind`) every round; a whole model it fetched would land
    /// in `out`.
    pub fn open(
        url: &str,
        credential: Option<&str>,
        peer: usize,
        layout: &Layout,
        (wire, kind): (Named, tch::Kind),
        rt: &tokio::runtime::Runtime,
        out: PathBuf,
    ) -> Result<VirtualPeer> {
        let client = {
            let _entered = rt.enter();
            client(url, credential, None, false)?
        };
        let mut link = Link {
            handle: rt.handle().clone(),
            shards: vec![Shard {
                client,
                names: None,
                full_bytes: 0,
                delta_max: 0,
            }],
            peer,
            session: 1000 + peer as u64,
            patience: Duration::from_secs(60),
            out,
            data_parts: Vec::new(),
            max_experts: None,
            activity: Default::default(),
            store: StoreLinks::new(),
            read: Default::default(),
        };
        link.set_layout(layout);
        let uploads = link.encode_upload(wire, kind, &[]);
        Ok(VirtualPeer { link, uploads })
    }

    /// Bytes of one upload.
    pub fn upload_bytes(&self) -> u64 {
        self.uploads.iter().map(|u| u.bytes.len() as u64).sum()
    }

    /// Joins as a member the run already lists (retrying while the server starts).
    pub fn join(&self) -> Result<()> {
        self.link
            .join(false)
            .map(|_| ())
            .map_err(|s| anyhow!("peer {} cannot join: {}", self.link.peer, s.message()))
    }

    /// Uploads round `round`, then fetches it as a delta without this peer's experts.
    pub fn round(&self, round: u64) -> Result<()> {
        let ask = FetchPlan {
            round: Some(round),
            have_previous: true,
            skip_own: true,
        };
        let peer = self.link.peer;
        match self
            .link
            .exchange(round, self.uploads.clone(), Work::default(), ask)
        {
            Exchange::Fetched { .. } => Ok(()),
            Exchange::UploadRefused(s) => Err(anyhow!("peer {peer} upload: {}", s.message())),
            Exchange::FetchFailed { status, .. } => {
                Err(anyhow!("peer {peer} fetch: {}", status.message()))
            }
        }
    }

    /// The store GETs this peer made so far (downloads through presigned URLs).
    pub fn store_gets(&self) -> u64 {
        self.link
            .store
            .as_ref()
            .map_or(0, |s| s.gets.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Tells the server this peer is done.
    pub fn done(&self) {
        self.link.done();
    }
}
