//! Codecs for the strictly ascending index list of a sparse frame.
//!
//! | id | codec | size in bytes |
//! |---|---|---|
//! | 0 | bitmap: bit i set when index i is kept | `ceil(n / 8)` |
//! | 1 | delta bit-packed: gaps `i_0`, `i_j - i_(j-1) - 1` in blocks of [`DELTA_BLOCK`], each block a width byte `w` (0..=64) then `len * w` bits | `sum(1 + ceil(len * w / 8))` |
//! | 2 | raw: each index as a little-endian integer of [`raw_width`] bytes | `count * raw_width(n)` |
//!
//! The encoder measures all three in one pass ([`IndexSizer`]) and picks the smallest (ties:
//! delta, then bitmap, then raw). Decoders check that indices are strictly increasing, `< n`,
//! exactly `count` of them, and that every padding bit is zero.

use crate::bits::{BitReader, BitWriter};

/// Codec id of the bitmap.
pub const BITMAP: u8 = 0;
/// Codec id of delta bit-packed blocks.
pub const DELTA: u8 = 1;
/// Codec id of raw indices.
pub const RAW: u8 = 2;
/// Gaps per delta block.
pub const DELTA_BLOCK: usize = 32;

/// Bytes per raw index for `n` elements: the fewest bytes that hold `n - 1` (at least 1).
pub const fn raw_width(n: u64) -> usize {
    if n <= 1 {
        return 1;
    }
    let bits = 64 - (n - 1).leading_zeros() as usize;
    bits.div_ceil(8)
}

const fn bit_width(x: u64) -> u32 {
    64 - x.leading_zeros()
}

/// Measures every codec's size for an ascending index stream, one index at a time.
#[derive(Clone, Debug)]
pub struct IndexSizer {
    n: u64,
    count: u64,
    next_min: u64,
    block_or: u64,
    block_len: usize,
    delta_bytes: usize,
}

impl IndexSizer {
    /// A sizer for indices below `n`.
    pub const fn new(n: u64) -> Self {
        IndexSizer {
            n,
            count: 0,
            next_min: 0,
            block_or: 0,
            block_len: 0,
            delta_bytes: 0,
        }
    }

    /// Adds the next index (strictly greater than the previous one, `< n`).
    #[inline]
    pub fn push(&mut self, i: u64) {
        let gap = i - self.next_min;
        self.next_min = i + 1;
        self.count += 1;
        self.block_or |= gap;
        self.block_len += 1;
        if self.block_len == DELTA_BLOCK {
            self.close_block();
        }
    }

    fn close_block(&mut self) {
        if self.block_len > 0 {
            let w = bit_width(self.block_or) as usize;
            self.delta_bytes += 1 + (self.block_len * w).div_ceil(8);
            self.block_len = 0;
            self.block_or = 0;
        }
    }

    /// Indices pushed so far.
    pub const fn count(&self) -> u64 {
        self.count
    }

    /// The chosen codec and its section length in bytes.
    pub fn choose(mut self) -> (u8, usize) {
        self.close_block();
        choose_sizes(self.n, self.count, self.delta_bytes)
    }
}

/// The smallest codec for `count` indices below `n` whose delta section takes `delta` bytes
/// (ties: delta, then bitmap, then raw).
fn choose_sizes(n: u64, count: u64, delta: usize) -> (u8, usize) {
    let bitmap = (n as usize).div_ceil(8);
    let raw = (count as usize).saturating_mul(raw_width(n));
    if delta <= bitmap && delta <= raw {
        (DELTA, delta)
    } else if bitmap <= raw {
        (BITMAP, bitmap)
    } else {
        (RAW, raw)
    }
}

/// The gaps of one delta block of a `u32` index list (`next` is one past the index before the
/// block), passed to `f` in order; returns their bitwise OR.
#[inline]
fn block_gaps(block: &[u32], next: u32, mut f: impl FnMut(u32)) -> u32 {
    let mut or = 0u32;
    let mut next = next;
    for &i in block {
        let gap = i.wrapping_sub(next);
        or |= gap;
        f(gap);
        next = i.wrapping_add(1);
    }
    or
}

/// The codec and section length [`IndexSizer`] chooses for a strictly ascending list of
/// indices below `n`, computed a delta block at a time from the list.
pub fn choose_for(n: u64, idx: &[u32]) -> (u8, usize) {
    let mut delta = 0usize;
    let mut next = 0u32;
    for block in idx.chunks(DELTA_BLOCK) {
        let w = 32 - block_gaps(block, next, |_| {}).leading_zeros() as usize;
        delta += 1 + (block.len() * w).div_ceil(8);
        next = block[block.len() - 1].wrapping_add(1);
    }
    choose_sizes(n, idx.len() as u64, delta)
}

/// Full delta blocks at a width known when compiling: [`DELTA_BLOCK`] gaps of `W` bits (1..=32)
/// fill exactly `W` little-endian 32-bit words, and gap `t` sits at bit `t * W` of that stream
/// (LSB first). With `W` a constant every shift and word index is one, so the compiler unrolls
/// a block into a few instructions per gap, where a width read from the frame costs a variable
/// shift, a window load and its bounds check per gap. [`by_width`] picks the copy for a width.
mod full_block {
    use super::DELTA_BLOCK;

    /// `$body` once for each gap `$t` of a block, 0 to 31, written out: a loop over a constant
    /// range is not always unrolled, and its shifts stay variable when it is not.
    macro_rules! each_gap {
        ($t:ident => $body:block) => {
            each_gap!(@ $t $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15
                16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
        };
        (@ $t:ident $body:block; $($n:literal)*) => {
            $({
                let $t: usize = $n;
                $body
            })*
        };
    }

    /// Word `j` of a block's bytes (`b.len() == 4 * W`, so a constant `j < W` needs no check).
    #[inline(always)]
    fn word(b: &[u8], j: usize) -> u32 {
        let mut le = [0u8; 4];
        le.copy_from_slice(&b[4 * j..4 * j + 4]);
        u32::from_le_bytes(le)
    }

    /// Gap `t` of a block of `W`-bit gaps in `b` (`4 * W` bytes).
    #[inline(always)]
    fn gap<const W: usize>(b: &[u8], t: usize) -> u32 {
        let bit = t * W;
        let (j, s) = (bit / 32, bit % 32);
        let mut v = word(b, j) >> s;
        if s + W > 32 {
            v |= word(b, j + 1) << (32 - s);
        }
        v & (u32::MAX >> (32 - W))
    }

    /// The sum of the block's gaps (`b.len() == 4 * W`).
    #[inline(never)]
    pub(super) fn sum<const W: usize>(b: &[u8]) -> u64 {
        let b = &b[..4 * W];
        let mut s = 0u64;
        each_gap!(t => {
            s += u64::from(gap::<W>(b, t));
        });
        s
    }

    /// The block's indices into `out`, the first `next` plus its gap, each later one its
    /// predecessor plus one plus its gap; returns one past the last (wrapping, as the callers'
    /// unchecked decode does).
    #[inline(never)]
    pub(super) fn unpack<const W: usize>(
        b: &[u8],
        mut next: usize,
        out: &mut [usize; DELTA_BLOCK],
    ) -> usize {
        let b = &b[..4 * W];
        each_gap!(t => {
            out[t] = next.wrapping_add(gap::<W>(b, t) as usize);
            next = out[t].wrapping_add(1);
        });
        next
    }

    /// Packs the gaps of one block, each below `2^W`, into `out` (`4 * W` bytes).
    #[inline(never)]
    pub(super) fn pack<const W: usize>(gaps: &[u32; DELTA_BLOCK], out: &mut [u8]) {
        let out = &mut out[..4 * W];
        let mut acc = 0u64;
        each_gap!(t => {
            let s = (t * W) % 32;
            acc |= u64::from(gaps[t]) << s;
            if s + W >= 32 {
                let j = t * W / 32;
                out[4 * j..4 * j + 4].copy_from_slice(&(acc as u32).to_le_bytes());
                acc >>= 32;
            }
        });
        // 32 gaps of W bits end on a word boundary: every bit has left.
        debug_assert_eq!(acc, 0);
    }
}

/// `full_block::$f::<W> $args` for `W = $w` in 1..=32, `$other` for any other width.
macro_rules! by_width {
    ($w:expr, $f:ident, $args:tt, $other:expr) => {
        by_width!(@arms $w, $f, $args, $other;
            1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
    };
    (@arms $w:expr, $f:ident, $args:tt, $other:expr; $($n:literal)*) => {
        match $w {
            $($n => by_width!(@call $f, $n, $args),)*
            _ => $other,
        }
    };
    (@call $f:ident, $n:literal, ($($a:expr),*)) => {
        full_block::$f::<$n>($($a),*)
    };
}

/// Writes a full delta block (its width byte, then its gaps packed at that width) into the front
/// of `out`, from its gaps and their bitwise OR; returns the bytes written (`1 + 4 * width`).
fn put_full_block(gaps: &[u32; DELTA_BLOCK], or: u32, out: &mut [u8]) -> usize {
    let w = (32 - or.leading_zeros()) as usize;
    out[0] = w as u8;
    by_width!(w, pack, (gaps, &mut out[1..]), ());
    1 + 4 * w
}

/// Writes a strictly ascending list of indices below `n` in `codec` into `section` (exactly the
/// length [`choose_for`] gives for that codec): the same bytes as [`IndexWriter`], with a full
/// delta block's gaps packed by the copy of the packer for its width, other blocks 32 bits at a
/// time.
///
/// # Panics
/// When `section` is shorter than that length, or when `idx` breaks its contract so that a
/// bitmap bit falls past the section. The frame encoders size the section themselves.
pub fn write_u32(codec: u8, n: u64, idx: &[u32], section: &mut [u8]) {
    match codec {
        BITMAP => {
            section.fill(0);
            for &i in idx {
                section[(i / 8) as usize] |= 1 << (i % 8);
            }
        }
        RAW => {
            let w = raw_width(n);
            for (o, &i) in section.chunks_exact_mut(w).zip(idx) {
                o.copy_from_slice(&u64::from(i).to_le_bytes()[..w]);
            }
        }
        _ => {
            let mut pos = 0usize;
            let mut next = 0u32;
            for block in idx.chunks(DELTA_BLOCK) {
                if let Ok(full) = <&[u32; DELTA_BLOCK]>::try_from(block) {
                    let mut gaps = [0u32; DELTA_BLOCK];
                    let mut or = 0u32;
                    for (g, &i) in gaps.iter_mut().zip(full) {
                        *g = i.wrapping_sub(next);
                        or |= *g;
                        next = i.wrapping_add(1);
                    }
                    pos += put_full_block(&gaps, or, &mut section[pos..]);
                    continue;
                }
                let w = 32 - block_gaps(block, next, |_| {}).leading_zeros();
                section[pos] = w as u8;
                pos += 1;
                // LSB-first: gaps enter a u64 above the bits already there; whole 32-bit words
                // leave as little-endian bytes (w <= 32, so nothing overflows).
                let mut acc = 0u64;
                let mut bits = 0u32;
                block_gaps(block, next, |gap| {
                    acc |= u64::from(gap) << bits;
                    bits += w;
                    if bits >= 32 {
                        section[pos..pos + 4].copy_from_slice(&(acc as u32).to_le_bytes());
                        pos += 4;
                        acc >>= 32;
                        bits -= 32;
                    }
                });
                let tail = bits.div_ceil(8) as usize;
                section[pos..pos + tail].copy_from_slice(&acc.to_le_bytes()[..tail]);
                pos += tail;
                next = block[block.len() - 1].wrapping_add(1);
            }
        }
    }
}

/// Writes an ascending index stream in one codec into a section sized by [`IndexSizer`].
pub struct IndexWriter<'a> {
    codec: u8,
    n: u64,
    buf: &'a mut [u8],
    pos: usize,
    next_min: u64,
    block: [u64; DELTA_BLOCK],
    block_len: usize,
}

impl<'a> IndexWriter<'a> {
    /// A writer for `codec` into `section`, which must be exactly the size the sizer chose.
    pub fn new(codec: u8, n: u64, section: &'a mut [u8]) -> Self {
        if codec == BITMAP {
            section.fill(0);
        }
        IndexWriter {
            codec,
            n,
            buf: section,
            pos: 0,
            next_min: 0,
            block: [0; DELTA_BLOCK],
            block_len: 0,
        }
    }

    /// Writes the next index.
    #[inline]
    pub fn push(&mut self, i: u64) {
        match self.codec {
            BITMAP => self.buf[(i / 8) as usize] |= 1 << (i % 8),
            RAW => {
                let w = raw_width(self.n);
                self.buf[self.pos..self.pos + w].copy_from_slice(&i.to_le_bytes()[..w]);
                self.pos += w;
            }
            _ => {
                self.block[self.block_len] = i - self.next_min;
                self.next_min = i + 1;
                self.block_len += 1;
                if self.block_len == DELTA_BLOCK {
                    self.flush_block();
                }
            }
        }
    }

    fn flush_block(&mut self) {
        if self.block_len == 0 {
            return;
        }
        let gaps = &self.block[..self.block_len];
        let or = gaps.iter().fold(0, |a, &g| a | g);
        if gaps.len() == DELTA_BLOCK
            && let Ok(or) = u32::try_from(or)
        {
            let mut narrow = [0u32; DELTA_BLOCK];
            for (n, &g) in narrow.iter_mut().zip(gaps) {
                *n = g as u32;
            }
            self.pos += put_full_block(&narrow, or, &mut self.buf[self.pos..]);
            self.block_len = 0;
            return;
        }
        let w = bit_width(or);
        self.buf[self.pos] = w as u8;
        self.pos += 1;
        let mut bw = BitWriter::new(&mut self.buf[self.pos..]);
        for &g in gaps {
            bw.write(g, w);
        }
        self.pos += bw.finish();
        self.block_len = 0;
    }

    /// Flushes the last delta block.
    pub fn finish(mut self) {
        if self.codec == DELTA {
            self.flush_block();
        }
    }
}

/// An index section is malformed (the frame decoder reports it as [`crate::Error::BadIndex`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidSection;

/// Length in bytes of an index section that starts at `bytes[0]`, without decoding it.
/// `Err(InvalidSection)` when the section runs past `bytes` or a width byte is invalid.
pub fn section_len(codec: u8, n: u64, count: u64, bytes: &[u8]) -> Result<usize, InvalidSection> {
    match section_extent(codec, n, count, bytes)? {
        len if len <= bytes.len() => Ok(len),
        _ => Err(InvalidSection),
    }
}

/// The length in bytes an index section starting at `bytes[0]` declares, which may run past
/// `bytes` (a frame cut short): for delta blocks, the walk stops at the first width byte that
/// is missing and the length returned is at least one past what is present.
/// `Err(InvalidSection)` only for content that is invalid whatever follows (a width byte over
/// 64, an unknown codec, a length that overflows).
pub(crate) fn section_extent(
    codec: u8,
    n: u64,
    count: u64,
    bytes: &[u8],
) -> Result<usize, InvalidSection> {
    match codec {
        BITMAP => usize::try_from(n.div_ceil(8)).map_err(|_| InvalidSection),
        RAW => usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(raw_width(n)))
            .ok_or(InvalidSection),
        DELTA => {
            let mut pos = 0usize;
            let mut left = count;
            while left > 0 {
                let len = left.min(DELTA_BLOCK as u64) as usize;
                let Some(&w) = bytes.get(pos) else {
                    return Ok(pos + 1);
                };
                if w > 64 {
                    return Err(InvalidSection);
                }
                pos = pos
                    .checked_add(1 + (len * w as usize).div_ceil(8))
                    .ok_or(InvalidSection)?;
                if pos > bytes.len() {
                    return Ok(pos);
                }
                left -= len as u64;
            }
            Ok(pos)
        }
        _ => Err(InvalidSection),
    }
}

/// Decodes and validates an index section (exactly `section_len` bytes), calling `f` with each
/// index in ascending order. `Err(InvalidSection)` on any invalid content; `f` may have been called for a
/// prefix of the indices by then, so callers validate in a first pass before writing output.
pub fn for_each_index(
    codec: u8,
    n: u64,
    count: u64,
    section: &[u8],
    mut f: impl FnMut(u64),
) -> Result<(), InvalidSection> {
    match codec {
        BITMAP => {
            let mut seen = 0u64;
            for (j, &byte) in section.iter().enumerate() {
                let mut b = byte;
                while b != 0 {
                    let t = b.trailing_zeros() as u64;
                    let i = (j as u64) * 8 + t;
                    if i >= n {
                        return Err(InvalidSection);
                    }
                    seen += 1;
                    if seen > count {
                        return Err(InvalidSection);
                    }
                    f(i);
                    b &= b - 1;
                }
            }
            if seen == count {
                Ok(())
            } else {
                Err(InvalidSection)
            }
        }
        RAW => {
            let w = raw_width(n);
            let mut next_min = 0u64;
            for chunk in section.chunks_exact(w) {
                let mut le = [0u8; 8];
                le[..w].copy_from_slice(chunk);
                let i = u64::from_le_bytes(le);
                if i < next_min || i >= n {
                    return Err(InvalidSection);
                }
                next_min = i + 1;
                f(i);
            }
            Ok(())
        }
        DELTA => {
            let mut pos = 0usize;
            let mut left = count;
            let mut next_min = 0u64;
            while left > 0 {
                let len = left.min(DELTA_BLOCK as u64) as usize;
                let w = u32::from(*section.get(pos).ok_or(InvalidSection)?);
                if w > 64 {
                    return Err(InvalidSection);
                }
                pos += 1;
                let body = section.get(pos..).ok_or(InvalidSection)?;
                let bytes = (len * w as usize).div_ceil(8);
                if w <= 56 && bytes + 8 <= body.len() {
                    // Fast path: each gap from one unaligned little-endian u64 window.
                    let mask = (1u64 << w) - 1;
                    for t in 0..len {
                        let bit = t * w as usize;
                        let mut le = [0u8; 8];
                        le.copy_from_slice(&body[bit / 8..bit / 8 + 8]);
                        let gap = (u64::from_le_bytes(le) >> (bit % 8)) & mask;
                        let i = next_min.checked_add(gap).ok_or(InvalidSection)?;
                        if i >= n {
                            return Err(InvalidSection);
                        }
                        next_min = i + 1;
                        f(i);
                    }
                    let used = len * w as usize;
                    if !used.is_multiple_of(8) && body[used / 8] >> (used % 8) != 0 {
                        return Err(InvalidSection);
                    }
                    pos += bytes;
                    left -= len as u64;
                    continue;
                }
                let mut br = BitReader::new(body);
                for _ in 0..len {
                    let gap = br.read(w).ok_or(InvalidSection)?;
                    let i = next_min.checked_add(gap).ok_or(InvalidSection)?;
                    if i >= n {
                        return Err(InvalidSection);
                    }
                    next_min = i + 1;
                    f(i);
                }
                if !br.padding_is_zero() {
                    return Err(InvalidSection);
                }
                pos += br.bytes_consumed();
                left -= len as u64;
            }
            if pos == section.len() {
                Ok(())
            } else {
                Err(InvalidSection)
            }
        }
        _ => Err(InvalidSection),
    }
}

/// Checks an index section (exactly `section_len` bytes) without decoding it into a list:
/// the same verdict as [`for_each_index`] (strictly increasing, `< n`, exactly `count`
/// indices, zero padding, the section consumed exactly), but cheaper. For delta blocks it sums
/// each block's gaps (the last index is `count - 1 + sum of the gaps`, and indices rise
/// strictly by construction); for the bitmap it counts set bits and checks the bits past `n`.
///
/// # Errors
/// [`InvalidSection`] on any invalid content.
pub fn validate(codec: u8, n: u64, count: u64, section: &[u8]) -> Result<(), InvalidSection> {
    match codec {
        BITMAP => {
            let mut seen = 0u64;
            let mut words = section.chunks_exact(8);
            for w in &mut words {
                let mut le = [0u8; 8];
                le.copy_from_slice(w);
                seen += u64::from(u64::from_le_bytes(le).count_ones());
            }
            for &b in words.remainder() {
                seen += u64::from(b.count_ones());
            }
            // Bits past n can only sit in the last byte (the section is ceil(n / 8) bytes).
            let tail = n % 8;
            if tail != 0
                && let Some(&last) = section.last()
                && last >> tail != 0
            {
                return Err(InvalidSection);
            }
            if seen == count && section.len() as u64 == n.div_ceil(8) {
                Ok(())
            } else {
                Err(InvalidSection)
            }
        }
        DELTA => {
            let mut pos = 0usize;
            let mut left = count;
            let mut next_min = 0u64;
            while left > 0 {
                let len = left.min(DELTA_BLOCK as u64) as usize;
                let w = u32::from(*section.get(pos).ok_or(InvalidSection)?);
                if w > 64 {
                    return Err(InvalidSection);
                }
                pos += 1;
                let body = section.get(pos..).ok_or(InvalidSection)?;
                let used = len * w as usize;
                let bytes = used.div_ceil(8);
                if bytes > body.len() {
                    return Err(InvalidSection);
                }
                let sum: u128 = if len == DELTA_BLOCK && (1..=32).contains(&w) {
                    // The guard leaves no width for the last arm; were it reached, a sum
                    // past any n refuses the section.
                    u128::from(by_width!(w, sum, (body), u64::MAX))
                } else if w <= 56 && bytes + 8 <= body.len() {
                    // Each gap < 2^56, so 32 of them sum without overflow in a u64.
                    let mask = (1u64 << w) - 1;
                    let mut s = 0u64;
                    for t in 0..len {
                        let bit = t * w as usize;
                        let mut le = [0u8; 8];
                        le.copy_from_slice(&body[bit / 8..bit / 8 + 8]);
                        s += (u64::from_le_bytes(le) >> (bit % 8)) & mask;
                    }
                    u128::from(s)
                } else {
                    let mut br = BitReader::new(&body[..bytes]);
                    let mut s = 0u128;
                    for _ in 0..len {
                        s += u128::from(br.read(w).ok_or(InvalidSection)?);
                    }
                    s
                };
                if !used.is_multiple_of(8) && body[used / 8] >> (used % 8) != 0 {
                    return Err(InvalidSection);
                }
                // The block's indices end at next_min + sum + len - 1.
                let next = u128::from(next_min) + sum + len as u128;
                next_min = u64::try_from(next).map_err(|_| InvalidSection)?;
                pos += bytes;
                left -= len as u64;
            }
            if next_min > n || pos != section.len() {
                return Err(InvalidSection);
            }
            Ok(())
        }
        RAW => {
            if section.len() as u64 != count.saturating_mul(raw_width(n) as u64) {
                return Err(InvalidSection);
            }
            for_each_index(codec, n, count, section, |_| {})
        }
        _ => Err(InvalidSection),
    }
}

/// Indices per call of [`for_each_batch`] (at most).
pub const BATCH: usize = 64;

/// Decodes a section that [`validate`] accepted, calling `f` with runs of up to [`BATCH`]
/// ascending indices (a delta block at a time for delta). On a section that was not validated
/// the indices passed are unspecified, but it never panics.
pub fn for_each_batch(codec: u8, n: u64, count: u64, section: &[u8], mut f: impl FnMut(&[usize])) {
    let mut buf = [0usize; BATCH];
    match codec {
        BITMAP => {
            let mut fill = 0usize;
            for (j, &byte) in section.iter().enumerate() {
                let mut b = byte;
                while b != 0 {
                    buf[fill] = j * 8 + b.trailing_zeros() as usize;
                    fill += 1;
                    if fill == BATCH {
                        f(&buf);
                        fill = 0;
                    }
                    b &= b - 1;
                }
            }
            if fill > 0 {
                f(&buf[..fill]);
            }
        }
        DELTA => {
            let mut pos = 0usize;
            let mut left = count;
            let mut next = 0usize;
            while left > 0 {
                let len = left.min(DELTA_BLOCK as u64) as usize;
                let Some(&w) = section.get(pos) else { return };
                let w = u32::from(w);
                pos += 1;
                let Some(body) = section.get(pos..) else {
                    return;
                };
                let bytes = (len * w as usize).div_ceil(8);
                if len == DELTA_BLOCK
                    && (1..=32).contains(&w)
                    && bytes <= body.len()
                    && let Some(out) = buf.first_chunk_mut::<DELTA_BLOCK>()
                {
                    // (The guard leaves no width for the last arm.)
                    next = by_width!(w, unpack, (body, next, out), next);
                    f(out);
                    pos += bytes;
                    left -= len as u64;
                    continue;
                }
                let out = &mut buf[..len];
                if w <= 56 && bytes + 8 <= body.len() {
                    let mask = (1u64 << w) - 1;
                    for (t, o) in out.iter_mut().enumerate() {
                        let bit = t * w as usize;
                        let mut le = [0u8; 8];
                        le.copy_from_slice(&body[bit / 8..bit / 8 + 8]);
                        let gap = ((u64::from_le_bytes(le) >> (bit % 8)) & mask) as usize;
                        *o = next.wrapping_add(gap);
                        next = o.wrapping_add(1);
                    }
                } else {
                    let mut br = BitReader::new(body);
                    for o in out.iter_mut() {
                        let gap = br.read(w).unwrap_or(0) as usize;
                        *o = next.wrapping_add(gap);
                        next = o.wrapping_add(1);
                    }
                }
                f(out);
                pos += bytes;
                left -= len as u64;
            }
        }
        RAW => {
            let w = raw_width(n);
            for run in section.chunks(BATCH * w) {
                let mut fill = 0usize;
                for (o, c) in buf.iter_mut().zip(run.chunks_exact(w)) {
                    let mut le = [0u8; 8];
                    le[..w].copy_from_slice(c);
                    *o = u64::from_le_bytes(le) as usize;
                    fill += 1;
                }
                f(&buf[..fill]);
            }
        }
        _ => {}
    }
}
