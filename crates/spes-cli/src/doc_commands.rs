//! Every `spes` command the docs show runs as written: each line of a ```sh block in README.md,
//! ARCHITECTURE.md and docs/ that starts with `spes` or `./spes` must parse with the real
//! argument parser.

use super::Cli;
use clap::Parser;
use std::path::{Path, PathBuf};

/// The repository's Markdown files a user reads.
fn doc_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// The commands of the ```sh blocks of `text` (continuation lines joined), each with its line.
fn sh_commands(text: &str) -> Vec<(usize, String)> {
    let (mut out, mut in_sh, mut pending) = (Vec::new(), false, None::<(usize, String)>);
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with("```") {
            in_sh = t == "```sh" || t == "```bash";
            continue;
        }
        if !in_sh {
            continue;
        }
        let (start, mut cmd) = pending.take().unwrap_or((i + 1, String::new()));
        match t.strip_suffix('\\') {
            Some(head) => {
                cmd.push_str(head.trim_end());
                cmd.push(' ');
                pending = Some((start, cmd));
            }
            None => {
                cmd.push_str(t);
                out.push((start, cmd));
            }
        }
    }
    out
}

/// Shell words of `line` up to a comment: quotes group, `#` at a word's start ends the line.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut quote, mut started) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, '#') if !started => break,
            (None, c) if c.is_whitespace() => {
                if started {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, c) => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        out.push(word);
    }
    out
}

/// The `spes` invocation of a command line (after any `VAR=value` prefixes), if it is one.
fn spes_args(cmd: &str) -> Option<Vec<String>> {
    let w = words(cmd);
    let at = w
        .iter()
        .position(|x| !x.contains('=') || x.starts_with('-'))?;
    matches!(w[at].as_str(), "spes" | "./spes").then(|| w[at..].to_vec())
}

#[test]
fn every_documented_spes_command_parses() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut checked = 0;
    let mut failures = Vec::new();
    for file in doc_files(&root) {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for (line, cmd) in sh_commands(&text) {
            let Some(args) = spes_args(&cmd) else {
                continue;
            };
            checked += 1;
            // `./spes` (build, then run) takes the same arguments as the binary.
            if let Err(e) = Cli::try_parse_from(&args) {
                if !matches!(
                    e.kind(),
                    clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
                ) {
                    let shown = file.strip_prefix(&root).unwrap_or(&file).display();
                    failures.push(format!("{shown}:{line}: `{cmd}`: {}", e.kind()));
                }
            }
        }
    }
    assert!(checked >= 20, "only {checked} commands found in the docs");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_shell_reading_keeps_quotes_and_drops_comments() {
    assert_eq!(
        words("spes train --set 'a=\"b c\"' x # --bogus"),
        ["spes", "train", "--set", "a=\"b c\"", "x"]
    );
    let cmds = sh_commands("```sh\nspes a \\\n  --b c\n```\n```text\nspes nope\n```\n");
    assert_eq!(cmds, vec![(2, "spes a --b c".to_string())]);
    assert_eq!(
        spes_args("SPES_CREDENTIAL=x spes node --peer 1"),
        Some(vec![
            "spes".into(),
            "node".into(),
            "--peer".into(),
            "1".into()
        ])
    );
    assert_eq!(spes_args("python3 x.py"), None);
}
