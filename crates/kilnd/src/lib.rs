//! The `kilnd` command line, shared with `kiln server`: one binary, two roles. With `--brick`
//! or `--volfile` it is a brick server (`kiln-server`); without, the management daemon
//! (`kiln-mgmt`).

use std::path::PathBuf;
use std::sync::Arc;

use kiln_proto::error::Context as _;
use kiln_proto::Error;
use kiln_server::{Listen, Server};

/// Kiln server. With `--brick DIR` (or `--volfile`): a brick server that exports DIR to Kiln
/// clients over TCP and/or a Unix socket. Without: the management daemon, which keeps volume
/// definitions in `--state-dir`, runs the bricks of this host for started volumes and answers
/// `kiln volume create|start|stop|delete|info|status|list` and clients asking for a volfile.
///
/// A brick server prints one line `kilnd: listening on ADDR` per bound address (with the real
/// port when 0 was given); the management daemon prints `kilnd: management on ADDR`. Both then
/// serve until killed. Logs go to stderr; set KILN_LOG=debug for more.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "kilnd", version)]
pub struct ServeArgs {
    /// The directory to export, with the default stack (io-stats → dispatch → posix). Every
    /// path a client names stays beneath it.
    #[arg(long, value_name = "DIR", conflicts_with = "volfile")]
    pub brick: Option<PathBuf>,
    /// Build the brick's stack from this volume graph instead (TOML; `kiln volume layers`
    /// lists the layer types and options). Its posix layer names the directory.
    #[arg(long, value_name = "FILE")]
    pub volfile: Option<PathBuf>,
    /// Serve Prometheus `/metrics` (and the profile routes) on this address; port 0 picks one,
    /// printed at start. "off" disables it.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:0")]
    pub metrics: String,
    /// Address to listen on: tcp:IP:PORT or unix:PATH. Repeat for several.
    #[arg(long, value_name = "ADDR", default_value = "tcp:127.0.0.1:24100")]
    pub listen: Vec<Listen>,
    /// Management mode: where volume definitions, secrets, brick volfiles and brick logs live.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kiln",
        conflicts_with_all = ["brick", "volfile"]
    )]
    pub state_dir: PathBuf,
    /// Management mode: the management address (tcp:IP:PORT; port 0 picks one, printed at
    /// start). Every request there but a client's volfile fetch needs the management secret
    /// (--mgmt-secret-file); other hosts' kilnds reach it with tcp:0.0.0.0:24007.
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "tcp:127.0.0.1:24007",
        conflicts_with_all = ["brick", "volfile"]
    )]
    pub mgmt: Listen,
    /// Management mode: the first TCP port bricks are given (each brick takes the next free
    /// one; open the range in firewalls).
    #[arg(long, value_name = "PORT", default_value_t = kiln_mgmt::FIRST_BRICK_PORT)]
    pub brick_port_base: u16,
    /// Management mode: seconds between rounds of the heal service, which heals the pool's
    /// replicated volumes by itself while this kilnd is the pool's leader (0: off; `kiln
    /// volume heal` still works). At most a day.
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub heal_interval: f64,
    /// Management mode: the management secret that `kiln volume` and other kilnds must prove
    /// (default STATE_DIR/mgmt.secret; a missing file is created, mode 0600). Every kilnd of a
    /// cluster needs the same one.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["brick", "volfile"])]
    pub mgmt_secret_file: Option<PathBuf>,
    /// Require clients to prove this shared secret (HMAC challenge-response; the secret never
    /// crosses the wire). A missing file is created with a new random secret (mode 0600).
    /// Clients read it from the file named by KILN_SECRET_FILE.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Brick mode: clients may also prove the key of a named identity listed in this file
    /// (JSON: `{"volume": NAME, "identities": [{"name", "key", "caps"}]}`, as kilnd writes
    /// it for its bricks from `kiln auth`), each held to its capabilities on every request.
    /// SIGHUP reads it again: connections of a removed identity, or of one whose key
    /// changed, are closed.
    #[arg(long, value_name = "PATH", conflicts_with = "mgmt_secret_file")]
    pub identities: Option<PathBuf>,
    /// Require TLS with mutual certificates on TCP addresses: DIR holds ca.pem (the CA that
    /// issued the clients' certificates), cert.pem and key.pem (this brick's identity); make
    /// them with `kiln tls init` and `kiln tls issue`. Plaintext TCP clients are refused with a
    /// message; Unix-socket clients stay plaintext. Clients set KILN_TLS_DIR to their own.
    /// Management mode: the management port takes TLS clients only too (`kiln volume` and
    /// `kiln mount` set KILN_TLS_DIR), this kilnd speaks TLS to the other kilnds of its pool
    /// with the same identity (issue it with --san for every address peers dial), and every
    /// brick it runs gets --tls DIR.
    #[arg(long, value_name = "DIR")]
    pub tls: Option<PathBuf>,
    /// Management mode: serve the management port in plaintext on an address other hosts can
    /// reach. Without --tls that is refused, because kilnds send each other volume secrets
    /// over it; allow it only on a network you trust.
    #[arg(long, conflicts_with_all = ["brick", "volfile", "tls"])]
    pub mgmt_plaintext: bool,
    /// Only TCP clients from this address range may connect (ADDR/PREFIX; repeat for several;
    /// default: anyone who can reach a listening address). Refused clients get EACCES and the
    /// refusal is logged. Unix-socket clients are governed by the socket file's permissions.
    #[arg(long, value_name = "CIDR")]
    pub allow: Vec<kiln_server::access::Cidr>,
    /// Clients served at once (connections that finished the handshake); one more is closed
    /// with a log line.
    #[arg(long, default_value_t = kiln_server::Limits::default().max_connections)]
    pub max_connections: usize,
    /// Connections that have not finished the handshake (HELLO, and AUTH when a secret is
    /// required), counted apart from clients so they can never take clients' places; past
    /// this a new one pushes out the oldest.
    #[arg(long, default_value_t = kiln_server::Limits::default().max_strangers)]
    pub max_strangers: usize,
    /// The same from one address.
    #[arg(long, default_value_t = kiln_server::Limits::default().max_strangers_per_address)]
    pub max_strangers_per_address: usize,
    /// Seconds a new connection has to finish the handshake before it is closed (0.1 to 3600;
    /// a value outside is taken as the nearer bound).
    #[arg(long, value_name = "SECS", default_value_t = 5.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub handshake_timeout: f64,
    /// Requests one connection may have waiting for replies before the server stops reading
    /// it (bounds memory per client together with an 8 MiB cap on queued reply bytes).
    #[arg(long, default_value_t = kiln_server::Limits::default().max_inflight)]
    pub max_inflight: usize,
    /// Handles (open files) one client connection may hold; one more open fails with EMFILE
    /// for that client alone.
    #[arg(long, default_value_t = kiln_server::Limits::default().max_handles)]
    pub max_handles: usize,
    /// Seconds after which a connection with nothing in flight that sends nothing is closed;
    /// 0 (the default) never closes a live one (TCP keepalive still ends the connection of a
    /// client whose host vanished, within about 30 s). At most a year.
    #[arg(long, value_name = "SECS", default_value_t = 0.0, value_parser = kiln_proto::seconds::up_to_a_year)]
    pub idle_timeout: f64,
    /// Threads for accepting connections and the brick's own timers; each client connection
    /// is served on a thread of its own, its fops inline (slow ones such as fsync go to a
    /// blocking pool).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

/// Installs the stderr logger: the `KILN_LOG` filter, else `RUST_LOG`, else `info` but
/// openraft's own lines (which repeat every half second while a pool member is down) and the
/// FUSE crate's warning that unmounting failed as its session ended (a mount unmounts itself
/// first, so the crate's own attempt finds nothing there); plain text unless stderr is a
/// terminal. Safe to call twice.
pub fn init_logging() {
    init_logging_as("");
}

/// [`init_logging`], every line starting with `tag` (a brick's `volume=NAME brick=DIR`), so
/// that the lines of many bricks in one journal or file can be told apart and grepped. The
/// events' own fields follow (`peer=ADDR` for a client's address).
pub fn init_logging_as(tag: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KILN_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("info,openraft=off,fuser::mnt=error"));
    // Colour only for a person at a terminal: a log file or the journal gets plain text.
    let ansi = std::io::stderr().is_terminal();
    let format = Tagged {
        tag: tag.to_owned(),
        inner: tracing_subscriber::fmt::format().with_ansi(ansi),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .event_format(format)
        .try_init();
}

/// The default line format after a fixed tag.
struct Tagged {
    tag: String,
    inner: tracing_subscriber::fmt::format::Format,
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Tagged
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        if !self.tag.is_empty() {
            write!(w, "{} ", self.tag)?;
        }
        self.inner.format_event(ctx, w, event)
    }
}

/// What a brick's log lines start with: `volume=NAME brick=DIR`, from its volfile (the top
/// layer names the volume, or it and the brick's index when kilnd wrote it; the posix layer
/// names the directory).
fn brick_tag(brick: Option<&std::path::Path>, vf: Option<&kiln_layer::volfile::Volfile>) -> String {
    if let Some(dir) = brick {
        return format!("brick={}", dir.display());
    }
    let Some(vf) = vf else {
        return String::new();
    };
    let dir = vf.layers.iter().find_map(|l| match &l.kind {
        kiln_layer::volfile::LayerKind::Posix(p) => Some(p.directory.clone()),
        _ => None,
    });
    let top = vf.layers.first().map_or("", |l| l.name.as_str());
    let volume = match kiln_mgmt::brick_of_point(top) {
        Some((v, i)) => format!("volume={v} index={i}"),
        None => format!("volume={top}"),
    };
    match dir {
        Some(d) => format!("{volume} brick={}", d.display()),
        None => volume,
    }
}

/// Prints a line to stdout. A caller that reads only the first lines may close its end: the
/// server keeps serving rather than die of a broken pipe.
fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Runs a server until killed.
pub fn main(args: ServeArgs) -> std::process::ExitCode {
    // The volfile is read once: for the log lines' tag, then to build the stack.
    let loaded = args
        .volfile
        .as_ref()
        .map(|f| kiln_layer::volfile::Volfile::load(f));
    let vf = loaded.as_ref().and_then(|r| r.as_ref().ok());
    init_logging_as(&brick_tag(args.brick.as_deref(), vf));
    if args.brick.is_none() && args.volfile.is_none() {
        return main_mgmt(args);
    }
    let mut builder = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(args.threads);
        b
    };
    let rt = match builder.thread_name("kilnd").enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kilnd: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let limits = kiln_server::Limits {
            max_connections: args.max_connections.max(1),
            max_strangers: args.max_strangers.max(1),
            max_strangers_per_address: args.max_strangers_per_address.max(1),
            handshake_timeout: std::time::Duration::from_secs_f64(
                args.handshake_timeout.clamp(0.1, 3600.0),
            ),
            max_inflight: args.max_inflight.max(1),
            max_handles: args.max_handles.max(1),
            idle_timeout: std::time::Duration::from_secs_f64(args.idle_timeout.max(0.0)),
        };
        let (secret, identities, tls) = match brick_access(&args) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("kilnd: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        let volfile = match (loaded, &args.brick) {
            (Some(Ok(v)), _) => v,
            (Some(Err(e)), _) => {
                eprintln!("kilnd: {e}");
                return std::process::ExitCode::FAILURE;
            }
            (None, Some(dir)) => kiln_server::default_volfile(dir),
            (None, None) => unreachable!("without --brick or --volfile kilnd manages volumes"),
        };
        let server = match Server::bind_volfile(&volfile, &args.listen) {
            Ok(s) => {
                let mut s = s.with_limits(limits).with_allow_list(args.allow.clone());
                if let Some(secret) = secret {
                    s = s.with_secret(secret);
                }
                if let Some(ids) = &identities {
                    s = s.with_identities(ids.clone());
                }
                if let Some(tls) = tls {
                    s = s.with_tls(tls);
                }
                s
            }
            Err(e) => {
                eprintln!("kilnd: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        for a in server.local_addrs() {
            say(&format!("kilnd: listening on {a}"));
        }
        if let Err(e) = serve_metrics(&args.metrics, &server, None) {
            eprintln!("kilnd: {e}");
            return std::process::ExitCode::FAILURE;
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
        serve_until_term(server, identities).await
    })
}

/// Serves the brick until SIGTERM (how kilnd stops its bricks); then what must outlive this
/// run is written and the process ends at once, fops in flight unanswered (their clients
/// send them again to the next run).
/// Who a brick admits: its shared secret (`--secret-file`, made when missing), its named
/// identities (`--identities`), and its TLS configuration (`--tls`).
#[allow(clippy::type_complexity)]
fn brick_access(
    args: &ServeArgs,
) -> Result<
    (
        Option<Vec<u8>>,
        Option<Arc<kiln_server::identity::Identities>>,
        Option<Arc<kiln_tls::ServerConfig>>,
    ),
    Error,
> {
    let secret = args
        .secret_file
        .as_deref()
        .map(kiln_server::auth::load_or_create)
        .transpose()?;
    let identities = args
        .identities
        .as_deref()
        .map(|p| kiln_server::identity::Identities::from_file(p).map(Arc::new))
        .transpose()
        .context("--identities")?;
    let tls = args
        .tls
        .as_deref()
        .map(|dir| kiln_tls::server_config(dir).with_context(|| format!("--tls {}", dir.display())))
        .transpose()?;
    Ok((secret, identities, tls))
}

/// SIGHUP reads the identities file again.
async fn serve_until_term(
    server: Server,
    identities: Option<Arc<kiln_server::identity::Identities>>,
) -> std::process::ExitCode {
    use tokio::signal::unix::{signal, SignalKind};
    let stack = server.stack();
    let (mut term, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(t), Ok(h)) => (t, h),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("kilnd: cannot watch for SIGTERM and SIGHUP: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let reload = async {
        loop {
            hup.recv().await;
            match &identities {
                Some(ids) => {
                    if let Err(e) = ids.reload() {
                        tracing::warn!("SIGHUP: identities not reloaded, the old ones stay: {e}");
                    }
                }
                None => tracing::info!("SIGHUP: no identities file to read again"),
            }
        }
    };
    tokio::select! {
        () = server.run() => std::process::ExitCode::SUCCESS,
        () = reload => std::process::ExitCode::SUCCESS,
        _ = term.recv() => {
            Server::keep_state(&stack);
            tracing::info!("stopped by SIGTERM");
            std::process::exit(0)
        }
    }
}

/// Checks the management daemon's options and opens its manager; with `--tls`, the
/// management port's TLS configuration too.
fn open_manager(
    args: &ServeArgs,
) -> Result<(Arc<kiln_mgmt::Manager>, Option<Arc<kiln_tls::ServerConfig>>), Error> {
    if args.secret_file.is_some() {
        return Err(Error::invalid(
            "--secret-file belongs to a brick; in management mode every volume has its own \
             secret (STATE_DIR/vols/NAME/secret); the management port's is --mgmt-secret-file",
        ));
    }
    let Listen::Tcp(mgmt_addr) = &args.mgmt else {
        return Err(Error::invalid(format!(
            "--mgmt {}: want tcp:IP:PORT",
            args.mgmt
        )));
    };
    if !mgmt_addr.ip().is_loopback() && args.tls.is_none() && !args.mgmt_plaintext {
        return Err(Error::failed(format!(
            "--mgmt {}: other hosts could reach this management port, and kilnds send each \
             other volume secrets over it: give --tls DIR (kiln tls issue), or \
             --mgmt-plaintext on a network you trust",
            args.mgmt
        )));
    }
    let mut exe =
        kiln_mgmt::brick_command().context("cannot find this executable to run bricks")?;
    let mut mgmt_tls = None;
    if let Some(dir) = &args.tls {
        // Checked now, so that a bad directory fails here and not in every brick.
        let cfg =
            kiln_tls::server_config(dir).with_context(|| format!("--tls {}", dir.display()))?;
        mgmt_tls = Some(cfg);
        exe.push("--tls".into());
        exe.push(dir.into());
        // The heal service is a client of those bricks: it uses the same identity. (Set
        // before any thread starts.)
        std::env::set_var(kiln_tls::ENV_DIR, dir);
    }
    let secret_file = args.mgmt_secret_file.as_deref();
    let manager = kiln_mgmt::Manager::open(&args.state_dir, exe, secret_file)?;
    manager.set_first_brick_port(args.brick_port_base);
    if let Some(dir) = &args.tls {
        manager.set_tls(dir)?;
    }
    Ok((manager, mgmt_tls))
}

/// The management daemon: restores the bricks of started volumes, then answers MGMT requests
/// on `--mgmt` until killed.
fn main_mgmt(args: ServeArgs) -> std::process::ExitCode {
    use kiln_mgmt as mgmt;
    let umask = mgmt::current_umask();
    let fail = |e: Error| {
        eprintln!("kilnd: {e}");
        std::process::ExitCode::FAILURE
    };
    let (manager, mut mgmt_tls) = match open_manager(&args) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.clamp(1, 2))
        .thread_name("kilnd-mgmt")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(Error::io("cannot start runtime", &e)),
    };
    rt.block_on(async {
        let volfile = mgmt::placeholder_volfile(&args.state_dir);
        let server = match Server::bind_volfile(&volfile, std::slice::from_ref(&args.mgmt)) {
            Ok(s) => {
                mgmt::restore_umask(umask);
                let s = s
                    .with_allow_list(args.allow.clone())
                    .with_secret(manager.secret())
                    .with_identities(manager.identities())
                    .with_mgmt(manager.handler());
                match mgmt_tls.take() {
                    Some(c) => s.with_tls(c),
                    None => s,
                }
            }
            Err(e) if e.to_string().contains("in use") => {
                return fail(Error::conflict(format!(
                    "{e}: another kilnd, or glusterd (which also listens on 24007), has the \
                     management port; stop it or give --mgmt tcp:IP:OTHERPORT (and \
                     HOST:OTHERPORT to `kiln peer probe` and in brick names)"
                )))
            }
            Err(e) => return fail(Error::from(e)),
        };
        let addr = server.local_addrs().into_iter().next();
        if let Some(Listen::Tcp(a)) = &addr {
            manager.set_mgmt_port(a.port());
            if let Err(e) = manager.start_pool(*a).await {
                return fail(e);
            }
        }
        let m = manager.clone();
        let heal = move |out: &mut kiln_layer::metrics::Scrape| {
            m.healer().render(out);
            m.runs().render(out);
        };
        if let Err(e) = serve_metrics(&args.metrics, &server, Some(Box::new(heal))) {
            // The volumes matter more than their figures: a taken metrics port (a fixed one,
            // from /etc/default/kilnd) must not keep the management daemon down.
            tracing::warn!("{e}; running without /metrics");
        }
        // The port answers at once: the pool's members must reach each other while bricks are
        // restored (which may record their ports in the pool's store). Volume commands wait
        // for the restore (it holds their lock).
        let serving = tokio::spawn(server.run());
        let m = manager.clone();
        if tokio::task::spawn_blocking(move || m.restore())
            .await
            .is_err()
        {
            return fail(Error::failed("restoring volumes failed"));
        }
        kiln_mgmt::orphans::start(manager.clone());
        kiln_mgmt::rebalancer::start(manager.clone());
        if args.heal_interval > 0.0 {
            let every = std::time::Duration::from_secs_f64(args.heal_interval);
            kiln_mgmt::healer::start(manager.clone(), every);
        }
        if let Some(a) = addr {
            say(&format!("kilnd: management on {a}"));
        }
        let _ = serving.await;
        std::process::ExitCode::SUCCESS
    })
}

/// Lines a kilnd adds to `/metrics` beside its server's (the heal service's, in management
/// mode).
type MoreMetrics = Box<dyn Fn(&mut kiln_layer::metrics::Scrape) + Send + Sync>;

/// Serves `/metrics` (the server's counters with the process's io-stats) on `addr` unless it is
/// "off", and prints where.
fn serve_metrics(addr: &str, server: &Server, more: Option<MoreMetrics>) -> Result<(), Error> {
    if addr == "off" {
        return Ok(());
    }
    let stats = server.stats();
    let extra: kiln_metrics::Extra = Arc::new(move |out: &mut kiln_layer::metrics::Scrape| {
        stats.render(out);
        kiln_server::posix::trouble::render(out);
        kiln_server::posix::sums::render(out);
        if let Some(more) = &more {
            more(out);
        }
    });
    let ep = kiln_metrics::serve(addr, "kilnd", Some(extra))
        .with_context(|| format!("cannot serve metrics on {addr}"))?;
    say(&format!("kilnd: metrics on http://{}/metrics", ep.addr));
    Ok(())
}
