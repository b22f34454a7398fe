//! spes data: tokenizing text into memory-mapped token shards, and a deterministic, resumable
//! loader of `[batch, seq+1]` training windows. Depends on no other spes crate.

pub mod input;
pub mod loader;
pub mod shard;
#[cfg(feature = "test-support")]
pub mod testing;
pub mod tokenize;

pub use loader::{Loader, ValWindows};
pub use shard::{Manifest, TokenDtype};
pub use tokenize::{tokenize, TokenizeOptions, TokenizerSource};
