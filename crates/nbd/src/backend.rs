//! The image an export serves, opened through the export's client stack: what every session
//! shares (the image, the export name, the stack) and one session's open handle.

use std::sync::{Arc, Mutex};

use kiln_client::volume::Source;
use kiln_client::{Fd, Volume};
use kiln_proto::sync::MutexExt as _;

use crate::spec::ImageSpec;
use kiln_proto::error::Context as _;
use kiln_proto::{Error, Kind};

/// What every session needs to know about the export.
pub struct Shared {
    /// The image.
    pub image: ImageSpec,
    /// The export name clients ask for (the empty name, the default export, works too).
    pub name: String,
    /// A line for humans (`NBD_INFO_DESCRIPTION`, `NBD_OPT_LIST`).
    pub description: String,
    /// Refuse writes.
    pub read_only: bool,
    /// The dirty record offered as `qemu:dirty-bitmap:NAME`, if any.
    pub bitmap: Option<String>,
    /// Where the stack comes from.
    pub source: Source,
    /// The client stack every session opens the image through (rebuilt when it has died).
    pub vol: Mutex<Option<Arc<Volume>>>,
}

impl Shared {
    /// True if a client asking for `name` means this export: the empty (default) name, or the
    /// export name with or without a leading `/` (NBD URIs carry it as a path).
    pub fn name_matches(&self, name: &str) -> bool {
        name.is_empty() || name.trim_start_matches('/') == self.name.trim_start_matches('/')
    }
}

/// The image opened through the export's client stack.
pub struct Backend {
    /// The stack.
    pub vol: Arc<Volume>,
    /// The open image; released when the backend is dropped unless taken.
    pub fd: Option<Fd>,
    /// Its size in bytes when opened.
    pub size: u64,
}

impl Drop for Backend {
    fn drop(&mut self) {
        // A client that left during the handshake: release the handle without waiting.
        if let Some(fd) = self.fd.take() {
            let vol = self.vol.clone();
            kiln_client::volume::layer::exec::spawn(async move {
                let _ = vol.close(fd).await;
            });
        }
    }
}

/// Where the image lives, for messages: the server, or the volfile.
fn place(sh: &Shared) -> String {
    match &sh.source {
        Source::Server { server, .. } => server.clone(),
        s => s.to_string(),
    }
}

/// The export's stack, built on first use and kept: its connections come back by themselves
/// when a brick restarts (the protocol-client reconnects and waits for it).
async fn volume(sh: &Shared) -> Result<Arc<Volume>, Error> {
    if let Some(v) = &*sh.vol.locked() {
        return Ok(v.clone());
    }
    let src = sh.source.clone();
    // Connecting is a blocking call (socket connect and the hello round trip).
    let vol = tokio::task::spawn_blocking(move || Volume::from_source(&src))
        .await
        .map_err(|e| Error::failed(format!("cannot reach {}: {e}", place(sh))))?
        .map_err(|e| match &sh.source {
            // Unreachable only when it is: a refusal is the server's own answer (no such
            // volume, not allowed), with its kind.
            Source::Server { server, .. } => match Error::from(e) {
                e if e.kind() == Kind::Unavailable => {
                    e.context(format_args!("Kiln server {server} is unreachable"))
                }
                e => e.context(format_args!("Kiln server {server}")),
            },
            s => Error::io(format_args!("cannot build the client stack of {s}"), &e),
        })?;
    let vol = Arc::new(vol);
    *sh.vol.locked() = Some(vol.clone());
    Ok(vol)
}

/// Opens the image through the export's stack; the error says what went wrong in words.
pub async fn open_backend(sh: &Shared) -> Result<Backend, Error> {
    let vol = volume(sh).await?;
    let at = place(sh);
    let path = &sh.image.path;
    let flags = if sh.read_only {
        libc::O_RDONLY
    } else {
        libc::O_RDWR
    };
    let fd = vol
        .open(path, flags)
        .await
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => Error::not_found(format!("image {path} not found on {at}")),
            _ => Error::io(format_args!("cannot open image {path} on {at}"), &e),
        })?;
    let mut be = Backend {
        vol: vol.clone(),
        fd: Some(fd.clone()),
        size: 0,
    };
    let attr = vol
        .fstat(&fd)
        .await
        .with_context(|| format!("cannot stat image {path} on {at}"))?;
    if attr.mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::failed(format!(
            "image {path} on {at} is not a regular file"
        )));
    }
    be.size = attr.size;
    Ok(be)
}
