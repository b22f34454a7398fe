//! spes data: reading corpora (text, JSON lines, gzip, zstd, parquet), tokenizing them in
//! parallel and resumably into memory-mapped token shards, importing token files other tools
//! wrote, and a deterministic, resumable loader of `[batch, seq+1]` training windows over one
//! directory or a weighted mixture. Depends on no other spes crate.

pub mod import;
pub mod input;
pub mod loader;
mod permute;
pub mod shard;
#[cfg(feature = "test-support")]
pub mod testing;
pub mod tokenize;

pub use loader::{Loader, Share, Source, ValWindows};
pub use shard::{Manifest, Part, TokenDtype};
pub use tokenize::{tokenize, TokenizeOptions, TokenizeReport, TokenizerSource};
