//! Mounting and unmounting: the FUSE session in the background or in the foreground until a
//! signal, and the lazy unmount.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::volume::Source;
use kiln_client::Volume;

use crate::*;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// Waits for SIGINT or SIGTERM (blocked by `block_signals`); false if waiting failed.
fn wait_for_signal() -> bool {
    // SAFETY: plain signal-set manipulation on a zeroed sigset_t, and sigwait into a local.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let mut sig = 0;
        let r = libc::sigwait(&set, &mut sig);
        if r != 0 {
            tracing::warn!("sigwait failed: {}", std::io::Error::from_raw_os_error(r));
        }
        r == 0
    }
}

fn block_signals() {
    // SAFETY: as above; threads started afterwards inherit the mask, so only `sigwait` sees them.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Something is mounted on `dir` that a new mount would hide. An automount point (autofs,
/// from an fstab line with `x-systemd.automount`) is not: it is waiting for this very mount.
fn is_mountpoint(dir: &Path) -> bool {
    mounted_at(dir).is_some_and(|(kind, _)| kind != "autofs")
}

/// The file system type and source of what is mounted on `dir` now (the topmost mount), from
/// `/proc/self/mountinfo`.
fn mounted_at(dir: &Path) -> Option<(String, String)> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let canon = dir.canonicalize().ok()?.to_string_lossy().into_owned();
    mounts.lines().rev().find_map(|l| {
        let (mount, fs) = l.split_once(" - ")?;
        if unescape(mount.split(' ').nth(4)?) != canon {
            return None;
        }
        let mut f = fs.split(' ');
        Some((f.next()?.to_owned(), unescape(f.next()?)))
    })
}

/// A mountinfo field with its octal escapes (`\040` for a space) decoded.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mounts the volume of the client stack `vol` on `mountpoint` and serves it from background
/// threads until the returned session is dropped or joined (after an unmount).
pub fn mount_background(
    vol: Arc<Volume>,
    source: &str,
    mountpoint: &Path,
    mode: Mode,
    attr_timeout: Duration,
    threads: usize,
) -> Result<fuser::BackgroundSession, Error> {
    let fs = KilnFs::new(vol, mode, attr_timeout)
        .with_context(|| format!("cannot read the root of {source}"))?;
    serve_background(fs, source, mountpoint, threads)
}

/// Serves `fs` on `mountpoint` from background threads (see [`mount_background`]).
pub fn serve_background(
    fs: KilnFs,
    source: &str,
    mountpoint: &Path,
    threads: usize,
) -> Result<fuser::BackgroundSession, Error> {
    serve_background_with(fs, source, mountpoint, threads, Vec::new())
}

/// [`serve_background`] with more of the kernel's mount flags (`ro`, `nosuid`, … from
/// [`kernel_flag`]), set as the mount is made.
pub fn serve_background_with(
    fs: KilnFs,
    source: &str,
    mountpoint: &Path,
    threads: usize,
    flags: Vec<fuser::MountOption>,
) -> Result<fuser::BackgroundSession, Error> {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(format!("kiln:{source}")),
        // The mount's type is fuse.kiln, so mount(8) hands a later `mount -o remount,...` to
        // mount.fuse.kiln (scripts/) instead of mount.fuse, which would try to run the source
        // as a program. fuser's own Subtype reaches only fusermount; the kernel takes it as
        // a mount option.
        fuser::MountOption::CUSTOM("subtype=kiln".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    config.mount_options.extend(flags);
    // Every user may use the mount (the kernel's `allow_other`); fuser itself would otherwise
    // refuse requests from anyone but the mounting user with EACCES. Access is checked by the
    // kernel (default_permissions) and by the bricks, which act as the caller.
    config.acl = fuser::SessionACL::All;
    let mut fs = fs;
    fs.gate = crate::gate::Gate::new(threads.max(1));
    config.n_threads = Some(threads.max(1));
    // Splice answers replies on the descriptor their requests were read from: one for all.
    config.clone_fd = !fs.splice.is_on();
    let fresh = fs.fresh.clone();
    let watch = (fs.mode == Mode::General).then(|| (fs.vol.clone(), fs.caches()));
    let splice = fs.splice_handle();
    let session = fuser::Session::new(fs, mountpoint, &config)
        .with_context(|| format!("cannot mount on {}", mountpoint.display()))?;
    if let Some(s) = splice {
        use std::os::fd::AsFd;
        s.set_device(session.as_fd());
    }
    fresh.set_notifier(session.notifier());
    if let Some((vol, caches)) = watch {
        if let Err(e) = changes::watch(&vol, caches) {
            tracing::warn!(
                "the bricks do not all push changes ({e}): other clients' changes are seen \
                 within --attr-timeout"
            );
        }
    }
    session.spawn().context("cannot start the FUSE session")
}

/// The kernel's mount flags `kiln mount -o` sets as it mounts (the mount is never without
/// them, as it would be between a mount and a remount), by name.
pub const KERNEL_FLAGS: [(&str, fuser::MountOption); 13] = {
    use fuser::MountOption as M;
    [
        ("ro", M::RO),
        ("rw", M::RW),
        ("nosuid", M::NoSuid),
        ("suid", M::Suid),
        ("nodev", M::NoDev),
        ("dev", M::Dev),
        ("noexec", M::NoExec),
        ("exec", M::Exec),
        ("noatime", M::NoAtime),
        ("atime", M::Atime),
        ("sync", M::Sync),
        ("async", M::Async),
        ("dirsync", M::DirSync),
    ]
};

/// The flag `-o NAME` asks for, if it is one of [`KERNEL_FLAGS`].
pub fn kernel_flag(name: &str) -> Option<fuser::MountOption> {
    KERNEL_FLAGS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| f.clone())
}

/// What `kiln mount`'s arguments name: the stack's source, a label for the mount and the mount
/// point. With `--volfile`, one positional argument is the mount point; two are a label and the
/// mount point.
pub fn mount_target(args: &MountArgs) -> Result<(Source, String, PathBuf), Error> {
    match (&args.volfile, &args.mountpoint) {
        (Some(v), None) => Ok((
            Source::Volfile(v.clone()),
            v.display().to_string(),
            PathBuf::from(&args.source),
        )),
        (Some(v), Some(m)) => Ok((Source::Volfile(v.clone()), args.source.clone(), m.clone())),
        (None, Some(m)) => Ok((Source::parse(&args.source)?, args.source.clone(), m.clone())),
        (None, None) => Err(Error::invalid(
            "missing the mount point: kiln mount SERVER:/VOL DIR",
        )),
    }
}

/// `kiln mount`.
pub fn main(args: MountArgs) -> Result<(), Error> {
    if let Some(p) = &args.secret_file {
        kiln_client::mgmt::use_secret_file(p);
    }
    let (source, label, mountpoint) = mount_target(&args)?;
    match std::fs::metadata(&mountpoint) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(Error::invalid(format!(
                "mount point {} is not a directory",
                mountpoint.display()
            )))
        }
        Err(e) => {
            return Err(Error::io(
                format_args!("mount point {}", mountpoint.display()),
                &e,
            ))
        }
    }
    if is_mountpoint(&mountpoint) {
        return Err(Error::conflict(format!(
            "mount point {} is busy: something is already mounted there",
            mountpoint.display()
        )));
    }
    let mut nonempty = false;
    let mut flags = Vec::new();
    for o in &args.options {
        match (o.as_str(), kernel_flag(o)) {
            ("nonempty", _) => nonempty = true,
            (_, Some(f)) => flags.push(f),
            (other, None) => {
                let names: Vec<&str> = KERNEL_FLAGS.iter().map(|(n, _)| *n).collect();
                return Err(Error::invalid(format!(
                    "unknown mount option {other:?} (known: nonempty, {})",
                    names.join(", ")
                )));
            }
        }
    }
    let empty = std::fs::read_dir(&mountpoint)
        .with_context(|| format!("mount point {}", mountpoint.display()))?
        .next()
        .is_none();
    if !empty && !nonempty {
        return Err(Error::failed(format!(
            "mount point {} is not empty: what it holds would be hidden while mounted \
             (-o nonempty mounts there anyway)",
            mountpoint.display()
        )));
    }
    block_signals();
    kiln_client::start_metrics(&args.metrics, "kiln-mount")?;
    let vol = Volume::from_source(&source).with_context(|| format!("cannot reach {source}"))?;
    let ttl = Duration::from_secs_f64(args.attr_timeout.max(0.0));
    let vol = Arc::new(vol);
    let fs = KilnFs::new(vol.clone(), args.mode, ttl)
        .with_context(|| format!("cannot read the root of {label}"))?
        .with_passthrough(args.passthrough == Switch::On)
        .with_splice(args.splice == Switch::On)
        .with_acl(args.acl)
        .with_writeback_cache(args.writeback_cache)
        .with_write_behind(args.write_behind == Switch::On)
        .with_small_file_max(args.small_file_max);
    let bg = serve_background_with(fs, &label, &mountpoint, args.threads, flags)?;
    println!(
        "kiln: mounted {} on {} ({:?} mode)",
        label,
        mountpoint.display(),
        args.mode
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let r = serve_until_unmounted(bg, &mountpoint);
    // Unmounted, every request answered: the bricks are told this client ends cleanly, so
    // nothing it wrote is left for heal to check.
    if r.is_ok() {
        vol.end();
    }
    r
}

/// Serves until a signal arrives (then unmounts) or the file system is unmounted from outside.
fn serve_until_unmounted(bg: fuser::BackgroundSession, mountpoint: &Path) -> Result<(), Error> {
    enum Event {
        Signal,
        Ended(std::io::Result<()>),
    }
    let (tx, rx) = std::sync::mpsc::channel::<Event>();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        if wait_for_signal() {
            let _ = tx.send(Event::Signal);
        }
    });
    std::thread::spawn(move || {
        let _ = tx2.send(Event::Ended(bg.join()));
    });
    loop {
        match rx.recv() {
            Ok(Event::Signal) => {
                tracing::info!("signal received, unmounting {}", mountpoint.display());
                if let Err(e) = unmount(mountpoint) {
                    tracing::warn!("{e}; detaching instead");
                    let _ = umount_lazy(mountpoint);
                }
            }
            Ok(Event::Ended(r)) => return r.context("FUSE session ended"),
            Err(_) => return Err(Error::failed("FUSE session thread vanished")),
        }
    }
}

fn umount_lazy(dir: &Path) -> Result<(), Error> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::invalid("bad path"))?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(Error::failed(format!(
            "cannot detach {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// `kiln umount DIR`: unmounts a Kiln mount, and nothing else (`umount(8)` is for the rest).
pub fn umount(dir: &Path) -> Result<(), Error> {
    match mounted_at(dir) {
        None => Err(Error::invalid(format!(
            "{} is not a mount point",
            dir.display()
        ))),
        Some((kind, source)) if kind == "fuse.kiln" || source.starts_with("kiln:") => unmount(dir),
        Some((kind, source)) => Err(Error::failed(format!(
            "{} is not a Kiln mount ({kind} from {source}); use umount(8) for it",
            dir.display()
        ))),
    }
}

/// Unmounts `dir`, whatever is mounted there.
fn unmount(dir: &Path) -> Result<(), Error> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::invalid("bad path"))?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::failed(format!(
            "cannot unmount {}: {e}",
            dir.display()
        )));
    }
    Ok(())
}
