//! Wire payloads: named tensors as a safetensors file, streamed in 1 MiB chunks behind a header
//! that carries the size and xxh3 checksum. Both sides stream through files on disk, so neither
//! holds a whole payload in memory as protobuf messages.

use crate::proto::{chunk::Part, Chunk, PayloadHeader};
use anyhow::{Context, Result};
use spes_train::PayloadDtype;
use std::io::Read;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};
use tokio::io::AsyncWriteExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::Status;

/// Payload bytes per gRPC message.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Writes tensors as safetensors in the wire dtype, into a temp file renamed into place.
pub fn write(path: &Path, named: &[(String, Tensor)], dtype: PayloadDtype) -> Result<()> {
    let kind = match dtype {
        PayloadDtype::Fp32 => Kind::Float,
        PayloadDtype::Bf16 => Kind::BFloat16,
    };
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
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Reads a payload file back as named fp32-or-bf16 CPU tensors.
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>> {
    Tensor::read_safetensors(path)
        .with_context(|| format!("payload {} is not valid safetensors", path.display()))
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

/// Streams `path` as a header followed by data chunks. A read error ends the stream early,
/// which the receiver detects as a size mismatch.
pub fn send(path: &Path, peer: usize, round: u64) -> Result<ReceiverStream<Result<Chunk, Status>>> {
    let (total_bytes, xxh3) = digest(path)?;
    let header = PayloadHeader {
        peer: peer as u32,
        round,
        total_bytes,
        xxh3,
    };
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
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let chunk = Chunk {
                        part: Some(Part::Data(buf[..n].to_vec())),
                    };
                    if tx.blocking_send(Ok(chunk)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(Status::internal(format!("read error: {e}"))));
                    return;
                }
            }
        }
    });
    Ok(ReceiverStream::new(rx))
}

/// Receives a header-then-chunks stream into `dest`, checking size and checksum.
/// `max_bytes` bounds what a sender may announce.
pub async fn receive<S>(mut stream: S, dest: &Path, max_bytes: u64) -> Result<PayloadHeader, Status>
where
    S: tokio_stream::Stream<Item = Result<Chunk, Status>> + Unpin,
{
    let header = match stream.next().await {
        Some(Ok(Chunk {
            part: Some(Part::Header(h)),
        })) => h,
        Some(Err(e)) => return Err(e),
        _ => return Err(Status::invalid_argument("payload must start with a header")),
    };
    if header.total_bytes > max_bytes {
        return Err(Status::invalid_argument(format!(
            "payload of {} bytes exceeds the {max_bytes}-byte limit for this model",
            header.total_bytes
        )));
    }
    let io = |e: std::io::Error| Status::internal(format!("cannot write {}: {e}", dest.display()));
    let mut file = tokio::fs::File::create(dest).await.map_err(io)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut received = 0u64;
    while let Some(chunk) = stream.next().await {
        match chunk?.part {
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
    Ok(header)
}
