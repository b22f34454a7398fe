//! Token shards: one-dimensional NumPy `.npy` files (uint16 or uint32), written atomically and
//! read through a memory map, and the `manifest.json` that lists and checksums them.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use ndarray::{s, Array1, ArrayView1};
use ndarray_npy::{ViewNpyExt, WriteNpyExt};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Element type of the token shards: uint16 when the vocabulary fits, else uint32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    Uint16,
    Uint32,
}

impl TokenDtype {
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDtype::Uint16
        } else {
            TokenDtype::Uint32
        }
    }
}

/// One shard as listed in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub tokens: u64,
    /// xxh3-64 of the whole file, hex. Fast enough to check on every open.
    pub xxh3: String,
}

/// `manifest.json` of a `spes tokenize` output directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub tokenizer: String,
    pub vocab_size: usize,
    pub eos_id: u32,
    pub dtype: TokenDtype,
    pub train_documents: u64,
    pub val_documents: u64,
    pub train_tokens: u64,
    pub val_tokens: u64,
    pub train: Vec<ShardInfo>,
    pub val: Vec<ShardInfo>,
    pub inputs: Vec<String>,
}

pub const MANIFEST: &str = "manifest.json";

impl Manifest {
    /// Reads and checks `<dir>/manifest.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {}: is this a `spes tokenize` output directory?",
                path.display()
            )
        })?;
        let m: Manifest = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a valid spes manifest", path.display()))?;
        if m.format_version != 1 {
            bail!(
                "{}: format_version {} is not supported (expected 1)",
                path.display(),
                m.format_version
            );
        }
        Ok(m)
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        write_atomic(&dir.join(MANIFEST), text.as_bytes())
    }
}

/// Writes a file by writing a sibling temp file, syncing it, then renaming it into place.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| Ok(w.write_all(bytes)?))
}

/// Like [`write_atomic`], with the content produced by a writer callback.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    write_atomic_mode(path, 0o644, fill)
}

/// Like [`write_atomic`], for secrets: the file is owner-only (0600) from its creation.
pub fn write_secret(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_mode(path, 0o600, |w| Ok(w.write_all(bytes)?))
}

/// Writes through a temp file created with `mode`, fsyncs it, renames it into place and
/// fsyncs the directory, so a crash leaves the old file or the new one, never a torn one.
fn write_atomic_mode(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = temp_sibling(path);
    let result = (|| -> Result<()> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        let mut w = BufWriter::new(file);
        fill(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// Fsyncs the directory holding `path`, making a rename or creation in it durable.
pub fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

fn temp_sibling(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Writes `tokens` as a `.npy` shard of the given dtype and returns its manifest entry.
pub fn write_shard(dir: &Path, file: &str, tokens: &[u32], dtype: TokenDtype) -> Result<ShardInfo> {
    let path = dir.join(file);
    write_atomic_with(&path, |w| {
        match dtype {
            TokenDtype::Uint16 => {
                let a: Array1<u16> = tokens.iter().map(|&t| t as u16).collect();
                a.write_npy(w)?;
            }
            TokenDtype::Uint32 => Array1::from(tokens.to_vec()).write_npy(w)?,
        }
        Ok(())
    })?;
    Ok(ShardInfo {
        file: file.to_owned(),
        tokens: tokens.len() as u64,
        xxh3: hash_file(&path)?,
    })
}

/// xxh3-64 of a file's bytes, as 16 hex digits.
pub fn hash_file(path: &Path) -> Result<String> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: read-only map of a file we do not modify while it is mapped.
    let map =
        unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
    Ok(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&map)))
}

/// A memory-mapped, verified shard. Reading a window copies only that window.
pub struct Shard {
    path: PathBuf,
    map: Mmap,
    dtype: TokenDtype,
    len: u64,
}

impl Shard {
    /// Maps and verifies a shard against its manifest entry: checksum, header, length, dtype.
    pub fn open(dir: &Path, info: &ShardInfo, dtype: TokenDtype) -> Result<Self> {
        let path = dir.join(&info.file);
        let file = File::open(&path)
            .with_context(|| format!("cannot open token shard {}", path.display()))?;
        // SAFETY: read-only map; shards are immutable once written (atomic rename).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map token shard {}", path.display()))?;
        let actual = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&map));
        if actual != info.xxh3 {
            bail!(
                "token shard {} is corrupt or truncated: checksum {actual} does not match the manifest's {} ({} bytes on disk)",
                path.display(),
                info.xxh3,
                map.len()
            );
        }
        let shard = Shard {
            path,
            map,
            dtype,
            len: info.tokens,
        };
        let n = shard.view_len()?;
        if n != info.tokens {
            bail!(
                "token shard {} holds {n} tokens, manifest says {}",
                shard.path.display(),
                info.tokens
            );
        }
        Ok(shard)
    }

    fn view_len(&self) -> Result<u64> {
        let err = |e: ndarray_npy::ViewNpyError| {
            anyhow::anyhow!(
                "token shard {} is not a valid {:?} .npy array: {e}",
                self.path.display(),
                self.dtype
            )
        };
        Ok(match self.dtype {
            TokenDtype::Uint16 => ArrayView1::<u16>::view_npy(&self.map).map_err(err)?.len(),
            TokenDtype::Uint32 => ArrayView1::<u32>::view_npy(&self.map).map_err(err)?.len(),
        } as u64)
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends tokens `[start, start+n)` to `out` as i64 (the header was validated at open).
    pub fn read_into(&self, start: u64, n: usize, out: &mut Vec<i64>) {
        let (a, b) = (start as usize, start as usize + n);
        match self.dtype {
            TokenDtype::Uint16 => {
                let v = ArrayView1::<u16>::view_npy(&self.map).expect("validated at open");
                out.extend(v.slice(s![a..b]).iter().map(|&t| t as i64));
            }
            TokenDtype::Uint32 => {
                let v = ArrayView1::<u32>::view_npy(&self.map).expect("validated at open");
                out.extend(v.slice(s![a..b]).iter().map(|&t| t as i64));
            }
        }
    }
}
