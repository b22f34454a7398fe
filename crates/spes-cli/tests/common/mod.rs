//! Helpers shared by the CLI test files.

#![allow(dead_code)] // each test file uses its own part

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};

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

/// A `spes` process of a multi-process test (server or node), its output in `log`. A crash
/// point (`SPES_FAULT`) SIGKILLs it once; with `restart` it is started again without it.
pub struct Proc {
    pub name: String,
    pub args: Vec<String>,
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    pub fault: Option<&'static str>,
    pub restart: bool,
    pub child: Option<Child>,
    pub killed: bool,
    pub restarted: bool,
    pub exit: Option<ExitStatus>,
    pub log: PathBuf,
}

impl Proc {
    pub fn new(name: String, args: Vec<String>, log: PathBuf) -> Proc {
        Proc {
            name,
            args,
            netns: None,
            fault: None,
            restart: false,
            child: None,
            killed: false,
            restarted: false,
            exit: None,
            log,
        }
    }

    pub fn spawn(&mut self) {
        let spes = env!("CARGO_BIN_EXE_spes");
        let mut cmd = match &self.netns {
            // `ip netns exec` execs the program itself, so the child is the spes process.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, spes]);
                c
            }
            None => Command::new(spes),
        };
        cmd.args(&self.args).env_remove("SPES_FAULT");
        if let (Some(f), false) = (self.fault, self.restarted) {
            cmd.env("SPES_FAULT", f);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        cmd.stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null());
        self.child = Some(cmd.spawn().unwrap());
    }

    /// Restarts a process its crash point killed; records a final exit otherwise.
    pub fn poll(&mut self) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        let Some(status) = child.try_wait().unwrap() else {
            return;
        };
        self.child = None;
        if status.signal() == Some(9) && !self.killed {
            self.killed = true;
            if self.restart {
                self.restarted = true;
                self.spawn();
                return;
            }
        }
        self.exit = Some(status);
    }

    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to the running process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("a running process").id();
        let ok = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{signal} {pid} ({}) failed", self.name);
    }

    /// Everything it logged so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The round records a server logged so far (`<out>/metrics.jsonl`).
pub fn rounds_logged(server: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(server.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A safetensors file's tensors by name.
pub fn tensors(path: &Path) -> BTreeMap<String, tch::Tensor> {
    tch::Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

/// A run config of a model that trains in milliseconds a step (the `tiny` preset shrunk:
/// 2 layers of width 32, `experts` experts, 512-token vocabulary, windows of 32) on `data`,
/// `max_steps` steps of 4 windows, followed by the `[sync]` section `sync` (its lines, no
/// header).
pub fn micro_config(data: &Path, experts: usize, max_steps: u64, sync: &str) -> String {
    format!(
        r#"
[model]
preset = "tiny"
vocab_size = 512
d_model = 32
n_layers = 2
n_heads = 2
head_dim = 16
n_kv_heads = 2
n_experts = {experts}
expert_hidden = 32
context_length = 32

[data]
path = "{}"

[train]
max_steps = {max_steps}
batch_size = 4
seq_len = 32
lr = 3e-3
warmup_steps = 2
log_every = 100
eval_batches = 2

[sync]
{sync}"#,
        data.display()
    )
}
