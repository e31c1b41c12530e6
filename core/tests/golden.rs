//! Golden frames pin the wire format (FORMAT.md): today's encoder must write every frame in
//! `testdata/golden/` byte for byte. Run with `GRADWIRE_BLESS=1` to rewrite them after a
//! deliberate format change, which must come with a version bump.
//!
//! An independent decoder written from FORMAT.md (`spec_decode`) must agree with the crate's
//! decoder on every golden frame, which checks the document against the code.

mod common;

use common::{Golden, codec_byte, decode, encode, golden, same_bits, testdata};
use gradwire_core::{FORMAT_VERSION, MAGIC, Method, Values, peek};
use std::path::PathBuf;

fn path(case: &Golden) -> PathBuf {
    testdata().join("golden").join(format!("{}.gwf", case.name))
}

fn blessing() -> bool {
    std::env::var_os("GRADWIRE_BLESS").is_some_and(|v| v == "1")
}

#[test]
fn encoder_writes_golden_frames_byte_for_byte() {
    let mut mismatches = Vec::new();
    for case in golden() {
        let frame = encode(&case.grad, &case.params).unwrap();
        assert_eq!(
            codec_byte(&frame, &case.params.method),
            case.codec,
            "{}: index codec",
            case.name
        );
        let p = path(&case);
        if blessing() {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, &frame).unwrap();
            continue;
        }
        let stored = std::fs::read(&p).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run with GRADWIRE_BLESS=1 to create it)",
                p.display()
            )
        });
        if stored != frame {
            mismatches.push(case.name);
        }
    }
    assert!(
        mismatches.is_empty(),
        "encoder output differs from golden frames {mismatches:?}: a wire change needs a \
         FORMAT_VERSION bump, then GRADWIRE_BLESS=1"
    );
}

#[test]
fn golden_folder_has_no_stale_frames() {
    let names: Vec<String> = golden().iter().map(|c| format!("{}.gwf", c.name)).collect();
    for entry in std::fs::read_dir(testdata().join("golden")).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        // The folders hold the std crate's formats (bundle, checkpoint, container): their
        // own test, std-adapter/tests/golden_formats.rs, checks them.
        if entry.file_type().unwrap().is_dir() {
            assert!(
                ["bundle", "checkpoint", "container"].contains(&name.as_str()),
                "testdata/golden/{name}/ is not a known format folder"
            );
            continue;
        }
        assert!(
            names.contains(&name),
            "testdata/golden/{name} is not produced by any case"
        );
    }
}

#[test]
fn golden_frames_decode_and_agree_with_the_spec_decoder() {
    for case in golden() {
        let frame = std::fs::read(path(&case)).unwrap();
        let n = case.grad.len();
        let out = decode(&frame, &case.params, n).unwrap();
        let spec =
            spec_decode(&frame).unwrap_or_else(|e| panic!("{}: spec decoder: {e}", case.name));
        assert_eq!(spec.n, n, "{}", case.name);
        assert!(
            same_bits(&out, &spec.values),
            "{}: {out:?} vs spec {:?}",
            case.name,
            spec.values
        );
        let h = peek(&frame).unwrap();
        assert_eq!(h.version, FORMAT_VERSION);
        assert_eq!(h.frame_len, frame.len());
        assert_eq!(h.kept, spec.kept, "{}", case.name);
    }
}

#[test]
fn format_version_is_one() {
    // Changing the version is a deliberate act: update FORMAT.md and the golden frames with it.
    assert_eq!(FORMAT_VERSION, 1);
    assert_eq!(&MAGIC, b"GWRF");
}

/// The worked example of FORMAT.md, byte for byte.
#[test]
fn worked_example_matches_format_md() {
    let case = golden()
        .into_iter()
        .find(|c| c.name == "worked_example")
        .unwrap();
    assert!(matches!(
        case.params.method,
        Method::TopK {
            values: Values::F32,
            ..
        }
    ));
    let frame = encode(&case.grad, &case.params).unwrap();
    let hex: String = frame.iter().map(|b| format!("{b:02x}")).collect();
    let doc = std::fs::read_to_string(testdata().join("..").join("FORMAT.md")).unwrap();
    let marker = "worked-example-hex: ";
    let line = doc
        .lines()
        .find_map(|l| l.trim().strip_prefix(marker))
        .expect("FORMAT.md has a `worked-example-hex:` line");
    assert_eq!(
        line.trim(),
        hex,
        "FORMAT.md's worked example is out of date"
    );

    // The other examples: the hex column of the code block after their introduction.
    for name in ["quant4_nearest", "sign_scaled_zero_mask"] {
        let case = golden().into_iter().find(|c| c.name == name).unwrap();
        let frame = encode(&case.grad, &case.params).unwrap();
        let start = doc
            .find(&format!("`testdata/golden/{name}.gwf`"))
            .unwrap_or_else(|| panic!("FORMAT.md has no example of {name}"));
        let block = doc[start..].split("```").nth(1).expect("its code block");
        let bytes: Vec<u8> = block
            .lines()
            .flat_map(|l| l.split("   ").next().unwrap_or("").split_whitespace())
            .map(|h| u8::from_str_radix(h, 16).unwrap())
            .collect();
        assert_eq!(bytes, frame, "FORMAT.md's example {name} is out of date");
    }
}

// ---------------------------------------------------------------------------------------------
// An independent decoder written from FORMAT.md. It is deliberately simple and trusts nothing
// of the crate but the `half` conversions.

struct Decoded {
    n: usize,
    kept: u64,
    values: Vec<f32>,
}

struct Rd<'a> {
    b: &'a [u8],
    p: usize,
}

impl Rd<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let s = self.b.get(self.p..self.p + n).ok_or("truncated")?;
        self.p += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn f32(&mut self) -> Result<f32, String> {
        Ok(f32::from_bits(self.u32()?))
    }
    /// Value spec: id, and for int8 a u32 block.
    fn vspec(&mut self) -> Result<(u8, u32), String> {
        let id = self.u8()?;
        let block = if id == 3 { self.u32()? } else { 0 };
        Ok((id, block))
    }
    fn bits(&mut self, len_bytes: usize) -> Result<Vec<bool>, String> {
        let s = self.take(len_bytes)?;
        Ok((0..8 * len_bytes)
            .map(|t| (s[t / 8] >> (t % 8)) & 1 == 1)
            .collect())
    }
}

fn from_bits_lsb(bits: &[bool]) -> u64 {
    bits.iter()
        .enumerate()
        .fold(0u64, |a, (t, &b)| a | (u64::from(b) << t))
}

fn plain(id: u8, r: &mut Rd<'_>) -> Result<f32, String> {
    Ok(match id {
        0 => r.f32()?,
        1 => half::f16::from_bits(u16::from_le_bytes(r.take(2)?.try_into().unwrap())).to_f32(),
        2 => half::bf16::from_bits(u16::from_le_bytes(r.take(2)?.try_into().unwrap())).to_f32(),
        _ => return Err("bad value id".into()),
    })
}

/// Reads `count` values of value spec (id, block).
fn values(r: &mut Rd<'_>, (id, block): (u8, u32), count: usize) -> Result<Vec<f32>, String> {
    if id == 3 {
        let blocks = count.div_ceil(block as usize);
        let scales: Vec<f32> = (0..blocks).map(|_| r.f32()).collect::<Result<_, _>>()?;
        let codes = r.take(count)?.to_vec();
        Ok(codes
            .iter()
            .enumerate()
            .map(|(j, &c)| (c as i8 as f32 / 127.0) * scales[j / block as usize])
            .collect())
    } else {
        (0..count).map(|_| plain(id, r)).collect()
    }
}

fn spec_decode(frame: &[u8]) -> Result<Decoded, String> {
    let body = frame.len().checked_sub(4).ok_or("short")?;
    let crc = u32::from_le_bytes(frame[body..].try_into().unwrap());
    if crc != crc32fast::hash(&frame[..body]) {
        return Err("crc".into());
    }
    let mut r = Rd {
        b: &frame[..body],
        p: 0,
    };
    if r.take(4)? != b"GWRF" || r.u8()? != 1 {
        return Err("magic/version".into());
    }
    let method = r.u8()?;
    let flags = r.u8()?;
    if r.u8()? != 0 {
        return Err("reserved".into());
    }
    let n64 = r.u64()?;
    let n = n64 as usize;
    let (kept, out) = match method {
        0 => {
            let v = r.vspec()?;
            (n64, values(&mut r, v, n)?)
        }
        1 | 2 => {
            let v = r.vspec()?;
            if method == 2 {
                r.f32()?;
            }
            let count = r.u64()? as usize;
            let codec = r.u8()?;
            let idx: Vec<usize> = match codec {
                0 => {
                    let bits = r.bits(n.div_ceil(8))?;
                    (0..n).filter(|&i| bits[i]).collect()
                }
                1 => {
                    let mut idx = Vec::new();
                    let mut next = 0usize;
                    let mut left = count;
                    while left > 0 {
                        let len = left.min(32);
                        let w = r.u8()? as usize;
                        let bits = r.bits((len * w).div_ceil(8))?;
                        for j in 0..len {
                            let gap = from_bits_lsb(&bits[j * w..(j + 1) * w]) as usize;
                            idx.push(next + gap);
                            next += gap + 1;
                        }
                        left -= len;
                    }
                    idx
                }
                2 => {
                    let mut w = 1;
                    while w < 8 && (n64.saturating_sub(1) >> (8 * w)) != 0 {
                        w += 1;
                    }
                    (0..count)
                        .map(|_| {
                            let mut le = [0u8; 8];
                            le[..w].copy_from_slice(r.take(w)?);
                            Ok(u64::from_le_bytes(le) as usize)
                        })
                        .collect::<Result<_, String>>()?
                }
                _ => return Err("codec".into()),
            };
            if idx.len() != count {
                return Err("count".into());
            }
            let vals = values(&mut r, v, count)?;
            (count as u64, common::scatter(n, &idx, &vals))
        }
        3 => {
            let v = r.vspec()?;
            let k = r.u64()?;
            let (seed, step, id) = (r.u64()?, r.u64()?, r.u64()?);
            let idx = common::randomk_oracle(n64, k, seed, step, id);
            let mut vals = values(&mut r, v, k as usize)?;
            if flags & 1 == 1 && k > 0 {
                let s = (n64 as f64 / k as f64) as f32;
                vals.iter_mut().for_each(|x| *x *= s);
            }
            let idx: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
            (k, common::scatter(n, &idx, &vals))
        }
        4 => {
            let bits = r.u8()?;
            let _rounding = r.u8()?;
            let block = r.u32()? as usize;
            let scales: Vec<f32> = (0..n.div_ceil(block))
                .map(|_| r.f32())
                .collect::<Result<_, _>>()?;
            let l = common::levels(bits);
            let b = r.bits((n * bits as usize).div_ceil(8))?;
            let bw = bits as usize;
            let out = (0..n)
                .map(|i| {
                    let c = from_bits_lsb(&b[i * bw..(i + 1) * bw]) as i32;
                    common::dequant_oracle(c - l as i32, scales[i / block], l)
                })
                .collect();
            (n64, out)
        }
        5 => {
            let mode = r.u8()?;
            let block = if mode == 1 { r.u32()? as usize } else { 0 };
            let mixed = if flags == 2 { r.u64()? as usize } else { 0 };
            let scales: Vec<f32> = if mode == 1 {
                (0..n.div_ceil(block))
                    .map(|_| r.f32())
                    .collect::<Result<_, _>>()?
            } else {
                Vec::new()
            };
            let b = r.bits(n.div_ceil(8))?;
            let mut out: Vec<f32> = (0..n)
                .map(|i| {
                    let mag = if mode == 1 { scales[i / block] } else { 1.0 };
                    if b[i] { -mag } else { mag }
                })
                .collect();
            if flags == 2 {
                // Zero mask: 2-bit states per mask block (the scale block, or 1024), then a
                // bitmap of ceil(min(mask_block, n) / 8) bytes per mixed block.
                let mb = if mode == 1 { block } else { 1024 };
                let blocks = n.div_ceil(mb);
                let states = r.bits(blocks.div_ceil(4))?;
                let mut seen = 0;
                for blk in 0..blocks {
                    let state = u8::from(states[2 * blk]) | (u8::from(states[2 * blk + 1]) << 1);
                    let range = blk * mb..(blk * mb + mb).min(n);
                    match state {
                        0 => {}
                        1 => out[range].iter_mut().for_each(|x| *x = 0.0),
                        2 => {
                            let map = r.bits(mb.min(n).div_ceil(8))?;
                            for (j, i) in range.enumerate() {
                                if map[j] {
                                    out[i] = 0.0;
                                }
                            }
                            seen += 1;
                        }
                        _ => return Err("mask state".into()),
                    }
                }
                if seen != mixed {
                    return Err("mixed count".into());
                }
            }
            (n64, out)
        }
        _ => return Err("method".into()),
    };
    if r.p != body {
        return Err("trailing".into());
    }
    Ok(Decoded {
        n,
        kept,
        values: out,
    })
}
