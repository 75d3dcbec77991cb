//! Test scaffolding: an in-process brick server, images on it, an in-process NBD export, and
//! checks that the Debian tools the tests drive are installed.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;

use kiln_client::{block_on, Client, SetAttrs};
use kiln_nbd::{Export, ExportConfig};

/// Fails the test, naming the Debian package, if `bin` is not on the PATH.
pub fn require_tool(bin: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "{bin} is not installed: these tests need the Debian package {package} \
         (apt-get install -y {package})"
    );
}

/// Starts a brick server in this process on `dir/brick`; returns the brick directory and its
/// Unix socket path.
pub fn start_brick(dir: &Path) -> (PathBuf, PathBuf) {
    let brick = dir.join("brick");
    std::fs::create_dir_all(&brick).expect("brick dir");
    let sock = dir.join("kilnd.sock");
    kiln_server::spawn_background(&brick, &[kiln_server::Listen::Unix(sock.clone())])
        .expect("brick server");
    (brick, sock)
}

/// Creates `path` on the brick through Kiln and sizes it (sparse) to `size` bytes.
pub fn create_image(brick_sock: &Path, path: &str, size: u64) {
    let c = Client::connect(&format!("unix:{}", brick_sock.display())).expect("connect to brick");
    let (fh, _) = block_on(c.create(path, libc::O_RDWR, 0o644)).expect("create image");
    block_on(c.setattr(
        path,
        &SetAttrs {
            valid: kiln_proto::ops::SETATTR_SIZE,
            size,
            ..Default::default()
        },
    ))
    .expect("size image");
    block_on(c.close(fh)).expect("close");
}

/// A running in-process export.
pub struct Running {
    /// The URI clients use.
    pub uri: String,
    /// The export name.
    pub name: String,
    /// The Unix socket it listens on (if any).
    pub sock: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    /// Shuts the export down (as SIGTERM would) and waits until it has.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().expect("export thread");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// Starts an export of `spec` listening on the Unix socket `sock`.
pub fn start_export(spec: &str, sock: &Path, read_only: bool) -> Running {
    try_start_export(spec, &format!("unix:{}", sock.display()), read_only).expect("start export")
}

/// Starts an export; `Err` is what `kiln nbd` would report (its message is what it prints).
pub fn try_start_export(
    spec: &str,
    listen: &str,
    read_only: bool,
) -> Result<Running, kiln_proto::Error> {
    try_start_named_export(spec, listen, read_only, None)
}

/// Logs to the test's captured output (shown with --nocapture or on failure); `KILN_LOG`
/// filters as in `kiln nbd`.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_test_writer()
        .try_init();
}

/// Starts an export named `name` (`None`: the default name).
pub fn try_start_named_export(
    spec: &str,
    listen: &str,
    read_only: bool,
    name: Option<&str>,
) -> Result<Running, kiln_proto::Error> {
    let cfg = ExportConfig {
        image: spec.parse()?,
        volfile: None,
        listen: listen.parse()?,
        export_name: name.map(str::to_owned),
        read_only,
        lock: Some(Default::default()),
        bitmap: None,
    };
    try_start_config(cfg)
}

/// Starts an export of any configuration (a volfile's image, say).
pub fn try_start_config(cfg: ExportConfig) -> Result<Running, kiln_proto::Error> {
    init_logging();
    let (tx, rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            match Export::bind(cfg).await {
                Ok(e) => {
                    let sock = match e.local_addr() {
                        kiln_nbd::Listen::Unix(p) => p.clone(),
                        kiln_nbd::Listen::Tcp(_) => PathBuf::new(),
                    };
                    tx.send(Ok((e.uri(), e.name().to_owned(), sock)))
                        .expect("report");
                    e.run(async {
                        let _ = stop_rx.await;
                    })
                    .await;
                }
                Err(e) => tx.send(Err(e)).expect("report"),
            }
        });
    });
    match rx.recv().expect("export thread reports") {
        Ok((uri, name, sock)) => Ok(Running {
            uri,
            name,
            sock,
            stop: Some(stop_tx),
            thread: Some(thread),
        }),
        Err(e) => {
            thread.join().expect("export thread");
            Err(e)
        }
    }
}

/// Runs a command; panics with its output if it fails. Returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
