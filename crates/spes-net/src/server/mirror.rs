//! The server's state in object storage (`spes server --store URL`), so that a new server on
//! another machine, with an empty `--out`, resumes the run bit for bit
//! (docs/design/server-state.md#in-a-store).
//!
//! `--out` stays the working copy: every file the server writes there that a restart needs
//! (published deltas, whole models, acknowledged uploads) is also put in the store, and every
//! restart point is a new, create-only manifest `state/NNNNNNNNNN.json` written after the
//! files it names — never one rewritten file. A manifest names the server process that wrote
//! it, so a create that finds its name taken tells this server's own earlier try (whose reply
//! was lost) from a second server writing the same run, which is refused.

use super::store::{hex_of, intact, read_state, ServerState, Staged, Stored, STATE_FILE};
use crate::payload;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_store::{Created, RunStore};
use std::path::Path;
use std::sync::Mutex;

const STATE_DIR: &str = "state";
/// Manifests kept: the newest and the one before, which a restart falls back to if the newest
/// is unreadable.
const KEEP_MANIFESTS: u64 = 2;

/// A restart point as the store keeps it.
#[derive(Serialize, Deserialize)]
struct Manifest {
    /// The server process that wrote it (random per process).
    writer: String,
    state: ServerState,
}

/// Another server wrote the manifest this one meant to write: two servers run the same store.
#[derive(Debug, thiserror::Error)]
#[error(
    "{key} in {url} was written by another server ({other}); two servers are writing this run's \
     store: stop one of them"
)]
pub(super) struct Conflict {
    key: String,
    url: String,
    other: String,
}

/// Stops this process if `e` says another server writes the store: going on would overwrite
/// that server's files (the manifests fence; the files they name are plain puts).
pub(super) fn exit_if_fenced(e: &anyhow::Error) {
    if let Some(c) = e.downcast_ref::<Conflict>() {
        tracing::error!("{c}");
        std::process::exit(3);
    }
}

/// The store a server mirrors its state to.
pub(super) struct Mirror {
    store: RunStore,
    writer: String,
    /// The number of the next manifest.
    next: Mutex<u64>,
}

impl Mirror {
    /// A mirror to `store`, as a new writer (a random id names its manifests).
    pub fn new(store: RunStore) -> Mirror {
        Mirror {
            store,
            writer: format!("{:016x}", rand::random::<u64>()),
            next: Mutex::new(0),
        }
    }

    /// The store's URL.
    pub fn url(&self) -> &str {
        self.store.url()
    }

    /// Puts `<out>/<file>` in the store under `file`.
    pub fn put(&self, out: &Path, file: &str) -> Result<()> {
        Ok(self.store.put_file(file, &out.join(file))?)
    }

    /// Bytes this process has put in the store.
    pub fn bytes_put(&self) -> u64 {
        self.store.bytes_put()
    }

    /// Whether the store hands out presigned URLs.
    pub fn presigns(&self) -> bool {
        self.store.presigns()
    }

    /// The size of `key`; `None` if there is no such object.
    pub fn size(&self, key: &str) -> Result<Option<u64>> {
        Ok(self.store.size(key)?)
    }

    /// A presigned GET URL of `file` for `lifetime`; `None` if the store cannot presign or
    /// failed to (logged): the caller streams instead.
    pub fn presign(&self, file: &str, lifetime: std::time::Duration) -> Option<String> {
        logged(file, self.store.presign_get(file, lifetime))
    }

    /// As [`Mirror::presign`], a presigned PUT URL of `key`.
    pub fn presign_put(&self, key: &str, lifetime: std::time::Duration) -> Option<String> {
        logged(key, self.store.presign_put(key, lifetime))
    }

    /// Downloads `key` to `path`; `false` if there is no such object.
    pub fn get_file(&self, key: &str, path: &Path) -> Result<bool> {
        Ok(self.store.get_file(key, path)?)
    }

    /// The fault point `corrupt-store@R`: puts `<out>/<file>` with its first byte (in the
    /// part every node reads) changed.
    pub fn put_corrupted(&self, out: &Path, file: &str) -> Result<()> {
        let mut bytes = std::fs::read(out.join(file))?;
        if let Some(b) = bytes.first_mut() {
            *b ^= 0x5a;
        }
        tracing::warn!(
            "{}: putting {file} corrupted in the store",
            crate::fault::ENV
        );
        Ok(self.store.put(file, bytes.into())?)
    }

    /// Deletes `file` from the store; a failure is logged (an orphan costs space, not state).
    pub fn delete(&self, file: &str) {
        if let Err(e) = self.store.delete(file) {
            tracing::warn!("cannot delete {file} from the store: {e}");
        }
    }

    /// Deletes the acknowledged uploads of rounds `drop` selects, and those nodes staged.
    pub fn delete_pending(&self, drop: impl Fn(u64) -> bool) {
        for dir in ["pending", "incoming"] {
            match self.store.list(dir) {
                Ok(listed) => {
                    for l in listed
                        .iter()
                        .filter(|l| pending_round(&l.key).is_none_or(&drop))
                    {
                        self.delete(&l.key);
                    }
                }
                Err(e) => tracing::warn!("cannot list the store's {dir}/: {e}"),
            }
        }
    }

    /// Writes `st` as the next manifest, then deletes those older than the kept ones.
    pub fn write(&self, st: &ServerState) -> Result<()> {
        let mut next = self.next.lock().unwrap();
        let body = serde_json::to_vec(&Manifest {
            writer: self.writer.clone(),
            state: st.clone(),
        })?;
        loop {
            let key = manifest_key(*next);
            match self.store.create(&key, body.clone().into())? {
                Created::Written => break,
                // Our own earlier try of this very manifest, whose reply was lost.
                Created::Exists(there) if there == body => break,
                Created::Exists(there) => {
                    let other = serde_json::from_slice::<Manifest>(&there)
                        .map(|m| m.writer)
                        .unwrap_or_else(|_| "unreadable".into());
                    if other != self.writer {
                        return Err(Conflict {
                            key,
                            url: self.store.url().to_owned(),
                            other,
                        }
                        .into());
                    }
                    // Our own earlier try, whose reply was lost: the next name is ours.
                    *next += 1;
                }
            }
        }
        if *next >= KEEP_MANIFESTS {
            self.delete(&manifest_key(*next - KEEP_MANIFESTS));
        }
        *next += 1;
        Ok(())
    }

    /// Before the server opens `out`: makes it hold the newer of its own restart point and
    /// the store's newest (its own when they tie), with every file it names that `out` lacks
    /// and the open round's acknowledged uploads; a store that has none yet is given `out`'s
    /// (a run moved into a store). Then claims the store: writes the restart point as this
    /// server's first manifest, so a server still writing there is refused at its next write.
    pub fn restore(&self, out: &Path) -> Result<()> {
        self.restore_files(out)?;
        let state_path = out.join(STATE_FILE);
        if state_path.exists() {
            self.write(&read_state(&state_path)?)?;
        }
        Ok(())
    }

    fn restore_files(&self, out: &Path) -> Result<()> {
        let listed = self.store.list(STATE_DIR)?;
        let mut seqs: Vec<u64> = listed.iter().filter_map(|l| manifest_seq(&l.key)).collect();
        seqs.sort_unstable();
        *self.next.lock().unwrap() = seqs.last().map_or(0, |s| s + 1);
        // The newest manifest or a clear error: an older one would roll the run back.
        let remote = match seqs.last() {
            None => None,
            Some(&seq) => {
                let key = manifest_key(seq);
                let bytes = self
                    .store
                    .get(&key)?
                    .with_context(|| format!("{key} was listed in {} but is gone", self.url()))?;
                let m: Manifest = serde_json::from_slice(&bytes).with_context(|| {
                    format!(
                        "{key} in {} is not a spes restart point; move it aside to resume \
                         from the one before",
                        self.url()
                    )
                })?;
                Some((key, m.state))
            }
        };
        for &seq in seqs.iter().rev().skip(KEEP_MANIFESTS as usize + 1) {
            self.delete(&manifest_key(seq));
        }
        let state_path = out.join(STATE_FILE);
        let local = state_path
            .exists()
            .then(|| read_state(&state_path))
            .transpose()?;
        match (remote, local) {
            (None, None) => Ok(()),
            (None, Some(local)) => {
                tracing::info!(
                    "the store {} holds no restart point: putting {}'s there",
                    self.url(),
                    out.display()
                );
                for s in stored_files(&local) {
                    // The opener falls back past a missing or torn file: so does the copy.
                    if intact(out, s) {
                        self.put(out, &s.file)?;
                    } else {
                        tracing::warn!("{} is missing or torn: not put in the store", s.file);
                    }
                }
                for l in local_pending(out)? {
                    self.put(out, &l)?;
                }
                Ok(())
            }
            (Some((key, remote)), Some(local))
                if local.rounds.last().map(|r| r.round)
                    >= remote.rounds.last().map(|r| r.round) =>
            {
                // `out` is as new: it only gets what it lacks of its own state.
                self.download(out, &key, &local)
            }
            (Some((key, remote)), _) => {
                self.download(out, &key, &remote)?;
                std::fs::create_dir_all(out)
                    .with_context(|| format!("cannot create {}", out.display()))?;
                remote.save(out)
            }
        }
    }

    /// Fills `out` with the files `st` names (those not there intact) and the open round's
    /// acknowledged uploads, then writes `st` as its restart point.
    fn download(&self, out: &Path, key: &str, st: &ServerState) -> Result<()> {
        let newest = st.rounds.last().map_or(0, |r| r.round);
        let missing: Vec<&Stored> = stored_files(st).filter(|s| !intact(out, s)).collect();
        if !missing.is_empty() {
            tracing::info!(
                "restoring {} from the store {} ({key}: published round {newest}; {} files)",
                out.display(),
                self.url(),
                missing.len()
            );
        }
        for s in missing {
            // A missing or torn file is left to the opener, which falls back past it.
            if !self.store.get_file(&s.file, &out.join(&s.file))? {
                tracing::error!("{} is named by {key} but not in the store", s.file);
            }
        }
        let open = newest + 1;
        for l in self.store.list("pending")? {
            if pending_round(&l.key) == Some(open) && !out.join(&l.key).exists() {
                self.store.get_file(&l.key, &out.join(&l.key))?;
            }
        }
        // Uploads their nodes staged: fetched by their record, kept only if they check out.
        for l in self.store.list("pending")? {
            let Some(name) = l.key.strip_suffix(".staged.json") else {
                continue;
            };
            let upload = out.join(format!("{name}.safetensors"));
            if pending_round(&l.key) != Some(open) || upload.exists() {
                continue;
            }
            let staged: Staged = serde_json::from_slice(&std::fs::read(out.join(&l.key))?)
                .with_context(|| format!("{} is unreadable", out.join(&l.key).display()))?;
            let fetched = self.store.get_file(&staged.key, &upload)?;
            let intact = fetched
                && payload::digest(&upload)
                    .is_ok_and(|(n, x)| n == staged.bytes && hex_of(x) == staged.xxh3);
            if !intact {
                let _ = std::fs::remove_file(&upload);
                tracing::error!(
                    "the acknowledged upload {} is missing or changed in the store: not re-applied",
                    staged.key
                );
            }
        }
        Ok(())
    }
}

/// A presigned URL, or `None` with the reason logged.
fn logged(key: &str, url: Result<Option<String>, spes_store::StoreError>) -> Option<String> {
    url.unwrap_or_else(|e| {
        tracing::warn!("cannot presign {key}: {e}");
        None
    })
}

fn manifest_key(seq: u64) -> String {
    format!("{STATE_DIR}/{seq:010}.json")
}

fn manifest_seq(key: &str) -> Option<u64> {
    key.strip_prefix(STATE_DIR)?
        .strip_prefix('/')?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// The round of a file in `pending/` (`pending/round-NNNNNN-peer-…`).
fn pending_round(key: &str) -> Option<u64> {
    let name = key.rsplit('/').next()?;
    name.strip_prefix("round-")?.get(..6)?.parse().ok()
}

/// Every file a restart point names.
fn stored_files(st: &ServerState) -> impl Iterator<Item = &Stored> {
    let fulls = st
        .fulls
        .iter()
        .flat_map(|f| std::iter::once(&f.model).chain(f.carried.as_ref()));
    fulls.chain(st.rounds.iter().flat_map(|r| r.files()))
}

/// The acknowledged uploads in `<out>/pending`, as keys relative to `out`.
fn local_pending(out: &Path) -> Result<Vec<String>> {
    let Ok(entries) = std::fs::read_dir(out.join("pending")) else {
        return Ok(Vec::new());
    };
    let mut keys = Vec::new();
    for e in entries {
        let name = e?.file_name().to_string_lossy().into_owned();
        if name.contains(".tmp-") {
            continue;
        }
        keys.push(format!("pending/{name}"));
    }
    if let Some(k) = keys.iter().find(|k| pending_round(k).is_none()) {
        bail!("{}: not an upload of a round", out.join(k).display());
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(round: u64) -> ServerState {
        serde_json::from_str(&format!(
            r#"{{"format_version": 3, "fulls": [], "rounds": [{{"round": {round}, "tokens": 0,
                "owners": [], "members": [0]}}], "initial_val_loss": null, "gone": [],
                "record": null}}"#
        ))
        .unwrap()
    }

    fn manifests(m: &Mirror) -> Vec<String> {
        m.store
            .list(STATE_DIR)
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect()
    }

    #[test]
    fn a_second_server_on_the_same_store_is_refused_and_a_lost_reply_is_not_a_conflict() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("store").display().to_string();
        let open = || Mirror::new(RunStore::open(&url, &Default::default()).unwrap());
        let (a, b) = (open(), open());
        let out = dir.path().join("out");
        a.restore(&out).unwrap();
        b.restore(&out).unwrap();
        a.write(&state(1)).unwrap();
        // B numbered its manifests before A wrote: its create loses the race.
        let e = b.write(&state(1)).unwrap_err();
        let conflict = e.downcast_ref::<Conflict>().expect("a typed conflict");
        assert!(conflict.key.ends_with("0000000000.json"), "{e}");
        // A's create went through but its reply was lost: trying again is not a conflict.
        *a.next.lock().unwrap() = 0;
        a.write(&state(2)).unwrap();
        let seqs = manifests(&a);
        assert_eq!(seqs, ["state/0000000000.json", "state/0000000001.json"]);
        // A third server restores the newest and numbers after it; old manifests go.
        let c = open();
        c.restore(&dir.path().join("c")).unwrap();
        let restored = read_state(&dir.path().join("c").join(STATE_FILE)).unwrap();
        assert_eq!(restored.newest().round, 2);
        for r in 3..6 {
            c.write(&state(r)).unwrap();
        }
        let seqs = manifests(&c);
        // Its restore claimed the store with manifest 2 (round 2), then rounds 3 to 5.
        assert_eq!(seqs, ["state/0000000004.json", "state/0000000005.json"]);
        // A newest manifest that does not parse stops a restore, naming it, rather than roll
        // the run back to the one before.
        c.store
            .put("state/0000000006.json", "{torn".into())
            .unwrap();
        let e = open().restore(&dir.path().join("d")).unwrap_err();
        assert!(format!("{e:#}").contains("state/0000000006.json"), "{e:#}");
    }

    #[test]
    fn a_restore_fetches_the_uploads_nodes_staged_and_only_as_they_were_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("store").display().to_string();
        let m = Mirror::new(RunStore::open(&url, &Default::default()).unwrap());
        m.write(&state(4)).unwrap();
        // Peers 0 and 1 staged their round-5 uploads; peer 1's object changed after its ack.
        for (peer, stored, acked) in [(0, "zero", "zero"), (1, "one!", "one.")] {
            let key = format!("incoming/round-000005-peer-{peer}-00000000000000ab.safetensors");
            m.store
                .put(&key, stored.as_bytes().to_vec().into())
                .unwrap();
            let record = Staged {
                key,
                bytes: 4,
                xxh3: hex_of(xxhash_rust::xxh3::xxh3_64(acked.as_bytes())),
            };
            let name = format!("pending/round-000005-peer-{peer}.staged.json");
            m.store
                .put(&name, serde_json::to_vec(&record).unwrap().into())
                .unwrap();
        }
        let out = dir.path().join("out");
        Mirror::new(RunStore::open(&url, &Default::default()).unwrap())
            .restore(&out)
            .unwrap();
        let upload = |peer| out.join(format!("pending/round-000005-peer-{peer}.safetensors"));
        assert_eq!(std::fs::read(upload(0)).unwrap(), b"zero");
        assert!(!upload(1).exists(), "a changed staged upload was restored");
    }
}
