//! TensorBoard event files (`--tensorboard DIR`): each role writes scalar curves under
//! `DIR/<role>/`, so `tensorboard --logdir DIR` shows the trainer, every node and the server
//! side by side.
//!
//! The format is TensorFlow's: TFRecord framing (length, masked CRC-32C of the length, the
//! record, its masked CRC-32C) around `Event` protocol buffers with one `Summary` of simple
//! values. The Rust crates that write it are unmaintained and pull an old prost, so the three
//! messages are declared here with the prost the workspace already builds, and the checksum is
//! the `crc32c` crate's.

use anyhow::{Context, Result};
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

#[derive(Clone, PartialEq, Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, tag = "2")]
    simple_value: f32,
}

/// TFRecord's checksum: CRC-32C, rotated and offset so a checksum of checksums is not trivial.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends scalar events to one new event file.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `<dir>/<role>/events.out.tfevents.<unix seconds>.<host>.<pid>`; a restarted
    /// role starts a new file beside the old ones, which TensorBoard reads as one run.
    pub fn create(dir: &Path, role: &str) -> Result<EventWriter> {
        let dir = dir.join(role);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "localhost".into());
        let secs = now().floor() as u64;
        let path = dir.join(format!(
            "events.out.tfevents.{secs}.{host}.{}",
            std::process::id()
        ));
        let file = std::fs::File::create(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = EventWriter { path, file };
        w.append(&Event {
            wall_time: now(),
            file_version: Some("brain.Event:2".into()),
            ..Event::default()
        })?;
        Ok(w)
    }

    /// Writes one event holding `scalars` at `step`; non-finite values are left out.
    pub fn scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let value: Vec<Value> = scalars
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| Value {
                tag: (*tag).to_owned(),
                simple_value: *v as f32,
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.append(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    fn append(&mut self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        // One write per record, so a reader never sees half of one between two appends.
        self.file
            .write_all(&record)
            .with_context(|| format!("cannot write {}", self.path.display()))
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum of TFRecord's own test vector: CRC-32C("123456789") is 0xe3069283.
    #[test]
    fn the_checksum_is_crc32c_masked() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn events_frame_and_decode_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), "node-0").unwrap();
        w.scalars(7, &[("train/loss", 2.5), ("skip", f64::NAN)])
            .unwrap();
        let bytes = std::fs::read(&w.path).unwrap();
        let mut events = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            events.push(Event::decode(data).unwrap());
            at += 16 + len;
        }
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let s = events[1].summary.as_ref().unwrap();
        assert_eq!((events[1].step, s.value.len()), (7, 1));
        assert_eq!(
            (s.value[0].tag.as_str(), s.value[0].simple_value),
            ("train/loss", 2.5)
        );
    }
}
