//! `spes status`: the server's view of a run in the terminal, once or every few seconds.

use anyhow::{Context, Result};
use spes_net::view::{EventView, NodeView, RunView};
use std::path::PathBuf;

/// The state of a run, from its server.
#[derive(clap::Args)]
pub struct Args {
    /// `http://host:port` or `https://host:port` of the server (shard 0 for a sharded run).
    #[arg(long)]
    pub server: String,
    /// A credential of the run: the viewer's (`spes auth credential --viewer`) or a node's (else
    /// the SPES_CREDENTIAL environment variable; none for a server run with --no-auth).
    #[arg(long)]
    pub credential_file: Option<PathBuf>,
    /// PEM CA certificate to trust for https (else the web PKI roots).
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// Send the credential in plaintext to a non-loopback http:// server.
    #[arg(long)]
    pub insecure: bool,
    /// Print again every this many seconds until interrupted.
    #[arg(long)]
    pub watch: Option<f64>,
    /// Print the server's RunView as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// `spes status`.
pub fn run(a: Args) -> Result<()> {
    let credential = crate::auth::secret_from(a.credential_file.as_deref(), "SPES_CREDENTIAL")?;
    let tls_ca = a
        .tls_ca
        .map(|p| spes_net::auth::read_pem(&p, "TLS CA certificate"))
        .transpose()?;
    if let Some(every) = a.watch {
        anyhow::ensure!(
            every > 0.0 && every.is_finite(),
            "--watch takes a positive number of seconds"
        );
    }
    let rt = tokio::runtime::Runtime::new()?;
    loop {
        let view = rt
            .block_on(spes_net::view::client::status(
                &a.server,
                credential.as_deref(),
                tls_ca.as_deref(),
                a.insecure,
            ))
            .with_context(|| format!("cannot read the status of {}", a.server))?;
        let text = if a.json {
            serde_json::to_string_pretty(&view)?
        } else {
            render(&view)
        };
        match a.watch {
            Some(every) => {
                // Clear the screen only on a terminal, so a pipe gets plain snapshots.
                if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                    print!("\x1b[2J\x1b[H");
                }
                println!("{text}");
                std::thread::sleep(std::time::Duration::from_secs_f64(every));
            }
            None => {
                println!("{text}");
                return Ok(());
            }
        }
    }
}

fn bytes(b: u64) -> String {
    let b = b as f64;
    match b {
        _ if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        _ if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        _ if b >= 1e3 => format!("{:.0} kB", b / 1e3),
        _ => format!("{b:.0} B"),
    }
}

fn lease(n: &NodeView, lease_s: f64) -> String {
    match n.lease_age_s {
        None => "none".into(),
        Some(a) if a < lease_s * 0.5 => format!("live ({a:.0} s)"),
        Some(a) if a < lease_s => format!("LATE ({a:.0} s)"),
        Some(a) => format!("EXPIRED ({a:.0} s)"),
    }
}

/// The view as text: the run's line, a table of nodes, the newest rounds and events.
pub fn render(v: &RunView) -> String {
    let r = &v.run;
    let mut out = format!(
        "round {}/{} (open {}) · {} tokens · wire {} · val loss {} · up {:.0} s{}\n{}\n",
        r.round,
        r.final_round,
        r.open_round,
        r.tokens,
        r.wire,
        r.val_loss.map_or("-".into(), |l| format!("{l:.4}")),
        r.uptime_s,
        if r.done { " · done" } else { "" },
        if r.choice.is_empty() {
            String::new()
        } else {
            format!("settings chosen {}\n", r.choice)
        }
    );
    out +=
        "| peer | member | lease | experts | step | tok/s | loss | idle | uploads | up | down |\n";
    out += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for n in &v.nodes {
        let rep = n.report.as_ref();
        let idle = rep.and_then(|r| r.sync.as_ref()).map_or("-".into(), |s| {
            format!(
                "{:.0} %",
                100.0 * (1.0 - spes_train::metrics::utilization(s.compute_s, s.idle_s))
            )
        });
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {idle} | {} | {} | {} |\n",
            n.peer,
            if n.member { "yes" } else { "no" },
            lease(n, r.lease_s),
            n.experts.len(),
            rep.map_or("-".into(), |r| r.step.to_string()),
            rep.map_or("-".into(), |r| format!("{:.0}", r.tokens_per_s)),
            rep.map_or("-".into(), |r| format!("{:.3}", r.losses.loss)),
            n.uploads,
            bytes(n.bytes_in),
            bytes(n.bytes_out),
        );
    }
    if let Some(p) = v.rounds.last() {
        out += &format!(
            "\nround {}: {:.1} s, aggregation {:.2} s, {} peers, {} missing, {} in, {} out\n",
            p.round,
            p.round_s,
            p.aggregation_s,
            p.peers,
            p.missing,
            bytes(p.bytes_in),
            bytes(p.bytes_out)
        );
    }
    let events: Vec<&EventView> = v.events.iter().take(5).collect();
    if !events.is_empty() {
        out += "\nlast events:\n";
        for e in events {
            out += &format!("  round {}: {}\n", e.round, e.text);
        }
    }
    out
}
