//! Token files: one-dimensional NumPy `.npy` shards (uint16 or uint32) that spes streams to disk
//! atomically, token files other tools wrote, both read through a memory map, and the
//! `manifest.json` that lists and checksums them.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Element type of token files. spes writes uint16 when the vocabulary fits, else uint32; it
/// reads the signed types other tools write too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    Uint16,
    Uint32,
    Int32,
    Int64,
}

impl TokenDtype {
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDtype::Uint16
        } else {
            TokenDtype::Uint32
        }
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::Uint16 => 2,
            TokenDtype::Uint32 | TokenDtype::Int32 => 4,
            TokenDtype::Int64 => 8,
        }
    }

    /// The NumPy `descr` of this dtype, little-endian.
    pub fn npy_descr(self) -> &'static str {
        match self {
            TokenDtype::Uint16 => "<u2",
            TokenDtype::Uint32 => "<u4",
            TokenDtype::Int32 => "<i4",
            TokenDtype::Int64 => "<i8",
        }
    }

    /// The dtype of a NumPy `descr` (`<u2`, `|u2` on one-byte-order files, ...).
    pub fn from_npy_descr(descr: &str) -> Option<Self> {
        let d = descr.trim_start_matches(['<', '|', '=']);
        [Self::Uint16, Self::Uint32, Self::Int32, Self::Int64]
            .into_iter()
            .find(|t| &t.npy_descr()[1..] == d)
    }

    /// Parses a `--dtype` name.
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "uint16" | "u16" => Self::Uint16,
            "uint32" | "u32" => Self::Uint32,
            "int32" | "i32" => Self::Int32,
            "int64" | "i64" => Self::Int64,
            _ => bail!("unknown token dtype `{name}`; expected uint16, uint32, int32 or int64"),
        })
    }
}

/// How the tokens of a file are laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileLayout {
    /// A NumPy `.npy` with its header (what spes writes).
    #[default]
    Npy,
    /// Headerless little-endian tokens from byte 0 (OLMo's memmaps, Megatron-LM's `.bin`).
    Raw,
}

/// One run of tokens as listed in the manifest: a whole shard spes wrote, or a range of a
/// token file another tool wrote.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Relative to the manifest's directory, or absolute.
    pub file: String,
    pub tokens: u64,
    /// xxh3-64 of the whole file, hex. Fast enough to check on every open.
    pub xxh3: String,
    #[serde(default, skip_serializing_if = "is_default")]
    pub layout: FileLayout,
    /// The first token of the run within the file.
    #[serde(default, skip_serializing_if = "is_default")]
    pub first: u64,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// Which of `of` disjoint parts of an input list a directory holds (`spes tokenize --part`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    pub index: usize,
    pub of: usize,
}

impl Part {
    /// Parses `p/N`.
    pub fn parse(text: &str) -> Result<Self> {
        let parsed = text
            .split_once('/')
            .and_then(|(p, n)| Some((p.trim().parse().ok()?, n.trim().parse().ok()?)));
        match parsed {
            Some((index, of)) if of > 0 && index < of => Ok(Part { index, of }),
            _ => bail!("--part `{text}`: expected p/N with 0 <= p < N, such as 3/16"),
        }
    }

    /// Whether input file `i` of the shared list belongs to this part. Files are dealt round
    /// robin, so a list that runs source by source gives every part some of each source.
    pub fn holds(&self, i: usize) -> bool {
        i % self.of == self.index
    }
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.of)
    }
}

/// `manifest.json` of a `spes tokenize` (or `spes data import`) output directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub tokenizer: String,
    /// xxh3-64 of the tokenizer file, hex: nodes and the server compare it before training.
    #[serde(default)]
    pub tokenizer_xxh3: String,
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
    /// The part of the input list this directory holds; `None` for the whole list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<Part>,
    /// xxh3-64 of the whole input list (every file and its size), hex: the parts of one list
    /// share it, so it names the corpus a part belongs to.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub input_list_xxh3: String,
    /// Records skipped as broken (`--skip-bad-records`).
    #[serde(default)]
    pub skipped_records: u64,
}

/// The tokenizer file of a tokenized directory.
pub const TOKENIZER: &str = "tokenizer.json";

/// What a manifest records of the tokenizer its tokens were made with.
#[derive(Clone, Copy, Debug)]
pub struct Vocab {
    pub vocab_size: usize,
    pub eos_id: u32,
    pub dtype: TokenDtype,
}

/// The manifest format this version writes; it reads 1 as well.
pub const MANIFEST_VERSION: u32 = 2;

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
        let mut m = m;
        if !(1..=MANIFEST_VERSION).contains(&m.format_version) {
            bail!(
                "{}: format_version {} is not supported (expected 1 to {MANIFEST_VERSION})",
                path.display(),
                m.format_version
            );
        }
        if m.tokenizer_xxh3.is_empty() {
            m.tokenizer_xxh3 = hash_file(&dir.join(&m.tokenizer))?;
        }
        Ok(m)
    }

    /// A manifest of the current format over `train` and `val` runs, with `<dir>/tokenizer.json`
    /// checksummed and the token totals counted; document counts, part and skips are zero
    /// until the caller sets them.
    pub fn over(
        dir: &Path,
        vocab: &Vocab,
        train: Vec<ShardInfo>,
        val: Vec<ShardInfo>,
        inputs: Vec<String>,
    ) -> Result<Manifest> {
        Ok(Manifest {
            format_version: MANIFEST_VERSION,
            tokenizer: TOKENIZER.into(),
            tokenizer_xxh3: hash_file(&dir.join(TOKENIZER))?,
            vocab_size: vocab.vocab_size,
            eos_id: vocab.eos_id,
            dtype: vocab.dtype,
            train_documents: 0,
            val_documents: 0,
            train_tokens: train.iter().map(|s| s.tokens).sum(),
            val_tokens: val.iter().map(|s| s.tokens).sum(),
            train,
            val,
            inputs,
            part: None,
            input_list_xxh3: String::new(),
            skipped_records: 0,
        })
    }

    /// The identity of the part this directory holds, `<list>:<p>/<N>`, the same on every
    /// machine that tokenized that part of that input list; `None` for a whole corpus.
    pub fn part_id(&self) -> Option<String> {
        let list = self
            .input_list_xxh3
            .get(..8)
            .unwrap_or(&self.input_list_xxh3);
        self.part.map(|p| format!("{list}:{p}"))
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

/// The fixed size of the `.npy` header spes writes: room for any length, so a shard can be
/// streamed to disk and its header patched once its length is known.
const NPY_HEADER: usize = 128;

/// The `.npy` header of a one-dimensional array of `len` tokens.
fn npy_header(dtype: TokenDtype, len: u64) -> [u8; NPY_HEADER] {
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': ({len},), }}",
        dtype.npy_descr()
    );
    let mut h = [b' '; NPY_HEADER];
    h[..6].copy_from_slice(b"\x93NUMPY");
    h[6] = 1;
    h[7] = 0;
    h[8..10].copy_from_slice(&((NPY_HEADER - 10) as u16).to_le_bytes());
    h[10..10 + dict.len()].copy_from_slice(dict.as_bytes());
    h[NPY_HEADER - 1] = b'\n';
    h
}

/// The dtype, length and data offset of a `.npy` file's header, or why it is not a
/// one-dimensional little-endian token array.
pub fn parse_npy_header(bytes: &[u8]) -> std::result::Result<(TokenDtype, u64, u64), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("no .npy magic".into());
    }
    let (len_bytes, start) = match bytes[6] {
        1 => (2, 10),
        2 | 3 => (4, 12),
        v => return Err(format!(".npy version {v} is not supported")),
    };
    if bytes.len() < start {
        return Err("truncated .npy header".into());
    }
    let header_len = if len_bytes == 2 {
        u16::from_le_bytes([bytes[8], bytes[9]]) as usize
    } else {
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize
    };
    let end = start + header_len;
    let dict = bytes
        .get(start..end)
        .and_then(|d| std::str::from_utf8(d).ok())
        .ok_or("truncated .npy header")?;
    let field = |key: &str| -> Option<&str> {
        let at = dict.find(&format!("'{key}'"))? + key.len() + 2;
        let rest = dict[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr = field("descr")
        .and_then(|r| r.strip_prefix('\''))
        .and_then(|r| r.split('\'').next())
        .ok_or("no descr in the .npy header")?;
    let dtype = TokenDtype::from_npy_descr(descr).ok_or_else(|| {
        format!(
            "dtype `{descr}` is not a token dtype (uint16, uint32, int32, int64, little-endian)"
        )
    })?;
    if field("fortran_order").is_some_and(|r| r.starts_with("True")) {
        return Err("a Fortran-order array".into());
    }
    let shape = field("shape")
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.split(')').next())
        .ok_or("no shape in the .npy header")?;
    let dims: Vec<&str> = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    let [dim] = dims[..] else {
        return Err(format!("shape ({shape}) is not one-dimensional"));
    };
    let len = dim
        .parse()
        .map_err(|_| format!("shape ({shape}) is not a length"))?;
    Ok((dtype, len, end as u64))
}

/// Streams tokens into `.npy` shards of at most `shard_tokens`, named `<stem>-NNN.npy`; each is
/// written to a temp file, its header patched, synced and renamed into place when it fills.
pub struct ShardWriter {
    dir: PathBuf,
    stem: String,
    dtype: TokenDtype,
    shard_tokens: u64,
    open: Option<OpenShard>,
    done: Vec<ShardInfo>,
}

struct OpenShard {
    tmp: PathBuf,
    file: BufWriter<File>,
    tokens: u64,
}

impl ShardWriter {
    pub fn new(dir: &Path, stem: String, dtype: TokenDtype, shard_tokens: u64) -> Self {
        ShardWriter {
            dir: dir.to_owned(),
            stem,
            dtype,
            shard_tokens: shard_tokens.max(1),
            open: None,
            done: Vec::new(),
        }
    }

    /// Appends tokens, closing shards as they fill.
    pub fn push(&mut self, mut ids: &[u32]) -> Result<()> {
        while !ids.is_empty() {
            if self.open.is_none() {
                self.open = Some(self.start()?);
            }
            let open = self.open.as_mut().expect("opened above");
            let n = ((self.shard_tokens - open.tokens) as usize).min(ids.len());
            let (now, rest) = ids.split_at(n);
            write_tokens(&mut open.file, now, self.dtype)
                .with_context(|| format!("cannot write {}", open.tmp.display()))?;
            open.tokens += n as u64;
            ids = rest;
            if open.tokens == self.shard_tokens {
                self.close()?;
            }
        }
        Ok(())
    }

    /// Closes the last shard and returns every shard written, in order.
    pub fn finish(mut self) -> Result<Vec<ShardInfo>> {
        self.close()?;
        Ok(self.done)
    }

    fn start(&self) -> Result<OpenShard> {
        let name = self.name(self.done.len());
        let tmp = temp_sibling(&self.dir.join(&name));
        let file =
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut file = BufWriter::with_capacity(1 << 20, file);
        file.write_all(&npy_header(self.dtype, 0))?;
        Ok(OpenShard {
            tmp,
            file,
            tokens: 0,
        })
    }

    fn name(&self, k: usize) -> String {
        format!("{}-{k:03}.npy", self.stem)
    }

    fn close(&mut self) -> Result<()> {
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        let name = self.name(self.done.len());
        let path = self.dir.join(&name);
        let result = (|| -> Result<()> {
            use std::io::{Seek, SeekFrom};
            let mut file = open.file.into_inner().map_err(|e| e.into_error())?;
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&npy_header(self.dtype, open.tokens))?;
            file.sync_all()?;
            std::fs::rename(&open.tmp, &path)?;
            sync_dir(&path)?;
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&open.tmp);
        }
        result.with_context(|| format!("cannot write {}", path.display()))?;
        self.done.push(ShardInfo {
            file: name,
            tokens: open.tokens,
            xxh3: hash_file(&path)?,
            layout: FileLayout::Npy,
            first: 0,
        });
        Ok(())
    }
}

fn write_tokens(w: &mut impl Write, ids: &[u32], dtype: TokenDtype) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(ids.len() * dtype.size());
    match dtype {
        TokenDtype::Uint16 => ids
            .iter()
            .for_each(|&t| buf.extend_from_slice(&(t as u16).to_le_bytes())),
        TokenDtype::Uint32 => ids
            .iter()
            .for_each(|&t| buf.extend_from_slice(&t.to_le_bytes())),
        TokenDtype::Int32 => ids
            .iter()
            .for_each(|&t| buf.extend_from_slice(&(t as i32).to_le_bytes())),
        TokenDtype::Int64 => ids
            .iter()
            .for_each(|&t| buf.extend_from_slice(&(t as i64).to_le_bytes())),
    }
    w.write_all(&buf)
}

/// Writes `tokens` as one `.npy` shard (`<stem>-000.npy`) and returns its manifest entry.
pub fn write_shard(dir: &Path, stem: &str, tokens: &[u32], dtype: TokenDtype) -> Result<ShardInfo> {
    let mut w = ShardWriter::new(dir, stem.to_owned(), dtype, tokens.len().max(1) as u64);
    w.push(tokens)?;
    w.finish()?
        .pop()
        .with_context(|| format!("{stem}: no tokens to write"))
}

/// xxh3-64 of a file's bytes, as 16 hex digits.
pub fn hash_file(path: &Path) -> Result<String> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: read-only map of a file we do not modify while it is mapped.
    let map =
        unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
    Ok(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&map)))
}

/// A memory-mapped, verified run of tokens. Reading a window copies only that window.
pub struct Shard {
    map: Mmap,
    dtype: TokenDtype,
    /// Byte offset of the run's first token.
    start: usize,
    len: u64,
}

impl Shard {
    /// Maps and verifies a run against its manifest entry: checksum, header, length, dtype.
    pub fn open(dir: &Path, info: &ShardInfo, dtype: TokenDtype) -> Result<Self> {
        let path = dir.join(&info.file);
        let file = File::open(&path)
            .with_context(|| format!("cannot open token file {}", path.display()))?;
        // SAFETY: read-only map; token files are immutable once written (atomic rename) or
        // imported (checksummed below).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map token file {}", path.display()))?;
        let actual = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&map));
        if actual != info.xxh3 {
            bail!(
                "token file {} is corrupt, truncated or changed: checksum {actual} does not match the manifest's {} ({} bytes on disk)",
                path.display(),
                info.xxh3,
                map.len()
            );
        }
        let (data, available) = match info.layout {
            FileLayout::Npy => {
                let (found, len, offset) = parse_npy_header(&map)
                    .map_err(|e| anyhow::anyhow!("token file {}: {e}", path.display()))?;
                if found != dtype {
                    bail!(
                        "token file {} holds {found:?} tokens, the manifest says {dtype:?}",
                        path.display()
                    );
                }
                let fits = len
                    .checked_mul(dtype.size() as u64)
                    .and_then(|b| b.checked_add(offset));
                if fits != Some(map.len() as u64) {
                    bail!(
                        "token file {}: its header says {len} tokens but the file is {} bytes",
                        path.display(),
                        map.len()
                    );
                }
                (offset, len)
            }
            FileLayout::Raw => (0, (map.len() / dtype.size()) as u64),
        };
        if info.first + info.tokens > available {
            bail!(
                "token file {} holds {available} tokens, the manifest reads {} from token {}",
                path.display(),
                info.tokens,
                info.first
            );
        }
        Ok(Shard {
            map,
            dtype,
            start: (data + info.first * dtype.size() as u64) as usize,
            len: info.tokens,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends tokens `[start, start+n)` of the run to `out` as i64.
    pub fn read_into(&self, start: u64, n: usize, out: &mut Vec<i64>) {
        let size = self.dtype.size();
        let a = self.start + start as usize * size;
        let bytes = &self.map[a..a + n * size];
        match self.dtype {
            TokenDtype::Uint16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]) as i64),
            ),
            TokenDtype::Uint32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as i64),
            ),
            TokenDtype::Int32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64),
            ),
            TokenDtype::Int64 => out.extend(
                bytes
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap())),
            ),
        }
    }
}
