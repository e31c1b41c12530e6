//! A tiny cursor that turns fuzzer bytes into structured values (the idea of
//! `arbitrary::Unstructured`, without the dependency, so that the stable replay tests in
//! `core/tests` and `std-adapter/tests` can include this file with `#[path]` and need no extra
//! dev-dependency). Reading past the end yields zeros; nothing here can panic.

/// Structured reads from the front of a byte slice.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor over `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Bytes not read yet.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when every byte was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }

    fn le<const W: usize>(&mut self) -> [u8; W] {
        let mut a = [0u8; W];
        let b = self.bytes(W);
        a[..b.len()].copy_from_slice(b);
        a
    }

    /// A byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        self.le::<1>()[0]
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.le())
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.le())
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.le())
    }

    /// A bool from the low bit of a byte.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A value in `lo..=hi` (`lo` past the end).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        let span = hi.saturating_sub(lo);
        if span == 0 {
            return lo;
        }
        let r = if span <= 0xff {
            u64::from(self.u8())
        } else if span <= 0xffff {
            u64::from(self.u16())
        } else if span <= 0xffff_ffff {
            u64::from(self.u32())
        } else {
            self.u64()
        };
        match span.checked_add(1) {
            Some(m) => lo + r % m,
            None => r,
        }
    }

    /// An f32 from raw bits (any value, NaN and infinities included).
    pub fn f32_bits(&mut self) -> f32 {
        f32::from_bits(self.u32())
    }
}

/// The CRC-32 (IEEE, reflected, as `crc32fast::hash`) of `data`. Own implementation so that
/// the std replay test needs no `crc32fast` dependency.
pub fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 == 1 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// A copy of `data` whose last four bytes are the little-endian CRC-32 of the bytes before
/// them (the trailer of a gradwire frame or bundle); `None` when `data` has under 4 bytes.
pub fn with_crc(data: &[u8]) -> Option<Vec<u8>> {
    let body = data.len().checked_sub(4)?;
    let mut v = data.to_vec();
    let crc = crc32(&v[..body]);
    v[body..].copy_from_slice(&crc.to_le_bytes());
    Some(v)
}
