//! A global allocator for the allocation tests: it forwards every call to the system allocator
//! and counts, while asked to, the allocation calls made on this thread, those made on every
//! thread (rayon's workers included), and the peak of bytes live on this thread. A test binary
//! that uses it includes this file (`#[path = "common/counting.rs"] mod counting;`) and
//! declares `#[global_allocator] static GLOBAL: counting::Counting = counting::Counting;`.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The counting allocator.
pub struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static CALLS: Cell<usize> = const { Cell::new(0) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

static EVERY_THREAD_ON: AtomicBool = AtomicBool::new(false);
static EVERY_THREAD_CALLS: AtomicUsize = AtomicUsize::new(0);

/// Notes one call that changes the bytes live by `delta` (`call`: an allocation, not a free).
fn note(delta: isize, call: bool) {
    if call && EVERY_THREAD_ON.load(Ordering::Relaxed) {
        EVERY_THREAD_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    // `try_with`: the thread-locals may already be gone while a thread shuts down.
    let _ = ON.try_with(|on| {
        if on.get() {
            if call {
                let _ = CALLS.try_with(|c| c.set(c.get() + 1));
            }
            let _ = LIVE.try_with(|l| {
                let v = l.get() + delta;
                l.set(v);
                let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
            });
        }
    });
}

// SAFETY: the crate itself forbids unsafe code; the test binaries need `unsafe impl GlobalAlloc`
// to count allocations (std-adapter's Cargo.toml sets `unsafe_code = "deny"` so that test files
// may allow it). Every call forwards to the system allocator unchanged; counting only touches
// atomics and const-initialised thread-locals, which never allocate.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize, true);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize, true);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as isize - layout.size() as isize, true);
        // SAFETY: forwarded with the caller's pointer, layout and size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize), false);
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Runs `f` with this thread's counters reset and on; returns its result.
fn on_this_thread<R>(f: impl FnOnce() -> R) -> R {
    CALLS.with(|c| c.set(0));
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    ON.with(|on| on.set(true));
    let r = f();
    ON.with(|on| on.set(false));
    r
}

/// Allocation calls (alloc, alloc_zeroed, realloc) made by `f` on this thread (other test
/// threads are not counted).
pub fn allocations(f: impl FnOnce()) -> usize {
    on_this_thread(f);
    CALLS.with(Cell::get)
}

/// Allocation calls made while `f` runs, on every thread: use it in a binary with one test, so
/// that no other test allocates meanwhile.
pub fn allocations_on_every_thread(f: impl FnOnce()) -> usize {
    EVERY_THREAD_CALLS.store(0, Ordering::SeqCst);
    EVERY_THREAD_ON.store(true, Ordering::SeqCst);
    f();
    EVERY_THREAD_ON.store(false, Ordering::SeqCst);
    EVERY_THREAD_CALLS.load(Ordering::SeqCst)
}

/// `f`'s result and the peak bytes allocated (above what was live before) on this thread while
/// it runs.
pub fn peak<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let r = on_this_thread(f);
    (r, PEAK.with(Cell::get).max(0) as usize)
}
