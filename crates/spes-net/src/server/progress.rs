//! The restart point in memory and its one writer. Changes are made under the state's lock and
//! numbered; [`Progress::commit`] writes `server.json` outside that lock, under the writer's
//! own, so no disk flush ever holds up a reader or a changer of the state (nor the coordinator,
//! whose lock comes before this one), and an older snapshot never overwrites a newer one.
//!
//! Lock order of the server (`State`): coordinator → progress → io → watch, each held only for
//! memory work; the writer's lock is taken with none of them held, and `served` alone.

use super::mirror::Mirror;
use super::store::ServerState;
use anyhow::Result;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

/// [`ServerState`] as the server runs it.
pub(super) struct Progress {
    /// The state and the number of changes made to it.
    state: Mutex<(ServerState, u64)>,
    /// The version on disk.
    written: Mutex<u64>,
    out: PathBuf,
    mirror: Option<Arc<Mirror>>,
}

impl Progress {
    /// The state as opened from (and written to) `<out>/server.json`, and to a new manifest
    /// in `mirror`'s store after it.
    pub fn new(state: ServerState, out: PathBuf, mirror: Option<Arc<Mirror>>) -> Progress {
        Progress {
            state: Mutex::new((state, 0)),
            written: Mutex::new(0),
            out,
            mirror,
        }
    }

    /// Reads the state (memory only: never held across a write).
    pub fn read(&self) -> MutexGuard<'_, (ServerState, u64)> {
        self.state.lock().unwrap()
    }

    /// Changes the state with `f`, which says whether it changed anything; returns what `f`
    /// returned and the version to [`Progress::commit`] (`None`: nothing changed).
    pub fn change<T>(&self, f: impl FnOnce(&mut ServerState) -> (T, bool)) -> (T, Option<u64>) {
        let mut st = self.state.lock().unwrap();
        let (out, changed) = f(&mut st.0);
        if !changed {
            return (out, None);
        }
        st.1 += 1;
        (out, Some(st.1))
    }

    /// Makes version `v` durable: writes the newest state unless a version at least as new is
    /// on disk already (it holds `v`'s change too).
    pub fn commit(&self, v: u64) -> Result<()> {
        self.commit_with(v, |st| {
            st.save(&self.out)?;
            match &self.mirror {
                Some(m) => m.write(st),
                None => Ok(()),
            }
        })
    }

    /// [`Progress::commit`] with `write` in place of the file write (tests slow it down).
    pub(super) fn commit_with(
        &self,
        v: u64,
        write: impl FnOnce(&ServerState) -> Result<()>,
    ) -> Result<()> {
        let mut written = self.written.lock().unwrap();
        if *written >= v {
            return Ok(());
        }
        // A snapshot of the newest version, copied out so the write holds no state lock.
        let (snapshot, version) = {
            let st = self.state.lock().unwrap();
            (st.0.clone(), st.1)
        };
        write(&snapshot)?;
        *written = version;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;

    fn state() -> ServerState {
        serde_json::from_str(
            r#"{"format_version": 3, "fulls": [], "rounds": [], "initial_val_loss": null,
                "gone": [], "record": null}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_slow_write_holds_up_no_reader_or_change_and_never_writes_an_older_state() {
        let p = Arc::new(Progress::new(state(), PathBuf::from("unused"), None));
        let ((), v1) = p.change(|st| {
            st.gone = vec![1];
            ((), true)
        });
        let (started, release) = (mpsc::channel(), mpsc::channel::<()>());
        let (started_tx, started_rx) = started;
        let (release_tx, release_rx) = release;
        let slow = {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut wrote = Vec::new();
                p.commit_with(v1.unwrap(), |st| {
                    wrote = st.gone.clone();
                    started_tx.send(()).unwrap();
                    release_rx.recv().unwrap(); // the disk takes its time
                    Ok(())
                })
                .unwrap();
                wrote
            })
        };
        started_rx.recv().unwrap();
        // While the write is under way, the state is read and changed at once.
        assert_eq!(p.read().0.gone, vec![1]);
        let ((), v2) = p.change(|st| {
            st.gone = vec![1, 2];
            ((), true)
        });
        let ((), none) = p.change(|_| ((), false));
        assert_eq!(none, None, "no change, no version");
        release_tx.send(()).unwrap();
        assert_eq!(
            slow.join().unwrap(),
            vec![1],
            "the snapshot of its own version"
        );
        // The newer version is written after; the older is never written again.
        let mut wrote = None;
        p.commit_with(v2.unwrap(), |st| {
            wrote = Some(st.gone.clone());
            Ok(())
        })
        .unwrap();
        assert_eq!(wrote, Some(vec![1, 2]));
        let again = p.commit_with(v1.unwrap(), |_| {
            panic!("an older version is on disk already")
        });
        assert!(again.is_ok());
        // A failed write leaves its version to the next commit.
        let ((), v3) = p.change(|st| {
            st.gone = vec![3];
            ((), true)
        });
        assert!(p
            .commit_with(v3.unwrap(), |_| anyhow::bail!("disk full"))
            .is_err());
        let mut retried = false;
        p.commit_with(v3.unwrap(), |_| {
            retried = true;
            Ok(())
        })
        .unwrap();
        assert!(retried);
    }
}
