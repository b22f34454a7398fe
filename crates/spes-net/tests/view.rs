//! The operator's view of a real run on loopback (issue 29): Prometheus `/metrics` parsed by
//! the Prometheus project's Python parser, the live page rendered by headless Chromium, the
//! `Status` call with the viewer credential, and TensorBoard's own reader on the event files.
//! Two nodes pause twice mid-run (their heartbeats go on), so every check sees a live run.
//! Needs `.venv` with tensorboard and prometheus_client and `chromium`: `scripts/setup.sh
//! --tests`, which `scripts/test.sh` runs, installs them.

mod common;

use common::*;
use spes_net::server::Limits;
use spes_net::view::browser;
use spes_net::view::http::HttpOptions;
use spes_net::view::RunView;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A GET over plain HTTP/1.1: status code and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = browser::get(addr, path).unwrap();
    (r.code, r.text())
}

fn python() -> std::path::PathBuf {
    repo_root().join(".venv/bin/python")
}

/// `/metrics` as the Prometheus client library's parser reads it: `name{labels}` → value.
fn parse_prometheus(text: &str) -> std::collections::BTreeMap<String, f64> {
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        out[s.name + ("{" + labels + "}" if labels else "")] = s.value
print(json.dumps(out))
"#;
    let mut child = Command::new(python())
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the repository's .venv (scripts/setup.sh)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "prometheus_client could not parse /metrics: {}\n{text}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn api(addr: SocketAddr) -> RunView {
    let (code, body) = get(addr, "/api/run");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls the view until `ok` holds (the scorer and heartbeats run on their own clocks).
fn view_until(addr: SocketAddr, what: &str, ok: impl Fn(&RunView) -> bool) -> RunView {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let v = api(addr);
        if ok(&v) {
            return v;
        }
        assert!(Instant::now() < until, "no {what} within 60 s: {v:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The page's DOM after headless Chromium ran its script.
fn chromium_dom(url: &str, profile: &Path) -> String {
    browser::headless_dom(&browser::chromium(), url, profile, Some(5000)).unwrap()
}

#[test]
fn a_live_run_is_watched_through_prometheus_a_browser_status_and_tensorboard() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let tb = tmp.path().join("tb");
    let cfg = config(
        &data,
        "spes",
        2,
        &[
            "train.max_steps=20",
            "train.log_every=1",
            "sync.lease_s=4",
            &format!("train.tensorboard=\"{}\"", tb.display()),
        ],
    );
    let out = tmp.path().join("server");
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web = http.local_addr().unwrap();
    let mut opts = options(cfg.clone(), &out, None, Limits::default(), (0, 1));
    opts.http = Some((http, HttpOptions::default()));
    let server = Server::start_options("127.0.0.1:0", opts);
    let url = server.url();

    // Node 0 also serves its own /metrics.
    let node_metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let node_web = node_metrics.local_addr().unwrap();
    // Each node trains 2 rounds, pauses, 2 more, pauses, then runs to the end.
    tch::set_num_threads(1);
    let (paused_tx, paused) = mpsc::channel();
    let mut resume = Vec::new();
    let nodes: Vec<_> = (0..2)
        .map(|peer| {
            let (go_tx, go) = mpsc::channel::<()>();
            resume.push(go_tx);
            let (mut opts, paused_tx) = (
                node_options(&cfg, &url, peer, tmp.path()),
                paused_tx.clone(),
            );
            if peer == 0 {
                opts.metrics_listener = Some(node_metrics.try_clone().unwrap());
            }
            std::thread::spawn(move || {
                let mut node = spes_net::Node::connect(opts).unwrap();
                for _ in 0..2 {
                    for _ in 0..2 {
                        let upload = node.train_round().unwrap();
                        node.sync(&upload).unwrap();
                    }
                    paused_tx.send(()).unwrap();
                    go.recv().unwrap();
                }
                node.run().unwrap()
            })
        })
        .collect();
    let wait_paused = || {
        for _ in 0..2 {
            paused.recv_timeout(Duration::from_secs(120)).unwrap();
        }
    };
    let release = || resume.iter().for_each(|g| g.send(()).unwrap());

    // 1. Prometheus text, twice, with the round counter advancing between.
    wait_paused();
    view_until(web, "round 2", |v| v.run.round >= 2);
    let (code, first) = get(web, "/metrics");
    assert_eq!(code, 200);
    let first = parse_prometheus(&first);
    release();
    wait_paused();
    // Both nodes' reports of their newest step and sync, and the newest round scored. A
    // report reaches the server on the node's heartbeat, after the round closed.
    let view = view_until(web, "reports and scores of round 4", |v| {
        v.run.round >= 4
            && v.nodes.len() == 2
            && v.nodes.iter().all(|n| {
                n.report
                    .as_ref()
                    .is_some_and(|r| r.step >= 8 && r.sync.as_ref().is_some_and(|s| s.round >= 3))
            })
            && v.expert_load.as_ref().is_some_and(|l| l.round >= 4)
            && v.loss.len() >= 5
    });
    let (_, second) = get(web, "/metrics");
    let second = parse_prometheus(&second);
    assert!(
        second["spes_round"] > first["spes_round"],
        "the round advanced: {} then {}",
        first["spes_round"],
        second["spes_round"]
    );
    for p in 0..2 {
        let l = format!("{{peer=\"{p}\"}}");
        assert!(second[&format!("spes_node_uploads_total{l}")] >= 4.0);
        assert!(second[&format!("spes_node_step{l}")] >= 8.0);
        assert!(second.contains_key(&format!("spes_node_lease_age_seconds{l}")));
        assert!(second.contains_key(&format!("spes_node_idle_share{l}")));
    }
    assert!(second["spes_val_loss"].is_finite() && second["spes_members"] == 2.0);
    let (code, own) = get(node_web, "/metrics");
    assert_eq!(code, 200);
    let own = parse_prometheus(&own);
    assert!(
        own["spes_node_step{peer=\"0\"}"] >= 8.0,
        "node 0's own /metrics: {own:?}"
    );
    assert!(
        !own.contains_key("spes_round"),
        "a node serves only its own families"
    );

    // 2. The page in a real browser, with this run's values.
    let dom = chromium_dom(&format!("http://{web}/"), &tmp.path().join("chromium"));
    let attr = |name: &str| -> String {
        let at = dom
            .find(&format!("{name}=\""))
            .unwrap_or_else(|| panic!("no {name} in {dom}"));
        dom[at + name.len() + 2..]
            .split('"')
            .next()
            .unwrap()
            .to_owned()
    };
    assert!(
        attr("data-rendered").parse::<u64>().unwrap() >= 1,
        "the page rendered"
    );
    assert!(attr("data-round").parse::<u64>().unwrap() >= view.run.round);
    assert!(dom.contains("id=\"members\""));
    for p in 0..2 {
        assert!(
            dom.contains(&format!("data-peer=\"{p}\"")),
            "node {p} in the members table"
        );
    }
    let chart = &dom[dom.find("id=\"loss-chart\"").expect("the loss chart")..];
    assert!(chart.contains("<svg"), "the loss chart draws");
    // Each cell of the heatmap: its layer, expert and load, as this run's view has them.
    let heatmap = &dom[dom.find("id=\"heatmap\"").expect("the heatmap")..];
    let heatmap = &heatmap[..heatmap.find("</svg>").expect("the heatmap draws")];
    let cells: Vec<(usize, usize, f64)> = heatmap
        .split("<rect ")
        .skip(1)
        .filter(|r| r.split('>').next().unwrap().contains("class=\"cell\""))
        .map(|r| {
            let tag = r.split('>').next().unwrap();
            let get = |k: &str| {
                let at = tag
                    .find(&format!("{k}=\""))
                    .unwrap_or_else(|| panic!("{k} in {tag}"));
                tag[at + k.len() + 2..]
                    .split('"')
                    .next()
                    .unwrap()
                    .to_owned()
            };
            let bad = |_| panic!("a cell that is not layer, expert, load: {tag}");
            (
                get("data-layer").parse().unwrap_or_else(bad),
                get("data-expert").parse().unwrap_or_else(bad),
                get("data-load").parse().unwrap_or_else(|_| panic!("{tag}")),
            )
        })
        .collect();
    assert_eq!(
        cells.len(),
        cfg.model.n_layers * cfg.model.n_experts,
        "one cell per layer × expert"
    );
    let shown = dom[dom.find("data-round=\"").unwrap()..]
        .split('"')
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap();
    if shown == view.run.round {
        let load = &view.expert_load.as_ref().unwrap().load;
        for (l, e, v) in &cells {
            assert!(
                (load[*l][*e] - v).abs() < 1e-3,
                "cell {l},{e}: {v} against {}",
                load[*l][*e]
            );
        }
    }

    // 3. `spes status`'s call, with the viewer credential; which acts as no peer.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let viewer = spes_net::auth::viewer_credential(SECRET);
    let status = rt
        .block_on(spes_net::view::client::status(
            &url,
            Some(&viewer),
            None,
            false,
        ))
        .unwrap();
    assert_eq!(status.run.final_round, 10);
    assert_eq!(
        status.nodes.iter().map(|n| n.peer).collect::<Vec<_>>(),
        vec![0, 1]
    );
    let refused = rt.block_on(async {
        raw_client(&url, &viewer)
            .await
            .heartbeat(spes_net::proto::JoinRequest {
                peer: 0,
                session: 1,
                ..Default::default()
            })
            .await
            .unwrap_err()
    });
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    let wrong = rt.block_on(spes_net::view::client::status(
        &url,
        Some("spes-viewer-00"),
        None,
        false,
    ));
    assert!(wrong.is_err(), "a wrong credential reads nothing");

    release();
    for n in nodes {
        assert_eq!(n.join().unwrap().steps, 20);
    }
    server.finish();

    // 4. TensorBoard's own reader finds every role's curves.
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out = {}
for role in sys.argv[2:]:
    ea = EventAccumulator(f"{sys.argv[1]}/{role}")
    ea.Reload()
    out[role] = {t: [e.step for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
print(json.dumps(out))
"#;
    let o = Command::new(python())
        .args([
            "-c",
            script,
            tb.to_str().unwrap(),
            "server",
            "node-0",
            "node-1",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let curves: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for node in ["node-0", "node-1"] {
        let steps = curves[node]["train/loss"].as_array().unwrap();
        assert_eq!(
            steps.len(),
            20,
            "{node}: a loss point per logged step: {curves}"
        );
        assert_eq!(curves[node]["sync/idle_s"].as_array().unwrap().len(), 10);
    }
    let val = curves["server"]["val/loss"].as_array().unwrap();
    assert_eq!(
        val.len(),
        11,
        "round 0 and each of the 10 rounds scored: {curves}"
    );
}

/// The listener as it runs off loopback: HTTPS with the server's certificate, and the viewer
/// credential on every data route (the rules themselves are unit-tested in `http.rs`).
#[test]
fn the_listener_serves_https_and_asks_for_the_viewer_credential() {
    use rustls::pki_types::{CertificateDer, ServerName};
    use spes_net::view::http::{serve, Endpoints};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (pem, key) = (
        cert.cert.pem().into_bytes(),
        cert.signing_key.serialize_pem().into_bytes(),
    );
    let viewer = spes_net::auth::viewer_credential(SECRET);
    let opts = HttpOptions {
        tls: Some((pem, key)),
        token: Some(viewer.clone()),
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let endpoints = Endpoints {
        metrics: Box::new(|| "spes_round 3\n".to_owned()),
        run_json: Some(Box::new(|| "{\"run\":{}}".to_owned())),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(serve(listener, opts, endpoints, async {
        let _ = stopped.await;
    }));
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(cert.cert.der().to_vec()))
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let get = |path: &str, token: Option<String>| {
        let path = path.to_owned();
        let connector = connector.clone();
        rt.block_on(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from("localhost").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
            let req = format!(
                "GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n"
            );
            tls.write_all(req.as_bytes()).await.unwrap();
            let mut text = String::new();
            let _ = tls.read_to_string(&mut text).await;
            text
        })
    };
    let status = |reply: &str| reply.split(' ').nth(1).unwrap().to_owned();
    assert_eq!(status(&get("/metrics", None)), "401");
    assert_eq!(
        status(&get("/metrics", Some("spes-viewer-00".into()))),
        "401"
    );
    let ok = get("/metrics", Some(viewer.clone()));
    assert!(status(&ok) == "200" && ok.contains("spes_round 3"), "{ok}");
    assert_eq!(status(&get("/api/run", None)), "401");
    // Without the credential the page comes empty; with `?token=` it holds the view.
    let empty = get("/", None);
    assert!(status(&empty) == "200" && !empty.contains("{\"run\":{}}"));
    let with_token = get(&format!("/?token={viewer}"), None);
    assert!(
        with_token.contains("{\"run\":{}}"),
        "the page with the view inside"
    );
    let _ = stop.send(());
    rt.block_on(server).unwrap().unwrap();
}
