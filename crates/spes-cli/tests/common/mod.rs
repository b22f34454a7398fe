//! Helpers shared by the CLI test files.

use std::ffi::OsStr;
use std::process::{Command, Output};

/// Runs the `spes` binary with `args` to completion.
pub fn spes<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spes"))
        .args(args)
        .output()
        .unwrap()
}

/// stdout then stderr, for failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `--set` overrides that shrink the `tiny` preset to a model that trains in seconds.
pub const SMALL: &[&str] = &[
    "--set",
    "model.vocab_size=512",
    "--set",
    "model.d_model=32",
    "--set",
    "model.n_layers=2",
    "--set",
    "model.n_heads=2",
    "--set",
    "model.n_kv_heads=2",
    "--set",
    "model.head_dim=16",
    "--set",
    "model.n_experts=4",
    "--set",
    "model.expert_hidden=32",
    "--set",
    "model.context_length=32",
    "--set",
    "train.seq_len=32",
    "--set",
    "train.batch_size=4",
    "--set",
    "train.warmup_steps=2",
];
