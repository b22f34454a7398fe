//! The loopback harness shared by the spes-net tests: a server in a thread, node options,
//! raw clients with a peer's credential.
#![allow(dead_code)]

use spes_net::auth::{credential, AddToken};
use spes_net::payload;
use spes_net::proto::spes_client::SpesClient;
use spes_net::proto::{PayloadHeader, UploadReply};
use spes_net::server::{serve, Limits, ServerOptions, ServerSummary};
use spes_net::{NodeOptions, Progress};
use spes_train::RunConfig;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use tch::Device;

pub const SECRET: &str = "test-run-secret-123";

/// The credential of `peer` in the test run.
pub fn cred(peer: usize) -> String {
    credential(SECRET, peer)
}

pub fn data(dir: &Path) -> PathBuf {
    spes_data::testing::small_corpus(dir, 120000)
}

pub fn config(data: &Path, mode: &str, nodes: usize, extra: &[&str]) -> RunConfig {
    let text = format!(
        r#"
[model]
preset = "micro"

[data]
path = "{}"

[train]
max_steps = 6
batch_size = 4
seq_len = 32
lr = 3e-3
warmup_steps = 2
log_every = 1
eval_batches = 2

[sync]
mode = "{mode}"
nodes = {nodes}
sync_steps = 2
merge_every = 0
round_timeout_s = 120
# Whole fp32 tensors, so tests can check averages exactly and upload raw values;
# the delta wire has its own tests.
wire = "fp32"
"#,
        data.display()
    );
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    RunConfig::parse(&text, &extra).unwrap()
}

pub struct Server {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<JoinHandle<anyhow::Result<ServerSummary>>>,
}

impl Server {
    pub fn start(cfg: RunConfig, out: &Path, tls: Option<(Vec<u8>, Vec<u8>)>) -> Server {
        Self::start_on("127.0.0.1:0", cfg, out, tls)
    }

    pub fn start_on(
        bind: &str,
        cfg: RunConfig,
        out: &Path,
        tls: Option<(Vec<u8>, Vec<u8>)>,
    ) -> Server {
        Self::start_with(bind, cfg, out, tls, Limits::default())
    }

    pub fn start_with(
        bind: &str,
        cfg: RunConfig,
        out: &Path,
        tls: Option<(Vec<u8>, Vec<u8>)>,
        limits: Limits,
    ) -> Server {
        Self::start_shard(bind, cfg, out, tls, limits, (0, 1))
    }

    /// Shard `shard.0` of `shard.1`.
    pub fn start_shard(
        bind: &str,
        cfg: RunConfig,
        out: &Path,
        tls: Option<(Vec<u8>, Vec<u8>)>,
        limits: Limits,
        shard: (usize, usize),
    ) -> Server {
        Self::start_options(bind, options(cfg, out, tls, limits, shard))
    }

    /// A server with any options.
    pub fn start_options(bind: &str, opts: ServerOptions) -> Server {
        let bind = bind.to_owned();
        let (addr_tx, addr_rx) = mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(bind.as_str()).await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                serve(opts, listener, async {
                    let _ = stop_rx.await;
                })
                .await
            })
        });
        Server {
            addr: addr_rx.recv().unwrap(),
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn finish(mut self) -> ServerSummary {
        self.handle.take().unwrap().join().unwrap().unwrap()
    }

    /// Stops the server now and waits until it has let go of its port.
    pub fn stop(mut self) -> ServerSummary {
        let _ = self.stop.take().unwrap().send(());
        self.finish()
    }
}

/// The test server's options: the test secret, CPU, a 5 s linger, no HTTP listener.
pub fn options(
    cfg: RunConfig,
    out: &Path,
    tls: Option<(Vec<u8>, Vec<u8>)>,
    limits: Limits,
    shard: (usize, usize),
) -> ServerOptions {
    ServerOptions {
        cfg,
        out: out.to_owned(),
        secret: Some(SECRET.into()),
        tls,
        init: None,
        device: Device::Cpu,
        linger_s: 5.0,
        limits,
        shard,
        http: None,
        store: None,
        replay: None,
    }
}

/// The repository's root (tests run in their crate's directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Starts nodes `peers` on threads, each running to the end of the run (one torch thread).
pub fn spawn_nodes(
    cfg: &RunConfig,
    url: &str,
    out: &Path,
    peers: impl IntoIterator<Item = usize>,
) -> Vec<JoinHandle<spes_net::NodeSummary>> {
    tch::set_num_threads(1);
    peers
        .into_iter()
        .map(|peer| {
            let opts = node_options(cfg, url, peer, out);
            std::thread::spawn(move || spes_net::Node::connect(opts).unwrap().run().unwrap())
        })
        .collect()
}

pub fn node_options(cfg: &RunConfig, url: &str, peer: usize, out: &Path) -> NodeOptions {
    NodeOptions {
        cfg: cfg.clone(),
        server: url.to_owned(),
        peer,
        out: out.join(format!("node-{peer}")),
        credential: Some(cred(peer)),
        tls_ca: None,
        device: Device::Cpu,
        progress: Progress::Quiet,
        patience_s: 60.0,
        join: false,
        insecure: false,
        data_parallel: None,
        metrics_listener: None,
    }
}

pub type RawClient =
    SpesClient<tonic::codegen::InterceptedService<tonic::transport::Channel, AddToken>>;

pub async fn raw_client(url: &str, token: &str) -> RawClient {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    SpesClient::with_interceptor(channel, AddToken::new(Some(token)).unwrap())
}

/// Round `round`'s whole model as peer 0 fetches it from the server at `url`.
pub fn fetch_whole(url: &str, round: u64, dir: &Path) -> spes_sync::Named {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = raw_client(url, &cred(0)).await;
        let req = spes_net::proto::FetchRequest {
            peer: 0,
            round,
            newest: false,
            wait_ms: 1000,
            have_previous: false,
            skip_own: false,
            ..Default::default()
        };
        let mut stream = c.fetch(req).await.unwrap().into_inner();
        let idle = std::time::Duration::from_secs(10);
        let header = payload::read_header(&mut stream, idle).await.unwrap();
        assert!(!header.delta);
        let path = dir.join(format!("whole-{round}.part"));
        payload::receive_body(&mut stream, &path, &header, idle)
            .await
            .unwrap();
        payload::read_parts(&path, &header.parts).unwrap()
    })
}

/// Metrics lines of a server's `metrics.jsonl`.
pub fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Peer `peer`'s upload under the config's initial ownership, each tensor made by `f` from the
/// fresh model's.
pub fn upload_of(
    cfg: &RunConfig,
    peer: usize,
    f: impl Fn(&tch::Tensor) -> tch::Tensor,
) -> spes_sync::Named {
    let model = spes_model::MoeModel::new(&cfg.model, Device::Cpu).unwrap();
    let scope = spes_sync::Scope::of(&cfg.sync, cfg.model.n_experts).unwrap();
    model
        .params()
        .into_iter()
        .filter(|p| scope.uploads(peer, p.role))
        .map(|p| (p.name, f(&p.tensor.detach())))
        .collect()
}

pub fn header_for(peer: usize, round: u64, total_bytes: u64, xxh3: u64) -> PayloadHeader {
    payload::upload_header(peer, 0, round, total_bytes, xxh3)
}

/// Streams the file at `path` behind `header`.
pub async fn upload_with(
    client: &mut RawClient,
    path: &Path,
    header: PayloadHeader,
) -> Result<UploadReply, tonic::Status> {
    let stream = tokio_stream::StreamExt::filter_map(
        payload::send(vec![payload::Source::File(path.to_owned())], header, |_| {}),
        |r| r.ok(),
    );
    client.upload(stream).await.map(|r| r.into_inner())
}

/// Uploads `named` (fp32) as peer `peer`'s tensors of `round`, with a truthful header.
pub async fn upload_raw(
    client: &mut RawClient,
    dir: &Path,
    peer: usize,
    round: u64,
    named: &spes_sync::Named,
) -> Result<UploadReply, tonic::Status> {
    let path = dir.join(format!("raw-{peer}-{round}.safetensors"));
    let (size, xxh3) = payload::write(&path, named, tch::Kind::Float).unwrap();
    upload_with(client, &path, header_for(peer, round, size, xxh3)).await
}
