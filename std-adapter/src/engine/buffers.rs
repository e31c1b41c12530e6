//! Buffers kept between calls: [`grow`], and a [`Pool`] of scratch sets that each task running
//! at the same time leases one of ([`Lease`]), so that a steady-state step allocates nothing.

use std::sync::{Mutex, PoisonError};

/// Grows `v` to at least `len` elements (never shrinks it).
pub(crate) fn grow<T: Clone + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// Scratch sets of type `T`, one per task that used one at the same time, kept between calls.
#[derive(Debug, Default)]
pub(crate) struct Pool<T> {
    free: Mutex<Vec<T>>,
}

impl<T> Pool<T> {
    /// The sets not leased now.
    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl<T> Pool<T> {
    /// Runs `f` on every set not leased now.
    #[cfg(test)]
    pub(crate) fn for_each_free(&self, f: impl FnMut(&mut T)) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter_mut()
            .for_each(f);
    }
}

impl<T: Default> Pool<T> {
    /// A lease on this pool: it takes a set on its first [`Lease::get`] (a new one when none is
    /// free) and gives it back when dropped.
    pub(crate) fn lease(&self) -> Lease<'_, T> {
        Lease {
            pool: self,
            item: None,
        }
    }
}

/// A set leased from a [`Pool`], taken when first used.
pub(crate) struct Lease<'p, T: Default> {
    pool: &'p Pool<T>,
    item: Option<T>,
}

impl<T: Default> Lease<'_, T> {
    /// The leased set.
    pub(crate) fn get(&mut self) -> &mut T {
        let pool = self.pool;
        self.item.get_or_insert_with(|| {
            pool.free
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop()
                .unwrap_or_default()
        })
    }
}

impl<T: Default> Drop for Lease<'_, T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(item);
        }
    }
}
