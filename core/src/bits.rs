//! Little-endian, least-significant-bit-first bit streams (bit `t` of byte `j` is stream bit
//! `8j + t`). Used by the index, quantization and sign sections.

/// Writes values of 0..=64 bits into a byte slice that the caller sized beforehand.
pub(crate) struct BitWriter<'a> {
    buf: &'a mut [u8],
    pos: usize,
    acc: u64,
    nbits: u32,
}

impl<'a> BitWriter<'a> {
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        BitWriter {
            buf,
            pos: 0,
            acc: 0,
            nbits: 0,
        }
    }

    /// Appends the low `width` bits of `value` (`width <= 64`; higher bits must be zero).
    #[inline]
    pub(crate) fn write(&mut self, value: u64, width: u32) {
        if width > 32 {
            self.write(value & 0xffff_ffff, 32);
            self.write(value >> 32, width - 32);
            return;
        }
        self.acc |= value << self.nbits;
        self.nbits += width;
        while self.nbits >= 8 {
            self.buf[self.pos] = self.acc as u8;
            self.pos += 1;
            self.acc >>= 8;
            self.nbits -= 8;
        }
    }

    /// Pads the last byte with zero bits and returns the bytes written.
    pub(crate) fn finish(mut self) -> usize {
        if self.nbits > 0 {
            self.buf[self.pos] = self.acc as u8;
            self.pos += 1;
        }
        self.pos
    }
}

/// Reads values of 0..=64 bits from a byte slice, refusing to read past its end.
pub(crate) struct BitReader<'a> {
    buf: &'a [u8],
    bitpos: usize,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        BitReader { buf, bitpos: 0 }
    }

    /// Reads `width` bits, or `None` past the end or for a `width` over 64 (a width byte of an
    /// unchecked section).
    #[inline]
    pub(crate) fn read(&mut self, width: u32) -> Option<u64> {
        if width > 64 {
            return None;
        }
        let width = width as usize;
        if self.bitpos.checked_add(width)? > self.buf.len().checked_mul(8)? {
            return None;
        }
        let mut v = 0u64;
        let mut got = 0usize;
        while got < width {
            let byte = *self.buf.get(self.bitpos / 8)?;
            let off = self.bitpos % 8;
            let take = (8 - off).min(width - got);
            let bits = (u64::from(byte) >> off) & ((1u64 << take) - 1);
            v |= bits << got;
            got += take;
            self.bitpos += take;
        }
        Some(v)
    }

    /// Bytes consumed so far, the partial last byte included.
    pub(crate) fn bytes_consumed(&self) -> usize {
        self.bitpos.div_ceil(8)
    }

    /// True when the unread bits of the current partial byte are all zero.
    pub(crate) fn padding_is_zero(&self) -> bool {
        let off = self.bitpos % 8;
        if off == 0 {
            return true;
        }
        match self.buf.get(self.bitpos / 8) {
            Some(&b) => (b >> off) == 0,
            None => true,
        }
    }
}
