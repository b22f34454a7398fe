//! Hostile input against a real server on 127.0.0.1: every input is refused, and nothing of it
//! reaches the model. Prints a table (run with --nocapture to see it).

mod common;

use common::*;
use spes_net::proto::{chunk::Part, Chunk, JoinRequest};
use spes_net::server::Limits;
use spes_net::{payload, Node, NodeOptions};
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::Code;

/// Resident and peak resident memory of this process, in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// What the server holds on disk: nothing received or accepted, still at round 0.
fn untouched(out: &Path) -> bool {
    let empty = |d: &str| std::fs::read_dir(out.join(d)).unwrap().next().is_none();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("server.json")).unwrap()).unwrap();
    empty("incoming") && empty("pending") && state["rounds"].as_array().unwrap().len() == 1
}

/// A header, then `n` small data chunks made on demand, then (if `hang`) silence.
fn stream_of(
    header: spes_net::proto::PayloadHeader,
    n: usize,
    hang: bool,
) -> impl tokio_stream::Stream<Item = Chunk> + Send + 'static {
    use tokio_stream::StreamExt;
    let head = tokio_stream::once(Chunk {
        part: Some(Part::Header(header)),
    });
    let data = tokio_stream::iter(0..n).map(|_| Chunk {
        part: Some(Part::Data(vec![7u8; 16 * 1024])),
    });
    let tail: std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Chunk> + Send>> = if hang {
        Box::pin(tokio_stream::pending())
    } else {
        Box::pin(tokio_stream::empty())
    };
    head.chain(data).chain(tail)
}

#[test]
fn hostile_inputs_are_refused_and_leave_the_model_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    // ~7 M parameters (28 MB in fp32), so memory growth from buffered uploads would show.
    let cfg = config(
        &data,
        "spes",
        2,
        &[
            "model.d_model=256",
            "model.n_heads=4",
            "model.n_kv_heads=4",
            "model.head_dim=64",
            "model.expert_hidden=512",
            "train.max_steps=2",
        ],
    );
    let out = tmp.path().join("server");
    let limits = Limits {
        idle_timeout: Duration::from_secs(1),
        ..Limits::default()
    };
    let server = Server::start_with("127.0.0.1:0", cfg.clone(), &out, None, limits);
    let url = server.url();
    let good = upload_of(&cfg, 0, |t| t.copy());
    let model_bytes: u64 = good.iter().map(|(_, t)| t.numel() as u64 * 4).sum::<u64>()
        + upload_of(&cfg, 1, |t| t.copy())
            .iter()
            .filter(|(n, _)| n.contains(".experts."))
            .map(|(_, t)| t.numel() as u64 * 4)
            .sum::<u64>();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut table: Vec<(String, usize, usize)> = Vec::new();
    let dir = tmp.path();
    rt.block_on(async {
        // A wrong credential, and a valid one used for another peer id.
        let mut wrong = raw_client(&url, &spes_net::auth::credential("another run", 0)).await;
        let e = wrong
            .join(JoinRequest { peer: 0, session: 1, join: false, ..Default::default() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated);
        let mut c1 = raw_client(&url, &cred(1)).await;
        let e = c1
            .join(JoinRequest { peer: 0, session: 1, join: false, ..Default::default() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        let e = upload_raw(&mut c1, dir, 0, 1, &good).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
        table.push(("wrong credential; credential of another peer (join, upload)".into(), 3, 3));

        // 3e38 in every value: finite, but far beyond any honest update.
        let mut c0 = raw_client(&url, &cred(0)).await;
        let huge = upload_of(&cfg, 0, |t| t.full_like(3e38));
        let e = upload_raw(&mut c0, dir, 0, 1, &huge).await.unwrap_err();
        assert!(e.message().contains("max_update_factor"), "{}", e.message());
        table.push(("3e38-valued upload".into(), 1, 1));

        // Headers that lie about the size: refused before any data is read.
        let path = dir.join("good.safetensors");
        let (size, xxh3) = payload::write(&path, &good, tch::Kind::Float).unwrap();
        let t0 = Instant::now();
        let lie = header_for(0, 1, 10 << 30, xxh3);
        let e = c0.upload(stream_of(lie, 64, false)).await.unwrap_err();
        assert!(e.message().contains("take exactly"), "{}", e.message());
        let short = header_for(0, 1, size, xxh3);
        let e = c0.upload(stream_of(short, 2, false)).await.unwrap_err();
        assert!(e.message().contains("truncated"), "{}", e.message());
        assert!(t0.elapsed() < Duration::from_secs(5));
        table.push(("header lies about the size (10 GiB; truncated body)".into(), 2, 2));

        // 32 concurrent uploads of a full-size payload for a closed round (round 0).
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let (before, _) = rss();
        let t0 = Instant::now();
        let uploads: Vec<_> = (0..32)
            .map(|_| {
                let mut c = c0.clone();
                let h = header_for(0, 0, size, xxh3);
                tokio::spawn(async move { c.upload(stream_of(h, 2000, false)).await })
            })
            .collect();
        let mut refused = 0;
        for u in uploads {
            let e = u.await.unwrap().unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
            assert!(e.message().contains("closed"), "{}", e.message());
            refused += 1;
        }
        let took = t0.elapsed();
        let (_, peak) = rss();
        let growth = peak.saturating_sub(before);
        println!(
            "32 uploads for a closed round: refused in {:.2} s; peak RSS grew {:.1} MB (model {:.1} MB)",
            took.as_secs_f64(),
            growth as f64 / 1e6,
            model_bytes as f64 / 1e6
        );
        assert!(took < Duration::from_secs(10), "{took:?}");
        assert!(
            (growth as f64) < 1.2 * model_bytes as f64,
            "peak RSS grew {growth} bytes; the model is {model_bytes}"
        );
        table.push(("32 concurrent uploads for a closed round".into(), 32, refused));

        // A stream that sends its header and then nothing is cut after the idle timeout.
        let t0 = Instant::now();
        let idle = header_for(0, 1, size, xxh3);
        let e = c0.upload(stream_of(idle, 0, true)).await.unwrap_err();
        let waited = t0.elapsed();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{}", e.message());
        assert!(waited >= Duration::from_millis(900) && waited < Duration::from_secs(10), "{waited:?}");
        table.push(("idle stream (cut after 1 s)".into(), 1, 1));
    });

    // A second process claiming a peer id that a live node holds is refused at join.
    let first = Node::connect(node_options(&cfg, &url, 0, dir)).unwrap();
    let err = Node::connect(NodeOptions {
        out: dir.join("impostor"),
        ..node_options(&cfg, &url, 0, dir)
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("peer 0 is held by a live node"), "{err}");
    drop(first);
    table.push(("second process with a live node's peer id".into(), 1, 1));
    assert!(untouched(&out), "no hostile input reached the model");
    server.stop();

    // Plaintext to a TLS server.
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let tls = Server::start(
        cfg.clone(),
        &tmp.path().join("tls-server"),
        Some((
            cert.cert.pem().into(),
            cert.signing_key.serialize_pem().into(),
        )),
    );
    let refused = rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(tls.url())
            .unwrap()
            .connect()
            .await;
        match channel {
            Err(_) => true,
            Ok(ch) => {
                let mut c = spes_net::proto::spes_client::SpesClient::new(ch);
                c.join(JoinRequest {
                    peer: 0,
                    session: 1,
                    join: false,
                    ..Default::default()
                })
                .await
                .is_err()
            }
        }
    });
    assert!(refused, "a plaintext request to a TLS server fails");
    table.push(("plaintext request to a TLS server".into(), 1, 1));
    assert!(untouched(&tmp.path().join("tls-server")));

    println!("| hostile input | tried | rejected | model unchanged |");
    println!("|---|---|---|---|");
    for (what, tried, rejected) in &table {
        assert_eq!(tried, rejected, "{what}");
        println!("| {what} | {tried} | {rejected} | yes |");
    }
}

/// A bounded property test of the payload decoder and the validator: random bytes and random
/// corruptions of a valid payload never panic.
#[test]
fn the_payload_decoder_and_validator_never_panic() {
    use proptest::prelude::*;
    let tmp = tempfile::tempdir().unwrap();
    let data = data(tmp.path());
    let cfg = config(&data, "spes", 2, &[]);
    let good = upload_of(&cfg, 0, |t| t.copy());
    let path = tmp.path().join("good.safetensors");
    payload::write(&path, &good, tch::Kind::BFloat16).unwrap();
    let valid = std::fs::read(&path).unwrap();
    let model = spes_model::MoeModel::new(&cfg.model, tch::Device::Cpu).unwrap();
    let layout = spes_sync::Layout::of(&model);
    let global: spes_sync::Named = model
        .params()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach()))
        .collect();
    let scope = spes_sync::Scope::of(&cfg.sync, cfg.model.n_experts).unwrap();
    // What the coordinator does with an upload's payload: decode the wire tensors, validate.
    let check = |bytes: &[u8]| {
        if let Ok(named) = payload::decode(bytes) {
            if let Ok(d) = spes_sync::delta::decode(named, &cfg.sync, 1, |n| layout.shape_of(n)) {
                let _ = spes_sync::validate(&layout, &scope, 0, &d, &global, Some(0.1));
            }
        }
    };
    assert!(payload::decode(&valid).is_ok());
    let config = ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(
        random in proptest::collection::vec(any::<u8>(), 0..512),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    )| {
        check(&random);
        let mut mutated = valid.clone();
        for (at, byte) in &flips {
            // Mostly in the JSON header, where the structure lives.
            let i = if at % 4 == 0 { at % mutated.len() } else { at % 600.min(mutated.len()) };
            mutated[i] = *byte;
        }
        check(&mutated);
        check(&valid[..cut % valid.len()]);
    });
}
