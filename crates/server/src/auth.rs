//! Secret files: read, or made with a fresh random secret (the handshake itself is
//! `kiln_proto::auth`).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Reads a secret file (its text, without surrounding white space). When the file does not
/// exist, creates it with a new random secret (64 hex digits, mode 0600) and says so.
pub fn load_or_create(path: &Path) -> std::io::Result<Vec<u8>> {
    match std::fs::read_to_string(path) {
        Ok(s) => {
            let s = s.trim();
            if s.is_empty() {
                return Err(std::io::Error::other(format!(
                    "secret file {} is empty",
                    path.display()
                )));
            }
            Ok(s.as_bytes().to_vec())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut raw = [0u8; 32];
            rustix::rand::getrandom(&mut raw, rustix::rand::GetRandomFlags::empty())?;
            let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)?;
            writeln!(f, "{hex}")?;
            tracing::info!(
                "created a new secret in {} (give it to clients)",
                path.display()
            );
            Ok(hex.into_bytes())
        }
        Err(e) => Err(std::io::Error::new(
            e.kind(),
            format!("cannot read secret file {}: {e}", path.display()),
        )),
    }
}
