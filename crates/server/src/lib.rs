//! kilnd, the brick server: exports one directory over TCP and Unix sockets.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod access;
pub mod auth;
pub mod conn;
pub mod control;
pub mod door;
pub mod grants;
pub mod identity;
pub mod limits;
pub mod stats;
pub mod watch;

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::net::{TcpListener, UnixListener};

pub use conn::Limits;
pub use kiln_layer::layers::posix::brick::{self, Brick};
pub use kiln_layer::layers::{marks, posix};
use kiln_layer::layers::{marks::MarksConfig, posix::PosixConfig};
pub use kiln_layer::volfile::{LayerKind, Volfile};
use kiln_layer::LayerRef;
use kiln_proto::Error;
pub use stats::Stats;

pub use kiln_proto::Listen;

/// A bound server, ready to run.
pub struct Server {
    stack: LayerRef,
    stats: Arc<Stats>,
    clients: conn::ClientBook,
    limits: Limits,
    allow: Vec<access::Cidr>,
    secret: Option<Arc<[u8]>>,
    identities: Option<Arc<identity::Identities>>,
    compat: identity::Caps,
    mgmt: Option<control::Handler>,
    tls: Option<Arc<kiln_tls::ServerConfig>>,
    tcp: Vec<TcpListener>,
    unix: Vec<UnixListener>,
}

impl Server {
    /// Serves the brick directory `dir` with the default stack ([`default_volfile`]) on every
    /// address. Must run inside a tokio runtime.
    pub fn bind(dir: &Path, listen: &[Listen]) -> std::io::Result<Server> {
        Server::bind_volfile(&default_volfile(dir), listen)
    }

    /// Builds the brick's stack from a volume graph and binds every address. Must run inside
    /// a tokio runtime.
    pub fn bind_volfile(volfile: &Volfile, listen: &[Listen]) -> std::io::Result<Server> {
        let stack = build_stack(volfile).map_err(std::io::Error::other)?;
        let mut tcp = Vec::new();
        let mut unix = Vec::new();
        for l in listen {
            match l {
                Listen::Tcp(a) => {
                    let std = std::net::TcpListener::bind(a).map_err(|e| {
                        std::io::Error::new(e.kind(), format!("cannot listen on {l}: {e}"))
                    })?;
                    std.set_nonblocking(true)?;
                    tcp.push(TcpListener::from_std(std)?);
                }
                Listen::Unix(p) => {
                    clear_stale_socket(p).map_err(|e| {
                        std::io::Error::new(e.kind(), format!("cannot listen on {l}: {e}"))
                    })?;
                    let l2 = UnixListener::bind(p).map_err(|e| {
                        std::io::Error::new(e.kind(), format!("cannot listen on {l}: {e}"))
                    })?;
                    unix.push(l2);
                }
            }
        }
        Ok(Server {
            stack,
            stats: Arc::default(),
            clients: Arc::default(),
            limits: Limits::default(),
            allow: Vec::new(),
            secret: None,
            identities: None,
            compat: compat_caps(volfile),
            mgmt: None,
            tls: None,
            tcp,
            unix,
        })
    }

    /// The addresses actually bound (with real port numbers).
    pub fn local_addrs(&self) -> Vec<Listen> {
        let mut out: Vec<Listen> = self
            .tcp
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .map(Listen::Tcp)
            .collect();
        out.extend(
            self.unix
                .iter()
                .filter_map(|l| l.local_addr().ok())
                .filter_map(|a| a.as_pathname().map(|p| Listen::Unix(p.to_owned()))),
        );
        out
    }

    /// Replaces the default limits.
    pub fn with_limits(mut self, limits: Limits) -> Server {
        self.limits = limits;
        self
    }

    /// Clients must prove this secret (challenge-response) before any fop but HELLO.
    pub fn with_secret(mut self, secret: Vec<u8>) -> Server {
        self.secret = Some(secret.into());
        self
    }

    /// Clients may also prove the keys of these named identities, each with its own
    /// capabilities (see [`identity`]).
    pub fn with_identities(mut self, ids: Arc<identity::Identities>) -> Server {
        self.identities = Some(ids);
        self
    }

    /// Answers MGMT requests with this handler (volume management, see [`control`]); without
    /// one they fail with `ENOSYS`.
    pub fn with_mgmt(mut self, handler: control::Handler) -> Server {
        self.mgmt = Some(handler);
        self
    }

    /// TCP clients must connect with TLS and present a certificate this configuration
    /// accepts (see [`kiln_tls::server_config`]); plaintext ones are refused with a message.
    /// Unix-socket clients are local and stay plaintext.
    pub fn with_tls(mut self, tls: Arc<kiln_tls::ServerConfig>) -> Server {
        self.tls = Some(tls);
        self
    }

    /// Only TCP clients from these ranges may connect (empty: everyone).
    pub fn with_allow_list(mut self, allow: Vec<access::Cidr>) -> Server {
        self.allow = allow;
        self
    }

    /// The server's counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// The brick's stack.
    pub fn stack(&self) -> LayerRef {
        self.stack.clone()
    }

    /// Keeps what the stack's layers keep across a clean stop (the marks layers' dirty
    /// records, see `kiln_layer::layers::marks`); for a brick that was told to stop.
    pub fn keep_state(stack: &LayerRef) {
        let mut f = |l: &dyn kiln_layer::Layer| {
            if let Some(m) = l
                .as_any()
                .and_then(|a| a.downcast_ref::<kiln_layer::layers::marks::Marks>())
            {
                if let Err(e) = m.keep_dirty() {
                    tracing::warn!("dirty records not kept: {e}");
                }
            }
        };
        f(&**stack);
        stack.visit(&mut f);
    }

    /// Accepts and serves connections forever.
    pub async fn run(self) {
        let mut tasks = tokio::task::JoinSet::new();
        let shared = Arc::new(Shared {
            served: conn::Served {
                stack: self.stack.clone(),
                stats: self.stats.clone(),
                clients: self.clients.clone(),
                limits: self.limits,
                secret: self.secret.clone(),
                identities: self.identities.clone(),
                compat: Arc::new(self.compat.clone()),
                mgmt: self.mgmt.clone(),
                grants: Default::default(),
                watchers: Default::default(),
            },
            door: door::Door::new(self.limits, self.stats.clone()),
        });
        let allow = Arc::new(self.allow);
        for l in self.tcp {
            let shared = shared.clone();
            let allow = allow.clone();
            let tls = self.tls.clone();
            tasks.spawn(async move {
                loop {
                    match l.accept().await {
                        Ok((s, peer)) => {
                            if !access::allowed(&allow, peer.ip()) {
                                shared.served.stats.refused.fetch_add(1, Ordering::Relaxed);
                                tokio::spawn(access::refuse(s, peer));
                                continue;
                            }
                            let _ = s.set_nodelay(true);
                            keepalive(&s);
                            if let Some(tls) = &tls {
                                tokio::spawn(accept_tls(s, peer, tls.clone(), shared.clone()));
                                continue;
                            }
                            let fd: OwnedFd = match s.into_std() {
                                Ok(s) => s.into(),
                                Err(e) => {
                                    tracing::warn!("accept: {e}");
                                    continue;
                                }
                            };
                            spawn_conn(fd, &shared, Some(peer.ip()), peer.to_string());
                        }
                        Err(e) => accept_error(e).await,
                    }
                }
            });
        }
        for l in self.unix {
            let shared = shared.clone();
            tasks.spawn(async move {
                loop {
                    match l.accept().await {
                        Ok((s, _)) => match s.into_std() {
                            Ok(s) => {
                                let fd: OwnedFd = s.into();
                                grow_unix_send_buffer(&fd);
                                spawn_conn(fd, &shared, None, "unix".into())
                            }
                            Err(e) => tracing::warn!("accept: {e}"),
                        },
                        Err(e) => accept_error(e).await,
                    }
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// What the compatibility identity (the shared secret, or no key at all) may do on a brick
/// served with `volfile`: everything, as root, unless the volume squashes root — then a
/// request without credentials, or as uid 0 or gid 0, runs as nobody, and no device nodes.
fn compat_caps(volfile: &Volfile) -> identity::Caps {
    let squash = volfile
        .layers
        .iter()
        .any(|l| matches!(&l.kind, LayerKind::Posix(p) if p.root_squash));
    identity::Caps {
        volumes: vec!["*".into()],
        root: !squash,
        devices: !squash,
        admin: true,
        ..identity::Caps::default()
    }
}

/// The default brick stack: io-stats (named `brick`) → dispatch → posix over `dir`.
pub fn default_volfile(dir: &Path) -> Volfile {
    Volfile::linear(vec![
        ("brick".into(), LayerKind::IoStats {}),
        ("dispatch".into(), LayerKind::Dispatch {}),
        ("posix".into(), LayerKind::Posix(PosixConfig::at(dir))),
    ])
}

/// The stack of a brick that belongs to a replicated volume: io-stats (named `name`) → marks →
/// dispatch → posix.
pub fn replica_volfile(dir: &Path, name: &str) -> Volfile {
    Volfile::linear(vec![
        (name.into(), LayerKind::IoStats {}),
        ("marks".into(), LayerKind::Marks(MarksConfig::at(dir))),
        ("dispatch".into(), LayerKind::Dispatch {}),
        ("posix".into(), LayerKind::Posix(PosixConfig::at(dir))),
    ])
}

/// Builds a brick stack: the generic layers, plus posix and dispatch.
pub fn build_stack(volfile: &Volfile) -> Result<LayerRef, Error> {
    volfile.build(&mut |def, mut kids| match &def.kind {
        LayerKind::Posix(c) => {
            let brick = Brick::open(&c.directory).map_err(|e| {
                Error::io(
                    format_args!("cannot open brick directory {}", c.directory.display()),
                    &e,
                )
            })?;
            Ok(Arc::new(posix::Posix::configured(&def.name, Arc::new(brick), c)) as LayerRef)
        }
        LayerKind::Dispatch {} => Ok(Arc::new(posix::Dispatch::new(&def.name, kids.remove(0)))),
        LayerKind::Marks(c) => Ok(Arc::new(marks::Marks::configured(
            &def.name,
            kids.remove(0),
            c,
        )?)),
        other => Err(Error::invalid(format!(
            "layer {:?}: a {} layer cannot run in a brick",
            def.name,
            other.type_name()
        ))),
    })
}

/// Send buffer for Unix stream sockets. Their default (~208 KiB) holds less than two 128 KiB
/// replies, so a pipelined reader starves: measured here, 128 KiB reads at QD32 went from
/// 2.9 GB/s (default) to 5.0 GB/s (1 to 8 MiB), above loopback TCP (3.2 to 4.4 GB/s) in the
/// same runs. On a Unix socket the sender's buffer is the only one.
pub const UNIX_SNDBUF: usize = 4 << 20;

/// Sets [`UNIX_SNDBUF`], above `net.core.wmem_max` when privileged, else as far as allowed.
pub fn grow_unix_send_buffer(fd: &OwnedFd) {
    use rustix::net::sockopt;
    if sockopt::set_socket_send_buffer_size_force(fd, UNIX_SNDBUF).is_err() {
        let _ = sockopt::set_socket_send_buffer_size(fd, UNIX_SNDBUF);
    }
}

/// A server running on a runtime of its own in a background thread: for embedding a brick in
/// another program, and for tests that want the brick's counters in the same process.
pub struct Background {
    /// The addresses actually bound.
    pub addrs: Vec<Listen>,
    /// The server's counters.
    pub stats: Arc<Stats>,
}

impl Background {
    /// The first Unix socket address, as a client address (`unix:PATH`).
    pub fn unix_addr(&self) -> Option<String> {
        self.addrs
            .iter()
            .find_map(|a| matches!(a, Listen::Unix(_)).then(|| a.to_string()))
    }

    /// The first TCP address, as a client address (`tcp:IP:PORT`).
    pub fn tcp_addr(&self) -> Option<String> {
        self.addrs
            .iter()
            .find_map(|a| matches!(a, Listen::Tcp(_)).then(|| a.to_string()))
    }
}

/// Removes the socket file at `p` if nobody listens on it any more (a server that died left
/// it behind). One that a live server listens on is refused: binding over it would take its
/// clients' next connections away from it without a word.
fn clear_stale_socket(p: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let socket = std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket());
    if !socket {
        return Ok(());
    }
    match std::os::unix::net::UnixStream::connect(p) {
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "a running server listens on this socket (stop it first)",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => std::fs::remove_file(p),
        Err(e) => Err(e),
    }
}

/// Binds `listen` for the brick at `dir` and serves it from a background thread (a 2-thread
/// runtime) for the rest of the process's life. Returns once the addresses are bound.
pub fn spawn_background(dir: &Path, listen: &[Listen]) -> std::io::Result<Background> {
    spawn_background_with(dir, listen, |s| s)
}

/// [`spawn_background`], the server configured by `configure` first (a secret, identities).
pub fn spawn_background_with(
    dir: &Path,
    listen: &[Listen],
    configure: impl FnOnce(Server) -> Server + Send + 'static,
) -> std::io::Result<Background> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (dir, listen) = (dir.to_owned(), listen.to_vec());
    std::thread::Builder::new()
        .name("kilnd-bg".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                match Server::bind(&dir, &listen).map(configure) {
                    Ok(server) => {
                        let _ = tx.send(Ok(Background {
                            addrs: server.local_addrs(),
                            stats: server.stats(),
                        }));
                        server.run().await;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            });
        })?;
    rx.recv()
        .map_err(|_| std::io::Error::other("the server thread ended before binding"))?
}

/// What every connection task of one server shares.
struct Shared {
    /// What each connection is served with.
    served: conn::Served,
    /// Who may hold a connection (strangers and clients, counted apart).
    door: Arc<door::Door>,
}

fn spawn_conn(fd: OwnedFd, shared: &Arc<Shared>, from: door::Address, peer: String) {
    let ticket = shared.door.knock(from, &peer);
    spawn_serve(conn::Sock::Plain(fd), shared, ticket, from, peer);
}

/// Blocking-pool threads of one connection (fsync, fallocate, management commands).
const CONN_BLOCKING_THREADS: usize = 64;

/// Serves a connection on a thread of its own, with a single-threaded runtime: its fops run
/// inline where its frames arrive, and a storage call that blocks (a slow or hung disk under
/// the brick) stalls that connection only, never another client's requests or the accept
/// loop. A thread costs tens of microseconds once per connection, not per request.
fn spawn_serve(
    sock: conn::Sock,
    shared: &Arc<Shared>,
    ticket: door::Ticket,
    from: door::Address,
    peer: String,
) {
    let served = shared.served.clone();
    let started = std::thread::Builder::new()
        .name("kiln-conn".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                // Fops offloaded to the blocking pool (fsync, fallocate) at most this many at
                // once per connection; more wait their turn.
                .max_blocking_threads(CONN_BLOCKING_THREADS)
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return tracing::warn!(%peer, "cannot serve a connection: {e}"),
            };
            rt.block_on(conn::serve(sock, served, ticket, from, peer));
        });
    if let Err(e) = started {
        tracing::warn!("cannot start a connection's thread: {e}");
    }
}

/// A TCP client on a TLS listener: a plaintext one is answered with a clear refusal; a TLS
/// one is handshaken on a thread of its own (certificate checks included), which then carries
/// the connection's records while the plaintext end is served like any other socket.
/// TCP keepalive on a client connection: a client whose host vanished (no FIN, no RST) is
/// found gone within about [`KEEPALIVE_IDLE`] + 3 × [`KEEPALIVE_INTERVAL`] even when idle,
/// so its connection ends and what it left half done becomes suspect marks
/// ([`kiln_layer::marks::ANY`]) for heal.
fn keepalive(s: &tokio::net::TcpStream) {
    use rustix::net::sockopt;
    let r = sockopt::set_socket_keepalive(s, true)
        .and_then(|()| sockopt::set_tcp_keepidle(s, KEEPALIVE_IDLE))
        .and_then(|()| sockopt::set_tcp_keepintvl(s, KEEPALIVE_INTERVAL))
        .and_then(|()| sockopt::set_tcp_keepcnt(s, 3));
    if let Err(e) = r {
        tracing::debug!("cannot set TCP keepalive: {e}");
    }
}

/// Idle time before the first keepalive probe.
pub const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(15);
/// Time between unanswered probes (3 of them end the connection).
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

async fn accept_tls(
    s: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    tls: Arc<kiln_tls::ServerConfig>,
    shared: Arc<Shared>,
) {
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(std::time::Duration::from_secs(10), s.peek(&mut first));
    match peeked.await {
        Ok(Ok(1)) if first[0] == kiln_tls::HANDSHAKE_RECORD => {}
        Ok(Ok(1)) => {
            shared.served.stats.refused.fetch_add(1, Ordering::Relaxed);
            return access::refuse_plaintext(s, peer).await;
        }
        _ => return, // closed, failed or silent before saying anything
    }
    let ticket = shared.door.knock(Some(peer.ip()), &peer.to_string());
    let tcp = match s.into_std() {
        Ok(t) => t,
        Err(e) => return tracing::warn!(%peer, "accept: {e}"),
    };
    let rt = tokio::runtime::Handle::current();
    let started = std::thread::Builder::new()
        .name("kiln-tls-accept".into())
        .spawn(move || {
            // The TLS handshake is part of the handshake the door times: a silent peer does
            // not hold this thread longer.
            let timed = tcp.try_clone().ok();
            if let Some(t) = &timed {
                let _ = t.set_read_timeout(Some(shared.served.limits.handshake_timeout));
            }
            match kiln_tls::accept_split(tcp, tls) {
                Ok(split) => {
                    if let Some(t) = &timed {
                        let _ = t.set_read_timeout(None);
                    }
                    let _rt = rt.enter();
                    spawn_serve(
                        conn::Sock::Tls(split),
                        &shared,
                        ticket,
                        Some(peer.ip()),
                        format!("{peer} (tls)"),
                    );
                }
                Err(e) => {
                    shared.served.stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%peer, "refused a TLS client: {e}");
                }
            }
        });
    if let Err(e) = started {
        tracing::warn!(%peer, "cannot start a TLS thread: {e}");
    }
}

/// Out of descriptors or similar: log and back off briefly instead of spinning.
async fn accept_error(e: std::io::Error) {
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}
