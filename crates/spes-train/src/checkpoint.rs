//! Checkpoints: `<root>/step-N/` with `state.json`, `optimizer.safetensors`, usually
//! `model.safetensors` (a SPES node's mid-run checkpoints leave it out: the server holds the
//! model) and any further files a caller adds, written into a temporary directory and renamed
//! into place, with file checksums verified on load.

use crate::config::RunConfig;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_data::shard::{hash_file, write_atomic};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";

/// 2: `model.safetensors` may be absent (1 always held it).
pub const FORMAT_VERSION: u32 = 2;

/// Everything besides tensors needed to continue a run exactly.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    pub format_version: u32,
    pub step: u64,
    pub tokens: u64,
    /// Training windows consumed by the data loader.
    pub data_position: u64,
    /// Seed of the data order (and of the initialisation, for the record).
    pub seed: u64,
    pub optimizer_steps: i64,
    pub config: RunConfig,
    /// xxh3 of each tensor file, checked before loading.
    pub files: BTreeMap<String, String>,
}

/// The model file of `path`: a checkpoint directory's model.safetensors, or `path` itself.
pub fn model_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(MODEL_FILE)
    } else {
        path.to_owned()
    }
}

impl TrainState {
    /// The state of a model that has not trained yet (an initialised or imported checkpoint).
    pub fn fresh(config: RunConfig) -> Self {
        TrainState {
            format_version: FORMAT_VERSION,
            step: 0,
            tokens: 0,
            data_position: 0,
            seed: config.train.seed,
            optimizer_steps: 0,
            config,
            files: Default::default(),
        }
    }
}

/// A loaded checkpoint.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: TrainState,
    /// The weights, unless the checkpoint left them out.
    pub model: Option<Vec<(String, Tensor)>>,
    pub optimizer: Vec<(String, Tensor)>,
}

fn to_cpu(named: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    named
        .iter()
        .map(|(n, t)| (n.clone(), t.to_device(Device::Cpu).contiguous()))
        .collect()
}

fn write_tensors(path: &Path, named: &[(String, Tensor)]) -> Result<()> {
    Tensor::write_safetensors(&to_cpu(named), path)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Writes `root/step-<state.step>` atomically and prunes all but the newest `keep`.
pub fn save(
    root: &Path,
    state: TrainState,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    keep: usize,
) -> Result<PathBuf> {
    let shallow = |named: &[(String, Tensor)]| -> Vec<(String, Tensor)> {
        named
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    };
    let tensors = [
        (MODEL_FILE.to_owned(), shallow(model)),
        (OPTIMIZER_FILE.to_owned(), shallow(optimizer)),
    ];
    save_with(root, state, &tensors, keep, &[])
}

/// A checkpoint's contents copied off the training state, so that it can be written on
/// another thread while training goes on: one CPU copy of the model and optimizer state.
pub struct Snapshot {
    root: PathBuf,
    state: TrainState,
    /// Tensor files by name.
    tensors: Vec<(String, Vec<(String, Tensor)>)>,
    keep: usize,
    extra: Vec<(String, Vec<u8>)>,
}

/// `named` copied to the CPU, in storage of its own.
fn cpu_copy(named: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    tch::no_grad(|| {
        named
            .iter()
            .map(|(n, t)| (n.clone(), t.to_device_(Device::Cpu, t.kind(), false, true)))
            .collect()
    })
}

impl Snapshot {
    /// Copies `model` (if given) and `optimizer` (to the CPU) for a checkpoint of `state`
    /// under `root`, keeping the newest `keep` checkpoints there.
    pub fn new(
        root: &Path,
        state: TrainState,
        model: Option<&[(String, Tensor)]>,
        optimizer: &[(String, Tensor)],
        keep: usize,
    ) -> Snapshot {
        let mut tensors = Vec::new();
        if let Some(m) = model {
            tensors.push((MODEL_FILE.to_owned(), cpu_copy(m)));
        }
        tensors.push((OPTIMIZER_FILE.to_owned(), cpu_copy(optimizer)));
        Snapshot {
            root: root.to_owned(),
            state,
            tensors,
            keep,
            extra: Vec::new(),
        }
    }

    /// Adds a tensor file (copied to the CPU), checksummed like the others.
    pub fn with_tensors(mut self, file: &str, named: &[(String, Tensor)]) -> Snapshot {
        self.tensors.push((file.to_owned(), cpu_copy(named)));
        self
    }

    /// Adds a small file to the checkpoint directory, renamed into place with the rest.
    pub fn with_file(mut self, name: &str, bytes: Vec<u8>) -> Snapshot {
        self.extra.push((name.to_owned(), bytes));
        self
    }

    /// Writes it as [`save`] does.
    pub fn write(self) -> Result<PathBuf> {
        save_with(
            &self.root,
            self.state,
            &self.tensors,
            self.keep,
            &self.extra,
        )
    }
}

fn save_with(
    root: &Path,
    mut state: TrainState,
    tensors: &[(String, Vec<(String, Tensor)>)],
    keep: usize,
    extra: &[(String, Vec<u8>)],
) -> Result<PathBuf> {
    std::fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
    let final_dir = root.join(format!("step-{}", state.step));
    let tmp = root.join(format!(".step-{}.tmp-{}", state.step, std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let written = (|| -> Result<()> {
        state.files.clear();
        state.format_version = FORMAT_VERSION;
        for (f, named) in tensors {
            let path = tmp.join(f);
            write_tensors(&path, named)?;
            std::fs::File::open(&path)?.sync_all()?;
            state.files.insert(f.clone(), hash_file(&path)?);
        }
        for (name, bytes) in extra {
            write_atomic(&tmp.join(name), bytes)?;
        }
        write_atomic(
            &tmp.join(STATE_FILE),
            serde_json::to_string_pretty(&state)?.as_bytes(),
        )?;
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir)?;
        }
        std::fs::rename(&tmp, &final_dir)?;
        spes_data::shard::sync_dir(&final_dir)?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("cannot write checkpoint {}", final_dir.display())));
    }
    prune(root, keep)?;
    Ok(final_dir)
}

/// `step-N` directories under `root` that hold a state file, sorted by N.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(out);
    };
    for entry in entries {
        let path = entry?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        if let Some(n) = name
            .strip_prefix("step-")
            .and_then(|n| n.parse::<u64>().ok())
        {
            if path.join(STATE_FILE).exists() {
                out.push((n, path));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The newest checkpoint directory under `root`, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    Ok(list(root)?.pop().map(|(_, p)| p))
}

fn prune(root: &Path, keep: usize) -> Result<()> {
    let all = list(root)?;
    let excess = all.len().saturating_sub(keep.max(1));
    for (_, dir) in &all[..excess] {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    Ok(())
}

/// Reads the state file of a checkpoint directory.
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read checkpoint state {}", path.display()))?;
    let state: TrainState = serde_json::from_str(&text)
        .with_context(|| format!("checkpoint state {} is corrupt", path.display()))?;
    if !(1..=FORMAT_VERSION).contains(&state.format_version) {
        bail!(
            "{}: unsupported format_version {}",
            path.display(),
            state.format_version
        );
    }
    Ok(state)
}

/// Reads and verifies tensor file `file` of the checkpoint in `dir` (`None` if it has none).
pub fn read_tensors(
    dir: &Path,
    state: &TrainState,
    file: &str,
) -> Result<Option<Vec<(String, Tensor)>>> {
    let Some(expected) = state.files.get(file) else {
        return Ok(None);
    };
    let path = dir.join(file);
    let actual = hash_file(&path)?;
    if &actual != expected {
        bail!(
            "checkpoint file {} is corrupt or truncated (checksum {actual}, expected {expected})",
            path.display()
        );
    }
    Tensor::read_safetensors(&path)
        .map(Some)
        .with_context(|| format!("cannot read {}", path.display()))
}

/// Loads and verifies a checkpoint directory (tensors on the CPU).
pub fn load(dir: &Path) -> Result<Checkpoint> {
    let state = read_state(dir)?;
    let model = read_tensors(dir, &state, MODEL_FILE)?;
    let optimizer = read_tensors(dir, &state, OPTIMIZER_FILE)?.with_context(|| {
        format!(
            "{}: no checksum for {OPTIMIZER_FILE}",
            dir.join(STATE_FILE).display()
        )
    })?;
    Ok(Checkpoint {
        dir: dir.to_owned(),
        state,
        model,
        optimizer,
    })
}
