//! Listing a directory across subvolumes: entries merged in subvolume order, with cursors so
//! a listing resumes where it stopped.

use crate::{Ctx, FopResult, ReaddirReply};

use super::*;

impl Distribute {
    pub(super) fn cursor(&self, path: &str, offset: u64) -> Option<Cursor> {
        let c = self.cursors.lock().ok()?;
        c.map.get(&(path.to_owned(), offset)).copied()
    }

    pub(super) fn save_cursor(&self, path: &str, offset: u64, cur: Cursor) {
        if let Ok(mut c) = self.cursors.lock() {
            let key = (path.to_owned(), offset);
            if c.map.insert(key.clone(), cur).is_none() {
                c.order.push_back(key);
                while c.order.len() > CURSORS_MAX {
                    if let Some(old) = c.order.pop_front() {
                        c.map.remove(&old);
                    }
                }
            }
        }
    }

    /// Whether an entry of subvolume `sub` belongs in the merged listing.
    pub(super) fn listed(sub: usize, e: &kiln_proto::ops::DirEntry) -> bool {
        (sub == 0 || !is_dir(&e.attr)) && !e.name.starts_with(super::migrate::MOVING_PREFIX)
    }

    /// Finds the position of merged index `target` by walking the listing from the start.
    pub(super) async fn seek(&self, cx: &Ctx, path: &str, target: u64) -> FopResult<Cursor> {
        let mut count = 0u64;
        for (sub, kid) in self.kids.iter().enumerate() {
            let mut off = 0u64;
            loop {
                let r = match kid.readdir(cx, path, off, SEEK_PAGE).await {
                    Ok(r) => r,
                    Err(ENOENT) if sub > 0 => break,
                    Err(e) => return Err(e),
                };
                let got = r.entries.0.len() as u64;
                for (i, e) in r.entries.0.iter().enumerate() {
                    if Self::listed(sub, e) {
                        count += 1;
                        if count == target {
                            return Ok(Cursor {
                                sub,
                                off: off + i as u64 + 1,
                            });
                        }
                    }
                }
                off += got;
                if r.eof || got == 0 {
                    break;
                }
            }
        }
        Ok(Cursor {
            sub: self.kids.len(),
            off: 0,
        })
    }

    pub(super) async fn readdir_merged(
        &self,
        cx: &Ctx,
        path: &str,
        offset: u64,
        max: u32,
    ) -> FopResult<ReaddirReply> {
        if self.kids.is_empty() {
            return Err(ENOTCONN);
        }
        let mut cur = if offset == 0 {
            Cursor { sub: 0, off: 0 }
        } else {
            match self.cursor(path, offset) {
                Some(c) => c,
                None => self.seek(cx, path, offset).await?,
            }
        };
        let mut out = Vec::new();
        while out.len() < max as usize && cur.sub < self.kids.len() {
            let want = max - out.len() as u32;
            let r = match self.kids[cur.sub].readdir(cx, path, cur.off, want).await {
                Ok(r) => r,
                Err(ENOENT) if cur.sub > 0 => {
                    cur = Cursor {
                        sub: cur.sub + 1,
                        off: 0,
                    };
                    continue;
                }
                Err(e) => return Err(e),
            };
            let got = r.entries.0.len();
            cur.off += got as u64;
            let sub = cur.sub;
            out.extend(r.entries.0.into_iter().filter(|e| Self::listed(sub, e)));
            if r.eof || got == 0 {
                cur = Cursor {
                    sub: cur.sub + 1,
                    off: 0,
                };
            }
        }
        let eof = cur.sub >= self.kids.len();
        if !eof {
            self.save_cursor(path, offset + out.len() as u64, cur);
        }
        Ok(ReaddirReply {
            entries: kiln_proto::codec::Seq(out),
            eof,
        })
    }
}
