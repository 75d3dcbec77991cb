//! The image's exclusive lock: one writable export of an image at a time.
//!
//! A writable export takes the image's lease on the bricks ([`kiln_proto::ops::LeaseReq`])
//! before it listens, and renews it every third of its time to live. While it holds the lease,
//! the bricks refuse changes of the image from every other client connection (`EBUSY`), so a
//! second export of the same image — a second QEMU started by mistake — is refused at start
//! (or waits, with `--lock-wait`) instead of corrupting it. The lease is given back when the
//! export stops, and the bricks drop it when its connection goes away (`kill -9`); an export
//! that stays alive but cut off (a partition) keeps it until it lapses, and from the moment
//! another export takes it over the bricks refuse the old one's writes, wherever they were
//! queued. A live migration hands over the same way: stop the source's export, start (or let
//! wait) the destination's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_client::{Fd, LeaseState, Volume};
use kiln_proto::ops::{LEASE_ACQUIRE, LEASE_RELEASE};
use kiln_proto::Error;

/// How an export locks its image.
#[derive(Debug, Clone)]
pub struct LockConfig {
    /// How long a grant lasts without a renewal: how long a cut-off holder keeps others out.
    pub ttl: Duration,
    /// How long to wait at start for another holder to let go (0: refuse at once).
    pub wait: Duration,
    /// Refuse to export when the bricks cannot lock (a standalone brick has no lock
    /// support); otherwise export unlocked, with a warning.
    pub required: bool,
}

impl Default for LockConfig {
    fn default() -> LockConfig {
        LockConfig {
            ttl: Duration::from_secs(10),
            wait: Duration::ZERO,
            required: false,
        }
    }
}

/// The lock, held: renewed in the background until released.
pub struct Held {
    vol: Arc<Volume>,
    fd: Option<Fd>,
    holder: String,
    ttl_ms: u32,
    renew: tokio::task::JoinHandle<()>,
    lost: Arc<AtomicBool>,
}

/// A name for this export unique among all holders: host, process and a nonce.
fn holder_name(export: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into());
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // The brick keeps names of 256 bytes at most; what follows `#` is shown to nobody else.
    let export: String = export.chars().take(120).collect();
    let host: String = host.chars().take(64).collect();
    format!(
        "kiln-nbd {export} on {host} pid {} #{nonce:08x}",
        std::process::id()
    )
}

/// Takes the lease of the image open as `fd` (kept open while held) for export `export`,
/// waiting up to `cfg.wait` for another holder; the error names the holder. `None`: the
/// bricks cannot lock and the lock is not required.
pub async fn take(
    vol: Arc<Volume>,
    fd: Fd,
    export: &str,
    cfg: &LockConfig,
) -> Result<Option<Held>, Error> {
    let holder = holder_name(export);
    let ttl_ms = cfg.ttl.as_millis().clamp(100, 300_000) as u32;
    let deadline = Instant::now() + cfg.wait;
    let mut told = false;
    loop {
        let st: LeaseState = match vol.lease(&fd, LEASE_ACQUIRE, ttl_ms, &holder).await {
            Ok(st) => st,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) && !cfg.required => {
                tracing::warn!(
                    "the bricks cannot lock images (standalone bricks): exporting unlocked"
                );
                let _ = vol.close(fd).await;
                return Ok(None);
            }
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) && !cfg.required => {
                tracing::warn!("a sharded image cannot be locked yet: exporting unlocked");
                let _ = vol.close(fd).await;
                return Ok(None);
            }
            Err(e) => {
                let _ = vol.close(fd).await;
                return Err(match e.raw_os_error() {
                    Some(libc::EOPNOTSUPP) => Error::invalid(
                        "the image cannot be locked (a sharded file): use --lock off",
                    ),
                    Some(libc::ENOSYS) => Error::invalid(
                        "the bricks cannot lock images (standalone bricks, not a managed \
                         volume): use --lock off or auto",
                    ),
                    _ => Error::io("cannot lock the image", &e),
                });
            }
        };
        if st.granted {
            tracing::info!(holder, token = st.token, "image locked");
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let _ = vol.close(fd).await;
            return Err(Error::failed(format!(
                "the image is locked by another export ({}); its lease lapses in {:.1} s \
                 unless renewed. Stop that export first, wait for it with --lock-wait SECS, \
                 or export read-only with --read-only",
                st.holder,
                f64::from(st.remaining_ms) / 1000.0
            )));
        }
        if !told {
            tracing::info!(by = st.holder, "image locked by another export: waiting");
            told = true;
        }
        // The holder may let go at any moment (its connection closes): look again soon.
        let pause = Duration::from_millis(u64::from(st.remaining_ms) + 10)
            .min(Duration::from_millis(200))
            .min(left);
        tokio::time::sleep(pause).await;
    }
    let lost = Arc::new(AtomicBool::new(false));
    let renew = tokio::spawn(renew(
        vol.clone(),
        fd.clone(),
        holder.clone(),
        ttl_ms,
        lost.clone(),
    ));
    Ok(Some(Held {
        vol,
        fd: Some(fd),
        holder,
        ttl_ms,
        renew,
        lost,
    }))
}

/// Renews the lease every third of its time to live until it is lost.
async fn renew(vol: Arc<Volume>, fd: Fd, holder: String, ttl_ms: u32, lost: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(u64::from(ttl_ms / 3)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut renewed = Instant::now();
    let mut warned = false;
    loop {
        tick.tick().await;
        match vol.lease(&fd, LEASE_ACQUIRE, ttl_ms, &holder).await {
            Ok(s) if s.granted => {
                renewed = Instant::now();
                warned = false;
            }
            Ok(s) => {
                tracing::error!(
                    by = s.holder,
                    "the image lock was taken over: the bricks refuse this export's writes now"
                );
                lost.store(true, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                let lapsed = renewed.elapsed() > Duration::from_millis(ttl_ms.into());
                if lapsed && !warned {
                    tracing::error!(
                        "the image lock was not renewed for longer than its lease ({e}): \
                         another export may take it over, and then the bricks refuse this \
                         export's writes"
                    );
                    warned = true;
                } else {
                    tracing::warn!("cannot renew the image lock (retrying): {e}");
                }
            }
        }
    }
}

impl Held {
    /// True once another export took the lock over.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// Stops renewing and gives the lease back.
    pub async fn release(mut self) {
        self.renew.abort();
        if let Some(fd) = self.fd.take() {
            if !self.lost() {
                match self
                    .vol
                    .lease(&fd, LEASE_RELEASE, self.ttl_ms, &self.holder)
                    .await
                {
                    Ok(_) => tracing::info!("image lock released"),
                    Err(e) => tracing::warn!("cannot release the image lock: {e}"),
                }
            }
            let _ = self.vol.close(fd).await;
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renew.abort();
    }
}
