//! Locks that keep working after a panic.
//!
//! A thread that panics while holding a `std` lock poisons it, and every later `lock()` then
//! returns an error. Kiln's locks guard caches, tables and queues whose every update is
//! complete or not made (no invariant spans a panic), so a poisoned lock is taken as it is:
//! one request's panic must not stop a brick or a mount from serving the next. These traits
//! say so once.
//!
//! (Here because every Kiln crate builds on this one; it does no I/O.)

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// [`Mutex::lock`], poisoned or not.
pub trait MutexExt<T: ?Sized> {
    /// The guard, whether or not a panic poisoned the lock.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock::read`] and [`RwLock::write`], poisoned or not.
pub trait RwLockExt<T: ?Sized> {
    /// A read guard, whether or not a panic poisoned the lock.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// The write guard, whether or not a panic poisoned the lock.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let r = std::sync::Arc::new(RwLock::new(1));
        let (m2, r2) = (m.clone(), r.clone());
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            let _w = r2.write().unwrap();
            panic!("poisons both");
        })
        .join();
        assert!(m.is_poisoned() && r.is_poisoned());
        *m.locked() += 1;
        *r.write_locked() += 1;
        assert_eq!((*m.locked(), *r.read_locked()), (2, 2));
    }
}
