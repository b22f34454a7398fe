//! Every `spes bench` harness at its smallest size, so none rots between the measurements it
//! exists for: each must finish and print its tables with the rows and values its size
//! implies. (`step` and `vs-pytorch` run in cli.rs.) The figures themselves are the
//! benchmarks' business, not these tests'.

mod common;

use common::{spes, text};
use std::path::Path;

/// The Markdown tables of `out`: each a header and its rows, cells trimmed.
fn tables(out: &str) -> Vec<(Vec<String>, Vec<Vec<String>>)> {
    let cells = |l: &str| -> Vec<String> {
        l.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    let lines: Vec<&str> = out.lines().collect();
    let mut found = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if i > 0 && l.starts_with("|---") {
            let rows = lines[i + 1..]
                .iter()
                .take_while(|r| r.starts_with('|'))
                .map(|r| cells(r))
                .collect();
            found.push((cells(lines[i - 1]), rows));
        }
    }
    found
}

/// The leading number of a cell such as `12.5 MiB` or `0.031 s`.
fn number(cell: &str) -> f64 {
    let n: String = cell
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == '-')
        .collect();
    n.parse()
        .unwrap_or_else(|_| panic!("`{cell}` starts with no number"))
}

/// Runs `spes bench <args>` and returns its tables, failing with its output if it fails.
fn bench(args: &[&str]) -> Vec<(Vec<String>, Vec<Vec<String>>)> {
    let mut all = vec!["bench"];
    all.extend(args);
    let o = spes(&all);
    assert!(o.status.success(), "spes {all:?}: {}", text(&o));
    tables(&String::from_utf8_lossy(&o.stdout))
}

fn out_arg(dir: &Path) -> String {
    dir.display().to_string()
}

#[test]
fn bench_sync_prints_traffic_aggregation_and_both_nodes_memory() {
    let t = bench(&[
        "sync",
        "--presets",
        "micro",
        "--rounds",
        "1",
        "--wires",
        "bf16_delta",
        "--batch-size",
        "1",
        "--seq-len",
        "16",
    ]);
    assert_eq!(t.len(), 3, "{t:?}");
    let modes: Vec<&str> = t[0].1.iter().map(|r| r[1].as_str()).collect();
    assert_eq!(modes, ["spes", "diloco"]);
    assert_eq!(t[1].1.len(), 1, "one wire asked for: {:?}", t[1].1);
    assert!(number(&t[1].1[0][6]) > 0.0, "throughput {:?}", t[1].1[0]);
    let (spes_node, diloco_node) = (&t[2].1[0], &t[2].1[1]);
    assert!(number(&spes_node[1]) < number(&diloco_node[1]), "{t:?}");
    assert!(number(&spes_node[4]) > 0.0 && number(&diloco_node[4]) > 0.0);
}

#[test]
fn bench_link_measures_a_wire_beside_its_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let t = bench(&[
        "link",
        "--rounds",
        "3",
        "--sync-steps",
        "1",
        "--wires",
        "bf16-delta",
        // A fast link: the test checks the harness, not how a slow link is lived.
        "--link",
        "10gbit,1ms",
        "--out",
        &out_arg(tmp.path()),
    ]);
    let rows = &t[0].1;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0][0], "bf16-delta");
    // "n0 / n1 / n2 / n3 % (lowest %) / planned %": six percentages.
    let utilization = rows[0].last().unwrap();
    let percents: Vec<f64> = utilization
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(percents.len(), 6, "{utilization}");
    assert!(
        percents.iter().all(|&u| u > 0.0 && u <= 100.0),
        "{utilization}"
    );
    assert!(number(&rows[0][3]) > 0.0, "compute s {:?}", rows[0]);
}

#[test]
fn bench_load_drives_virtual_peers_through_the_node_transport() {
    let tmp = tempfile::tempdir().unwrap();
    let t = bench(&[
        "load",
        "--nodes",
        "2,3",
        "--rounds",
        "2",
        "--out",
        &out_arg(tmp.path()),
    ]);
    let rows = &t[0].1;
    let nodes: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(nodes, ["2", "3"]);
    for r in rows {
        assert!(number(&r[2]) > 0.0, "round p50 {r:?}");
        assert!(number(&r[6]) > 0.0, "server peak RSS {r:?}");
    }
}

#[test]
fn bench_soak_samples_a_short_run() {
    let tmp = tempfile::tempdir().unwrap();
    let t = bench(&[
        "soak",
        "--rounds",
        "4",
        "--every",
        "2",
        "--out",
        &out_arg(tmp.path()),
    ]);
    let rows = &t[0].1;
    assert_eq!(rows.len(), 2, "a sample every 2 of 4 rounds: {rows:?}");
    assert!(number(&rows[1][0]) >= 4.0, "{rows:?}");
    for r in rows {
        assert!(number(&r[1]) > 0.0 && number(&r[2]) > 0.0, "RSS {r:?}");
    }
}

#[test]
fn bench_view_renders_the_page_of_a_long_run() {
    let tmp = tempfile::tempdir().unwrap();
    let t = bench(&[
        "view",
        "--rounds",
        "40",
        "--nodes",
        "3",
        "--layers",
        "1",
        "--experts",
        "4",
        "--repeats",
        "1",
        "--out",
        &out_arg(tmp.path()),
    ]);
    let requests = &t[0].1;
    assert_eq!(requests.len(), 3, "{requests:?}");
    assert!(requests.iter().all(|r| number(&r[1]) > 0.0), "{requests:?}");
    let load = &t[1].1[0];
    assert_eq!(load[1], "40", "round shown: {load:?}");
    assert_eq!(load[4], "4", "one heatmap cell per expert: {load:?}");
    assert_eq!(load[5], "3", "one row per member: {load:?}");
}
