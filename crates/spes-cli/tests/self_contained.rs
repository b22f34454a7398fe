//! The test suite needs nothing beside the checkout: no Rust source of the workspace names a
//! path that climbs out of the repository (a `shared/` folder beside the checkout, or three
//! levels up from a crate). The datasets the experiment specs and benchmarks use stay outside;
//! what the tests read lives in `fixtures/` or is made by `spes_data::testing`.

use std::path::{Path, PathBuf};

/// Whether a line of Rust names a path outside the repository (comments aside): a `shared/`
/// folder beside it, or three levels up from a crate's manifest directory (an `include_*!`
/// path is relative to its source file, three levels below the root, so it may).
fn climbs_out(line: &str) -> bool {
    let code = line.trim_start();
    let beside = ["..", "/shared"].concat();
    let three_up = ["\"..", "/../../"].concat();
    !code.starts_with("//")
        && (code.contains(&beside) || (code.contains(&three_up) && !code.contains("include_")))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_source_reads_outside_the_repository() {
    // The check itself, on lines written here in parts so that this file passes it.
    let up = "../../..";
    assert!(climbs_out(&format!(
        r#"let p = root.join("{up}/shared/x.txt");"#
    )));
    assert!(climbs_out(&format!(
        r#"let p = root.join("{up}/elsewhere");"#
    )));
    assert!(climbs_out(&format!(
        r#"read(root().join("..{}/eval"))"#,
        "/shared"
    )));
    assert!(!climbs_out(&format!(
        "// Tests once read ..{} beside it.",
        "/shared"
    )));
    assert!(!climbs_out(
        r#"let c = root.join("../../configs/tiny.toml");"#
    ));
    assert!(!climbs_out(&format!(
        r#"const C: &str = include_str!("{up}/configs/x.toml");"#
    )));
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&crates, &mut files);
    assert!(files.len() > 50, "found only {} sources", files.len());
    let offenders: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.lines()
                .enumerate()
                .filter(|(_, l)| climbs_out(l))
                .map(|(i, l)| format!("{}:{}: {}", f.display(), i + 1, l.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "sources name paths outside the repository:\n{}",
        offenders.join("\n")
    );
}
