//! Every `spes` command the docs show runs as written: each line of a ```sh block in README.md,
//! ARCHITECTURE.md and docs/ that starts with `spes` or `./spes` must parse with the real
//! argument parser. The scripts' calls (`"$bin" …` in scripts/*.sh), whose values are often
//! shell variables, must name a real command and only options it has.

use super::Cli;
use clap::{CommandFactory, Parser};
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

/// The `spes` calls of a shell script: the words after `"$bin"` or `"$spes"` (how the scripts
/// name the binary) up to the first pipe, redirection or end of a substitution, each with its line
/// (continuation lines joined; comment lines skipped).
fn script_calls(text: &str) -> Vec<(usize, Vec<String>)> {
    let (mut out, mut pending) = (Vec::new(), None::<(usize, String)>);
    for (i, line) in text.lines().enumerate() {
        let (start, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
        if line.trim_start().starts_with('#') {
            continue;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(head) => {
                joined.push_str(head);
                joined.push(' ');
                pending = Some((start, joined));
                continue;
            }
            None => joined.push_str(line),
        }
        let at = ["\"$bin\" ", "\"$spes\" "]
            .iter()
            .filter_map(|m| joined.find(m).map(|p| p + m.len()))
            .min();
        if let Some(at) = at {
            let rest = &joined[at..];
            let end = rest
                .find(['|', '>', '<', ')', ';', '&'])
                .unwrap_or(rest.len());
            out.push((start, words(&rest[..end])));
        }
    }
    out
}

/// Whether `args` (after the binary) name a real command and only long options it takes;
/// words from shell variables (`$…`) are taken on trust. The reason when not.
fn check_call(args: &[String]) -> Result<(), String> {
    let mut cmd = Cli::command();
    cmd.build();
    let mut path = vec!["spes".to_string()];
    let mut words = args.iter().peekable();
    while let Some(w) = words.peek() {
        if w.starts_with('-') || w.starts_with('$') || !cmd.has_subcommands() {
            break;
        }
        match cmd.find_subcommand(w.as_str()) {
            Some(sub) => {
                path.push(w.to_string());
                cmd = sub.clone();
                words.next();
            }
            None => return Err(format!("`{}` has no command `{w}`", path.join(" "))),
        }
    }
    if cmd.has_subcommands() && words.peek().is_none_or(|w| w.starts_with('-')) {
        let asked = words.peek().map(|w| w.as_str());
        if !matches!(asked, Some("--help" | "--version" | "-V" | "-h")) {
            return Err(format!("`{}` needs a command", path.join(" ")));
        }
    }
    let global = Cli::command();
    for w in words.filter_map(|w| w.strip_prefix("--")) {
        let name = w.split('=').next().unwrap_or(w);
        let known = |c: &clap::Command| c.get_arguments().any(|a| a.get_long() == Some(name));
        if !(known(&cmd) || known(&global) || matches!(name, "help" | "version")) {
            return Err(format!("`{}` has no option --{name}", path.join(" ")));
        }
    }
    Ok(())
}

#[test]
fn every_spes_call_of_the_scripts_names_real_commands_and_options() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (mut checked, mut failures) = (0, Vec::new());
    for e in std::fs::read_dir(root.join("scripts")).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "sh") {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        for (line, args) in script_calls(&text) {
            checked += 1;
            if let Err(why) = check_call(&args) {
                let name = p.file_name().unwrap().to_string_lossy();
                failures.push(format!("scripts/{name}:{line}: {why}"));
            }
        }
    }
    assert!(checked >= 10, "only {checked} calls found in scripts/");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_script_call_of_a_missing_command_or_option_is_caught() {
    let calls = script_calls(
        "# \"$bin\" nope\nr=$(\"$bin\" bench step \"$@\" --json | tail)\n  \"$bin\" plan \\\n    memory --bogus 1 >x\n",
    );
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(
        calls[0],
        (
            2,
            vec!["bench".into(), "step".into(), "$@".into(), "--json".into()]
        )
    );
    assert!(check_call(&calls[0].1).is_ok());
    assert_eq!(calls[1].0, 3);
    let why = check_call(&calls[1].1).unwrap_err();
    assert!(why.contains("--bogus"), "{why}");
    let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    assert!(check_call(&args("bench --json"))
        .unwrap_err()
        .contains("needs a command"));
    assert!(check_call(&args("bench-sync"))
        .unwrap_err()
        .contains("no command"));
    assert!(check_call(&args("--version")).is_ok());
    assert!(check_call(&args("train $x --out y")).is_ok());
}
