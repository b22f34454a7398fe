//! Wire payloads: one or more safetensors files ("parts") streamed back to back in 1 MiB chunks
//! behind a header that carries each part's size and xxh3 checksum. The server streams through
//! files on disk (what it receives must survive a crash; what it sends is kept anyway); a node
//! sends its upload and receives a round's delta in memory, so a round writes nothing to its
//! disk; neither side holds a payload as protobuf messages. A writer
//! hashes while it writes, so a file is never read back to be checksummed. A receiver reads the
//! header first, so it can refuse a payload before any of its data arrives, and cuts a stream
//! that goes idle.

use crate::proto::{chunk::Part as ChunkPart, Chunk, Part, PayloadHeader};
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, TensorInfo};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::{Device, Kind, Tensor};
use tokio::io::AsyncWriteExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::Status;

/// Payload bytes per gRPC message.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The largest gRPC message a peer may send: a full chunk plus framing.
pub const MAX_MESSAGE_BYTES: usize = CHUNK_BYTES + 64 * 1024;

/// The safetensors dtype and element size of a wire kind: f32, bf16, int32, int16 or uint8.
fn st_dtype(kind: Kind) -> (Dtype, usize) {
    match kind {
        Kind::BFloat16 => (Dtype::BF16, 2),
        Kind::Int => (Dtype::I32, 4),
        Kind::Int16 => (Dtype::I16, 2),
        Kind::Uint8 => (Dtype::U8, 1),
        _ => (Dtype::F32, 4),
    }
}

/// The kind a tensor of kind `t` travels as when floats travel as `float`: wide integers as
/// int32, int16 (sparse indices) and bytes (packed codes) as they are.
fn wire_kind(t: Kind, float: Kind) -> Kind {
    match t {
        Kind::Int | Kind::Int64 => Kind::Int,
        Kind::Int16 => Kind::Int16,
        Kind::Uint8 => Kind::Uint8,
        _ => float,
    }
}

/// The safetensors header (length prefix, JSON padded to 8 bytes) of tensors with these names,
/// shapes and kinds (f32, bf16 or int32), with data in name order; and the data's length.
fn header_of<'a>(entries: impl IntoIterator<Item = (&'a str, &'a [i64], Kind)>) -> (Vec<u8>, u64) {
    let mut sorted: Vec<(&str, &[i64], Kind)> = entries.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, kind) in sorted {
        let (dtype, elt) = st_dtype(kind);
        let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let n = shape.iter().product::<usize>() * elt;
        let info = TensorInfo {
            dtype,
            shape,
            data_offsets: (offset, offset + n),
        };
        offset += n;
        header.insert(
            name.to_owned(),
            serde_json::to_value(info).expect("plain data"),
        );
    }
    let mut json = serde_json::to_vec(&header).expect("plain data");
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    (out, offset as u64)
}

/// The exact size of the safetensors file [`write`] makes for tensors of these names, shapes
/// and wire kinds (f32, bf16 or int32).
pub fn expected_size<'a>(entries: impl IntoIterator<Item = (&'a str, &'a [i64], Kind)>) -> u64 {
    let (header, data) = header_of(entries);
    header.len() as u64 + data
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hasher: xxhash_rust::xxh3::Xxh3,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Streams tensors as safetensors into `w`, floats as `kind` (f32 or bf16), integers as int32
/// and bytes as uint8, each tensor converted on its own (so at most one is copied at a time);
/// returns the bytes written and their xxh3, hashed while writing.
fn write_into<W: Write>(
    w: W,
    named: &[(String, Tensor)],
    kind: Kind,
) -> std::io::Result<(u64, u64, W)> {
    let shapes: Vec<(String, Vec<i64>, Kind)> = named
        .iter()
        .map(|(n, t)| (n.clone(), t.size(), wire_kind(t.kind(), kind)))
        .collect();
    let (header, _) = header_of(
        shapes
            .iter()
            .map(|(n, s, k)| (n.as_str(), s.as_slice(), *k)),
    );
    let mut order: Vec<&(String, Tensor)> = named.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let mut w = Hashing {
        inner: w,
        hasher: xxhash_rust::xxh3::Xxh3::new(),
        bytes: 0,
    };
    w.write_all(&header)?;
    for (_, t) in order {
        let k = wire_kind(t.kind(), kind);
        let t = t.to_device(Device::Cpu).to_kind(k).contiguous();
        let len = t.numel() * st_dtype(k).1;
        // Safety: `t` is a contiguous CPU tensor of `len` bytes, alive for this borrow.
        let bytes = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) };
        w.write_all(bytes)?;
    }
    w.flush()?;
    Ok((w.bytes, w.hasher.digest(), w.inner))
}

/// Writes tensors as safetensors ([`encode`]'s bytes) through a temp file that is fsynced
/// and renamed into place (with its directory fsynced). Returns the file's size and xxh3.
pub fn write(path: &Path, named: &[(String, Tensor)], kind: Kind) -> Result<(u64, u64)> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<(u64, u64)> {
        let file = std::fs::File::create(&tmp)?;
        let (bytes, digest, w) = write_into(
            std::io::BufWriter::with_capacity(CHUNK_BYTES, file),
            named,
            kind,
        )?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok((bytes, digest))
    };
    let digest = write().with_context(|| format!("cannot write payload {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    spes_data::shard::sync_dir(path).with_context(|| format!("cannot sync {}", path.display()))?;
    Ok(digest)
}

/// Writes several tensor groups as safetensors back to back in one file (temp file, fsync,
/// rename, as [`write`]): a round's parts, read as a whole or by range. Returns each part's
/// size and xxh3, then the whole file's.
pub fn write_parts(
    path: &Path,
    groups: &[Vec<(String, Tensor)>],
    kind: Kind,
) -> Result<(Vec<Part>, (u64, u64))> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<(Vec<Part>, (u64, u64))> {
        let file = std::fs::File::create(&tmp)?;
        let mut whole = Hashing {
            inner: std::io::BufWriter::with_capacity(CHUNK_BYTES, file),
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            bytes: 0,
        };
        let mut parts = Vec::with_capacity(groups.len());
        for named in groups {
            let (bytes, digest, _) = write_into(&mut whole, named, kind)?;
            parts.push(part(bytes, digest));
        }
        let total = (whole.bytes, whole.hasher.digest());
        whole
            .inner
            .into_inner()
            .map_err(|e| e.into_error())?
            .sync_all()?;
        Ok((parts, total))
    };
    let written = write().with_context(|| format!("cannot write payload {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    spes_data::shard::sync_dir(path).with_context(|| format!("cannot sync {}", path.display()))?;
    Ok(written)
}

/// Tensors as safetensors bytes in memory (floats as `kind`, see [`write`]), and their xxh3.
pub fn encode(named: &[(String, Tensor)], kind: Kind) -> (Vec<u8>, u64) {
    let (_, digest, bytes) =
        write_into(Vec::new(), named, kind).expect("writing to memory does not fail");
    (bytes, digest)
}

/// Decodes a safetensors payload of f32, bf16, int32 or uint8 tensors. Any malformed input is an error,
/// never a panic (fuzzed by the test suite).
pub fn decode(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    decode_with(bytes, |data, shape, kind| {
        Tensor::from_data_size(data, shape, kind)
    })
}

/// [`decode`], making each tensor from its bytes, shape and kind with `make`.
fn decode_with(
    bytes: &[u8],
    make: impl Fn(&[u8], &[i64], Kind) -> Tensor,
) -> Result<Vec<(String, Tensor)>> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow::anyhow!("not a valid safetensors payload: {e:?}"))?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        let (kind, elt) = match view.dtype() {
            Dtype::F32 => (Kind::Float, 4usize),
            Dtype::BF16 => (Kind::BFloat16, 2),
            Dtype::I32 => (Kind::Int, 4),
            Dtype::I16 => (Kind::Int16, 2),
            Dtype::U8 => (Kind::Uint8, 1),
            other => bail!("tensor `{name}` is {other:?}, expected F32, BF16, I32, I16 or U8"),
        };
        let numel = view
            .shape()
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .with_context(|| format!("tensor `{name}`: shape overflows"))?;
        if numel.checked_mul(elt) != Some(view.data().len()) {
            bail!("tensor `{name}`: data length does not match its shape");
        }
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        out.push((name, make(view.data(), &shape, kind)));
    }
    Ok(out)
}

/// Maps a payload file (privately: a write to it stays in this process) and lends its
/// tensors to `f` without copying them; a tensor whose bytes are not aligned to its element
/// size is copied instead. The mapping is gone when `f` returns.
///
/// # Safety
/// `f` must not keep the tensors or any view of them beyond its return (copy what it keeps),
/// and the file must not be truncated meanwhile.
pub unsafe fn with_mapped<R>(path: &Path, f: impl FnOnce(Vec<(String, Tensor)>) -> R) -> Result<R> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    let named = decode_with(&map, |data, shape, kind| {
        let elt = kind.elt_size_in_bytes();
        if data.is_empty() || !(data.as_ptr() as usize).is_multiple_of(elt) {
            return Tensor::from_data_size(data, shape, kind);
        }
        // Safety: `data` holds exactly the tensor's bytes (checked by `decode_with`) in the
        // mapping, which outlives `f` and so every use of the tensor (the caller's contract).
        unsafe { Tensor::from_blob(data.as_ptr(), shape, &[], kind, Device::Cpu) }
    })
    .with_context(|| format!("payload {}", path.display()))?;
    let out = f(named);
    drop(map);
    Ok(out)
}

fn map(path: &Path) -> Result<memmap2::Mmap> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // Safety: the file is private to this process (received or written by it) and not
    // modified while mapped.
    unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))
}

/// Reads a payload file (memory-mapped) as named f32-or-bf16 CPU tensors.
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>> {
    decode(&map(path)?).with_context(|| format!("payload {}", path.display()))
}

/// Reads a received multi-part payload (memory-mapped): every part's tensors, in part order.
pub fn read_parts(path: &Path, parts: &[Part]) -> Result<Vec<(String, Tensor)>> {
    decode_parts(&map(path)?, parts).with_context(|| format!("payload {}", path.display()))
}

/// The tensors of a received multi-part payload's bytes, in part order.
pub fn decode_parts(bytes: &[u8], parts: &[Part]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for (i, p) in parts.iter().enumerate() {
        let end = at.saturating_add(p.bytes as usize).min(bytes.len());
        out.extend(decode(&bytes[at..end]).with_context(|| format!("part {i}"))?);
        at = end;
    }
    Ok(out)
}

/// The header of peer `peer`'s (process `session`'s) upload for `round`: one part of `bytes`
/// with checksum `xxh3`.
pub fn upload_header(
    peer: usize,
    session: u64,
    round: u64,
    bytes: u64,
    xxh3: u64,
) -> PayloadHeader {
    PayloadHeader {
        peer: peer as u32,
        round,
        total_bytes: bytes,
        parts: vec![part(bytes, xxh3)],
        session,
        ..Default::default()
    }
}

/// The header's part for a file of this size and checksum.
pub fn part(bytes: u64, xxh3: u64) -> Part {
    Part {
        bytes,
        xxh3,
        offset: 0,
    }
}

/// Checks that `bytes` holds `parts` back to back, each with its size and checksum; returns
/// the size and xxh3 of them all, as [`digest`] gives a file's.
pub fn check_parts(bytes: &mut impl Read, parts: &[Part]) -> Result<(u64, u64), String> {
    let mut buf = vec![0u8; CHUNK_BYTES];
    let (mut whole, mut total) = (xxhash_rust::xxh3::Xxh3::new(), 0u64);
    for (i, p) in parts.iter().enumerate() {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut left = p.bytes;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = bytes
                .read(&mut buf[..want])
                .map_err(|e| format!("cannot read part {i}: {e}"))?;
            if n == 0 {
                return Err(format!("part {i} ends {left} bytes short"));
            }
            hasher.update(&buf[..n]);
            whole.update(&buf[..n]);
            left -= n as u64;
            total += n as u64;
        }
        if hasher.digest() != p.xxh3 {
            return Err(format!("part {i} fails its checksum"));
        }
    }
    Ok((total, whole.digest()))
}

/// Size and xxh3-64 of a file.
pub fn digest(path: &Path) -> Result<(u64, u64)> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, hasher.digest()))
}

/// Where a part of a payload being sent is.
pub enum Source {
    File(PathBuf),
    /// `len` bytes of a file from `offset`: one part of a file of several.
    Range {
        path: PathBuf,
        offset: u64,
        len: u64,
    },
    Bytes(std::sync::Arc<Vec<u8>>),
}

/// Streams the `sources` back to back as `header` (which lists them as parts) followed by
/// data chunks; `after_chunk(i)` runs once chunk `i` is queued. A read error ends the stream
/// early, which the receiver sees as a size mismatch.
pub fn send(
    sources: Vec<Source>,
    header: PayloadHeader,
    after_chunk: impl Fn(usize) + Send + 'static,
) -> ReceiverStream<Result<Chunk, Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        let first = Chunk {
            part: Some(ChunkPart::Header(header)),
        };
        if tx.blocking_send(Ok(first)).is_err() {
            return;
        }
        let mut buf = vec![0u8; CHUNK_BYTES];
        let mut i = 0;
        for source in sources {
            let mut f: Box<dyn Read> = match source {
                Source::File(path) => match std::fs::File::open(&path) {
                    Ok(f) => Box::new(f),
                    Err(_) => {
                        let _ = tx.blocking_send(Err(Status::internal("payload file vanished")));
                        return;
                    }
                },
                Source::Range { path, offset, len } => {
                    let opened = std::fs::File::open(&path).and_then(|mut f| {
                        f.seek(std::io::SeekFrom::Start(offset))?;
                        Ok(f)
                    });
                    match opened {
                        Ok(f) => Box::new(f.take(len)),
                        Err(_) => {
                            let _ =
                                tx.blocking_send(Err(Status::internal("payload file vanished")));
                            return;
                        }
                    }
                }
                Source::Bytes(bytes) => Box::new(std::io::Cursor::new(ArcBytes(bytes))),
            };
            loop {
                match f.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let chunk = Chunk {
                            part: Some(ChunkPart::Data(buf[..n].to_vec())),
                        };
                        if tx.blocking_send(Ok(chunk)).is_err() {
                            return;
                        }
                        after_chunk(i);
                        i += 1;
                    }
                    Err(e) => {
                        let _ = tx.blocking_send(Err(Status::internal(format!("read error: {e}"))));
                        return;
                    }
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// Shared bytes as a slice, for reading or sending them without a copy.
pub struct ArcBytes(pub std::sync::Arc<Vec<u8>>);

impl AsRef<[u8]> for ArcBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

async fn next_chunk<S>(stream: &mut S, idle: Duration) -> Result<Option<Chunk>, Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    match tokio::time::timeout(idle, stream.next()).await {
        Ok(next) => next.transpose(),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "the stream sent nothing for {:.0} s",
            idle.as_secs_f64()
        ))),
    }
}

/// Reads the header that starts a payload stream, waiting at most `idle`. Its parts must add
/// up to its total.
pub async fn read_header<S>(stream: &mut S, idle: Duration) -> Result<PayloadHeader, Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    match next_chunk(stream, idle).await? {
        Some(Chunk {
            part: Some(ChunkPart::Header(h)),
        }) => {
            let sum = h
                .parts
                .iter()
                .try_fold(0u64, |acc, p| acc.checked_add(p.bytes));
            if sum != Some(h.total_bytes) {
                return Err(Status::invalid_argument(
                    "the header's parts do not add up to its total_bytes",
                ));
            }
            Ok(h)
        }
        _ => Err(Status::invalid_argument("payload must start with a header")),
    }
}

/// Receives the data chunks after `header` into `dest`, checking the size and every part's
/// checksum; empty chunks and gaps longer than `idle` end it with an error.
pub async fn receive_body<S>(
    stream: &mut S,
    dest: &Path,
    header: &PayloadHeader,
    idle: Duration,
) -> Result<(), Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    let io = |e: std::io::Error| Status::internal(format!("cannot write {}: {e}", dest.display()));
    let file = tokio::fs::File::create(dest).await.map_err(io)?;
    let mut sink = Sink::File(file);
    receive_into(stream, &mut sink, header, idle)
        .await?
        .map_err(io)?;
    let Sink::File(mut file) = sink else {
        unreachable!("a file sink stays one")
    };
    file.flush().await.map_err(io)?;
    file.sync_all().await.map_err(io)?;
    Ok(())
}

/// [`receive_body`] into memory (what a node does with a round's delta, which it applies at
/// once: nothing of it needs the disk).
pub async fn receive_to_memory<S>(
    stream: &mut S,
    header: &PayloadHeader,
    idle: Duration,
) -> Result<Vec<u8>, Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    let mut sink = Sink::Memory(Vec::with_capacity(header.total_bytes.min(1 << 30) as usize));
    receive_into(stream, &mut sink, header, idle)
        .await?
        .map_err(|e| Status::internal(e.to_string()))?;
    let Sink::Memory(bytes) = sink else {
        unreachable!("a memory sink stays one")
    };
    Ok(bytes)
}

/// Where received data goes.
enum Sink {
    File(tokio::fs::File),
    Memory(Vec<u8>),
}

impl Sink {
    async fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::File(f) => f.write_all(bytes).await,
            Sink::Memory(v) => {
                v.extend_from_slice(bytes);
                Ok(())
            }
        }
    }
}

/// The checks of [`receive_body`], writing each chunk to `sink`: the outer error is the
/// payload's fault, the inner one the sink's.
async fn receive_into<S>(
    stream: &mut S,
    sink: &mut Sink,
    header: &PayloadHeader,
    idle: Duration,
) -> Result<std::io::Result<()>, Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    let parts = &header.parts;
    // The part being received (`parts.len()`: all done), its bytes so far and their hash.
    let mut idx = 0usize;
    let mut in_part = 0u64;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut received = 0u64;
    // Ends every part that is complete (zero-byte parts at once), checking its hash.
    let close_full = |idx: &mut usize, in_part: &mut u64, hasher: &mut xxhash_rust::xxh3::Xxh3| {
        while *idx < parts.len() && *in_part == parts[*idx].bytes {
            if hasher.digest() != parts[*idx].xxh3 {
                return Err(Status::invalid_argument(format!(
                    "payload part {}: checksum mismatch",
                    *idx
                )));
            }
            *hasher = xxhash_rust::xxh3::Xxh3::new();
            *in_part = 0;
            *idx += 1;
        }
        Ok(())
    };
    close_full(&mut idx, &mut in_part, &mut hasher)?;
    while let Some(chunk) = next_chunk(stream, idle).await? {
        match chunk.part {
            Some(ChunkPart::Data(bytes)) if bytes.is_empty() => {
                return Err(Status::invalid_argument("empty data chunk"))
            }
            Some(ChunkPart::Data(bytes)) => {
                received += bytes.len() as u64;
                if received > header.total_bytes {
                    return Err(Status::invalid_argument(format!(
                        "payload longer than the announced {} bytes",
                        header.total_bytes
                    )));
                }
                let mut rest = &bytes[..];
                while !rest.is_empty() && idx < parts.len() {
                    let take = rest.len().min((parts[idx].bytes - in_part) as usize);
                    hasher.update(&rest[..take]);
                    in_part += take as u64;
                    rest = &rest[take..];
                    close_full(&mut idx, &mut in_part, &mut hasher)?;
                }
                if let Err(e) = sink.put(&bytes).await {
                    return Ok(Err(e));
                }
            }
            _ => {
                return Err(Status::invalid_argument(
                    "a second header inside the payload",
                ))
            }
        }
    }
    if received != header.total_bytes || idx < parts.len() {
        return Err(Status::invalid_argument(format!(
            "payload truncated: {received} of {} bytes arrived",
            header.total_bytes
        )));
    }
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_tensors_equal_read_ones_for_every_wire_kind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        tch::manual_seed(1);
        // An odd number of bytes first, so a later tensor may sit unaligned and be copied.
        let named = vec![
            (
                "a#q".to_string(),
                Tensor::randint(256, [13], (Kind::Uint8, Device::Cpu)),
            ),
            (
                "b#idx".to_string(),
                Tensor::arange(9, (Kind::Int, Device::Cpu)),
            ),
            (
                "c".to_string(),
                Tensor::randn([4, 5], (Kind::Float, Device::Cpu)),
            ),
        ];
        for float in [Kind::Float, Kind::BFloat16] {
            write(&path, &named, float).unwrap();
            let mut read = read(&path).unwrap();
            read.sort_by(|a, b| a.0.cmp(&b.0));
            // Safety: the closure keeps only copies.
            let mut mapped = unsafe {
                with_mapped(&path, |m| {
                    m.into_iter()
                        .map(|(n, t)| (n, t.copy()))
                        .collect::<Vec<_>>()
                })
            }
            .unwrap();
            mapped.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(read.len(), 3);
            for ((n, a), (m, b)) in read.iter().zip(&mapped) {
                assert_eq!(n, m);
                assert_eq!(a.kind(), b.kind(), "{n}");
                assert!(a.equal(b), "{n} as {float:?}");
            }
        }
    }

    #[test]
    fn expected_size_is_the_written_size() {
        let dir = tempfile::tempdir().unwrap();
        let named = vec![
            (
                "b.weight".to_string(),
                Tensor::ones([3, 5], (Kind::Float, Device::Cpu)),
            ),
            (
                "a.norm".to_string(),
                Tensor::ones([7], (Kind::Float, Device::Cpu)),
            ),
            (
                "model.layers.10.x".to_string(),
                Tensor::ones([2, 2, 2], (Kind::Float, Device::Cpu)),
            ),
        ];
        for dtype in [Kind::Float, Kind::BFloat16] {
            let path = dir.path().join("p.safetensors");
            let (size, xxh3) = write(&path, &named, dtype).unwrap();
            assert_eq!(digest(&path).unwrap(), (size, xxh3));
            let shapes: Vec<(String, Vec<i64>)> =
                named.iter().map(|(n, t)| (n.clone(), t.size())).collect();
            let expected = expected_size(
                shapes
                    .iter()
                    .map(|(n, s)| (n.as_str(), s.as_slice(), dtype)),
            );
            assert_eq!(size, expected, "{dtype:?}");
            let back = read(&path).unwrap();
            assert_eq!(back.len(), 3);
            assert_eq!(
                back.iter().find(|(n, _)| n == "a.norm").unwrap().1.kind(),
                dtype
            );
            let ones = back.iter().find(|(n, _)| n == "b.weight").unwrap();
            assert_eq!(
                ones.1
                    .to_kind(Kind::Float)
                    .sum(Kind::Float)
                    .double_value(&[]),
                15.0
            );
        }
    }
}
