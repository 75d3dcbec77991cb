//! `kiln vhost-user-blk`: serves a VM image that lives on a Kiln volume to QEMU as a
//! vhost-user-blk device. QEMU shares the guest's RAM with this process and hands it the
//! virtqueues, so a guest read's payload goes from the brick's socket straight into the
//! guest's pages: no NBD hop, no buffer in between (see [`backend`]).
//!
//! Built on rust-vmm's `vhost-user-backend` (the protocol, the vrings, the worker threads),
//! `virtio-queue` and `vm-memory`; the virtio-blk requests and the data path are ours.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod backend;
pub mod config;
pub mod request;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::Volume;
use kiln_nbd::lock::{self, Held, LockConfig};
use kiln_nbd::ImageSpec;
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use backend::{Blk, Image};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// Serve a VM image on a Kiln volume to QEMU as a vhost-user-blk device.
///
/// IMAGE is SERVER:/VOL/PATH as for `kiln nbd` (or the PATH with --volfile). The device
/// listens on the Unix socket --socket; give QEMU the guest RAM as shared memory and the socket:
///
///   kiln vhost-user-blk 127.0.0.1:/vms/disk.img --socket /run/kiln/disk.vhost
///   qemu-system-x86_64 ... -object memory-backend-memfd,id=mem,size=4G,share=on \
///     -numa node,memdev=mem -chardev socket,id=c,path=/run/kiln/disk.vhost,reconnect=1 \
///     -device vhost-user-blk-pci,chardev=c,num-queues=2
///
/// Prints "kiln vhost-user-blk: serving PATH (SIZE bytes) at SOCKET" once listening, then
/// serves one QEMU at a time until SIGINT or SIGTERM; when QEMU goes away it waits for the
/// next (a QEMU with `reconnect=` comes back by itself). SIGINT and SIGTERM stop it for a
/// restart: it starts no more requests, lets those started complete, syncs the image and
/// exits; a new `kiln vhost-user-blk` on the socket then takes over the running guest (QEMU
/// hands it what the guest asked for meanwhile). A device killed outright (SIGKILL, a crash)
/// with requests in flight cannot be taken over that way: that needs QEMU's in-flight
/// tracking, which the vhost-user crates used here do not offer yet. A brick that restarts
/// is waited for, as the mount and NBD do, not reported to the guest. A writable device
/// locks the image as `kiln nbd` does (--lock).
#[derive(clap::Args, Debug, Clone)]
#[command(verbatim_doc_comment)]
pub struct VhostArgs {
    /// The image: SERVER:/VOL/PATH, or with --volfile the PATH.
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// The vhost-user socket QEMU connects to (replaced if a stale one is there). It is this
    /// process's user's alone (mode 0600) unless --socket-group is given.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Let this group (a name or a number) connect too: the socket gets it and mode 0660, so
    /// a QEMU that runs as a member (libvirt's runs in `kvm`, say) is let in; others are not.
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
    /// Build the client stack from this volfile (TOML) instead of connecting to SERVER.
    #[arg(long, value_name = "FILE")]
    pub volfile: Option<PathBuf>,
    /// A read-only device (VIRTIO_BLK_F_RO); the image is opened read-only.
    #[arg(long)]
    pub read_only: bool,
    /// Virtqueues offered (QEMU's num-queues may ask for fewer); each has a thread of its own.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub num_queues: u16,
    /// Lock the image for this device alone: auto, exclusive or off (see `kiln nbd --help`).
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = ["auto", "exclusive", "off"])]
    pub lock: String,
    /// Wait up to SECS (at most a day) at start for another holder's lock on the image to go.
    #[arg(long, value_name = "SECS", default_value_t = 0.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub lock_wait: f64,
    /// The volume's secret file (else `KILN_SECRET_FILE`, else the local state directory's).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Serve Prometheus `/metrics` on this address (port 0 picks one, logged at start; the
    /// brick learns it, so `kiln volume profile` reaches this export); "off" disables it.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:0")]
    pub metrics: String,
    /// Sample every Nth read and write for a waterfall (0: none): from the guest's kick
    /// through the client and the brick to the used ring; `kiln volume profile VOL trace`
    /// (or GET /traces on the metrics address) shows them.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub trace_every: u64,
}

impl VhostArgs {
    /// What this export's log lines start with: `volume=V image=PATH`.
    pub fn log_tag(&self) -> String {
        ImageSpec::log_tag(&self.image, self.volfile.as_deref())
    }
}

/// Runs `kiln vhost-user-blk` until SIGINT or SIGTERM.
pub fn main(args: VhostArgs) -> Result<(), Error> {
    if let Some(p) = &args.secret_file {
        kiln_client::mgmt::use_secret_file(p);
    }
    let (spec, src) = ImageSpec::with_source(&args.image, args.volfile.as_deref())?;
    kiln_client::start_metrics(&args.metrics, "kiln-vhost-user-blk")?;
    // The lock's renewals, and the signals, run on a small runtime of their own.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kiln-vhost")
        .enable_all()
        .build()
        .context("cannot start runtime")?;
    let vol = Arc::new(Volume::from_source(&src).with_context(|| format!("cannot reach {src}"))?);
    vol.set_trace_every(args.trace_every);
    let image = open(&vol, &spec.path, args.read_only)?;
    let held = match (args.read_only, args.lock.as_str()) {
        (true, _) | (_, "off") => None,
        (false, mode) => {
            let cfg = LockConfig {
                wait: Duration::from_secs_f64(args.lock_wait.clamp(0.0, 86400.0)),
                required: mode == "exclusive",
                ..LockConfig::default()
            };
            let fd = rt
                .block_on(vol.open(&spec.path, libc::O_RDWR))
                .with_context(|| format!("cannot open image {}", spec.path))?;
            rt.block_on(lock::take(vol.clone(), fd, &spec.path, &cfg))?
        }
    };
    let size = image.size;
    let blk = Blk::new(image, args.num_queues);
    let sock = args.socket.to_string_lossy().into_owned();
    let group = args.socket_group.as_deref().map(group_id).transpose()?;
    let mut listener = Listener::new(&sock, true)
        .map_err(|e| Error::failed(format!("cannot listen on {sock}: {e}")))?;
    // Made under the umask, which lets no one but its owner write (connect) to it: narrowed,
    // or opened to the group, before anyone is told it is there.
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(&args.socket, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::os::unix::fs::chown(&args.socket, None, group))
        .with_context(|| format!("cannot set the owner and mode of {sock}"))?;
    println!(
        "kiln vhost-user-blk: serving {} ({size} bytes) at {sock}",
        spec.path
    );
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    rt.spawn(stop_on_signal(blk.clone(), held, args.socket.clone()));
    loop {
        let mut daemon = VhostUserDaemon::new(
            "kiln-vhost-user-blk".into(),
            blk.clone(),
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        )
        .map_err(|e| Error::failed(format!("cannot start the device: {e}")))?;
        daemon
            .start(&mut listener)
            .map_err(|e| Error::failed(format!("accepting on {sock}: {e}")))?;
        tracing::info!("QEMU connected");
        match daemon.wait() {
            Ok(()) => tracing::info!("QEMU disconnected"),
            Err(e) => tracing::info!("QEMU connection ended: {e}"),
        }
        drop(daemon);
        // Nothing of this connection may reach the next one's rings.
        blk.drain();
        log_summary(&blk);
    }
}

/// The group `name` names (or the number it is).
fn group_id(name: &str) -> Result<u32, Error> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let c =
        std::ffi::CString::new(name).map_err(|_| Error::failed(format!("no group {name:?}")))?;
    // SAFETY: `struct group` is plain data (integers and pointers): all zeroes is a valid one.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 16 << 10];
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: getgrnam_r writes the entry into `grp` and its strings into `buf`, both ours and
    // alive across the call, and sets `found` to `&grp` or null; only the gid is read after.
    let r = unsafe {
        libc::getgrnam_r(
            c.as_ptr(),
            &mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if r != 0 || found.is_null() {
        return Err(Error::failed(format!(
            "--socket-group {name}: no such group"
        )));
    }
    Ok(grp.gr_gid)
}

/// Opens the image and checks it is a regular file.
fn open(vol: &Arc<Volume>, path: &str, read_only: bool) -> Result<Image, Error> {
    let flags = if read_only {
        libc::O_RDONLY
    } else {
        libc::O_RDWR
    };
    let fd = kiln_client::block_on(vol.open(path, flags)).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => Error::not_found(format!("image {path} not found")),
        // Only a kilnd without a brick (its management port) answers a fop so.
        Some(libc::ENOSYS) => Error::invalid(format!(
            "cannot open image {path}: the volume's server is a management port, not a brick \
             (a volfile names bricks; SERVER:/VOL/PATH may name either)"
        )),
        _ => Error::io(format_args!("cannot open image {path}"), &e),
    })?;
    let attr = kiln_client::block_on(vol.fstat(&fd))
        .with_context(|| format!("cannot stat image {path}"))?;
    if attr.mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::failed(format!("image {path} is not a regular file")));
    }
    let mut id = [0u8; 20];
    let tag = format!("kiln-{:x}", attr.ino);
    let n = tag.len().min(20);
    id[..n].copy_from_slice(&tag.as_bytes()[..n]);
    Ok(Image {
        vol: vol.clone(),
        fd,
        size: attr.size,
        read_only,
        id,
    })
}

/// What the device did, and what the client copied (0 on this path for reads).
fn log_summary(blk: &Blk) {
    use std::sync::atomic::Ordering::Relaxed;
    let s = blk.stats();
    let copied: u64 = blk
        .image()
        .vol
        .clients()
        .iter()
        .map(|c| c.stats().bytes_copied.load(Relaxed))
        .sum();
    tracing::info!(
        reads = s.reads.load(Relaxed),
        read_bytes = s.read_bytes.load(Relaxed),
        writes = s.writes.load(Relaxed),
        write_bytes = s.write_bytes.load(Relaxed),
        flushes = s.flushes.load(Relaxed),
        discards = s.discards.load(Relaxed),
        zeroes = s.zeroes.load(Relaxed),
        errors = s.errors.load(Relaxed),
        bytes_copied = copied,
        "device summary"
    );
}

/// On SIGINT or SIGTERM: lets the requests in flight complete (starting no more), makes what
/// they wrote durable, gives the lock back, removes the socket, logs and exits. A QEMU that
/// connected with `reconnect=` keeps its guest running and hands what the guest asked for
/// meanwhile to the next `kiln vhost-user-blk` on the socket.
async fn stop_on_signal(blk: Blk, held: Option<Held>, sock: PathBuf) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    let sig = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("{sig}: stopping (once the requests in flight complete; again to exit now)");
    let b = blk.clone();
    let stopped = tokio::task::spawn_blocking(move || b.stop());
    // Requests wait on bricks that may not come back soon: a second signal does not wait.
    let was = tokio::select! {
        r = stopped => r.unwrap_or(0),
        _ = term.recv() => now(&sock),
        _ = int.recv() => now(&sock),
    };
    let img = blk.image();
    if !img.read_only {
        if let Err(e) = img.vol.fsync(&img.fd, false).await {
            tracing::warn!("cannot make the image's writes durable: {e}");
        }
    }
    tracing::info!(
        in_flight = was,
        "stopped: every request started has completed"
    );
    log_summary(&blk);
    if let Some(h) = held {
        h.release().await;
    }
    let _ = std::fs::remove_file(&sock);
    std::process::exit(0);
}

/// A second SIGINT or SIGTERM while stopping: exits at once, requests in flight or not.
fn now(sock: &Path) -> ! {
    tracing::warn!("signalled again: exiting without waiting for the requests in flight");
    let _ = std::fs::remove_file(sock);
    std::process::exit(1);
}
