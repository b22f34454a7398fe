//! The store's keys in an owner-only file, for machines where the environment is shared or
//! logged (`--store-credentials FILE`).

use serde::Deserialize;
use std::path::Path;

/// An S3 store's keys, and optionally where it is:
///
/// ```toml
/// access_key_id = "…"
/// secret_access_key = "…"
/// endpoint = "https://<account>.r2.cloudflarestorage.com"  # not for AWS S3
/// region = "auto"
/// ```
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub endpoint: Option<String>,
    pub region: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <secret>)", self.access_key_id)
    }
}

impl Credentials {
    /// Reads `path`, which must be readable by its owner alone (mode 0600 or 0400).
    pub fn read(path: &Path) -> Result<Credentials, String> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "{shown} holds store keys but is readable by others (mode {mode:o}): chmod 600 {shown}"
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
        // The parser's message quotes the offending line, which may hold a key: name the field only.
        toml::from_str(&text).map_err(|e| {
            let at = e
                .span()
                .map_or(String::new(), |s| format!(" at byte {}", s.start));
            format!(
                "{shown}: not a credentials file{at} (expected access_key_id, \
                 secret_access_key and optionally session_token, endpoint, region)"
            )
        })
    }
}
