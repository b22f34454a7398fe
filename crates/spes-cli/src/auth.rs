//! `spes auth <what>`: run secrets, node credentials and TLS certificates, and how commands
//! read a secret.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A secret read from a file, or else from an environment variable.
pub fn secret_from(file: Option<&Path>, env: &str) -> Result<Option<String>> {
    match (file, std::env::var(env)) {
        (Some(path), _) => Ok(Some(spes_net::auth::read_token(path)?)),
        (None, Ok(t)) if !t.trim().is_empty() => Ok(Some(t.trim().to_owned())),
        _ => Ok(None),
    }
}

/// 32 random bytes from the OS-seeded CSPRNG, as hex: a run secret.
pub(crate) fn new_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(clap::Subcommand)]
pub enum Auth {
    /// Write a new random run secret (owner-only) for `spes server --secret-file`.
    Secret(SecretArgs),
    /// Derive node credentials from the run secret: each authorizes exactly one peer id.
    /// Prints them, or writes DIR/node-<peer>.credential (owner-only) with --out.
    Credential(CredentialArgs),
    /// Write a self-signed TLS certificate and key (cert.pem, key.pem) for `spes server`.
    Cert(CertArgs),
}

/// Runs the `spes auth` command `what` names.
pub fn run(what: Auth) -> Result<()> {
    match what {
        Auth::Secret(a) => secret(a),
        Auth::Credential(a) => credentials(a),
        Auth::Cert(a) => cert(a),
    }
}

#[derive(clap::Args)]
pub struct SecretArgs {
    #[arg(long)]
    pub out: PathBuf,
}

/// `spes auth secret`: refuses to overwrite an existing secret.
fn secret(a: SecretArgs) -> Result<()> {
    let out = a.out;
    if out.exists() {
        anyhow::bail!(
            "{} exists; remove it first to make a new secret",
            out.display()
        );
    }
    spes_data::shard::write_secret(&out, new_secret().as_bytes())?;
    println!("wrote {} (owner-only): give it to `spes server --secret-file` and make node credentials with `spes auth credential`", out.display());
    Ok(())
}

#[derive(clap::Args)]
pub struct CredentialArgs {
    #[arg(long)]
    pub secret_file: PathBuf,
    #[arg(long, num_args = 1.., required_unless_present = "viewer")]
    pub peer: Vec<usize>,
    /// Also the run's read-only viewer credential (`spes status`, the HTTP listener off
    /// loopback, a Prometheus scrape): DIR/viewer.credential with --out.
    #[arg(long)]
    pub viewer: bool,
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct CertArgs {
    #[arg(long)]
    pub out: PathBuf,
    /// Host names or IP addresses the certificate is valid for.
    #[arg(long, num_args = 1.., default_value = "localhost")]
    pub host: Vec<String>,
}

/// `spes auth cert`.
fn cert(a: CertArgs) -> Result<()> {
    let (out, hosts) = (a.out.as_path(), a.host);
    let cert =
        rcgen::generate_simple_self_signed(hosts).context("cannot generate a certificate")?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    spes_data::shard::write_atomic(&out.join("cert.pem"), cert.cert.pem().as_bytes())?;
    spes_data::shard::write_secret(
        &out.join("key.pem"),
        cert.signing_key.serialize_pem().as_bytes(),
    )?;
    println!(
        "wrote {0}/cert.pem and {0}/key.pem: serve with --tls-cert/--tls-key, give nodes --tls-ca {0}/cert.pem",
        out.display()
    );
    Ok(())
}

/// `spes auth credential`.
fn credentials(a: CredentialArgs) -> Result<()> {
    let (secret_file, peers, out) = (&a.secret_file, &a.peer, a.out.as_deref());
    let secret = spes_net::auth::read_token(secret_file)?;
    let viewer = a.viewer.then(|| {
        (
            "viewer".to_owned(),
            spes_net::auth::viewer_credential(&secret),
        )
    });
    let nodes = peers
        .iter()
        .map(|&p| (format!("node-{p}"), spes_net::auth::credential(&secret, p)));
    for (name, c) in nodes.chain(viewer) {
        match out {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
                let path = dir.join(format!("{name}.credential"));
                spes_data::shard::write_secret(&path, c.as_bytes())?;
                println!("{}", path.display());
            }
            None => println!("{c}"),
        }
    }
    Ok(())
}
