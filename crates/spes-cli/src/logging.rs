//! Where `tracing` output goes and how it looks: colour only when stderr is a terminal (a log
//! file or pipe gets plain text an operator can grep), or one JSON object per line
//! (`--log-format json`) for log shippers.

use clap::ValueEnum;
use std::io::IsTerminal;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines, coloured on a terminal.
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, fields.
    Json,
}

/// Installs the process's subscriber; `RUST_LOG` filters it (default `info`).
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_current_span(false).init(),
    }
}
