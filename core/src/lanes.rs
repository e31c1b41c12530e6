//! Small helpers shared by the SIMD kernels: loads of eight lanes, zero-padded tails, and the
//! element sources the selection scan reads from.
//!
//! Everything here uses safe `wide` operations only. Tails (the last `len % 8` elements) are
//! loaded into a zero-padded `[f32; 8]` and go through the same kernel as full chunks.

use wide::f32x8;

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
            .map(|c| [load(c), load(&c[LANES..])])
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
}
