//! A run whose state lives in a real S3-compatible store (SeaweedFS on loopback,
//! `common::S3Server`): the server is killed 50 ms after it acknowledged an upload of round 5,
//! its whole `--out` is taken away (a lost machine), and a new server started on an empty
//! folder with the same store resumes the run: it re-applies that acknowledged upload, serves
//! every round from the newest the lost one published, and every node ends bit-identical to
//! the final published model; every node read every round from the store through presigned
//! URLs. No log line, `spes status`, live-page data or `/metrics` shows the store's secret key
//! or a URL's signature. Bounded: 180 s. Then the store's faults: stopped for 30 s mid-run
//! (the run waits and completes, every round published once, the retries logged; a node whose
//! download it broke takes the round from the server, counted); a URL that expired before
//! its node read it is renewed; a corrupt object is refused by its checksum, asked for again,
//! then read from the server; wrong keys and a clock 20 minutes off (libfaketime) each one
//! clear error at start; the server's own create-only writes and multipart uploads as spes
//! uses them.

mod common;

use common::{rounds_logged, tensors, Loopback, Proc, S3Server};
use std::time::{Duration, Instant};

const NODES: usize = 3;
const MAX_STEPS: u64 = 16;
const SYNC_STEPS: u64 = 2;
const SECRET: &str = "store-test-secret";

#[test]
fn a_lost_server_machine_loses_nothing_when_the_run_is_in_a_store() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Whole models every 3 rounds: the new server rebuilds the newest round from one and the
    // deltas after it, all read from the store.
    let (s3, run, config_args, mut server_args) = store_run(
        dir,
        "runs/lost-server",
        "checkpoint_every_rounds = 3\nround_timeout_s = 60\n",
    );
    let http = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    server_args.extend(["--linger-s".into(), "20".into()]);
    server_args.extend(["--http".into(), http.to_string()]);
    let mut server = run.server(&server_args);
    (server.fault, server.restart) = (Some("acked@5"), true);
    server.wipe = Some(run.server_out());
    let mut procs = vec![server];
    for peer in 0..NODES {
        let mut args = config_args.to_vec();
        // Node 2 uploads well after the others: round 5 is still open when the server dies.
        if peer == 2 {
            args.extend(["--set".into(), "train.slowdown=20".into()]);
        }
        procs.push(run.node(peer, &args));
    }
    for p in &mut procs {
        p.spawn();
    }
    // The live page's data and `spes status`, while the run runs.
    let mut answers = String::new();
    let started = Instant::now();
    while procs.iter().any(Proc::running) || procs.iter().any(|p| p.exit.is_none()) {
        for p in &mut procs {
            p.poll();
        }
        if answers.is_empty() && procs[0].kills == 1 && rounds_logged(&run.server_out()).len() > 1 {
            let cred = dir.join("node-0.credential");
            let cred = cred.to_str().unwrap();
            answers = common::text(&common::spes(&[
                "status",
                "--server",
                &run.url,
                "--credential-file",
                cred,
            ]));
            for path in ["/api/run", "/metrics"] {
                if let Ok(reply) = spes_net::view::browser::get(http, path) {
                    answers.push_str(&reply.text());
                }
            }
        }
        give_up_after_180_s(&procs, started);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_all_succeeded(&procs);
    assert_eq!(
        procs[0].kills,
        1,
        "the server was not killed:\n{}",
        procs[0].output()
    );

    // The new server restored the lost one's newest round from the store and re-applied the
    // upload it had acknowledged.
    let log = procs[0].output();
    let lost = rounds_logged(&dir.join("server-lost"));
    let lost_newest = lost.last().map_or(0, |l| l["round"].as_u64().unwrap());
    assert!(
        lost_newest >= 2,
        "the lost server published round {lost_newest}"
    );
    let resumed: u64 = log
        .lines()
        .find_map(|l| l.split("resuming after round ").nth(1))
        .and_then(|r| r.split(':').next())
        .unwrap_or_else(|| panic!("the new server did not resume:\n{log}"))
        .parse()
        .unwrap();
    assert!(
        resumed >= lost_newest,
        "resumed after {resumed}, the lost server logged {lost_newest}"
    );
    // Round 5 was open, so round 4 the newest published: the whole model of round 3 and the
    // delta of round 4, both read from the store.
    assert!(
        log.contains("resuming after round 4: whole model of round 3 plus 1 replayed deltas"),
        "{log}"
    );
    assert!(log.contains("from the store"), "{log}");
    assert!(
        log.contains("re-applied the acknowledged upload"),
        "the acknowledged upload of round 5 was not re-applied:\n{log}"
    );
    // Every round after it was published once, to the last.
    let final_round = MAX_STEPS / SYNC_STEPS;
    let rounds: Vec<u64> = rounds_logged(&run.server_out())
        .iter()
        .map(|l| l["round"].as_u64().unwrap())
        .collect();
    assert_eq!(rounds, (resumed..=final_round).collect::<Vec<_>>(), "{log}");

    assert_every_node_holds_the_final_model(&run);

    // Every node put its uploads in the store and read every round from it, none from the
    // server, through URLs no log
    // line, status or live-page answer shows in full; nor the store's secret key.
    for peer in 0..NODES {
        let (store, server) = downloads(&run, peer);
        assert!(
            store > 0 && server == 0,
            "node {peer}: {store} bytes from the store, {server} from the server"
        );
    }
    // (The new server's first round also holds the uploads it re-applied.)
    let reapplied = log.matches("re-applied the acknowledged upload").count() as u64;
    for line in rounds_logged(&run.server_out()).iter().skip(1) {
        let mut uploads = line["peers"].as_array().map_or(0, |p| p.len() as u64);
        if line["round"] == resumed + 1 {
            uploads -= reapplied;
        }
        assert!(
            line["store_staged"] == uploads && line["store_fallbacks"] == 0,
            "round {}: not every upload came through the store: {line}",
            line["round"]
        );
    }
    let mut seen = answers.clone();
    for p in &procs {
        seen.push_str(&p.output());
    }
    assert!(
        !answers.is_empty(),
        "no status or live-page answer was read"
    );
    assert!(
        answers.contains("spes_store_links_total"),
        "/metrics counts no links:\n{answers}"
    );
    assert!(
        !seen.contains(&s3.secret_key),
        "the store's secret key was shown"
    );
    assert!(
        !seen.contains("X-Amz-Signature"),
        "a presigned URL was shown in full"
    );
}

#[test]
fn an_expired_url_is_renewed_a_lost_staged_upload_sent_again_and_a_corrupt_object_read_from_the_server(
) {
    let tmp = tempfile::tempdir().unwrap();
    let (_s3, run, config_args, mut server_args) = store_run(tmp.path(), "runs/links", "");
    // URLs live 2 s; node 1 waits 3 s before reading round 2's. The uploads of round 3 are
    // gone from the store when the server reads them. Round 5 is put in the store with a byte
    // changed.
    server_args.extend(["--store-url-lifetime-s".into(), "2".into()]);
    let mut server = run.server(&server_args);
    server.fault = Some("drop-staged@3,corrupt-store@5");
    let mut procs = vec![server];
    for peer in 0..NODES {
        procs.push(run.node(peer, &config_args));
    }
    procs[2].fault = Some("store-wait@2");
    for p in &mut procs {
        p.spawn();
    }
    let started = Instant::now();
    while procs.iter().any(|p| p.exit.is_none()) {
        for p in &mut procs {
            p.poll();
        }
        give_up_after_180_s(&procs, started);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_all_succeeded(&procs);
    let waited = procs[2].output();
    assert!(
        waited.contains("round 2 from the store")
            && waited.contains("expired or no longer valid; asking the server for a new URL"),
        "node 1's URL did not expire:\n{waited}"
    );
    for (peer, p) in procs[1..].iter().enumerate() {
        let log = p.output();
        assert!(
            log.contains("cannot use round 3's upload staged at")
                && log.contains("sending it to the server instead"),
            "node {peer} did not send its round-3 upload again:\n{log}"
        );
        assert!(
            log.contains("round 5 from the store")
                && log.contains("part 0 fails its checksum; taking it from the server instead"),
            "node {peer} took the corrupt round:\n{log}"
        );
        let (store, server) = downloads(&run, peer);
        assert!(
            store > 0 && server > 0,
            "node {peer}: {store} bytes from the store, {server} from the server"
        );
    }
    let fallbacks: u64 = rounds_logged(&run.server_out())
        .iter()
        .map(|l| l["store_fallbacks"].as_u64().unwrap_or(0))
        .sum();
    assert!(fallbacks >= NODES as u64, "{fallbacks} fallbacks counted");
    let staged = |round: u64| {
        rounds_logged(&run.server_out())
            .iter()
            .find(|l| l["round"] == round)
            .map(|l| l["store_staged"].as_u64().unwrap())
    };
    // Round 3's uploads came in the stream; round 4's were staged again.
    assert_eq!(
        (staged(3), staged(4)),
        (Some(0), Some(NODES as u64)),
        "{}",
        procs[0].output()
    );
    assert_every_node_holds_the_final_model(&run);
}

#[test]
fn the_store_stopped_for_30_s_mid_run_loses_no_round() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut s3, run, config_args, mut server_args) = store_run(tmp.path(), "runs/outage", "");
    server_args.extend(["--linger-s".into(), "20".into()]);
    let mut procs = vec![run.server(&server_args)];
    for peer in 0..NODES {
        procs.push(run.node(peer, &config_args));
    }
    // Node 0 waits 3 s between round 2's URL and reading it: the store stops meanwhile.
    procs[1].fault = Some("store-wait@2");
    for p in &mut procs {
        p.spawn();
    }
    let (started, mut stopped) = (Instant::now(), None);
    let mut restarted = false;
    while procs.iter().any(|p| p.exit.is_none()) {
        for p in &mut procs {
            p.poll();
        }
        if stopped.is_none() && rounds_logged(&run.server_out()).len() >= 3 {
            s3.stop();
            stopped = Some(Instant::now());
        }
        if !restarted && stopped.is_some_and(|s| s.elapsed() >= Duration::from_secs(30)) {
            s3.resume();
            restarted = true;
        }
        give_up_after_180_s(&procs, started);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_all_succeeded(&procs);
    assert!(restarted, "the run ended before the store came back");
    let log = procs[0].output();
    let rounds: Vec<u64> = rounds_logged(&run.server_out())
        .iter()
        .map(|l| l["round"].as_u64().unwrap())
        .collect();
    assert_eq!(
        rounds,
        (0..=MAX_STEPS / SYNC_STEPS).collect::<Vec<_>>(),
        "{log}"
    );
    assert!(
        log.contains("failed, retrying in"),
        "no retry was logged:\n{log}"
    );
    // The node the store failed took round 2 from the server, counted there.
    let node = procs[1].output();
    assert!(
        node.contains("round 2 from the store")
            && node.contains("taking it from the server instead"),
        "node 0 did not fall back to the server:\n{node}"
    );
    let fallbacks: u64 = rounds_logged(&run.server_out())
        .iter()
        .map(|l| l["store_fallbacks"].as_u64().unwrap_or(0))
        .sum();
    assert!(fallbacks >= 1, "no fallback counted:\n{log}");
    assert_every_node_holds_the_final_model(&run);
}

#[test]
fn wrong_store_keys_and_a_skewed_clock_are_each_one_clear_error_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let s3 = S3Server::start(dir);
    let config = dir.join("store.toml");
    let data = spes_data::testing::small_corpus(dir, 20000);
    std::fs::write(
        &config,
        common::micro_config(&data, 4, 4, "mode = \"spes\"\nnodes = 2\nsync_steps = 2\n"),
    )
    .unwrap();
    let server = |flags: Vec<String>, faketime: Option<&str>| {
        let mut cmd = match faketime {
            Some(offset) => {
                let mut c = std::process::Command::new("faketime");
                c.args(["-f", offset, env!("CARGO_BIN_EXE_spes")]);
                c
            }
            None => std::process::Command::new(env!("CARGO_BIN_EXE_spes")),
        };
        cmd.args([
            "server",
            "--no-auth",
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cpu",
        ])
        .arg("--config")
        .arg(&config)
        .arg("--out")
        .arg(dir.join("server"))
        .args(flags)
        .env("DONT_FAKE_MONOTONIC", "1");
        let o = cmd
            .output()
            .expect("spes (and faketime: scripts/setup.sh --tests)");
        assert!(!o.status.success());
        common::text(&o)
    };
    let wrong = dir.join("wrong.toml");
    let keys = std::fs::read_to_string(&s3.credentials).unwrap();
    std::fs::write(&wrong, keys.replace(&s3.secret_key, "not-the-secret")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut flags = s3.flags("runs/keys");
    flags[3] = wrong.display().to_string();
    let text = server(flags, None);
    assert!(text.contains("refused the keys"), "{text}");
    assert_eq!(text.matches("refused the keys").count(), 1, "{text}");
    assert!(!text.contains("not-the-secret"), "{text}");
    // What spes relies on, on the real server: a second create of a name is refused (412),
    // and a file above one part goes up in parts and comes back whole.
    let opts = spes_store::StoreOptions {
        allow_http: true,
        credentials: Some(s3.credentials.clone()),
    };
    let store = spes_store::RunStore::open("s3://spes/runs/rules", &opts).unwrap();
    let first = spes_store::Bytes::from_static(b"first");
    assert_eq!(
        store.create("state/0.json", first.clone()).unwrap(),
        spes_store::Created::Written
    );
    assert_eq!(
        store
            .create("state/0.json", spes_store::Bytes::from_static(b"second"))
            .unwrap(),
        spes_store::Created::Exists(first)
    );
    let big = dir.join("big.bin");
    let content: Vec<u8> = (0..spes_store::PART + 1000)
        .map(|i| (i % 253) as u8)
        .collect();
    std::fs::write(&big, &content).unwrap();
    store.put_file("checkpoints/big.bin", &big).unwrap();
    let back = dir.join("back.bin");
    assert!(store.get_file("checkpoints/big.bin", &back).unwrap());
    assert!(
        std::fs::read(&back).unwrap() == content,
        "the multipart file came back changed"
    );

    let text = server(s3.flags("runs/clock"), Some("-20m"));
    assert!(
        text.contains("clock is") && text.contains("set the clock"),
        "{text}"
    );
    assert!(
        !dir.join("server").join("server.json").exists(),
        "nothing is written"
    );
}

/// A SeaweedFS store in `dir`, a 3-node micro SPES run's loopback (`sync`: more `[sync]`
/// keys), the processes' `--config` flags, and the server's flags with the store under
/// `prefix`.
fn store_run(
    dir: &std::path::Path,
    prefix: &str,
    sync: &str,
) -> (S3Server, Loopback, Vec<String>, Vec<String>) {
    let s3 = S3Server::start(dir);
    let data = spes_data::testing::small_corpus(dir, 60000);
    let config = dir.join("store.toml");
    let sync = format!("mode = \"spes\"\nnodes = {NODES}\nsync_steps = {SYNC_STEPS}\n{sync}");
    std::fs::write(&config, common::micro_config(&data, 6, MAX_STEPS, &sync)).unwrap();
    let run = Loopback::new(dir, Some(SECRET));
    let config_args = vec!["--config".to_string(), config.display().to_string()];
    let mut server_args = config_args.clone();
    server_args.extend(s3.flags(prefix));
    (s3, run, config_args, server_args)
}

/// Fails the test with every process's log once the run has taken 180 s.
fn give_up_after_180_s(procs: &[Proc], started: Instant) {
    if started.elapsed() > Duration::from_secs(180) {
        for p in procs {
            eprintln!("--- {} ---\n{}", p.name, p.output());
        }
        panic!("the run did not finish within 180 s");
    }
}

/// Every node ends bit-identical to the final published model.
fn assert_every_node_holds_the_final_model(run: &Loopback) {
    let final_round = MAX_STEPS / SYNC_STEPS;
    let global = tensors(
        &run.server_out()
            .join(format!("checkpoints/round-{final_round:06}.safetensors")),
    );
    for peer in 0..NODES {
        let ck = run
            .node_out(peer)
            .join(format!("checkpoints/step-{MAX_STEPS}/model.safetensors"));
        let local = tensors(&ck);
        assert_eq!(local.len(), global.len());
        for (name, g) in &global {
            assert!(local[name].equal(g), "node {peer}: `{name}` differs");
        }
    }
}

/// The payload bytes node `peer` read from the store and from the server (its sync lines).
fn downloads(run: &Loopback, peer: usize) -> (u64, u64) {
    let text = std::fs::read_to_string(run.node_out(peer).join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "sync")
        .fold((0, 0), |(a, b), v| {
            (
                a + v["bytes_down_store"].as_u64().unwrap_or(0),
                b + v["bytes_down_server"].as_u64().unwrap_or(0),
            )
        })
}

fn assert_all_succeeded(procs: &[Proc]) {
    for p in procs {
        let exit = p.exit.unwrap();
        assert!(exit.success(), "{} failed:\n{}", p.name, p.output());
    }
}
