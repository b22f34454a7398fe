//! Silent faults: a host that stays alive while nothing it sends arrives and its connections
//! neither close nor move, as a paused VM, a sleeping laptop or a network partition do. A real
//! server and 4 real nodes (processes of the `spes` binary, over TLS with credentials, the nodes
//! started with no config: the run's settings come from the server) train 16
//! rounds; node 1 goes silent after round 2 until the server has evicted it, and the server goes
//! silent once node 1 is back, for longer than every lease but shorter than eviction. Once by
//! pausing the processes (SIGSTOP, then SIGCONT), once by cutting each host's link where every
//! host has a network namespace of its own (its bridge port down, then up). Each run must
//! finish with every round published once, no round held for its timeout, node 1 uploading
//! again within 4 rounds of its return, the round open during the server's silence keeping
//! every upload, its silence costing no membership, and every node bit-identical to the final
//! model. Bounded: each run ends within 300 s (it takes 25–90 s here).

mod common;

use common::{rounds_logged, tensors, Loopback, Proc};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const NODES: usize = 4;
const SECRET: &str = "silent-test-secret";
const MICRO_SYNC_STEPS: u64 = 4;
const MICRO_ROUNDS: u64 = 16;

/// A run and its faults. CI runs the micro one; `SPES_SILENT_SCENARIO=issue` runs the one
/// issue 43 measured (configs/spes-tiny.toml with bf16 deltas, 20 steps a round, 14 rounds,
/// 5 s leases, eviction 12 s after; node 1 silent for 30 s, the server for 15 s; vocabulary
/// 512 on the tests' corpus) and `issue-undisturbed` the same without faults, for the
/// wall-time ratio.
struct Scenario {
    /// The server's config; nodes take the run's settings from the server.
    config: PathBuf,
    /// The nodes' data.
    data: PathBuf,
    /// The nodes' own `--set` (node-local keys).
    node_sets: Vec<String>,
    /// `--set` overrides for every role.
    sets: Vec<String>,
    rounds: u64,
    sync_steps: u64,
    round_timeout_s: f64,
    /// How long node 1 is silent; `None`: until the server evicted it.
    node_silent: Option<Duration>,
    /// How long the server is silent: longer than every lease, shorter than eviction.
    server_silent: Duration,
    disturbed: bool,
    /// The whole run's bound.
    limit: Duration,
}

impl Scenario {
    fn of_env(dir: &Path) -> Scenario {
        let which = std::env::var("SPES_SILENT_SCENARIO").unwrap_or_default();
        let data = spes_data::testing::small_corpus(dir, 120000);
        if which.is_empty() {
            return Scenario {
                config: micro_config(dir, &data),
                data,
                // Rounds of about a second (steps of ~7 ms made ~40 times as long, the CPU
                // left free), so the faults fall mid-run.
                node_sets: vec!["train.slowdown=40".into()],
                sets: Vec::new(),
                rounds: MICRO_ROUNDS,
                sync_steps: MICRO_SYNC_STEPS,
                round_timeout_s: 60.0,
                node_silent: None,
                server_silent: Duration::from_secs(3),
                disturbed: true,
                limit: Duration::from_secs(300),
            };
        }
        assert!(
            ["issue", "issue-undisturbed"].contains(&which.as_str()),
            "SPES_SILENT_SCENARIO is `issue` or `issue-undisturbed`, not `{which}`"
        );
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let sets = [
            format!("data.path={}", data.display()),
            "model.vocab_size=512".into(),
            "sync.wire=bf16_delta".into(),
            "sync.sync_steps=20".into(),
            "train.max_steps=280".into(),
            "sync.lease_s=5".into(),
            "sync.evict_after_s=12".into(),
            "train.log_every=20".into(),
        ];
        Scenario {
            config: root.join("configs/spes-tiny.toml"),
            data,
            node_sets: Vec::new(),
            sets: sets.into(),
            rounds: 14,
            sync_steps: 20,
            round_timeout_s: 300.0,
            node_silent: Some(Duration::from_secs(30)),
            server_silent: Duration::from_secs(15),
            disturbed: which == "issue",
            limit: Duration::from_secs(3600),
        }
    }
}

/// How a host is silenced.
enum Fault {
    /// SIGSTOP, then SIGCONT, on loopback.
    Pause,
    /// Each host in its own network namespace; its link to the others goes down, then up.
    Cut(Netns),
}

impl Fault {
    /// Silences (`true`) or restores host `i` (0: the server, 1..: node `i - 1`).
    fn silence(&self, procs: &[Proc], i: usize, silent: bool) {
        match self {
            Fault::Pause => procs[i].signal(if silent { "STOP" } else { "CONT" }),
            Fault::Cut(net) => net.link(i, !silent),
        }
    }

    /// The address host `i` listens on.
    fn host(&self, i: usize) -> String {
        match self {
            Fault::Pause => "127.0.0.1".into(),
            Fault::Cut(net) => net.addr(i),
        }
    }
}

/// Runs `ip` with `args`; a failure fails the test, naming the command.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip` (iproute2 is needed for this test): {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed (this test needs root and iproute2): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A bridge in a namespace of its own (the "switch") and one namespace per host, each with a
/// veth to the bridge and an address on 10.231.0.0/24; removed on drop.
struct Netns {
    prefix: String,
    hosts: usize,
}

impl Netns {
    fn new(hosts: usize) -> Netns {
        let net = Netns {
            prefix: format!("spes-silent-{}-", std::process::id()),
            hosts,
        };
        let hub = net.hub();
        ip(&["netns", "add", &hub]);
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &hub, "link", "set", "br0", "up"]);
        for i in 0..hosts {
            let (ns, port) = (net.ns(i), format!("v{i}"));
            ip(&["netns", "add", &ns]);
            let peer = ["peer", "name", "eth0", "netns", &ns];
            ip(&[
                &["-n", &hub, "link", "add", &port, "type", "veth"][..],
                &peer,
            ]
            .concat());
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"]);
            let addr = format!("{}/24", net.addr(i));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    fn hub(&self) -> String {
        format!("{}hub", self.prefix)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    fn addr(&self, i: usize) -> String {
        format!("10.231.0.{}", i + 1)
    }

    /// Host `i`'s bridge port up or down: while down, what it sends is lost without a word.
    fn link(&self, i: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.hub(), "link", "set", &format!("v{i}"), state]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in (0..self.hosts).map(|i| self.ns(i)).chain([self.hub()]) {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

fn micro_config(dir: &Path, data: &Path) -> PathBuf {
    let path = dir.join("silent.toml");
    let sync = format!(
        r#"mode = "spes"
nodes = {NODES}
sync_steps = {MICRO_SYNC_STEPS}
wire = "bf16_delta"
overlap = true
overlap_steps = 1
merge_every = 0
round_timeout_s = 60
lease_s = 2
evict_after_s = 3
"#
    );
    let steps = MICRO_ROUNDS * MICRO_SYNC_STEPS;
    std::fs::write(&path, common::micro_config(data, 8, steps, &sync)).unwrap();
    path
}

/// Waits until `done` holds of the server's round records, failing after `limit` or once the
/// server has exited.
fn wait_for(
    server: &Path,
    procs: &mut [Proc],
    limit: Duration,
    what: &str,
    done: impl Fn(&[serde_json::Value]) -> bool,
) {
    let start = Instant::now();
    while !done(&rounds_logged(server)) {
        for p in procs.iter_mut() {
            p.poll();
        }
        if start.elapsed() > limit || !procs[0].running() {
            let logs: Vec<String> = procs
                .iter()
                .map(|p| format!("--- {} ---\n{}", p.name, p.output()))
                .collect();
            panic!(
                "{what} did not happen within {limit:?}:\n{}",
                logs.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn newest(rounds: &[serde_json::Value]) -> u64 {
    rounds.last().and_then(|r| r["round"].as_u64()).unwrap_or(0)
}

fn has(list: &serde_json::Value, peer: u64) -> bool {
    list.as_array()
        .is_some_and(|a| a.contains(&serde_json::json!(peer)))
}

fn run_through_silent_faults(fault: Fault) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sc = Scenario::of_env(dir);
    let config = &sc.config;
    let run = Loopback::new(dir, Some(SECRET));
    let port = match fault {
        Fault::Pause => run.port(),
        Fault::Cut(_) => 50051,
    };
    let run = run.tls(&fault.host(0), port);
    let server_out = run.server_out();
    // The server reads the run's config; a node only names its data and the server.
    let sets = |role: &str, mut a: Vec<String>| -> Vec<String> {
        if role == "node" {
            a.extend([
                "--set".to_string(),
                format!("data.path={}", sc.data.display()),
            ]);
            for set in &sc.node_sets {
                a.extend(["--set".to_string(), set.clone()]);
            }
        }
        for set in &sc.sets {
            a.extend(["--set".to_string(), set.clone()]);
        }
        a
    };
    let server_args = vec![
        "--config".to_string(),
        config.display().to_string(),
        "--linger-s".into(),
        "30".into(),
    ];
    let mut procs = vec![run.server(&sets("server", server_args))];
    for peer in 0..NODES {
        procs.push(run.node(peer, &sets("node", Vec::new())));
    }
    for (i, p) in procs.iter_mut().enumerate() {
        if let Fault::Cut(net) = &fault {
            p.netns = Some(net.ns(i));
        }
        p.spawn();
    }
    let started = Instant::now();
    let faults = sc
        .disturbed
        .then(|| silence(&sc, &fault, &mut procs, &server_out));
    while procs.iter().any(Proc::running) {
        for p in procs.iter_mut() {
            p.poll();
        }
        if started.elapsed() > sc.limit {
            for p in &procs {
                eprintln!("--- {} ---\n{}", p.name, p.output());
            }
            panic!("the run did not finish within {:?}", sc.limit);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for p in &procs {
        let exit = p.exit.unwrap();
        assert!(exit.success(), "{} failed:\n{}", p.name, p.output());
    }

    let lines = rounds_logged(&server_out);
    let rounds: Vec<u64> = lines.iter().map(|l| l["round"].as_u64().unwrap()).collect();
    let every: Vec<u64> = (0..=sc.rounds).collect();
    assert_eq!(rounds, every, "{}", procs[0].output());
    let slowest = lines[1..]
        .iter()
        .map(|l| l["round_s"].as_f64().unwrap())
        .fold(0.0, f64::max);
    println!(
        "the run took {:.1} s; slowest round {slowest:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        slowest < sc.round_timeout_s,
        "a round waited its whole timeout ({slowest:.1} s)"
    );
    if let Some(f) = faults {
        check_faults(&lines, &f, &procs);
    }
    bit_identical(&sc, &server_out, dir);
}

/// The rounds around the faults, as the server's records number them.
struct Faults {
    silent_from: u64,
    back_at: u64,
    server_silent_at: u64,
}

/// Silences node 1 after round 2 (until the server evicted it, or for its time), then the
/// server once node 1 is back in.
fn silence(sc: &Scenario, fault: &Fault, procs: &mut [Proc], server_out: &Path) -> Faults {
    let (server, node1, limit) = (0, 2, sc.limit);
    wait_for(server_out, procs, limit, "round 2", |r| newest(r) >= 2);
    fault.silence(procs, node1, true);
    let silent_from = newest(&rounds_logged(server_out));
    match sc.node_silent {
        Some(t) => std::thread::sleep(t),
        None => {
            wait_for(server_out, procs, limit, "node 1's eviction", |r| {
                r.iter().any(|l| has(&l["evicted"], 1))
            });
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    fault.silence(procs, node1, false);
    let back_at = newest(&rounds_logged(server_out));
    // Back means training again: a rejoined node may still be fetching the model when the
    // server's silence starts, and that round would miss it for a reason not under test.
    wait_for(server_out, procs, limit, "node 1's return", |r| {
        r.iter()
            .any(|l| l["round"].as_u64() > Some(back_at) && has(&l["peers"], 1))
    });
    fault.silence(procs, server, true);
    let server_silent_at = newest(&rounds_logged(server_out));
    std::thread::sleep(sc.server_silent);
    fault.silence(procs, server, false);
    Faults {
        silent_from,
        back_at,
        server_silent_at,
    }
}

/// Node 1 trained again soon after its return, and the server's silence cost no membership.
fn check_faults(lines: &[serde_json::Value], f: &Faults, procs: &[Proc]) {
    let evicted = lines
        .iter()
        .find(|l| has(&l["evicted"], 1))
        .and_then(|l| l["round"].as_u64());
    let uploaded_again = lines
        .iter()
        .filter(|l| l["round"].as_u64() > Some(f.back_at))
        .find(|l| has(&l["peers"], 1))
        .and_then(|l| l["round"].as_u64())
        .unwrap_or_else(|| {
            let log = procs[2].output();
            panic!("node 1 never uploaded after its return:\n{log}")
        });
    println!(
        "node 1 silent from round {}, evicted at {evicted:?}, back at {}, uploads again in \
         round {uploaded_again}; the server silent at round {}",
        f.silent_from, f.back_at, f.server_silent_at
    );
    // Two rounds on a loaded machine: a cut link may take some seconds (keepalives,
    // reconnects) to carry again, and a round here is about one.
    assert!(
        uploaded_again <= f.back_at + 4,
        "node 1 came back after round {} and first uploaded round {uploaded_again}",
        f.back_at
    );
    // The round open while the server was silent kept every member's upload: the server did
    // not take its own silence for theirs.
    let during = lines
        .iter()
        .find(|l| l["round"].as_u64() == Some(f.server_silent_at + 1))
        .unwrap();
    assert_eq!(during["peers"], serde_json::json!([0, 1, 2, 3]), "{during}");
    // Nobody was evicted after the server's silence, and every node trained the last round.
    for l in lines
        .iter()
        .filter(|l| l["round"].as_u64() > Some(f.server_silent_at))
    {
        assert_eq!(l["evicted"], serde_json::json!([]), "{l}");
    }
    let last = lines.last().unwrap();
    assert_eq!(last["peers"], serde_json::json!([0, 1, 2, 3]), "{last}");
}

/// Every node ends bit-identical to the final published model.
fn bit_identical(sc: &Scenario, server_out: &Path, dir: &Path) {
    let rounds = sc.rounds;
    let global = tensors(&server_out.join(format!("checkpoints/round-{rounds:06}.safetensors")));
    for peer in 0..NODES {
        let ck = dir.join(format!(
            "node-{peer}/checkpoints/step-{}/model.safetensors",
            rounds * sc.sync_steps
        ));
        let local = tensors(&ck);
        assert_eq!(local.len(), global.len());
        for (name, g) in &global {
            assert!(
                local[name].equal(g),
                "node {peer}: `{name}` differs from the published model"
            );
        }
    }
}

#[test]
fn a_paused_node_and_a_paused_server_cost_only_the_rounds_they_missed() {
    run_through_silent_faults(Fault::Pause);
}

#[test]
fn a_node_and_the_server_cut_off_cost_only_the_rounds_they_missed() {
    run_through_silent_faults(Fault::Cut(Netns::new(NODES + 1)));
}
