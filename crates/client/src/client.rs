//! The client API: asynchronous, vectored fops on one brick connection.
//!
//! Three ways to move data, all zero-copy on the read path:
//! - `async` [`Client::preadv`] / [`Client::pwritev`] take owned buffers and give them back with
//!   the result, so dropping the future early can never leave the connection writing into memory
//!   the caller reuses.
//! - [`Client::preadv_blocking`] / [`Client::pwritev_blocking`] borrow the caller's slices and
//!   block the calling thread until done.
//! - [`Client::preadv_raw`] / [`Client::pwritev_raw`] take raw vectors and a completion callback
//!   (the C ABI and the FUSE daemon build on these).
//!
//! Paths are volume paths: `/a/b` and `a/b` name the same file. `.` components and repeated `/`
//! are folded; `..` is sent as is and refused by the server.

use std::future::Future;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::ToSocketAddrs;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kiln_layer::timer::within;

use kiln_proto::auth::{ClientHalf, Key};
use kiln_proto::codec::{Seq, Wire};
use kiln_proto::iov::RawIov;
use kiln_proto::ops::*;
use kiln_proto::{errno, Op};

use crate::conn::{Callback, Completion, Conn, ConnStats, Done, Errno, ReplyData, Slot};

/// An open file on the server. Close it with [`Client::close`]; a handle dropped without closing
/// stays open on the server until the connection ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fh(pub u64);

/// How long connecting waits for a brick's HELLO and AUTH answers.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a TCP connect may take before it counts as failed (and is tried again).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Converts a wire errno into an `io::Error`: a damaged block no replica could stand in for
/// ([`errno::ECKSUM`]) is an input/output error to the application.
pub fn errno_error(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(errno::for_application(e) as i32)
}

/// Folds a volume path into the wire form.
pub fn wire_path(path: &str) -> String {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// A connection to one brick.
pub struct Client {
    pub(crate) conn: Arc<Conn>,
    server: String,
    /// Kept to reconnect with (see [`Client::reconnect`]).
    secret: Option<Vec<u8>>,
    tls: Option<Arc<kiln_tls::ClientConfig>>,
    /// The brick said in HELLO that it is new to its volume; cleared when it says it is a
    /// member (see [`Client::refresh_joining`]).
    joining: std::sync::atomic::AtomicBool,
    /// The brick ships block checksums with a READ that asks ([`kiln_proto::ops::HELLO_SUMS`]).
    ships_sums: std::sync::atomic::AtomicBool,
}

impl Drop for Client {
    fn drop(&mut self) {
        // In order: nothing of this client is given up (its BYE, if it said one, still goes).
        self.conn.close();
    }
}

pub(crate) struct SlotWait(pub(crate) Arc<Slot>);

impl Future for SlotWait {
    type Output = Completion;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Completion> {
        self.0.poll(cx.waker())
    }
}

fn raw_mut(b: &mut [u8]) -> RawIov {
    RawIov::of_mut(b)
}

fn raw(b: &[u8]) -> RawIov {
    RawIov::of(b)
}

fn check_len(total: usize) -> io::Result<u32> {
    if total > kiln_proto::MAX_PAYLOAD_LEN as usize {
        return Err(errno_error(errno::EINVAL));
    }
    Ok(total as u32)
}

/// A path fop's parameter type on [`Client`]: an open file is a brick handle number.
macro_rules! client_ty {
    (handle, $ty:ty) => {
        Fh
    };
    ($kind:ident, $ty:ty) => {
        $ty
    };
}

/// A path fop's argument as its request field, on [`Client`].
macro_rules! client_arg {
    (path, $e:expr) => {
        wire_path($e)
    };
    (text, $e:expr) => {
        $e.to_owned()
    };
    (val, $e:expr) => {
        $e
    };
    (refd, $e:expr) => {
        $e.clone()
    };
    (handle, $e:expr) => {
        $e.0
    };
}

/// [`Client`]'s path and handle fops, from [`kiln_layer::for_each_path_fop`]: the same
/// requests the protocol-client layer sends, with brick handle numbers for open files.
macro_rules! client_methods {
    (() $( ($name:ident, $op:ident, $req:path { $( $f:ident : $ty:ty => $kind:ident ),* },
            $ret:ty, $wire:ty, $to_ret:tt, $to_wire:tt) )*) => {
        $(
            #[doc = concat!("The `", stringify!($name), "` fop (see `kiln_layer::Layer`).")]
            // The table's types borrow for 'a; a fop whose only argument is a handle has none.
            #[allow(clippy::extra_unused_lifetimes)]
            pub async fn $name<'a>(&self, $( $f: client_ty!($kind, $ty) ),*) -> io::Result<$ret> {
                // A struct literal needs a type name, not a path fragment.
                type Req = $req;
                let req = Req { $( $f: client_arg!($kind, $f) ),* };
                self.call::<$wire>(Op::$op, &req).await.map($to_ret)
            }
        )*
    };
}

impl Client {
    /// Connects to a brick at `tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH` and says hello. When
    /// the brick requires a secret, it is read from the file named by `KILN_SECRET_FILE`.
    pub fn connect(addr: &str) -> io::Result<Client> {
        let secret = match std::env::var_os("KILN_SECRET_FILE") {
            Some(path) => Some(
                std::fs::read_to_string(&path)
                    .map_err(|e| {
                        io::Error::new(
                            e.kind(),
                            format!(
                                "cannot read KILN_SECRET_FILE {}: {e}",
                                Path::new(&path).display()
                            ),
                        )
                    })?
                    .trim()
                    .as_bytes()
                    .to_vec(),
            ),
            None => None,
        };
        Client::connect_with_secret(addr, secret.as_deref())
    }

    /// Connects and, if the brick asks for it, proves `secret` (the brick proves it back).
    /// TCP connections use TLS when `KILN_TLS_DIR` names an identity directory (see
    /// [`kiln_tls`]).
    pub fn connect_with_secret(addr: &str, secret: Option<&[u8]>) -> io::Result<Client> {
        Client::connect_opts(addr, secret, kiln_tls::client_config_from_env()?)
    }

    /// [`Client::connect_with_secret`] with an explicit TLS configuration (`None`: plaintext).
    pub fn connect_opts(
        addr: &str,
        secret: Option<&[u8]>,
        tls: Option<Arc<kiln_tls::ClientConfig>>,
    ) -> io::Result<Client> {
        let conn = open_conn(addr, tls.as_ref())?;
        let tls_on = tls.is_some() && !addr.starts_with("unix:");
        let client = Client {
            conn,
            server: addr.to_owned(),
            secret: secret.map(<[u8]>::to_vec),
            tls,
            joining: false.into(),
            ships_sums: false.into(),
        };
        // A brick that takes the connection but never answers (stopping, or stuck) must not
        // hold the caller — a reconnect thread, with fops waiting on it — for good.
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let hello = crate::block_on(within(
            deadline,
            client.call::<HelloReply>(
                Op::Hello,
                &HelloReq {
                    version: kiln_proto::frame::VERSION as u32,
                    client: "kiln-client".into(),
                    metrics: kiln_metrics::local_endpoint()
                        .map(|a| a.to_string())
                        .unwrap_or_default(),
                },
            ),
        ))
        .unwrap_or_else(|| client.handshake_timed_out(addr))
        .map_err(|e| {
            if e.raw_os_error() == Some(errno::EACCES as i32) {
                io::Error::new(
                    e.kind(),
                    format!("{addr} refused this client (not in its allow-list)"),
                )
            } else if e.raw_os_error() == Some(errno::EPROTONOSUPPORT as i32) {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{addr} requires TLS: set {} to a directory with ca.pem, cert.pem \
                         and key.pem (kiln tls issue)",
                        kiln_tls::ENV_DIR
                    ),
                )
            } else if tls_on {
                io::Error::new(
                    e.kind(),
                    format!(
                        "handshake with {addr} failed: {e} (over TLS: did the brick refuse \
                         this client's certificate? its log says)"
                    ),
                )
            } else {
                io::Error::new(e.kind(), format!("handshake with {addr} failed: {e}"))
            }
        })?;
        tracing::debug!(server = %hello.server, "connected to {addr}");
        if hello.flags & kiln_proto::ops::HELLO_NEW_BRICK != 0 {
            tracing::info!("{addr} is a new brick: no reads from it until it is rebuilt");
            client
                .joining
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let pings = hello.flags & kiln_proto::ops::HELLO_PING != 0;
        client.ships_sums.store(
            hello.flags & kiln_proto::ops::HELLO_SUMS != 0,
            std::sync::atomic::Ordering::SeqCst,
        );
        if hello.auth_required {
            let Some(secret) = secret else {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{addr} requires a secret: point KILN_SECRET_FILE at the brick's secret file"),
                ));
            };
            crate::block_on(within(
                deadline,
                client.authenticate(addr, secret, &hello.nonce),
            ))
            .unwrap_or_else(|| client.handshake_timed_out(addr))?;
        }
        client.conn.arm(pings);
        Ok(client)
    }

    /// True when the brick knows PING and BYE (it said so in HELLO).
    pub fn speaks_bye(&self) -> bool {
        self.conn.pings()
    }

    /// Why the connection watchdog ended this connection (its brick stopped answering), if it
    /// did (see [`crate::conn::ping_timeout`]).
    pub fn away(&self) -> Option<&str> {
        self.conn.away()
    }

    /// Gives up on a handshake that did not finish in [`HANDSHAKE_TIMEOUT`].
    fn handshake_timed_out<T>(&self, addr: &str) -> io::Result<T> {
        self.conn.shutdown();
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{addr} did not answer the handshake within {HANDSHAKE_TIMEOUT:?}"),
        ))
    }

    async fn authenticate(&self, addr: &str, secret: &[u8], server_nonce: &[u8]) -> io::Result<()> {
        let key = Key::from_file_text(secret);
        let (half, req) = ClientHalf::answer(&key, server_nonce)?;
        let reply: AuthReply = self.call(Op::Auth, &req).await.map_err(|e| {
            if e.raw_os_error() == Some(errno::EACCES as i32) {
                let who = match key.identity.as_str() {
                    "" => "wrong secret".to_owned(),
                    n => format!("wrong key for identity {n}, or no such identity"),
                };
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{addr} refused this client: {who}"),
                )
            } else {
                io::Error::new(e.kind(), format!("authentication with {addr} failed: {e}"))
            }
        })?;
        if !half.server_proved(&reply.proof) {
            self.conn.shutdown();
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{addr} could not prove it holds the secret; not using it"),
            ));
        }
        Ok(())
    }

    /// A client of a brick that cannot be reached now: every call fails (ENOTCONN) and
    /// [`Client::reconnect`] tries `addr` again with `secret` and `tls`. A volume whose brick
    /// is down starts with one, and its protocol-client reconnects in the background.
    pub fn unreachable(
        addr: &str,
        secret: Option<&[u8]>,
        tls: Option<Arc<kiln_tls::ClientConfig>>,
    ) -> io::Result<Client> {
        // A connection whose other end is gone: the receive thread sees EOF at once and fails
        // the connection, as for a brick that went away.
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        drop(theirs);
        let conn = Conn::start(ours.into())?;
        conn.shutdown();
        Ok(Client {
            conn,
            server: addr.to_owned(),
            secret: secret.map(<[u8]>::to_vec),
            tls,
            joining: false.into(),
            ships_sums: false.into(),
        })
    }

    /// A new connection to the same brick with the same secret (after this one failed).
    pub fn reconnect(&self) -> io::Result<Client> {
        Client::connect_opts(&self.server, self.secret.as_deref(), self.tls.clone())
    }

    /// True when the brick ships block checksums for the reader to check (HELLO said so).
    pub fn ships_sums(&self) -> bool {
        self.ships_sums.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True while the brick is new to its volume (HELLO said so, and no later ask said it is
    /// a member).
    pub fn joining(&self) -> bool {
        self.joining.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Asks the brick again whether it is new (heal makes it a member when a rebuild ends);
    /// returns the answer, or the error.
    pub async fn refresh_joining(&self) -> io::Result<bool> {
        use kiln_proto::marks::{MemberReq, MemberState, MEMBER_ASK};
        let arg = (String::new(), MemberReq { op: MEMBER_ASK });
        let st: MemberState = self.call(Op::Member, &arg).await?;
        let joining = st.joining == 1;
        self.joining
            .store(joining, std::sync::atomic::Ordering::SeqCst);
        Ok(joining)
    }

    /// The address this client connected to.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The connection's counters (`bytes_copied` among them).
    pub fn stats(&self) -> &ConnStats {
        &self.conn.stats
    }

    /// Runs `f`; requests this thread submits meanwhile leave together when it returns, in one
    /// `sendmsg` where they fit. Use it to issue a burst of `*_raw` calls.
    pub fn batch<R>(&self, f: impl FnOnce() -> R) -> R {
        self.conn.batch(f)
    }

    /// Closes the connection: calls in flight and every later call fail.
    pub fn shutdown(&self) {
        self.conn.shutdown();
    }

    /// True once the connection has failed; every call then returns an error.
    pub fn is_dead(&self) -> bool {
        self.conn.is_dead()
    }

    async fn call_raw(&self, op: Op, args: Vec<u8>) -> io::Result<ReplyData> {
        let slot = Arc::new(Slot::default());
        // SAFETY: no payload or sink vectors.
        unsafe {
            self.conn.submit(
                op,
                0,
                &args,
                &[],
                Vec::new(),
                None,
                Done::Slot(slot.clone()),
                None,
            )
        }
        .map_err(|r| errno_error(r.errno))?;
        SlotWait(slot).await.result.map_err(errno_error)
    }

    async fn call<R: Wire>(&self, op: Op, req: &impl Wire) -> io::Result<R> {
        let reply = self.call_raw(op, req.to_wire()).await?;
        R::from_wire(&reply.args).map_err(|e| {
            tracing::warn!(op = op.name(), "bad reply arguments: {e}");
            errno_error(errno::EPROTO)
        })
    }

    async fn call_unit(&self, op: Op, req: &impl Wire) -> io::Result<()> {
        self.call_raw(op, req.to_wire()).await.map(|_| ())
    }

    kiln_layer::for_each_path_fop!(client_methods);

    /// Asks the brick to push other connections' changes to this one ([`Op::Watch`]), to
    /// `sink` (called on the receiving thread with each push's [`kiln_proto::ops::Changes`]
    /// arguments; it must not block), or stops.
    pub async fn watch(&self, sink: Option<crate::conn::PushSink>) -> io::Result<()> {
        let on = sink.is_some();
        if on {
            self.conn.set_push(sink);
        }
        let r = self
            .call_unit(Op::Watch, &kiln_proto::ops::WatchReq { on })
            .await;
        if !on {
            self.conn.set_push(None);
        }
        r
    }

    /// Tells the brick this client ends cleanly ([`Op::Bye`]): call it only when every change
    /// sent on this connection, and on its siblings to the other replicas, was answered.
    pub async fn bye(&self) -> io::Result<()> {
        self.call_raw(Op::Bye, Vec::new()).await.map(|_| ())
    }

    /// True when no request of this connection waits for its reply.
    pub fn idle(&self) -> bool {
        self.conn.idle()
    }

    /// Tells the brick about `reads` reads (`bytes` bytes) made straight from its files
    /// ([`crate::shortcut`]), for its profile.
    pub async fn report_local_reads(&self, reads: u64, bytes: u64) -> io::Result<()> {
        let req = kiln_proto::ops::GrantReq {
            fh: 0,
            reads,
            bytes,
            pin: 0,
        };
        self.call_unit(Op::Grant, &req).await
    }

    /// Pins `fh`'s file on the brick: it refuses to move the file while the handle is open
    /// (FUSE passthrough reads it behind the brick's back). Returns the reply and the
    /// descriptors that came with it: the connection's grant table when `table` says so,
    /// then a read-only descriptor of the file.
    pub async fn pin(
        &self,
        fh: Fh,
    ) -> io::Result<(kiln_proto::ops::GrantReply, Vec<std::os::fd::OwnedFd>)> {
        let req = kiln_proto::ops::GrantReq {
            fh: fh.0,
            reads: 0,
            bytes: 0,
            pin: 1,
        };
        let reply = self.call_raw(Op::Grant, req.to_wire()).await?;
        let r = kiln_proto::ops::GrantReply::from_wire(&reply.args)
            .map_err(|_| errno_error(errno::EPROTO))?;
        Ok((r, reply.fds))
    }

    /// Profiling on the brick: `cmd` is `PROFILE_INFO`, `PROFILE_START` or `PROFILE_STOP`
    /// (see `kiln_proto::ops`). Returns the brick's io-stats report as JSON, with the metrics
    /// endpoints its clients announced.
    pub fn profile(&self, cmd: u32) -> io::Result<serde_json::Value> {
        let mut buf = vec![0u8; kiln_proto::MAX_PAYLOAD_LEN as usize];
        let sink = vec![raw_mut(&mut buf)];
        let slot = Arc::new(Slot::default());
        let args = ProfileReq { cmd }.to_wire();
        // SAFETY: `buf` outlives the request: this function waits for the completion.
        unsafe {
            self.conn.submit(
                Op::Profile,
                0,
                &args,
                &[],
                sink,
                None,
                Done::Slot(slot.clone()),
                None,
            )
        }
        .map_err(|r| errno_error(r.errno))?;
        let n = slot.wait().result.map_err(errno_error)?.payload_len;
        serde_json::from_slice(&buf[..n]).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad profile reply: {e}"),
            )
        })
    }

    /// Opens an existing file with Linux `O_*` flags.
    pub async fn open(&self, path: &str, flags: i32) -> io::Result<Fh> {
        let r: OpenReply = self
            .call(
                Op::Open,
                &OpenReq {
                    path: wire_path(path),
                    flags: flags as u32,
                    peek: 0,
                },
            )
            .await?;
        Ok(Fh(r.fh))
    }

    /// Creates (with `O_EXCL`: only creates) a file and opens it.
    pub async fn create(&self, path: &str, flags: i32, mode: u32) -> io::Result<(Fh, Attr)> {
        let r: CreateReply = self
            .call(
                Op::Create,
                &CreateReq {
                    path: wire_path(path),
                    flags: flags as u32,
                    mode,
                },
            )
            .await?;
        Ok((Fh(r.fh), r.attr))
    }

    /// Closes a handle.
    pub async fn close(&self, fh: Fh) -> io::Result<()> {
        self.call_unit(Op::Release, &HandleReq { fh: fh.0 }).await
    }

    /// Lists a whole directory with attributes (`.` and `..` left out).
    pub async fn readdir(&self, path: &str) -> io::Result<Vec<DirEntry>> {
        let path = wire_path(path);
        let mut out = Vec::new();
        loop {
            let r: ReaddirReply = self
                .call(
                    Op::Readdir,
                    &ReaddirReq {
                        path: path.clone(),
                        offset: out.len() as u64,
                        max: 256,
                    },
                )
                .await?;
            let got = r.entries.0.len();
            out.extend(r.entries.0);
            if r.eof || got == 0 {
                return Ok(out);
            }
        }
    }

    /// Sets an extended attribute (`flags`: `XATTR_CREATE` / `XATTR_REPLACE`).
    pub async fn setxattr(
        &self,
        path: &str,
        name: &str,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        let req = SetxattrReq {
            path: wire_path(path),
            name: name.to_owned(),
            value: value.to_vec(),
            flags,
        };
        self.call_unit(Op::Setxattr, &req).await
    }

    /// Lists extended attribute names.
    pub async fn listxattr(&self, path: &str) -> io::Result<Vec<String>> {
        let r: XattrNames = self
            .call(
                Op::Listxattr,
                &PathReq {
                    path: wire_path(path),
                },
            )
            .await?;
        Ok(r.names.0)
    }

    /// Removes an extended attribute.
    pub async fn removexattr(&self, path: &str, name: &str) -> io::Result<()> {
        self.call_unit(
            Op::Removexattr,
            &XattrReq {
                path: wire_path(path),
                name: name.to_owned(),
            },
        )
        .await
    }

    /// Reads at `offset` into `bufs`, in order, straight from the socket.
    ///
    /// Returns the bytes read — fewer than the buffers hold only at end of file — and the
    /// buffers. Zero-length buffers are skipped. On error the buffers' contents are unspecified.
    /// Dropping the future before it completes is safe: the buffers are freed once the reply has
    /// been received (or the connection fails).
    pub async fn preadv<B>(
        &self,
        fh: Fh,
        mut bufs: Vec<B>,
        offset: u64,
    ) -> (io::Result<usize>, Vec<B>)
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        let sink: Vec<RawIov> = bufs.iter_mut().map(|b| raw_mut(b.as_mut())).collect();
        let len = match check_len(sink.iter().map(|v| v.len).sum()) {
            Ok(l) => l,
            Err(e) => return (Err(e), bufs),
        };
        let args = ReadReq {
            fh: fh.0,
            offset,
            len,
        }
        .to_wire();
        let slot = Arc::new(Slot::default());
        // Moving the `Vec` into the box does not move its elements.
        let keep: Box<dyn std::any::Any + Send> = Box::new(bufs);
        // SAFETY: the sink points into `bufs`' heap memory, which the connection keeps alive
        // (boxed as `keep`) until the completion is delivered.
        let submitted = unsafe {
            self.conn.submit(
                Op::Read,
                0,
                &args,
                &[],
                sink,
                Some(keep),
                Done::Slot(slot.clone()),
                None,
            )
        };
        if let Err(e) = submitted {
            return (Err(errno_error(e.errno)), Vec::new());
        }
        let c = SlotWait(slot).await;
        let bufs = *c
            .keep
            .expect("buffers come back")
            .downcast::<Vec<B>>()
            .expect("same type");
        (c.result.map(|r| r.payload_len).map_err(errno_error), bufs)
    }

    /// Writes `bufs`, in order, at `offset`, sending straight from them. Returns the bytes
    /// written and the buffers. Dropping the future early is safe, as for [`Client::preadv`].
    pub async fn pwritev<B>(&self, fh: Fh, bufs: Vec<B>, offset: u64) -> (io::Result<usize>, Vec<B>)
    where
        B: AsRef<[u8]> + Send + 'static,
    {
        let payload: Vec<RawIov> = bufs.iter().map(|b| raw(b.as_ref())).collect();
        if let Err(e) = check_len(payload.iter().map(|v| v.len).sum()) {
            return (Err(e), bufs);
        }
        let args = WriteReq { fh: fh.0, offset }.to_wire();
        let slot = Arc::new(Slot::default());
        let keep: Box<dyn std::any::Any + Send> = Box::new(bufs);
        // SAFETY: as in `preadv`: the payload lives in `keep` until completion.
        let submitted = unsafe {
            self.conn.submit(
                Op::Write,
                0,
                &args,
                &payload,
                Vec::new(),
                Some(keep),
                Done::Slot(slot.clone()),
                None,
            )
        };
        if let Err(e) = submitted {
            return (Err(errno_error(e.errno)), Vec::new());
        }
        let c = SlotWait(slot).await;
        let bufs = *c
            .keep
            .expect("buffers come back")
            .downcast::<Vec<B>>()
            .expect("same type");
        (c.result.and_then(write_count).map_err(errno_error), bufs)
    }

    /// Blocking `preadv` into borrowed slices; see [`Client::preadv`] for the contract.
    pub fn preadv_blocking(
        &self,
        fh: Fh,
        bufs: &mut [IoSliceMut<'_>],
        offset: u64,
    ) -> io::Result<usize> {
        let sink: Vec<RawIov> = bufs.iter_mut().map(|b| raw_mut(b)).collect();
        let len = check_len(sink.iter().map(|v| v.len).sum())?;
        let args = ReadReq {
            fh: fh.0,
            offset,
            len,
        }
        .to_wire();
        let slot = Arc::new(Slot::default());
        // SAFETY: this function does not return until the completion is delivered, and holds
        // the exclusive borrow of `bufs` until then.
        unsafe {
            self.conn.submit(
                Op::Read,
                0,
                &args,
                &[],
                sink,
                None,
                Done::Slot(slot.clone()),
                None,
            )
        }
        .map_err(|r| errno_error(r.errno))?;
        slot.wait()
            .result
            .map(|r| r.payload_len)
            .map_err(errno_error)
    }

    /// Blocking `pwritev` from borrowed slices.
    pub fn pwritev_blocking(&self, fh: Fh, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        let payload: Vec<RawIov> = bufs.iter().map(|b| raw(b)).collect();
        check_len(payload.iter().map(|v| v.len).sum())?;
        let args = WriteReq { fh: fh.0, offset }.to_wire();
        let slot = Arc::new(Slot::default());
        // SAFETY: as in `preadv_blocking`.
        unsafe {
            self.conn.submit(
                Op::Write,
                0,
                &args,
                &payload,
                Vec::new(),
                None,
                Done::Slot(slot.clone()),
                None,
            )
        }
        .map_err(|r| errno_error(r.errno))?;
        slot.wait()
            .result
            .and_then(write_count)
            .map_err(errno_error)
    }

    /// Reads into raw vectors; `cb` gets the byte count or the errno, on the receive thread.
    ///
    /// # Safety
    /// The vectors' memory must stay valid and untouched until `cb` has been called.
    pub unsafe fn preadv_raw(
        &self,
        fh: Fh,
        iov: &[RawIov],
        offset: u64,
        cb: Box<dyn FnOnce(Result<usize, Errno>) + Send>,
    ) -> Result<(), Errno> {
        let total: usize = iov.iter().map(|v| v.len).sum();
        let len = check_len(total).map_err(|_| errno::EINVAL)?;
        let args = ReadReq {
            fh: fh.0,
            offset,
            len,
        }
        .to_wire();
        let done: Callback = Box::new(move |c: Completion| cb(c.result.map(|r| r.payload_len)));
        // SAFETY: forwarded to the caller.
        unsafe {
            self.conn.submit(
                Op::Read,
                0,
                &args,
                &[],
                iov.to_vec(),
                None,
                Done::Callback(done),
                None,
            )
        }
        .map(|_| ())
        .map_err(|r| r.errno)
    }

    /// Writes from raw vectors; `cb` gets the byte count or the errno, on the receive thread.
    ///
    /// # Safety
    /// The vectors' memory must stay valid and unchanged until `cb` has been called.
    pub unsafe fn pwritev_raw(
        &self,
        fh: Fh,
        iov: &[RawIov],
        offset: u64,
        cb: Box<dyn FnOnce(Result<usize, Errno>) + Send>,
    ) -> Result<(), Errno> {
        let total: usize = iov.iter().map(|v| v.len).sum();
        check_len(total).map_err(|_| errno::EINVAL)?;
        let args = WriteReq { fh: fh.0, offset }.to_wire();
        let done: Callback = Box::new(move |c: Completion| cb(c.result.and_then(write_count)));
        // SAFETY: forwarded to the caller.
        unsafe {
            self.conn.submit(
                Op::Write,
                0,
                &args,
                iov,
                Vec::new(),
                None,
                Done::Callback(done),
                None,
            )
        }
        .map(|_| ())
        .map_err(|r| r.errno)
    }

    /// Flushes a file; `cb` runs on the receive thread.
    pub fn fsync_raw(
        &self,
        fh: Fh,
        datasync: bool,
        cb: Box<dyn FnOnce(Result<(), Errno>) + Send>,
    ) -> Result<(), Errno> {
        let args = FsyncReq { fh: fh.0, datasync }.to_wire();
        let done: Callback = Box::new(move |c: Completion| cb(c.result.map(|_| ())));
        // SAFETY: no payload or sink vectors.
        unsafe {
            self.conn.submit(
                Op::Fsync,
                0,
                &args,
                &[],
                Vec::new(),
                None,
                Done::Callback(done),
                None,
            )
        }
        .map(|_| ())
        .map_err(|r| r.errno)
    }
}

fn write_count(r: ReplyData) -> Result<usize, Errno> {
    WriteReply::from_wire(&r.args)
        .map(|w| w.written as usize)
        .map_err(|_| errno::EPROTO)
}

/// Keeps `Seq` in this module's public vocabulary for callers building requests by hand.
pub type Entries = Seq<DirEntry>;

/// Opens the socket to `addr` (Unix, or TCP with TLS when `tls` is given) and starts its
/// connection; no handshake yet.
fn open_conn(addr: &str, tls: Option<&Arc<kiln_tls::ClientConfig>>) -> io::Result<Arc<Conn>> {
    let mut split_conn = None;
    let sock: Option<OwnedFd> = if let Some(path) = addr.strip_prefix("unix:") {
        let s: OwnedFd = std::os::unix::net::UnixStream::connect(path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot connect to {addr}: {e}")))?
            .into();
        // A Unix socket's only buffer is the sender's; the default (~208 KiB) is smaller
        // than two 128 KiB writes, which throttles pipelined writes (see the server's
        // UNIX_SNDBUF, measured for reads).
        use rustix::net::sockopt;
        if sockopt::set_socket_send_buffer_size_force(&s, 4 << 20).is_err() {
            let _ = sockopt::set_socket_send_buffer_size(&s, 4 << 20);
        }
        Some(s)
    } else {
        let a = addr.strip_prefix("tcp:").unwrap_or(addr);
        let mut last = io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("no address for {addr}"),
        );
        let mut found = None;
        for sa in a
            .to_socket_addrs()
            .map_err(|e| io::Error::new(e.kind(), format!("bad server address {addr:?}: {e}")))?
        {
            // Bounded: a host that dropped off the network answers no SYN, and a reconnect
            // thread must come back to try again (and to say so) within seconds.
            match std::net::TcpStream::connect_timeout(&sa, CONNECT_TIMEOUT) {
                Ok(s) => {
                    found = Some(s);
                    break;
                }
                Err(e) => last = io::Error::new(e.kind(), format!("cannot connect to {addr}: {e}")),
            }
        }
        let s = found.ok_or(last)?;
        s.set_nodelay(true)?;
        match tls {
            Some(cfg) => {
                let split = kiln_tls::connect_split(s, cfg.clone(), kiln_tls::server_name(a)?)
                    .map_err(|e| io::Error::new(e.kind(), format!("{addr}: {e}")))?;
                split_conn = Some(Conn::start_tls(split)?);
                None
            }
            None => Some(s.into()),
        }
    };
    match (sock, split_conn) {
        (Some(sock), _) => Conn::start(sock),
        (None, Some(conn)) => Ok(conn),
        (None, None) => unreachable!("a TLS connection starts its own Conn"),
    }
}
