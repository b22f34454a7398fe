//! The README's decentralized quick start, run as written on loopback: its tokenize, server
//! and node commands (every peer the comment names), shortened to a few steps with the same
//! `--set` on server and nodes, must train and end with every node on the final model.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The commands of the first ```sh block under the README's quick-start heading.
fn quick_start(readme: &str) -> Vec<String> {
    let at = readme
        .find("## Decentralized quick start")
        .expect("the README has a decentralized quick start");
    let block = &readme[at..];
    let start = block.find("```sh\n").expect("a sh block") + 6;
    let end = start + block[start..].find("```").expect("a closed block");
    block[start..end].lines().map(str::to_owned).collect()
}

/// A command line's words before its comment (the quick start uses no quotes).
fn words(line: &str) -> Vec<String> {
    line.split('#')
        .next()
        .unwrap()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The same shortening for server and nodes (a config key they must agree on) and the
/// server's own scoring kept small.
const SHORT: &[&str] = &[
    "--set",
    "train.max_steps=10",
    "--set",
    "train.seq_len=64",
    "--set",
    "train.eval_batches=2",
];

#[test]
fn the_readme_quick_start_trains_on_loopback() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = quick_start(&readme);
    assert_eq!(lines.len(), 3, "tokenize, server, node: {lines:?}");
    let (tok, server, node) = (words(&lines[0]), words(&lines[1]), words(&lines[2]));
    assert_eq!(
        [&tok[..2], &server[..2], &node[..2]].map(|w| w[1].clone()),
        ["tokenize", "server", "node"].map(String::from)
    );
    // The node line's comment names the other peers.
    let peers: Vec<usize> = std::iter::once(0)
        .chain(
            lines[2]
                .split("--peer")
                .nth(2)
                .unwrap_or("")
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|p| p.parse().ok()),
        )
        .collect();
    assert_eq!(peers, vec![0, 1, 2, 3]);
    // The commands name paths relative to the repository; run them there, writing under a
    // temporary `runs` (the repository's own `runs/` is not touched).
    let tmp = tempfile::tempdir().unwrap();
    for dir in ["configs", "crates"] {
        std::os::unix::fs::symlink(root.join(dir).canonicalize().unwrap(), tmp.path().join(dir))
            .unwrap();
    }
    let bin = env!("CARGO_BIN_EXE_spes");
    let run = |w: &[String], extra: &[&str]| {
        let mut c = Command::new(bin);
        c.args(&w[1..]).args(extra).current_dir(tmp.path());
        c
    };
    let t0 = Instant::now();
    let o = run(&tok, &[]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut server = run(&server, SHORT)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut nodes: Vec<Child> = peers
        .iter()
        .map(|p| {
            let mut w = node.clone();
            let i = w.iter().position(|x| x == "--peer").unwrap();
            w[i + 1] = p.to_string();
            let o = w.iter().position(|x| x == "--out").unwrap();
            w[o + 1] = format!("runs/node-{p}");
            run(&w, SHORT)
                .args(["--progress", "quiet"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    for (p, n) in nodes.iter_mut().enumerate() {
        while n.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "node {p} did not finish");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    for (p, n) in nodes.into_iter().enumerate() {
        let o = n.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "node {p}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    while server.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the server did not finish");
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = server.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "server: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Two rounds of 5 steps; every node ends on the server's final round.
    let metrics = std::fs::read_to_string(tmp.path().join("runs/server/metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["round"], 2, "{metrics}");
    assert!(last["val_loss"].as_f64().is_some_and(f64::is_finite));
    for p in peers {
        let s = std::fs::read_to_string(tmp.path().join(format!("runs/node-{p}/summary.json")))
            .unwrap();
        let s: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(s["steps"], 10, "node {p}");
    }
    eprintln!("quick start: {:.1} s", t0.elapsed().as_secs_f64());
}
