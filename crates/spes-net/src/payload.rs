//! Wire payloads: named tensors as a safetensors file, streamed in 1 MiB chunks behind a header
//! that carries the size and xxh3 checksum. Both sides stream through files on disk, so neither
//! holds a whole payload in memory as protobuf messages. A receiver reads the header first, so
//! it can refuse a payload before any of its data arrives, and cuts a stream that goes idle.

use crate::proto::{chunk::Part, Chunk, PayloadHeader};
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, TensorInfo};
use spes_train::PayloadDtype;
use std::io::Read;
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

fn wire_kind(dtype: PayloadDtype) -> Kind {
    match dtype {
        PayloadDtype::Fp32 => Kind::Float,
        PayloadDtype::Bf16 => Kind::BFloat16,
    }
}

/// Writes tensors as safetensors in the wire dtype through a temp file that is fsynced and
/// renamed into place (with its directory fsynced). Returns the file's size and xxh3.
pub fn write(path: &Path, named: &[(String, Tensor)], dtype: PayloadDtype) -> Result<(u64, u64)> {
    let kind = wire_kind(dtype);
    let converted: Vec<(String, Tensor)> = named
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.to_device(Device::Cpu).to_kind(kind).contiguous(),
            )
        })
        .collect();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    Tensor::write_safetensors(&converted, &tmp)
        .with_context(|| format!("cannot write payload {}", tmp.display()))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", tmp.display()))?;
    let digest = digest(&tmp)?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    spes_data::shard::sync_dir(path).with_context(|| format!("cannot sync {}", path.display()))?;
    Ok(digest)
}

/// The exact size of the safetensors file [`write`] makes for tensors of these names and
/// shapes: 8 bytes of header length, the JSON header padded to 8 bytes, then the data.
pub fn expected_size<'a>(
    entries: impl IntoIterator<Item = (&'a str, &'a [i64])>,
    dtype: PayloadDtype,
) -> u64 {
    let (st_dtype, elt) = match dtype {
        PayloadDtype::Fp32 => (Dtype::F32, 4),
        PayloadDtype::Bf16 => (Dtype::BF16, 2),
    };
    // Every tensor has the same dtype, so the file orders them by name, as this map does.
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut sorted: Vec<(&str, &[i64])> = entries.into_iter().collect();
    sorted.sort();
    for (name, shape) in sorted {
        let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let n = shape.iter().product::<usize>() * elt;
        let info = TensorInfo {
            dtype: st_dtype,
            shape,
            data_offsets: (offset, offset + n),
        };
        offset += n;
        header.insert(
            name.to_owned(),
            serde_json::to_value(info).expect("plain data"),
        );
    }
    let json = serde_json::to_string(&header).expect("plain data").len();
    (8 + json.div_ceil(8) * 8 + offset) as u64
}

/// Decodes a safetensors payload of f32 or bf16 tensors. Any malformed input is an error,
/// never a panic (fuzzed by the test suite).
pub fn decode(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow::anyhow!("not a valid safetensors payload: {e:?}"))?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        let (kind, elt) = match view.dtype() {
            Dtype::F32 => (Kind::Float, 4usize),
            Dtype::BF16 => (Kind::BFloat16, 2),
            other => bail!("tensor `{name}` is {other:?}, expected F32 or BF16"),
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
        out.push((name, Tensor::from_data_size(view.data(), &shape, kind)));
    }
    Ok(out)
}

/// Reads a payload file (memory-mapped) as named f32-or-bf16 CPU tensors.
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // Safety: the file is private to this process (received or written by it) and not
    // modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    decode(&map).with_context(|| format!("payload {}", path.display()))
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

/// Streams `path` as `header` followed by data chunks; `after_chunk(i)` runs once chunk `i`
/// is queued. A read error ends the stream early, which the receiver sees as a size mismatch.
pub fn send(
    path: &Path,
    header: PayloadHeader,
    after_chunk: impl Fn(usize) + Send + 'static,
) -> ReceiverStream<Result<Chunk, Status>> {
    let path = path.to_owned();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        let first = Chunk {
            part: Some(Part::Header(header)),
        };
        if tx.blocking_send(Ok(first)).is_err() {
            return;
        }
        let Ok(mut f) = std::fs::File::open(&path) else {
            let _ = tx.blocking_send(Err(Status::internal("payload file vanished")));
            return;
        };
        let mut buf = vec![0u8; CHUNK_BYTES];
        for i in 0.. {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let chunk = Chunk {
                        part: Some(Part::Data(buf[..n].to_vec())),
                    };
                    if tx.blocking_send(Ok(chunk)).is_err() {
                        return;
                    }
                    after_chunk(i);
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(Status::internal(format!("read error: {e}"))));
                    return;
                }
            }
        }
    });
    ReceiverStream::new(rx)
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

/// Reads the header that starts a payload stream, waiting at most `idle`.
pub async fn read_header<S>(stream: &mut S, idle: Duration) -> Result<PayloadHeader, Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    match next_chunk(stream, idle).await? {
        Some(Chunk {
            part: Some(Part::Header(h)),
        }) => Ok(h),
        _ => Err(Status::invalid_argument("payload must start with a header")),
    }
}

/// Receives the data chunks after `header` into `dest`, checking size and checksum; empty
/// chunks and gaps longer than `idle` end it with an error.
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
    let mut file = tokio::fs::File::create(dest).await.map_err(io)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut received = 0u64;
    while let Some(chunk) = next_chunk(stream, idle).await? {
        match chunk.part {
            Some(Part::Data(bytes)) if bytes.is_empty() => {
                return Err(Status::invalid_argument("empty data chunk"))
            }
            Some(Part::Data(bytes)) => {
                received += bytes.len() as u64;
                if received > header.total_bytes {
                    return Err(Status::invalid_argument(format!(
                        "payload longer than the announced {} bytes",
                        header.total_bytes
                    )));
                }
                hasher.update(&bytes);
                file.write_all(&bytes).await.map_err(io)?;
            }
            _ => {
                return Err(Status::invalid_argument(
                    "a second header inside the payload",
                ))
            }
        }
    }
    file.flush().await.map_err(io)?;
    if received != header.total_bytes {
        return Err(Status::invalid_argument(format!(
            "payload truncated: {received} of {} bytes arrived",
            header.total_bytes
        )));
    }
    if hasher.digest() != header.xxh3 {
        return Err(Status::invalid_argument("payload checksum mismatch"));
    }
    file.sync_all().await.map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for dtype in [PayloadDtype::Fp32, PayloadDtype::Bf16] {
            let path = dir.path().join("p.safetensors");
            let (size, _) = write(&path, &named, dtype).unwrap();
            let shapes: Vec<(String, Vec<i64>)> =
                named.iter().map(|(n, t)| (n.clone(), t.size())).collect();
            let expected = expected_size(
                shapes.iter().map(|(n, s)| (n.as_str(), s.as_slice())),
                dtype,
            );
            assert_eq!(size, expected, "{dtype:?}");
            let back = read(&path).unwrap();
            assert_eq!(back.len(), 3);
            assert_eq!(
                back.iter().find(|(n, _)| n == "a.norm").unwrap().1.kind(),
                wire_kind(dtype)
            );
        }
    }
}
