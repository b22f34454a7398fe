//! Every name the docs cite exists: each backticked repository path and each `Type::member`
//! in README.md, ARCHITECTURE.md, docs/guides and docs/design (docs/results cite history, so
//! they may name what has since moved).

use std::path::{Path, PathBuf};

/// What a backticked span names that must exist.
#[derive(Debug, PartialEq)]
enum Cited {
    /// A file or directory, from the repository root or from `crates/`.
    Path(String),
    /// A method, associated function or field of a type defined in the workspace.
    Member { ty: String, name: String },
}

/// The inline code spans of Markdown `text` outside fenced blocks, each with its line.
fn code_spans(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let (Some(span), Some(_)) = (parts.next(), parts.next()) {
            out.push((i + 1, span.to_owned()));
        }
    }
    out
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// What `span` cites, if it cites anything checkable: `Type::function` (a capitalised type, a
/// lower-case function, optional arguments), or a path that starts at one of `tops` (the
/// repository's top-level entries and its crates' directories).
fn cited(span: &str, tops: &[String]) -> Option<Cited> {
    let s = span.trim();
    let head = s.split('(').next().unwrap_or(s);
    if let Some((ty, name)) = head.split_once("::") {
        let upper = ty.starts_with(|c: char| c.is_ascii_uppercase());
        let lower = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_');
        return (upper && lower && is_ident(ty) && is_ident(name)).then(|| Cited::Member {
            ty: ty.to_owned(),
            name: name.to_owned(),
        });
    }
    let bare = s
        .split(['#', ':'])
        .next()
        .unwrap_or(s)
        .trim_end_matches('/');
    let plain = !bare.contains(|c: char| c.is_whitespace() || "<>*{}$|,=".contains(c));
    let first = bare.split('/').next().unwrap_or("");
    (plain && bare.contains('/') && tops.iter().any(|t| t == first))
        .then(|| Cited::Path(bare.to_owned()))
}

/// Every `.rs` file under `dir`, with its text.
fn sources(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            out.push((p, text));
        }
    }
}

/// Whether `cited` exists: the path from the root or from `crates/`; the member as a `fn` in a
/// file that has an `impl` of the type, or as a field in a file that defines the struct.
fn exists(cited: &Cited, root: &Path, rust: &[(PathBuf, String)]) -> bool {
    match cited {
        Cited::Path(p) => root.join(p).exists() || root.join("crates").join(p).exists(),
        Cited::Member { ty, name } => rust.iter().any(|(_, text)| {
            let implements = text.lines().any(|l| {
                let l = l.trim_start();
                l.starts_with("impl")
                    && l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .any(|w| w == ty)
            });
            let defines = [format!("fn {name}("), format!("fn {name}<")]
                .iter()
                .any(|f| text.contains(f.as_str()));
            let field = text.contains(&format!("struct {ty}"))
                && text.lines().any(|l| {
                    let l = l.trim_start();
                    let l = l
                        .strip_prefix("pub ")
                        .or(l.strip_prefix("pub(crate) "))
                        .unwrap_or(l);
                    l.starts_with(&format!("{name}:"))
                });
            implements && defines || field
        }),
    }
}

/// The cited names of `text` that do not exist, as `line: span`.
fn missing(text: &str, root: &Path, tops: &[String], rust: &[(PathBuf, String)]) -> Vec<String> {
    code_spans(text)
        .into_iter()
        .filter_map(|(line, span)| {
            let c = cited(&span, tops)?;
            (!exists(&c, root, rust)).then(|| format!("{line}: `{span}`"))
        })
        .collect()
}

/// The repository's top-level entries and its crates' directory names.
fn tops(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for dir in [root.to_path_buf(), root.join("crates")] {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // Ignored folders (.gitignore) are what builds and runs write, not the
            // repository's: a clone that ran `spes demo` has `runs/`, a fresh one not.
            if !matches!(name.as_str(), "target" | ".git" | ".venv" | "runs") {
                out.push(name);
            }
        }
    }
    out
}

/// The docs whose names are checked.
fn checked_docs(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    for dir in ["docs/guides", "docs/design"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "md") {
                files.push(e.path());
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_path_and_function_the_docs_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (tops, mut rust) = (tops(&root), Vec::new());
    sources(&root.join("crates"), &mut rust);
    let (mut failures, mut checked) = (Vec::new(), [0usize; 2]);
    for file in checked_docs(&root) {
        let text = std::fs::read_to_string(&file).unwrap();
        for (_, span) in code_spans(&text) {
            match cited(&span, &tops) {
                Some(Cited::Path(_)) => checked[0] += 1,
                Some(Cited::Member { .. }) => checked[1] += 1,
                None => {}
            }
        }
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        failures.extend(
            missing(&text, &root, &tops, &rust)
                .into_iter()
                .map(|m| format!("{shown}:{m}")),
        );
    }
    println!("checked {} paths and {} members", checked[0], checked[1]);
    assert!(
        checked[0] > 50 && checked[1] > 20,
        "only {checked:?} names found"
    );
    assert!(
        failures.is_empty(),
        "the docs name what does not exist:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_name_checker_finds_a_missing_path_and_a_missing_function() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (tops, mut rust) = (tops(&root), Vec::new());
    sources(&root.join("crates"), &mut rust);
    let snippet = "\
Real: `crates/spes-model/src/model/mod.rs`, `spes-net/src/server/mod.rs#L1`, `MoeModel::begin_step`, `MoeModel::cfg`.
Gone: `crates/spes-model/src/nothing.rs` and `MoeModel::no_such_method()`.
Not names: `spes demo`, `runs/<name>/metrics.jsonl`, `a::b`, `sync.wire`.
```sh
cat crates/never/here.rs
```
";
    assert_eq!(
        missing(snippet, &root, &tops, &rust),
        vec![
            "2: `crates/spes-model/src/nothing.rs`".to_string(),
            "2: `MoeModel::no_such_method()`".to_string(),
        ]
    );
    assert_eq!(
        cited("Coordinator::close(now)", &tops),
        Some(Cited::Member {
            ty: "Coordinator".into(),
            name: "close".into()
        })
    );
}
