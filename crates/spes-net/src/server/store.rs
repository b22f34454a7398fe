//! The server's state on disk, so that a killed server restarts into the newest round it
//! published, bit for bit (docs/design/server-state.md).
//!
//! Every round is made durable with what that round needs: its published delta (the files a
//! delta fetch streams) and its line in `server.json`. A whole fp32 model, with the carried
//! state (outer momenta, lossy residuals), is written only every `sync.checkpoint_every_rounds`
//! rounds, at the last round, and on every round of the fp32 wire (which publishes whole
//! models): `checkpoints/round-NNNNNN.safetensors`, the newest `sync.keep_checkpoints` kept.
//! A restart loads the newest intact whole model and replays the kept deltas after it — the
//! same `base + f32(delta)` every node computes, so the model is bit-identical to the one
//! published. What it cannot replay is the carried state, which is as old as that whole model.
//!
//! Every file is written to a temp name, fsynced and renamed, and its directory fsynced;
//! `server.json` is rewritten last, so a crash between leaves the previous round intact.

use super::mirror::Mirror;
use super::progress::Progress;
use super::ServerOptions;
use crate::payload;
use crate::settings::Choices;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_data::shard::write_atomic;
use spes_model::MoeModel;
use spes_sync::{delta, Layout, Named, PartBook, RoundDelta, RoundSettings, Scope};
use spes_train::metrics::RoundRecord;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(super) const STATE_FILE: &str = "server.json";
/// 5: each round records the next one's settings (`PublishedRound::settings`), which may change
/// between rounds; 4: a round's delta parts in one file (`PublishedRound::bundle`), one object
/// to presign; 3: whole models only every `checkpoint_every_rounds`, rounds replayed from their
/// deltas (2 wrote a whole model and the carried state every round).
const FORMAT_VERSION: u32 = 5;

/// A published round as the restart point records it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct PublishedRound {
    pub round: u64,
    /// Training tokens of the run up to this round.
    pub tokens: u64,
    /// Who trains what in the round after this one (`owners` empty in DiLoCo mode).
    pub owners: Vec<usize>,
    pub members: Vec<usize>,
    /// Delta wires: the round's deltas from the round before, as the parts a fetch streams.
    #[serde(default)]
    pub parts: Vec<DeltaPart>,
    /// The one file holding `parts` back to back (format 3 kept a file per part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<Stored>,
    /// `sync.round_by = "tokens"`: the rows each of `members` trains in the round after this
    /// one ([`spes_sync::Coordinator::budget`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budget: Vec<u64>,
    /// The settings of the round after this one (format 4 and before: the config's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<RoundSettings>,
}

/// A file written under `--out`, with its size and checksum.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Stored {
    /// Relative to `--out`.
    pub file: String,
    pub bytes: u64,
    pub xxh3: String,
}

/// One part of a round's published delta: `stored.bytes` bytes of `stored.file` from
/// `offset`, with their own checksum.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct DeltaPart {
    #[serde(flatten)]
    pub stored: Stored,
    /// The peer whose own upload (its experts) this part holds verbatim; `None`: the rest.
    pub own: Option<usize>,
    #[serde(default)]
    pub offset: u64,
}

/// An acknowledged upload its node put in the store (`Stage`): its key there, size and
/// checksum, kept beside it in `pending/` so a restored server fetches and checks it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Staged {
    pub key: String,
    pub bytes: u64,
    pub xxh3: String,
}

/// A whole model on disk and the carried state after its round.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct FullModel {
    pub round: u64,
    #[serde(flatten)]
    pub model: Stored,
    pub carried: Option<Stored>,
}

/// The restart point, rewritten atomically after each published round.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct ServerState {
    pub format_version: u32,
    /// Whole models on disk, oldest first.
    pub fulls: Vec<FullModel>,
    /// Published rounds from the newest whole model's on (at least the last two), oldest
    /// first: what a restart replays and what fetches serve.
    pub rounds: Vec<PublishedRound>,
    pub initial_val_loss: Option<f64>,
    pub gone: Vec<usize>,
    /// The newest round's metrics line without its scores, to write again after a crash.
    pub record: Option<RoundRecord>,
    /// `data.partition = "disjoint"`: who reads which data part.
    #[serde(default, skip_serializing_if = "PartBook::is_empty")]
    pub data_parts: PartBook,
    /// The most experts each node that declared one may own (`train.memory_gib`), by peer.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub caps: BTreeMap<usize, usize>,
    /// An adaptive run's choices so far (also exported to `choices.json`).
    #[serde(default, skip_serializing_if = "Choices::is_empty")]
    pub choices: Choices,
}

impl PublishedRound {
    /// The files holding the round's delta: its bundle, or (format 3) a file per part.
    pub fn files(&self) -> Box<dyn Iterator<Item = &Stored> + '_> {
        match &self.bundle {
            Some(b) => Box::new(std::iter::once(b)),
            None => Box::new(self.parts.iter().map(|p| &p.stored)),
        }
    }
}

impl ServerState {
    pub fn newest(&self) -> &PublishedRound {
        self.rounds.last().expect("round 0 is always published")
    }

    /// The kept published round `round`.
    pub fn round(&self, round: u64) -> Option<&PublishedRound> {
        self.rounds.iter().find(|r| r.round == round)
    }

    /// Writes `<out>/server.json` atomically.
    pub fn save(&self, out: &Path) -> Result<()> {
        write_atomic(
            &out.join(STATE_FILE),
            serde_json::to_string_pretty(self)?.as_bytes(),
        )
    }
}

/// The restart point of format 2: every round's whole model in `global/`.
#[derive(Deserialize)]
struct StateV2 {
    rounds: Vec<RoundV2>,
    initial_val_loss: Option<f64>,
    gone: Vec<usize>,
    record: Option<RoundRecord>,
}

#[derive(Deserialize)]
struct RoundV2 {
    round: u64,
    file: String,
    bytes: u64,
    xxh3: String,
    tokens: u64,
    owners: Vec<usize>,
    members: Vec<usize>,
    #[serde(default)]
    parts: Vec<PartV2>,
    #[serde(default)]
    carried: Option<CarriedV2>,
}

#[derive(Deserialize)]
struct PartV2 {
    file: String,
    bytes: u64,
    xxh3: String,
    own: Option<usize>,
}

#[derive(Deserialize)]
struct CarriedV2 {
    file: String,
    xxh3: String,
}

impl From<StateV2> for ServerState {
    /// Each kept round of format 2 is a whole model in `global/`.
    fn from(v2: StateV2) -> Self {
        let in_global = |f: &str| format!("global/{f}");
        ServerState {
            format_version: FORMAT_VERSION,
            fulls: v2
                .rounds
                .iter()
                .map(|r| FullModel {
                    round: r.round,
                    model: Stored {
                        file: in_global(&r.file),
                        bytes: r.bytes,
                        xxh3: r.xxh3.clone(),
                    },
                    carried: r.carried.as_ref().map(|c| Stored {
                        file: in_global(&c.file),
                        bytes: 0,
                        xxh3: c.xxh3.clone(),
                    }),
                })
                .collect(),
            rounds: v2
                .rounds
                .into_iter()
                .map(|r| PublishedRound {
                    round: r.round,
                    tokens: r.tokens,
                    owners: r.owners,
                    members: r.members,
                    parts: r
                        .parts
                        .into_iter()
                        .map(|p| DeltaPart {
                            stored: Stored {
                                file: in_global(&p.file),
                                bytes: p.bytes,
                                xxh3: p.xxh3,
                            },
                            own: p.own,
                            offset: 0,
                        })
                        .collect(),
                    bundle: None,
                    budget: Vec::new(),
                    settings: None,
                })
                .collect(),
            initial_val_loss: v2.initial_val_loss,
            gone: v2.gone,
            record: v2.record,
            data_parts: PartBook::default(),
            caps: BTreeMap::new(),
            choices: Choices::default(),
        }
    }
}

pub(super) fn hex_of(x: u64) -> String {
    format!("{x:016x}")
}

pub(super) fn parse_hex(x: &str) -> u64 {
    u64::from_str_radix(x, 16).unwrap_or_default()
}

/// A closed round to publish, with what the restart point records about it.
pub(super) struct Publication<'a> {
    pub round: u64,
    pub global: &'a Named,
    pub next: &'a Scope,
    /// The rows each of `next`'s members trains in the next round, by peer (empty: by steps).
    pub budget: &'a BTreeMap<usize, u64>,
    /// The settings of the next round.
    pub settings: RoundSettings,
    pub tokens: u64,
    pub gone: &'a BTreeSet<usize>,
    pub record: RoundRecord,
    /// Delta wires: what the round publishes (none for round 0).
    pub delta: Option<&'a RoundDelta>,
    /// [`spes_sync::Coordinator::carried`] after the round.
    pub carried: Named,
    /// Write the whole model and the carried state too, before the round is announced (a
    /// round without a delta, which nodes fetch whole; else [`Store::publish_full`] after).
    pub full: bool,
}

/// Where the server keeps its files.
pub(super) struct Store {
    pub out: PathBuf,
    /// Newest whole models kept (0: all).
    pub keep: usize,
    /// The object store every file a restart needs is put in too (`--store`).
    pub mirror: Option<Arc<Mirror>>,
}

impl Store {
    /// Writes the round durably and the restart point after it, then prunes what the new
    /// restart point no longer needs. Safe to retry after a failure.
    pub fn publish(&self, progress: &Progress, p: &Publication) -> Result<()> {
        let (parts, bundle) = match p.delta {
            Some(d) => {
                let (parts, bundle) = self.write_delta(p.round, d)?;
                (parts, Some(bundle))
            }
            None => (Vec::new(), None),
        };
        let full = if p.full {
            Some(self.write_full(p.round, p.global, &p.carried)?)
        } else {
            None
        };
        crate::fault::point("publish", p.round);
        let members: Vec<usize> = p.next.members().into_iter().collect();
        // A budget covers every next member or none (a round by steps).
        let budget: Option<Vec<u64>> = members.iter().map(|m| p.budget.get(m).copied()).collect();
        let budget = budget.unwrap_or_default();
        let entry = PublishedRound {
            round: p.round,
            tokens: p.tokens,
            owners: p.next.owners(),
            members,
            parts,
            bundle,
            budget,
            settings: Some(p.settings),
        };
        let (dropped, version) = progress.change(|st| {
            st.rounds.retain(|r| r.round < p.round);
            st.rounds.push(entry);
            if let Some(f) = full {
                st.fulls.retain(|x| x.round < p.round);
                st.fulls.push(f);
            }
            st.gone = p.gone.iter().copied().collect();
            st.record = Some(p.record.clone());
            (prune(st, self.keep), true)
        });
        progress.commit(version.expect("a publication changes the restart point"))?;
        self.drop_files(dropped);
        self.remove_pending(|r| r <= p.round);
        Ok(())
    }

    /// Writes published round `round`'s whole model and carried state (`global`, `carried`)
    /// as a restart point, after the round was announced: until this returns, a restart
    /// replays the round from an older one. Safe to retry after a failure.
    pub fn publish_full(
        &self,
        progress: &Progress,
        round: u64,
        global: &Named,
        carried: &Named,
    ) -> Result<()> {
        let full = self.write_full(round, global, carried)?;
        crate::fault::point("full", round);
        let (dropped, version) = progress.change(|st| {
            st.fulls.retain(|x| x.round < round);
            st.fulls.push(full);
            (prune(st, self.keep), true)
        });
        progress.commit(version.expect("a whole model changes the restart point"))?;
        self.drop_files(dropped);
        Ok(())
    }

    /// Removes files the restart point no longer names, here and in the store.
    fn drop_files(&self, dropped: Vec<String>) {
        for file in dropped {
            let _ = std::fs::remove_file(self.out.join(&file));
            if let Some(m) = &self.mirror {
                m.delete(&file);
            }
        }
    }

    /// Writes a round's delta as one file of parts: everything but the experts published
    /// verbatim, then one part per peer whose experts it publishes verbatim (which that peer
    /// may skip). Puts the file in the store.
    fn write_delta(&self, round: u64, d: &RoundDelta) -> Result<(Vec<DeltaPart>, Stored)> {
        let own_of: HashMap<&str, usize> = d
            .verbatim
            .iter()
            .flat_map(|(&p, names)| names.iter().map(move |n| (n.as_str(), p)))
            .collect();
        let mut owners: Vec<Option<usize>> = vec![None];
        owners.extend(d.verbatim.keys().map(|&p| Some(p)));
        let mut groups: Vec<Named> = owners.iter().map(|_| Vec::new()).collect();
        for (name, t) in &d.delta {
            let own = own_of.get(name.as_str()).copied();
            let g = owners
                .iter()
                .position(|o| *o == own)
                .expect("a group per owner");
            groups[g].push((name.clone(), t.shallow_clone()));
        }
        let file = format!("global/round-{round:06}.delta.parts");
        let (written, (bytes, xxh3)) =
            payload::write_parts(&self.out.join(&file), &groups, tch::Kind::BFloat16)?;
        if let Some(m) = &self.mirror {
            m.put(&self.out, &file)?;
            if crate::fault::active("corrupt-store", round) {
                m.put_corrupted(&self.out, &file)?;
            }
        }
        let mut offset = 0;
        let parts = written
            .into_iter()
            .zip(owners)
            .map(|(p, own)| {
                let part = DeltaPart {
                    stored: Stored {
                        file: file.clone(),
                        bytes: p.bytes,
                        xxh3: hex_of(p.xxh3),
                    },
                    own,
                    offset,
                };
                offset += p.bytes;
                part
            })
            .collect();
        let bundle = Stored {
            file,
            bytes,
            xxh3: hex_of(xxh3),
        };
        Ok((parts, bundle))
    }

    /// Writes round `round`'s whole fp32 model and (if any) its carried state.
    fn write_full(&self, round: u64, global: &Named, carried: &Named) -> Result<FullModel> {
        let model = self.write(
            &format!("checkpoints/round-{round:06}.safetensors"),
            global,
            tch::Kind::Float,
        )?;
        let carried = if carried.is_empty() {
            None
        } else {
            Some(self.write(
                &format!("checkpoints/round-{round:06}.carried.safetensors"),
                carried,
                tch::Kind::Float,
            )?)
        };
        Ok(FullModel {
            round,
            model,
            carried,
        })
    }

    /// Writes `named` to `file` (relative to `--out`) as a payload, and puts it in the store.
    pub fn write(&self, file: &str, named: &Named, kind: tch::Kind) -> Result<Stored> {
        let stored = self.write_local(file, named, kind)?;
        if let Some(m) = &self.mirror {
            m.put(&self.out, file)?;
        }
        Ok(stored)
    }

    /// Bytes this process has put in the store (0 without one).
    pub fn bytes_put(&self) -> u64 {
        self.mirror.as_ref().map_or(0, |m| m.bytes_put())
    }

    /// [`Store::write`] to `--out` only: a file no restart needs.
    pub fn write_local(&self, file: &str, named: &Named, kind: tch::Kind) -> Result<Stored> {
        let (bytes, xxh3) = payload::write(&self.out.join(file), named, kind)?;
        Ok(Stored {
            file: file.to_owned(),
            bytes,
            xxh3: hex_of(xxh3),
        })
    }

    /// Puts the kept upload of `peer` for `round` (and what it reported) in the store; an
    /// upload its node staged there only gets its record.
    pub fn mirror_pending(&self, round: u64, peer: usize) -> Result<()> {
        let Some(m) = &self.mirror else {
            return Ok(());
        };
        let staged = self.pending_staged_path(round, peer);
        let upload = match staged.exists() {
            true => staged,
            false => self.pending_path(round, peer),
        };
        for path in [self.pending_work_path(round, peer), upload] {
            // Published (and removed) meanwhile: nothing of it needs keeping any more.
            if !path.exists() {
                return Ok(());
            }
            let file = path.strip_prefix(&self.out).expect("under --out");
            m.put(&self.out, &file.display().to_string())?;
        }
        Ok(())
    }

    /// Removes the kept uploads of the rounds `drop` selects, here and in the store.
    pub fn remove_pending(&self, drop: impl Fn(u64) -> bool) {
        remove_pending(&self.out, &drop);
        if let Some(m) = &self.mirror {
            m.delete_pending(drop);
        }
    }

    pub fn pending_path(&self, round: u64, peer: usize) -> PathBuf {
        self.out
            .join("pending")
            .join(format!("round-{round:06}-peer-{peer}.safetensors"))
    }

    /// Where the record of an upload its node staged in the store is kept ([`Staged`]).
    pub fn pending_staged_path(&self, round: u64, peer: usize) -> PathBuf {
        self.out
            .join("pending")
            .join(format!("round-{round:06}-peer-{peer}.staged.json"))
    }

    /// Where what that upload reported it trained is kept beside it (a restarted server
    /// weighs and budgets by it again).
    pub fn pending_work_path(&self, round: u64, peer: usize) -> PathBuf {
        self.out
            .join("pending")
            .join(format!("round-{round:06}-peer-{peer}.work.json"))
    }
}

/// Drops whole models beyond the newest `keep` (0: keeps all) and rounds before the newest
/// whole model (keeping the last two, which fetches serve); returns the files to delete.
fn prune(st: &mut ServerState, keep: usize) -> Vec<String> {
    let mut dropped = Vec::new();
    if keep > 0 && st.fulls.len() > keep {
        let excess = st.fulls.len() - keep;
        for f in st.fulls.drain(..excess) {
            dropped.push(f.model.file);
            dropped.extend(f.carried.map(|c| c.file));
        }
    }
    let since = st.fulls.last().map_or(0, |f| f.round);
    let keep_from = st.rounds.len().saturating_sub(2);
    let mut i = 0;
    st.rounds.retain(|r| {
        let kept = r.round >= since || i >= keep_from;
        i += 1;
        if !kept {
            dropped.extend(r.files().map(|f| f.file.clone()));
        }
        kept
    });
    dropped
}

/// Removes pending uploads whose round matches `drop`.
fn remove_pending(out: &Path, drop: impl Fn(u64) -> bool) {
    let Ok(entries) = std::fs::read_dir(out.join("pending")) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let round = name
            .strip_prefix("round-")
            .and_then(|r| r.get(..6))
            .and_then(|r| r.parse::<u64>().ok());
        if round.is_none_or(&drop) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// What [`open`] found or made.
pub(super) struct Opened {
    pub model: MoeModel,
    /// The tensors this server (shard) owns.
    pub layout: Layout,
    pub global: Named,
    /// The carried state of the whole model the restart built on ([`spes_sync::Coordinator::carried`]).
    pub carried: Named,
    pub progress: ServerState,
    pub fresh: bool,
}

/// Whether the stored file exists under `out` and has its checksum.
pub(super) fn intact(out: &Path, s: &Stored) -> bool {
    payload::digest(&out.join(&s.file))
        .ok()
        .is_some_and(|(_, x)| hex_of(x) == s.xxh3)
}

/// `named` in `layout`'s order, if it holds exactly the layout's tensors with their shapes.
fn in_layout(layout: &Layout, named: Named, path: &Path) -> Result<Named> {
    let mut by_name: HashMap<String, tch::Tensor> = named.into_iter().collect();
    let out = layout
        .entries
        .iter()
        .map(|(name, _, shape)| match by_name.remove(name) {
            Some(t) if t.size() == *shape => Ok((name.clone(), t.to_kind(tch::Kind::Float))),
            _ => bail!("{}: `{name}` is missing or misshapen", path.display()),
        })
        .collect::<Result<Named>>()?;
    if let Some(extra) = by_name.keys().next() {
        bail!("{}: unexpected tensor `{extra}`", path.display());
    }
    Ok(out)
}

/// A whole model and its carried state, if both are intact.
fn load_full(out: &Path, layout: &Layout, f: &FullModel) -> Option<(Named, Named)> {
    let path = out.join(&f.model.file);
    let global = intact(out, &f.model)
        .then(|| payload::read(&path).and_then(|n| in_layout(layout, n, &path)))?
        .ok()?;
    let carried = match &f.carried {
        None => Vec::new(),
        Some(c) => intact(out, c)
            .then(|| payload::read(&out.join(&c.file)).ok())
            .flatten()?,
    };
    Some((global, carried))
}

/// Applies round `r`'s published delta to `global` in place, as every node does; `false` if a
/// part is missing, corrupt or does not fit.
fn replay(
    out: &Path,
    cfg: &spes_sync::SyncConfig,
    layout: &Layout,
    r: &PublishedRound,
    global: &Named,
) -> bool {
    let mut wire = Vec::new();
    if let Some(b) = &r.bundle {
        let parts: Vec<_> = r
            .parts
            .iter()
            .map(|p| payload::part(p.stored.bytes, 0))
            .collect();
        match intact(out, b).then(|| payload::read_parts(&out.join(&b.file), &parts)) {
            Some(Ok(named)) => wire.extend(named),
            _ => return false,
        }
    }
    for p in r.parts.iter().filter(|_| r.bundle.is_none()) {
        if !intact(out, &p.stored) {
            return false;
        }
        match payload::read(&out.join(&p.stored.file)) {
            Ok(named) => wire.extend(named),
            Err(_) => return false,
        }
    }
    let Ok(deltas) = delta::decode(wire, cfg, r.round, |n| layout.shape_of(n)) else {
        return false;
    };
    let index: HashMap<&str, usize> = global
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    tch::no_grad(|| {
        for (name, d) in deltas {
            if let Some(&i) = index.get(name.as_str()) {
                d.apply_(&mut global[i].1.shallow_clone());
            }
        }
    });
    true
}

/// Loads the newest round it can rebuild — the newest intact whole model, then every kept
/// delta after it in order (stopping before a missing or corrupt one) — or creates θ⁰
/// (fresh init from the seed, or `init`) as round 0.
pub(super) fn open(opts: &ServerOptions, mirror: Option<&Mirror>) -> Result<Opened> {
    if let Some(m) = mirror {
        m.restore(&opts.out)?;
    }
    for dir in ["global", "checkpoints", "incoming", "pending"] {
        let d = opts.out.join(dir);
        std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    for stale in std::fs::read_dir(opts.out.join("incoming"))? {
        let _ = std::fs::remove_file(stale?.path());
    }
    let model = MoeModel::seeded(&opts.cfg.model, opts.device, opts.cfg.train.seed)?;
    let (i, k) = opts.shard;
    let layout = Layout::of(&model).shard(i, k);
    let state_path = opts.out.join(STATE_FILE);
    if !state_path.exists() {
        if let Some(init) = &opts.init {
            let named = tch::Tensor::read_safetensors(init)
                .with_context(|| format!("cannot read initial weights {}", init.display()))?;
            model.load(&named, &init.display().to_string())?;
        }
        let global = model
            .params()
            .into_iter()
            .filter(|p| layout.holds(&p.name))
            .map(|p| (p.name, p.tensor.detach().copy()))
            .collect();
        let st = ServerState {
            format_version: FORMAT_VERSION,
            fulls: Vec::new(),
            rounds: Vec::new(),
            initial_val_loss: None,
            gone: Vec::new(),
            record: None,
            data_parts: PartBook::default(),
            caps: BTreeMap::new(),
            choices: Choices::default(),
        };
        return Ok(Opened {
            model,
            layout,
            global,
            carried: Vec::new(),
            progress: st,
            fresh: true,
        });
    }
    let mut st = read_state(&state_path)?;
    let out = &opts.out;
    while let Some(full) = st.fulls.last().cloned() {
        let Some((global, carried)) = load_full(out, &layout, &full) else {
            tracing::error!(
                "{} or its carried state is missing or corrupt; falling back to the whole model before it",
                out.join(&full.model.file).display()
            );
            st.fulls.pop();
            st.record = None;
            continue;
        };
        // Replay the rounds after it, each in the settings the round before announced; the
        // first that cannot be replayed ends the run's history. The carried state is the
        // whole model's, but a lossless round leaves no residual.
        let mut at = full.round;
        let mut carried = carried;
        for r in st.rounds.iter().filter(|r| r.round > full.round) {
            let settings = st.round(at).and_then(|p| p.settings);
            let cfg = opts
                .cfg
                .sync
                .for_round(settings.unwrap_or_else(|| opts.cfg.sync.settings()));
            if r.round != at + 1 || !replay(out, &cfg, &layout, r, &global) {
                tracing::error!(
                    "round {}'s delta is missing or corrupt; resuming after round {at}",
                    r.round
                );
                break;
            }
            if !cfg.wire().is_lossy() {
                carried = spes_sync::after_lossless_round(carried);
            }
            at = r.round;
        }
        if st.round(at).is_none() {
            bail!("{}: round {at} is not recorded", state_path.display());
        }
        if at != st.newest().round {
            st.rounds.retain(|r| r.round <= at);
            st.record = None;
        }
        st.save(out)?;
        tracing::info!(
            "resuming after round {at}: whole model of round {} plus {} replayed deltas",
            full.round,
            at - full.round
        );
        return Ok(Opened {
            model,
            layout,
            global,
            carried,
            progress: st,
            fresh: false,
        });
    }
    bail!(
        "{}: no whole model is intact; move --out aside to start over",
        state_path.display()
    )
}

/// Reads `server.json`, of this format or the one before.
pub(super) fn read_state(path: &Path) -> Result<ServerState> {
    let text = std::fs::read_to_string(path)?;
    #[derive(Deserialize)]
    struct Version {
        format_version: u32,
    }
    let bad = || {
        format!(
            "{} is corrupt or from another spes (expected format_version {FORMAT_VERSION}, 4, 3 or 2)",
            path.display()
        )
    };
    let version: Version = serde_json::from_str(&text).with_context(bad)?;
    match version.format_version {
        // Format 4 reads as 5 with the config's settings every round, and format 3 as 4 with a
        // file per part (no bundle, offsets 0).
        FORMAT_VERSION | 4 | 3 => {
            let mut st: ServerState = serde_json::from_str(&text).with_context(bad)?;
            st.format_version = FORMAT_VERSION;
            Ok(st)
        }
        2 => Ok(serde_json::from_str::<StateV2>(&text)
            .with_context(bad)?
            .into()),
        v => bail!("{}: format_version {v}; {}", path.display(), bad()),
    }
}
