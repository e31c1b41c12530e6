//! Small helpers shared by the SIMD kernels: loads of eight lanes, zero-padded tails, and the
//! element sources the selection scan reads from.
//!
//! Everything here uses safe `wide` operations only. Tails (the last `len % 8` elements) are
//! loaded into a zero-padded `[f32; 8]` and go through the same kernel as full chunks.
//!
//! [`prefetch`] asks for a cache line [`AHEAD`] elements before a streaming kernel reads it
//! (through `safe_arch`, `wide`'s own backend; a hint that never changes a result): a core's
//! hardware prefetcher may keep too few lines in flight for a loop that does more per element
//! than add.

use wide::bytemuck::cast;
use wide::{f32x8, i8x16, i16x8};

/// Lanes per vector.
pub(crate) const LANES: usize = 8;

/// Loads `s[..8]` (`s.len() >= 8`).
#[inline]
pub(crate) fn load(s: &[f32]) -> f32x8 {
    let mut a = [0.0f32; LANES];
    a.copy_from_slice(&s[..LANES]);
    f32x8::new(a)
}

/// Loads `s` (`s.len() <= 8`) into the low lanes, the others zero.
#[inline]
pub(crate) fn load_padded(s: &[f32]) -> f32x8 {
    let mut a = [0.0f32; LANES];
    a[..s.len()].copy_from_slice(s);
    f32x8::new(a)
}

/// How far ahead of their reads the streaming kernels prefetch, in f32 elements (16 KiB per
/// stream).
pub(crate) const AHEAD: usize = 4096;

/// Asks for the cache line that holds `x[i]` to be loaded into every cache level. Nothing
/// happens when `i` is out of bounds or the target has no prefetch instruction; a hint, it
/// never changes a result.
#[inline(always)]
pub(crate) fn prefetch(x: &[f32], i: usize) {
    if let Some(v) = x.get(i) {
        prefetch_line(v);
    }
}

/// Asks for the cache line that holds `v` (see [`prefetch`]); for loops that take `v` from a
/// slice cut once for many prefetches, so that none needs a bounds check of its own.
#[inline(always)]
pub(crate) fn prefetch_line(v: &f32) {
    #[cfg(all(
        any(target_arch = "x86", target_arch = "x86_64"),
        target_feature = "sse"
    ))]
    safe_arch::prefetch_t0(v);
    #[cfg(not(all(
        any(target_arch = "x86", target_arch = "x86_64"),
        target_feature = "sse"
    )))]
    let _ = v;
}

/// The region of `x` whose lines a streaming loop over `start..start + len` asks for: the
/// same length, `dist` elements on; where that would run past `x`, the loop's own elements (in
/// cache by then: a hint either way). `start..start + len` must be in bounds.
#[inline(always)]
pub(crate) fn region_ahead(x: &[f32], start: usize, len: usize, dist: usize) -> &[f32] {
    let from = start.saturating_add(dist);
    match x.get(from..from.saturating_add(len)) {
        Some(ahead) => ahead,
        None => &x[start..start + len],
    }
}

/// `x[start..start + len]` in chunks of `STEP` elements (16 or 32), each handed out after a
/// prefetch of its lines [`AHEAD`] elements on (one per 16 elements), taken from a region cut
/// once ([`region_ahead`]), so that no prefetch needs a bounds check of its own.
#[inline(always)]
fn chunks_ahead<const STEP: usize>(
    x: &[f32],
    start: usize,
    len: usize,
) -> impl Iterator<Item = &[f32]> {
    let ahead = region_ahead(x, start, len, AHEAD).chunks_exact(STEP);
    x[start..start + len]
        .chunks_exact(STEP)
        .zip(ahead)
        .map(|(c, p)| {
            prefetch_line(&p[0]);
            if STEP > 2 * LANES {
                prefetch_line(&p[2 * LANES]);
            }
            c
        })
}

/// Sixteen elements as two vectors.
#[inline(always)]
fn load2(c: &[f32]) -> [f32x8; 2] {
    [load(c), load(&c[LANES..])]
}

/// Thirty-two elements as four vectors.
#[inline(always)]
fn load4(c: &[f32]) -> [f32x8; 4] {
    [
        load(c),
        load(&c[LANES..]),
        load(&c[2 * LANES..]),
        load(&c[3 * LANES..]),
    ]
}

/// The lane masks of four vectors (every lane all ones or all zeros), lane `j` of vector `v`
/// as bit `8 * v + j`: two saturating packs per pair of vectors and one byte mask per sixteen
/// lanes (what `to_bitmask` per vector, shifted and or-ed, compiles to in more instructions).
#[inline(always)]
pub(crate) fn bitmask32(m: [f32x8; 4]) -> u32 {
    let bytes = |a: f32x8, b: f32x8| {
        i8x16::from_i16x16_saturate(cast([
            i16x8::from_i32x8_saturate(cast(a)),
            i16x8::from_i32x8_saturate(cast(b)),
        ]))
        .to_bitmask()
    };
    bytes(m[0], m[1]) | (bytes(m[2], m[3]) << 16)
}

/// Where a scan reads its elements from: one slice, or the lane-wise f32 sum of two.
pub(crate) trait Source {
    /// Element count.
    fn len(&self) -> usize;
    /// Elements `i..i + 8` (`i + 8 <= len`).
    fn chunk(&self, i: usize) -> f32x8;
    /// Elements `i..len` (`len - i <= 8`), zero-padded.
    fn tail(&self, i: usize) -> f32x8;
    /// Element `i`.
    fn at(&self, i: usize) -> f32;
    /// Elements `start..start + 16 * (len / 16)` sixteen at a time, as two vectors (`start +
    /// len <= len()`): the bounds are checked once, not per chunk.
    fn pairs(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]>;
    /// [`Source::pairs`] that also asks for the line [`AHEAD`] elements past each pair, in
    /// every slice the source reads, from a region cut once (see `region_ahead`), so that no
    /// prefetch needs a bounds check of its own.
    fn pairs_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]>;
    /// [`Source::pairs_ahead`] thirty-two elements at a time, two lines per slice
    /// (`start..start + 32 * (len / 32)`).
    fn quads_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 4]>;
}

/// The elements of one slice.
#[derive(Clone, Copy)]
pub(crate) struct One<'a>(pub(crate) &'a [f32]);

impl Source for One<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn chunk(&self, i: usize) -> f32x8 {
        load(&self.0[i..])
    }
    #[inline]
    fn tail(&self, i: usize) -> f32x8 {
        load_padded(&self.0[i..])
    }
    #[inline]
    fn at(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline]
    fn pairs(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]> {
        self.0[start..start + len]
            .chunks_exact(2 * LANES)
            .map(load2)
    }
    #[inline]
    fn pairs_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]> {
        chunks_ahead::<{ 2 * LANES }>(self.0, start, len).map(load2)
    }
    #[inline]
    fn quads_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 4]> {
        chunks_ahead::<{ 4 * LANES }>(self.0, start, len).map(load4)
    }
}

/// `g[i] + r[i]` in f32 (the input of an error-feedback step); both slices have one length.
#[derive(Clone, Copy)]
pub(crate) struct Sum<'a>(pub(crate) &'a [f32], pub(crate) &'a [f32]);

impl Source for Sum<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn chunk(&self, i: usize) -> f32x8 {
        load(&self.0[i..]) + load(&self.1[i..])
    }
    #[inline]
    fn tail(&self, i: usize) -> f32x8 {
        load_padded(&self.0[i..]) + load_padded(&self.1[i..])
    }
    #[inline]
    fn at(&self, i: usize) -> f32 {
        self.0[i] + self.1[i]
    }
    #[inline]
    fn pairs(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]> {
        let g = self.0[start..start + len].chunks_exact(2 * LANES);
        let r = self.1[start..start + len].chunks_exact(2 * LANES);
        g.zip(r)
            .map(|(a, b)| [load(a) + load(b), load(&a[LANES..]) + load(&b[LANES..])])
    }
    // Not two `chunks_ahead` zipped: that form costs the two-pass error-feedback step 0.2
    // instructions per element more (6.21 against 6.00, `instr ef_step_two_pass`).
    #[inline]
    fn pairs_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]> {
        let ahead = region_ahead(self.0, start, len, AHEAD)
            .chunks_exact(2 * LANES)
            .zip(region_ahead(self.1, start, len, AHEAD).chunks_exact(2 * LANES));
        self.pairs(start, len).zip(ahead).map(|(x, (pg, pr))| {
            prefetch_line(&pg[0]);
            prefetch_line(&pr[0]);
            x
        })
    }
    #[inline]
    fn quads_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 4]> {
        let g = self.0[start..start + len].chunks_exact(4 * LANES);
        let r = self.1[start..start + len].chunks_exact(4 * LANES);
        let ahead = region_ahead(self.0, start, len, AHEAD)
            .chunks_exact(4 * LANES)
            .zip(region_ahead(self.1, start, len, AHEAD).chunks_exact(4 * LANES));
        g.zip(r).zip(ahead).map(|((a, b), (pg, pr))| {
            prefetch_line(&pg[0]);
            prefetch_line(&pg[2 * LANES]);
            prefetch_line(&pr[0]);
            prefetch_line(&pr[2 * LANES]);
            let (a, b) = (load4(a), load4(b));
            [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]]
        })
    }
}

/// Elements `start..start + len` of a source, as a source (its prefetches reach past `len`,
/// into the rest of the underlying source).
pub(crate) struct Range<'a, S>(pub(crate) &'a S, pub(crate) usize, pub(crate) usize);

impl<S: Source> Source for Range<'_, S> {
    #[inline]
    fn len(&self) -> usize {
        self.2
    }
    #[inline]
    fn chunk(&self, i: usize) -> f32x8 {
        self.0.chunk(self.1 + i)
    }
    #[inline]
    fn tail(&self, i: usize) -> f32x8 {
        let live = self.2 - i;
        let mut a = [0.0f32; LANES];
        for (t, v) in a[..live].iter_mut().enumerate() {
            *v = self.0.at(self.1 + i + t);
        }
        f32x8::new(a)
    }
    #[inline]
    fn at(&self, i: usize) -> f32 {
        self.0.at(self.1 + i)
    }
    #[inline]
    fn pairs(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]> {
        self.0.pairs(self.1 + start, len)
    }
    #[inline]
    fn pairs_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 2]> {
        self.0.pairs_ahead(self.1 + start, len)
    }
    #[inline]
    fn quads_ahead(&self, start: usize, len: usize) -> impl Iterator<Item = [f32x8; 4]> {
        self.0.quads_ahead(self.1 + start, len)
    }
}
