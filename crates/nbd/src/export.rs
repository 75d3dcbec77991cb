//! The export: a listener for NBD clients, one session per client, and the image on the volume.
//!
//! The export builds one client stack ([`kiln_client::Volume`]: the default stack for a brick,
//! or a volfile's graph with distribute and replicate over several bricks) and every NBD client
//! connection opens its own handle on the image through it. One stack means one set of io-stats
//! points in `/metrics`; if every brick connection of the stack is lost, the next client to
//! connect gets a fresh stack. Sessions run on the tokio runtime: a reader task (the session
//! itself) and a writer task; completions arrive on the Kiln connections' receive threads.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_client::volume::Source;
use kiln_proto::error::Context as _;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub use crate::backend::{open_backend, Backend, Shared};
use crate::handshake::{handshake, Negotiated};
pub use crate::lock::{Held, LockConfig};
use crate::metrics::Metrics;
use crate::reader::Reader;
use crate::spec::{nbd_uri, ImageSpec, Listen};
use crate::transmission::{self, Ctx, End};

/// How long a client may take to finish the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a shutdown waits for clients' requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What to export and how.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// The image on the volume.
    pub image: ImageSpec,
    /// Build the client stack from this volfile instead of connecting to `image.server`.
    pub volfile: Option<PathBuf>,
    /// Where NBD clients connect.
    pub listen: Listen,
    /// The export name; `None`: the image path in the volume.
    pub export_name: Option<String>,
    /// Refuse writes.
    pub read_only: bool,
    /// Lock the image for this export alone while it runs ([`crate::lock`]); ignored for a
    /// read-only export.
    pub lock: Option<LockConfig>,
    /// Offer the bricks' dirty record of this name as `qemu:dirty-bitmap:NAME`.
    pub bitmap: Option<String>,
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// A bound export, ready to run.
pub struct Export {
    shared: Arc<Shared>,
    listener: Listener,
    local: Listen,
    size: u64,
    lock: Option<Held>,
}

impl Export {
    /// Checks that the image can be opened (so a typo fails now, not at the first client),
    /// then binds the listen address. Must run inside a tokio runtime.
    pub async fn bind(cfg: ExportConfig) -> Result<Export, Error> {
        let name = cfg
            .export_name
            .clone()
            .unwrap_or_else(|| cfg.image.path.clone());
        let (source, place) = match &cfg.volfile {
            Some(v) => (
                Source::Volfile(v.clone()),
                format!("the volume of volfile {}", v.display()),
            ),
            None => (
                Source::Server {
                    server: cfg.image.server.clone(),
                    volume: cfg.image.volume.clone(),
                },
                format!("volume {} on {}", cfg.image.volume, cfg.image.server),
            ),
        };
        let description = format!(
            "Kiln image {} in {place}{}",
            cfg.image.path,
            if cfg.read_only { " (read-only)" } else { "" }
        );
        let shared = Arc::new(Shared {
            image: cfg.image,
            name,
            description,
            read_only: cfg.read_only,
            bitmap: cfg.bitmap,
            source,
            vol: Mutex::new(None),
        });
        let mut probe = open_backend(&shared).await?;
        let size = probe.size;
        let fd = probe.fd.take().expect("a new backend holds the image");
        let lock = match &cfg.lock {
            Some(l) if !cfg.read_only => {
                crate::lock::take(probe.vol.clone(), fd, &shared.name, l).await?
            }
            _ => {
                let _ = probe.vol.close(fd).await;
                None
            }
        };
        drop(probe);

        let (listener, local) = match &cfg.listen {
            Listen::Tcp(a) => {
                let l = TcpListener::bind(a)
                    .await
                    .with_context(|| format!("cannot listen on {}", cfg.listen))?;
                let local = l.local_addr()?;
                (Listener::Tcp(l), Listen::Tcp(local))
            }
            Listen::Unix(p) => {
                // A socket file left by a previous run that died is replaced; anything else
                // at that path is not ours to remove.
                if let Ok(m) = std::fs::symlink_metadata(p) {
                    use std::os::unix::fs::FileTypeExt;
                    if m.file_type().is_socket() {
                        let _ = std::fs::remove_file(p);
                    }
                }
                let l = UnixListener::bind(p)
                    .with_context(|| format!("cannot listen on {}", cfg.listen))?;
                (Listener::Unix(l, p.clone()), cfg.listen.clone())
            }
        };
        Ok(Export {
            shared,
            listener,
            local,
            size,
            lock,
        })
    }

    /// Where the export listens (with the real port if 0 was asked for).
    pub fn local_addr(&self) -> &Listen {
        &self.local
    }

    /// The export name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The image size found when binding.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The NBD URI clients can use.
    pub fn uri(&self) -> String {
        nbd_uri(&self.local, &self.shared.name)
    }

    /// Serves clients until `shutdown` completes, then stops accepting, lets every client's
    /// requests in flight finish (for up to 10 s), closes the connections and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut sessions = JoinSet::new();
        let next_id = AtomicU64::new(1);
        tokio::pin!(shutdown);
        loop {
            let accepted: io::Result<Halves> = tokio::select! {
                _ = &mut shutdown => break,
                Some(_) = sessions.join_next(), if !sessions.is_empty() => continue,
                r = accept(&self.listener) => r,
            };
            match accepted {
                Ok((rd, wr, peer)) => {
                    let peer = format!("#{} {peer}", next_id.fetch_add(1, Relaxed));
                    let sh = self.shared.clone();
                    let stop = stop_rx.clone();
                    sessions.spawn(session(rd, wr, peer, sh, stop));
                }
                Err(e) => {
                    // Out of file descriptors and the like: do not spin.
                    tracing::warn!("accept on {} failed: {e}", self.local);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        while sessions.try_join_next().is_some() {}
        tracing::info!("shutting down: {} client(s) connected", sessions.len());
        let _ = stop_tx.send(true);
        if let Listener::Unix(_, p) = &self.listener {
            let _ = std::fs::remove_file(p);
        }
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while sessions.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "{} client(s) still busy after {SHUTDOWN_GRACE:?}; closing them",
                sessions.len()
            );
            sessions.shutdown().await;
        }
        if let Some(l) = self.lock {
            l.release().await;
        }
        // Every session over and the lock released: the bricks are told this client ends
        // cleanly (when nothing is in flight), so its writes are left for heal to check only
        // after a crash. Not after sessions were cut short: a change dropped mid-way was
        // never marked, and its bricks' records are then all heal has of it.
        let vol = self.shared.vol.locked().take();
        if let (Some(v), true) = (vol, drained.is_ok()) {
            let _ = tokio::task::spawn_blocking(move || v.end()).await;
        }
    }
}

type Halves = (
    Box<dyn AsyncRead + Send + Unpin>,
    Box<dyn AsyncWrite + Send + Unpin>,
    String,
);

async fn accept(l: &Listener) -> io::Result<Halves> {
    match l {
        Listener::Tcp(l) => {
            let (s, a) = l.accept().await?;
            // Replies are complete messages; do not hold them back waiting for more.
            s.set_nodelay(true)?;
            let (r, w) = s.into_split();
            Ok((Box::new(r), Box::new(w), a.to_string()))
        }
        Listener::Unix(l, _) => {
            let (s, _) = l.accept().await?;
            let (r, w) = s.into_split();
            Ok((Box::new(r), Box::new(w), "unix".to_owned()))
        }
    }
}

/// One client, from greeting to goodbye.
async fn session(
    rd: Box<dyn AsyncRead + Send + Unpin>,
    mut wr: Box<dyn AsyncWrite + Send + Unpin>,
    peer: String,
    sh: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut rd = Reader::new(rd);
    tracing::debug!(peer = %peer, "client connected");
    let neg = tokio::select! {
        r = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut rd, &mut wr, &sh)) => r,
        _ = stop.changed() => return,
    };
    let Negotiated {
        backend,
        structured,
        contexts,
    } = match neg {
        Ok(Ok(Some(n))) => n,
        Ok(Ok(None)) => {
            tracing::debug!(peer = %peer, "client left during the handshake");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(peer = %peer, "handshake failed, closing this client: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!(peer = %peer, "no handshake within {HANDSHAKE_TIMEOUT:?}, closing this client");
            return;
        }
    };
    tracing::info!(
        peer = %peer,
        "client attached to {:?} ({} bytes{}{})",
        sh.name,
        backend.size,
        if structured { ", structured replies" } else { "" },
        if sh.read_only { ", read-only" } else { "" }
    );
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut backend = backend;
    let fd = backend
        .fd
        .take()
        .expect("a negotiated backend holds the image");
    // The session keeps its own handle on the stack, to close the image once the last reply is
    // out (a clone of the context would keep the writer's channel open forever).
    let vol = backend.vol.clone();
    let ctx = Arc::new(Ctx::new(
        vol.clone(),
        fd.clone(),
        backend.size,
        (structured, contexts),
        sh.read_only,
        metrics.clone(),
        peer.clone(),
        tx,
    ));
    let writer = tokio::spawn(transmission::write_replies(wr, rx, metrics.clone()));
    let end = transmission::read_requests(&mut rd, ctx, &mut stop).await;
    let wrote = writer.await;
    let _ = vol.close(fd).await;
    let how = match &end {
        End::Disconnect => "disconnected".to_owned(),
        End::Eof => "closed the connection".to_owned(),
        End::Shutdown => "disconnected by server shutdown".to_owned(),
        End::Error(e) => format!("dropped: {e}"),
    };
    match wrote {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(peer = %peer, "sending replies failed: {e}"),
        Err(e) => tracing::warn!(peer = %peer, "reply writer failed: {e}"),
    }
    tracing::info!(peer = %peer, "client {how}: {}", metrics.summary(rd.copied));
}
