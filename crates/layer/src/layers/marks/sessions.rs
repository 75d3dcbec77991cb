//! Heal sessions on the replica being healed: what other connections changed since a heal
//! began, and heal's own writes, which skip it.
//!
//! Names and attributes the same way: a session also records which [`aspect`]s of the name
//! (the entry, mode, owner, times, xattrs) other connections changed since it began, and a
//! change heal makes to the name through the same connection while the session lives skips
//! what they touched — a setattr drops those attributes, any other change fails with
//! [`m::SKIPPED`] — because the target's are the newer: the client's change reaches the
//! replica heal copies from too, after heal read it. (A touched entry counts as every
//! aspect: an entry made anew has new attributes.)

use std::time::Instant;

use crate::marks::{self as m, HealInfo, RangeSet};
use crate::{errno, Ctx, Fut, IoBufs, Written};

use super::locks::{len_of, span, Entered};
use super::*;

impl Marks {
    /// Begins (afresh) `owner`'s heal session on `path`: changes in flight now count as
    /// changed since it began. Another connection's live heal session on the file refuses a
    /// heal's (`EBUSY`): two heals copying one file at once only slow each other down (and
    /// one would wait on the other's locks until its own session lapsed); the heal refused
    /// waits for the other to finish and then looks at what is left.
    pub(super) fn heal_begin(&self, owner: u64, path: &str, migrate: bool) -> FopResult<()> {
        let key = self.key(path);
        let mut st = key.state();
        let now = Instant::now();
        st.sessions.retain(|s| s.expires > now && s.owner != owner);
        if !migrate && st.sessions.iter().any(|s| !s.migrate) {
            return Err(libc::EBUSY as u32);
        }
        let mut written = RangeSet::default();
        for w in st.inflight.iter().filter(|w| !w.heal && w.owner != owner) {
            written.add(w.start, len_of(w.start, w.end));
        }
        let busy = st.clients > 0 || !written.is_empty();
        // A change of the name in flight now may be anything: all of it counts as touched.
        let naming = st
            .inflight
            .iter()
            .any(|w| w.ns && !w.heal && w.owner != owner);
        st.sessions.push(Session {
            owner,
            expires: now + m::LOCK_LEASE,
            written,
            skipped: RangeSet::default(),
            busy,
            touched: if naming { aspect::ALL } else { 0 },
            migrate,
            frozen: false,
        });
        Ok(())
    }

    /// What of the name other connections touched since `owner`'s live session on the file
    /// began ([`aspect`] bits; a touched entry counts as all of it); 0 without a session.
    pub(super) fn touched(key: &FileKey, owner: u64) -> u32 {
        let st = key.state();
        let now = Instant::now();
        let t = st
            .sessions
            .iter()
            .find(|s| s.owner == owner && s.expires > now)
            .map_or(0, |s| s.touched);
        if t & aspect::ENTRY != 0 {
            aspect::ALL
        } else {
            t
        }
    }

    pub(super) fn heal_end(&self, owner: u64, path: &str) {
        let key = self.key(path);
        key.state().sessions.retain(|s| s.owner != owner);
        self.forget(path, &key);
    }

    /// `owner`'s session on `path`, as [`HealInfo`]; hands over (and forgets) what its writes
    /// skipped.
    pub(super) fn heal_info(&self, owner: u64, path: &str) -> HealInfo {
        let key = self.key(path);
        let mut info = HealInfo::default();
        {
            let mut st = key.state();
            let now = Instant::now();
            st.sessions.retain(|s| s.expires > now);
            if let Some(s) = st.sessions.iter_mut().find(|s| s.owner == owner) {
                s.expires = now + m::LOCK_LEASE;
                info.live = 1;
                info.busy = u32::from(s.busy);
                let skipped = std::mem::take(&mut s.skipped);
                let room = m::PAGE_BYTES / 16 - 1;
                let mut rest: Option<(u64, u64)> = None;
                for (i, (o, l)) in skipped.iter().enumerate() {
                    if i < room {
                        info.skipped.0.push(m::Range { offset: o, len: l });
                    } else {
                        // Past the page's room: one range over all the rest.
                        let end = if l == m::WHOLE { u64::MAX } else { o + l };
                        rest = Some(rest.map_or((o, end), |(a, b)| (a, b.max(end))));
                    }
                }
                if let Some((a, b)) = rest {
                    info.skipped.0.push(m::Range {
                        offset: a,
                        len: len_of(a, b),
                    });
                }
            }
        }
        self.forget(path, &key);
        info
    }

    /// A write through a heal handle: only the parts no client changed since the session
    /// began; the reply counts the bytes written (fewer than sent when some were skipped).
    pub(super) fn heal_write<'a>(
        &'a self,
        cx: &'a Ctx,
        mfd: &'a MarkFd,
        offset: u64,
        data: IoBufs,
    ) -> Fut<'a, Written> {
        Box::pin(async move {
            let len = data.len() as u64;
            if len == 0 {
                return self.child().write(cx, &mfd.inner, offset, data).await;
            }
            let (start, end) = span(offset, len);
            let (id, keep) = Marks::enter_heal(&mfd.key, cx.owner, start, end, false).await?;
            let _in = Entered { key: &mfd.key, id };
            if keep == [(offset, len)] {
                let w = self.child().write(cx, &mfd.inner, offset, data).await?;
                // Heal's writes are whole or an error: a short one would read as "skipped".
                return if w.n as u64 == len {
                    Ok(w)
                } else {
                    Err(errno::EIO)
                };
            }
            let mut n = 0;
            for (o, l) in keep {
                let bytes = copy_out(&data, (o - offset) as usize, l as usize);
                let w = self
                    .child()
                    .write(cx, &mfd.inner, o, IoBufs::owned(vec![bytes]))
                    .await?;
                if w.n as u64 != l {
                    return Err(errno::EIO);
                }
                n += w.n;
            }
            Ok(Written { n, bufs: data })
        })
    }
}

/// `len` bytes of a write's data from byte `from` on, copied out.
fn copy_out(data: &IoBufs, from: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut skip = from;
    for v in data.iov() {
        if out.len() == len {
            break;
        }
        if skip >= v.len {
            skip -= v.len;
            continue;
        }
        // SAFETY: a write's vectors point to memory that its `IoBufs` keeps valid, and that
        // nobody writes, for as long as it lives; `data` is borrowed for this whole call.
        let s = unsafe { std::slice::from_raw_parts(v.base as *const u8, v.len) };
        let take = (v.len - skip).min(len - out.len());
        out.extend_from_slice(&s[skip..skip + take]);
        skip = 0;
    }
    out
}
