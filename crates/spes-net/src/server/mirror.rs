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

use super::store::{intact, read_state, ServerState, Stored, STATE_FILE};
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

/// The store a server mirrors its state to.
pub(super) struct Mirror {
    store: RunStore,
    writer: String,
    /// The number of the next manifest.
    next: Mutex<u64>,
}

impl Mirror {
    pub fn new(store: RunStore) -> Mirror {
        Mirror {
            store,
            writer: format!("{:016x}", rand::random::<u64>()),
            next: Mutex::new(0),
        }
    }

    pub fn url(&self) -> &str {
        self.store.url()
    }

    /// Puts `<out>/<file>` in the store under `file`.
    pub fn put(&self, out: &Path, file: &str) -> Result<()> {
        Ok(self.store.put_file(file, &out.join(file))?)
    }

    /// Deletes `file` from the store; a failure is logged (an orphan costs space, not state).
    pub fn delete(&self, file: &str) {
        if let Err(e) = self.store.delete(file) {
            tracing::warn!("cannot delete {file} from the store: {e}");
        }
    }

    /// Deletes the acknowledged uploads of rounds `drop` selects.
    pub fn delete_pending(&self, drop: impl Fn(u64) -> bool) {
        match self.store.list("pending") {
            Ok(listed) => {
                for l in listed
                    .iter()
                    .filter(|l| pending_round(&l.key).is_none_or(&drop))
                {
                    self.delete(&l.key);
                }
            }
            Err(e) => tracing::warn!("cannot list the store's pending uploads: {e}"),
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

    /// Before the server opens `out`: makes it hold the store's newest restart point and the
    /// files it names, unless `out`'s own is as new; a store that has none yet is given
    /// `out`'s (a run moved into a store). Numbers the next manifest after the newest.
    pub fn restore(&self, out: &Path) -> Result<()> {
        let listed = self.store.list(STATE_DIR)?;
        let mut seqs: Vec<u64> = listed.iter().filter_map(|l| manifest_seq(&l.key)).collect();
        seqs.sort_unstable();
        *self.next.lock().unwrap() = seqs.last().map_or(0, |s| s + 1);
        let mut remote = None;
        for &seq in seqs.iter().rev() {
            let key = manifest_key(seq);
            let parsed = self.store.get(&key)?.and_then(|b| {
                serde_json::from_slice::<Manifest>(&b)
                    .map_err(|e| tracing::error!("{key} in the store is unreadable: {e}"))
                    .ok()
            });
            if let Some(m) = parsed {
                remote = Some((key, m.state));
                break;
            }
        }
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
                    self.put(out, &s.file)?;
                }
                for l in local_pending(out)? {
                    self.put(out, &l)?;
                }
                self.write(&local)
            }
            (Some((_, remote)), Some(local))
                if local.rounds.last().map(|r| r.round)
                    >= remote.rounds.last().map(|r| r.round) =>
            {
                Ok(())
            }
            (Some((key, remote)), _) => self.download(out, &key, &remote),
        }
    }

    /// Fills `out` with the files `st` names (those not there intact) and the open round's
    /// acknowledged uploads, then writes `st` as its restart point.
    fn download(&self, out: &Path, key: &str, st: &ServerState) -> Result<()> {
        let newest = st.rounds.last().map_or(0, |r| r.round);
        tracing::info!(
            "restoring {} from the store {} ({key}: published round {newest})",
            out.display(),
            self.url()
        );
        for s in stored_files(st) {
            if intact(out, s) {
                continue;
            }
            // A missing or torn file is left to the opener, which falls back past it.
            if !self.store.get_file(&s.file, &out.join(&s.file))? {
                tracing::error!("{} is named by {key} but not in the store", s.file);
            }
        }
        let open = newest + 1;
        for l in self.store.list("pending")? {
            if pending_round(&l.key) == Some(open) {
                self.store.get_file(&l.key, &out.join(&l.key))?;
            }
        }
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        st.save(out)
    }
}

fn manifest_key(seq: u64) -> String {
    format!("{STATE_DIR}/{seq:010}.json")
}

fn manifest_seq(key: &str) -> Option<u64> {
    key.strip_prefix("state/")?
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
    fulls.chain(
        st.rounds
            .iter()
            .flat_map(|r| r.parts.iter().map(|p| &p.stored)),
    )
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
    if keys.iter().any(|k| pending_round(k).is_none()) {
        bail!(
            "{}: a file that is not an upload",
            out.join("pending").display()
        );
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
        let seqs: Vec<_> = a
            .store
            .list("state")
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect();
        assert_eq!(seqs, ["state/0000000000.json", "state/0000000001.json"]);
        // A third server restores the newest and numbers after it; old manifests go.
        let c = open();
        c.restore(&dir.path().join("c")).unwrap();
        let restored = read_state(&dir.path().join("c").join(STATE_FILE)).unwrap();
        assert_eq!(restored.newest().round, 2);
        for r in 3..6 {
            c.write(&state(r)).unwrap();
        }
        let seqs: Vec<_> = c
            .store
            .list("state")
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect();
        assert_eq!(seqs, ["state/0000000003.json", "state/0000000004.json"]);
    }
}
