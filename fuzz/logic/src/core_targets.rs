//! Bodies of the fuzz targets over `gradwire-core`: each `pub fn NAME(data: &[u8])` is what
//! `fuzz/fuzz_targets/NAME.rs` runs, and what `core/tests/fuzz_replay.rs` runs on every file
//! of `fuzz/corpus/NAME/`. They panic (assert) when a property fails; they never allocate more
//! than a few hundred KiB whatever the input.

use crate::gens::{gen_grad, gen_params, pow2};
use crate::input::{Input, with_crc};
use gradwire_core::{
    Error, Header, K, Method, Params, Rounding, SignScale, Values, accumulate_into, decode_into,
    encode_into, encode_selected_into, max_frame_len, peek, quant, scalar, scratch_len, select,
    sign,
};

/// Largest output buffer (elements) a decoding target allocates. Frames that declare more are
/// still parsed and checked, against a buffer of an arbitrary smaller length.
pub const MAX_OUT: usize = 1 << 12;

/// Largest gradient the encoding targets build.
pub const MAX_GRAD: usize = 600;

/// A NaN with a payload no decoder writes: an element still holding it was not overwritten.
pub const SENTINEL: u32 = 0x7fc0_dead;

fn sentinel_buf(n: usize) -> Vec<f32> {
    vec![f32::from_bits(SENTINEL); n]
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `a == b`, with NaN equal to NaN.
fn same_value(a: f32, b: f32) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

// ---------------------------------------------------------------------------------------------
// decode: decode_into and accumulate_into on arbitrary bytes
// ---------------------------------------------------------------------------------------------

/// Builds a `decode` input (used to seed the corpus): decode against the frame's own header.
pub fn decode_seed(frame: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; 8];
    v.extend_from_slice(frame);
    v
}

/// Input: `[mode][weight selector][4 weight bytes][u16 length][params...]` then the frame.
/// Checks, on the raw bytes and again with the CRC trailer repaired:
/// - `decode_into` either fails leaving the buffer untouched, or succeeds with `out.len() == n`,
///   every element overwritten and no NaN;
/// - `peek` fails exactly when decoding fails on the same parse error;
/// - `accumulate_into` fails exactly when `decode_into` fails (same error, `acc` untouched) and
///   otherwise adds `weight * decoded` to every element.
pub fn decode(data: &[u8]) {
    let mut head = Input::new(data.get(..8).unwrap_or(data));
    let mode = head.u8();
    let weight = match head.u8() % 4 {
        0 => 1.0,
        1 => -1.0,
        2 => 0.25,
        _ => head.f32_bits(),
    };
    let weight = if weight.is_finite() { weight } else { 1.0 };
    let mut head = Input::new(data.get(6..8).unwrap_or(&[]));
    let arb_len = head.range(0, 4096) as usize;
    let frame = data.get(8..).unwrap_or(&[]);
    // The arbitrary expected parameters come from the bytes after the frame's header, which
    // are also frame bytes: cheap, and they often look like a real header.
    let mut pinp = Input::new(frame.get(16..).unwrap_or(&[]));
    let arb = gen_params(&mut pinp, arb_len, &[]);
    decode_one(frame, mode, weight, &arb, arb_len);
    if let Some(fixed) = with_crc(frame)
        && fixed != frame
    {
        decode_one(&fixed, mode, weight, &arb, arb_len);
    }
}

fn decode_one(frame: &[u8], mode: u8, weight: f32, arb: &Params, arb_len: usize) {
    let peeked = peek(frame);
    let (expected, n) = match (&peeked, mode % 4) {
        (Ok(h), 0 | 1) if h.n <= MAX_OUT as u64 => {
            // The frame's own parameters, and its n (or a neighbour of it).
            let n = h.n as usize;
            let n = if mode % 4 == 1 {
                n.saturating_add(1)
            } else {
                n
            };
            (h.params, n)
        }
        (Ok(h), 2) if h.n <= MAX_OUT as u64 => (*arb, h.n as usize),
        _ => (*arb, arb_len),
    };
    check_decode(frame, &peeked, &expected, n, weight);
}

/// The decode properties for one (frame, expected, n).
fn check_decode(
    frame: &[u8],
    peeked: &Result<Header, Error>,
    expected: &Params,
    n: usize,
    weight: f32,
) {
    let mut out = sentinel_buf(n);
    let r = decode_into(frame, expected, &mut out);
    match (&r, peeked) {
        (Err(e), Err(p)) => assert_eq!(e, p, "peek and decode disagree"),
        (Ok(_), Err(p)) => panic!("decode succeeded where peek failed with {p:?}"),
        _ => {}
    }
    match r {
        Err(_) => assert!(
            out.iter().all(|v| v.to_bits() == SENTINEL),
            "decode_into wrote output and then failed"
        ),
        Ok(info) => {
            assert_eq!(info.n, n as u64);
            let h = peeked.as_ref().expect("peek succeeded");
            assert_eq!(info.kept, h.kept);
            assert!(info.kept <= info.n);
            assert_eq!(h.frame_len, frame.len());
            if let Some(i) = out.iter().position(|v| v.to_bits() == SENTINEL) {
                panic!("decode_into left element {i} of {n} unwritten");
            }
            if let Some(i) = out.iter().position(|v| v.is_nan()) {
                panic!("decode_into produced NaN at {i}");
            }
        }
    }
    let before: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut acc = before.clone();
    let r2 = accumulate_into(frame, expected, &mut acc, weight);
    assert_eq!(
        r.err(),
        r2.err(),
        "decode_into and accumulate_into disagree"
    );
    match r2 {
        Err(_) => assert!(
            same_bits(&acc, &before),
            "accumulate_into changed acc, then failed"
        ),
        Ok(_) => {
            for i in 0..n {
                let want = before[i] + weight * out[i];
                assert!(
                    same_value(acc[i], want),
                    "accumulate_into at {i}: {} != {} + {} * {}",
                    acc[i],
                    before[i],
                    weight,
                    out[i]
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// peek: the header reader
// ---------------------------------------------------------------------------------------------

/// Checks `peek` on the bytes and with the CRC repaired: it never panics; what it accepts has
/// the magic, version 1, `frame_len == len`, `kept <= n`, valid parameters, and a full decode
/// against the header's own parameters and n can fail only on the body (index or value).
pub fn peek_frame(data: &[u8]) {
    peek_one(data);
    if let Some(fixed) = with_crc(data)
        && fixed != data
    {
        peek_one(&fixed);
    }
}

fn peek_one(frame: &[u8]) {
    let Ok(h) = peek(frame) else { return };
    assert_eq!(&frame[..4], b"GWRF");
    assert_eq!(h.version, gradwire_core::FORMAT_VERSION);
    assert_eq!(h.frame_len, frame.len());
    assert!(h.kept <= h.n, "kept {} > n {}", h.kept, h.n);
    assert!(
        h.params.method.validate().is_ok(),
        "peek returned invalid {h:?}"
    );
    if let Method::TopK { k, .. } | Method::RandomK { k, .. } = h.params.method {
        assert!(matches!(k, K::Count(c) if c == h.kept));
    }
    if h.n <= MAX_OUT as u64 {
        let mut out = sentinel_buf(h.n as usize);
        match decode_into(frame, &h.params, &mut out) {
            Ok(info) => {
                assert_eq!(info.method, h.params.method);
                assert_eq!(info.kept, h.kept);
            }
            Err(Error::BadIndex { .. } | Error::BadValue { .. }) => {}
            Err(e) => panic!("peek accepted {h:?} but decode against it failed: {e:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// roundtrip: encode -> decode within the method's error bound
// ---------------------------------------------------------------------------------------------

/// True when `x` has a finite representation in `v` (checked with `half`, independently of
/// the crate's own check).
fn fits(v: Values, x: f32) -> bool {
    match v {
        Values::F16 => half::f16::from_f32(x).is_finite(),
        Values::Bf16 => half::bf16::from_f32(x).is_finite(),
        _ => true,
    }
}

/// The unit in the last place of an f16 (`bf16`: 7 mantissa bits) near `|x|`.
fn ulp16(x: f32, mantissa: i32, min_exp: i32) -> f32 {
    let e = ((x.abs().to_bits() >> 23) as i32 - 127).max(min_exp);
    pow2(e - mantissa)
}

/// Asserts the value codec's bound for one value: f32 exact, f16/bf16 the nearest-even cast
/// (within half an ulp). Int8 is checked per block by the caller.
fn check_plain(v: Values, x: f32, d: f32, what: &str) {
    match v {
        Values::F32 => assert_eq!(x.to_bits(), d.to_bits(), "{what}: f32 not exact"),
        Values::F16 => {
            assert_eq!(d, half::f16::from_f32(x).to_f32(), "{what}: f16 cast");
            let u = ulp16(x.abs().min(d.abs()), 10, -14);
            assert!(
                (f64::from(x) - f64::from(d)).abs() <= f64::from(u) / 2.0,
                "{what}: f16 {x} -> {d} beyond half an ulp"
            );
        }
        Values::Bf16 => {
            assert_eq!(d, half::bf16::from_f32(x).to_f32(), "{what}: bf16 cast");
            let u = ulp16(x.abs().min(d.abs()), 7, -126);
            assert!(
                (f64::from(x) - f64::from(d)).abs() <= f64::from(u) / 2.0,
                "{what}: bf16 {x} -> {d} beyond half an ulp"
            );
        }
        Values::Int8 { .. } => {}
    }
}

/// Tolerance of a quantized value with block absmax `m` and `l` levels: half a step
/// (`steps = 0.5`) or a whole step (stochastic), plus f32 rounding of the computation.
fn quant_tol(m: f32, l: u32, steps: f64) -> f64 {
    let m = f64::from(m);
    m / f64::from(l) * steps + m * f64::from(pow2(-20)) + f64::from(pow2(-149))
}

/// Checks the decoded values of a sparse frame: `kept` are the indices the method must keep.
fn check_sparse(grad: &[f32], out: &[f32], kept: &[usize], v: Values, scale: f32) {
    let mut is_kept = vec![false; grad.len()];
    for &i in kept {
        is_kept[i] = true;
    }
    for (i, (&o, &k)) in out.iter().zip(&is_kept).enumerate() {
        if !k {
            assert_eq!(o.to_bits(), 0, "index {i} not kept but decoded to {o}");
        }
    }
    match v {
        Values::Int8 { block } => {
            for chunk in kept.chunks(block as usize) {
                let m = chunk.iter().fold(0.0f32, |m, &i| m.max(grad[i].abs()));
                let tol = quant_tol(m, 127, 0.5);
                for &i in chunk {
                    if overflowed(grad[i], out[i], tol, scale) {
                        continue;
                    }
                    let d = f64::from(out[i]) / f64::from(scale);
                    let err = (f64::from(grad[i]) - d).abs();
                    assert!(
                        err <= tol * 1.000_001,
                        "int8 at {i}: {} -> {d}, error {err} > {tol}",
                        grad[i]
                    );
                }
            }
        }
        _ => {
            for &i in kept {
                if scale == 1.0 {
                    check_plain(v, grad[i], out[i], "sparse value");
                } else {
                    // Unbiased random-k: value * (n / k) in f32 (inf where that overflows).
                    let d = half_cast(v, grad[i]);
                    assert_eq!(out[i], d * scale, "unbiased random-k at {i}");
                    assert!(!overflowed(grad[i], out[i], 0.0, scale) || (d * scale).is_infinite());
                }
            }
        }
    }
}

/// True when the decoded `d` is infinite because the unbiased estimate `x * scale` (with `x`
/// within `tol`) is beyond f32's range: a documented result of unbiased random-k, not an error.
fn overflowed(x: f32, d: f32, tol: f64, scale: f32) -> bool {
    d.is_infinite()
        && scale != 1.0
        && (f64::from(x.abs()) + tol) * f64::from(scale) >= f64::from(f32::MAX)
        && (d < 0.0) == (x < 0.0)
}

fn half_cast(v: Values, x: f32) -> f32 {
    match v {
        Values::F16 => half::f16::from_f32(x).to_f32(),
        Values::Bf16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Exact top-k by an independent oracle: sort by (|x| descending, index ascending).
fn topk_oracle(grad: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..grad.len()).collect();
    idx.sort_by(|&a, &b| {
        scalar::magnitude_key(grad[b])
            .cmp(&scalar::magnitude_key(grad[a]))
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// Builds a `roundtrip` input (used to seed the corpus) that yields `grad` with method byte
/// choices `method_bytes`.
pub fn roundtrip_seed(method_bytes: &[u8], grad: &[f32]) -> Vec<u8> {
    let mut v = Vec::new();
    let len = grad.len().min(MAX_GRAD) as u16;
    v.extend_from_slice(&len.to_le_bytes());
    v.push(1); // finite raw bits
    for x in &grad[..len as usize] {
        v.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    v.extend_from_slice(method_bytes);
    v
}

/// Input: a gradient, then a method and parameters. Checks:
/// - `encode_into` fails exactly as the spec says (invalid params, first non-finite index, first
///   value out of the value type's range; buffer and scratch one short);
/// - the frame fits `max_frame_len`, carries a valid CRC, and the encoder is deterministic;
/// - `peek` reports n, the frame length and the kept count; decoding against the header's
///   parameters gives the same as against the sender's;
/// - the decoded tensor obeys the method's error bound (f32 exact, f16/bf16 the nearest-even cast
///   within half an ulp, int8 and b-bit quantization within half a step, stochastic within one
///   step, sign = sign x block mean |g| (or +-1), top-k keeps the oracle's set, threshold keeps
///   |g| > t, random-k keeps k distinct indices);
/// - top-k frames equal `encode_selected_into` on the oracle's indices;
/// - every truncated prefix (CRC repaired or not) is an error.
pub fn roundtrip(data: &[u8]) {
    let mut inp = Input::new(data);
    let grad = gen_grad(&mut inp, MAX_GRAD);
    let n = grad.len();
    let params = gen_params(&mut inp, n, &grad);
    let m = params.method;
    let max = max_frame_len(n, &m);
    let sl = scratch_len(n, &m);
    if max > 1 << 24 || sl > 1 << 20 {
        // An absurd block size or k on an invalid method: nothing to allocate for.
        assert!(
            m.validate().is_err() || max <= 1 << 24,
            "{m:?}: max_frame_len {max}"
        );
        return;
    }
    let mut frame = vec![0u8; max];
    let mut scratch = vec![0u32; sl];
    let res = encode_into(&grad, &params, &mut scratch, &mut frame);
    if let Err(e) = m.validate() {
        assert_eq!(res, Err(e));
        return;
    }
    if let Some(index) = grad.iter().position(|x| !x.is_finite()) {
        assert_eq!(res, Err(Error::NonFinite { index }));
        return;
    }
    if let Some(v) = m.values()
        && let Some(index) = grad.iter().position(|&x| !fits(v, x))
    {
        assert_eq!(res, Err(Error::ValueOutOfRange { index }));
        return;
    }
    if let Method::RandomK {
        k, unbiased: true, ..
    } = m
        && let Err(Error::ValueOutOfRange { index }) = res
    {
        // Unbiased random-k refuses a kept value whose decoded product with n/k overflows. A
        // decoded value is at most the largest |x| (int8: its block's absmax; f16/bf16: |x|
        // rounded up by under 1%), so that largest |x| times n/k must come near f32::MAX.
        let kk = k.resolve(n as u64).max(1);
        let s = (n as f64 / kk as f64) as f32;
        let max_abs = grad.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        assert!(
            f64::from(max_abs) * f64::from(s) > 0.99 * f64::from(f32::MAX),
            "{m:?}: ValueOutOfRange at {index} with max |x| {max_abs} and n/k {s}"
        );
        assert!(index < n, "{m:?}: ValueOutOfRange at {index} of {n}");
        let mut o = sentinel_buf(n);
        assert!(
            decode_into(&frame, &params, &mut o).is_err(),
            "{m:?}: a refused frame decoded"
        );
        return;
    }
    let len = match res {
        Ok(len) => len,
        Err(e) => panic!("encode_into({m:?}, n = {n}) failed: {e:?}"),
    };
    assert!(len <= max);
    let frame = &frame[..len];
    let crc = crate::input::crc32(&frame[..len - 4]);
    assert_eq!(frame[len - 4..], crc.to_le_bytes());

    // Too small buffers are refused up front.
    let mut small = vec![0u8; max - 1];
    assert_eq!(
        encode_into(&grad, &params, &mut scratch, &mut small),
        Err(Error::BufferTooSmall {
            needed: max,
            got: max - 1
        })
    );
    if sl > 0 {
        let mut s2 = vec![0u32; sl - 1];
        let mut f2 = vec![0u8; max];
        assert!(matches!(
            encode_into(&grad, &params, &mut s2, &mut f2),
            Err(Error::ScratchTooSmall { .. })
        ));
    }
    // Deterministic, whatever the scratch held before.
    let mut again = vec![0xa5u8; max];
    let mut scratch2 = vec![0xdead_beefu32; sl];
    let len2 = encode_into(&grad, &params, &mut scratch2, &mut again).expect("second encode");
    assert_eq!(&again[..len2], frame, "encoder is not deterministic");

    let h = peek(frame).expect("peek of a fresh frame");
    assert_eq!(h.n, n as u64);
    assert_eq!(h.frame_len, len);

    let mut out = sentinel_buf(n);
    let info = match decode_into(frame, &params, &mut out) {
        Ok(info) => info,
        Err(e) => panic!("decode of a fresh {m:?} frame (n = {n}) failed: {e:?}"),
    };
    assert_eq!(info.n, n as u64);
    assert_eq!(info.kept, h.kept);
    assert!(!out.iter().any(|v| v.to_bits() == SENTINEL));
    assert!(
        out.iter().all(|v| v.is_finite()),
        "{m:?}: a fresh frame decoded to a non-finite value"
    );
    let mut out_h = sentinel_buf(n);
    decode_into(frame, &h.params, &mut out_h).expect("decode against the peeked header");
    assert!(same_bits(&out, &out_h));
    let mut acc = vec![0.0f32; n];
    accumulate_into(frame, &params, &mut acc, 1.0).expect("accumulate");
    assert!(acc.iter().zip(&out).all(|(a, o)| a == o));

    check_bound(&grad, &params, &out, info.kept, frame);

    // Truncated prefixes, as they are and with a repaired trailer, are errors.
    let cuts = [0, 1, 4, 19, 20, len / 2, len.saturating_sub(5), len - 1];
    for &cut in &cuts {
        if cut >= len {
            continue;
        }
        let pre = &frame[..cut];
        let mut o = sentinel_buf(n);
        assert!(
            decode_into(pre, &params, &mut o).is_err(),
            "prefix {cut} of {len} decoded"
        );
        if let Some(fixed) = with_crc(pre) {
            assert!(
                decode_into(&fixed, &params, &mut o).is_err(),
                "CRC-repaired prefix {cut} of {len} decoded"
            );
        }
        assert!(o.iter().all(|v| v.to_bits() == SENTINEL));
    }
}

/// A segmented frame of `idx` (segments of 1, 2, 3, ... entries, FORMAT.md 3.2.1) decodes
/// each segment's entries exactly as a frame of that segment alone does.
fn check_segmented(grad: &[f32], idx: &[u32], values: Values) {
    let n = grad.len();
    let mut segs = Vec::new();
    let (mut left, mut len) = (idx.len() as u32, 1u32);
    while left > 0 {
        segs.push(len.min(left));
        left -= len.min(left);
        len += 1;
    }
    let k = idx.len();
    let mut f = vec![0u8; gradwire_core::segmented_frame_len(n, k, values, segs.len())];
    let mut s = vec![0u32; gradwire_core::segmented_scratch_len(n, k, values, segs.len())];
    let len = gradwire_core::encode_segmented_into(grad, idx, &segs, values, &mut s, &mut f)
        .expect("encode_segmented_into");
    let whole = decode_sparse(&f[..len], n, k, values);
    let mut at = 0usize;
    for &c in &segs {
        let part = &idx[at..at + c as usize];
        let m = Method::TopK {
            k: K::Count(part.len() as u64),
            values,
        };
        let mut f1 = vec![0u8; max_frame_len(n, &m)];
        let mut s1 = vec![0u32; scratch_len(n, &m)];
        let l1 = encode_selected_into(grad, part, values, &mut s1, &mut f1).expect("segment");
        let own = decode_sparse(&f1[..l1], n, part.len(), values);
        for &i in part {
            assert_eq!(
                whole[i as usize].to_bits(),
                own[i as usize].to_bits(),
                "segmented frame at {i}"
            );
        }
        at += c as usize;
    }
}

fn decode_sparse(frame: &[u8], n: usize, k: usize, values: Values) -> Vec<f32> {
    let p = Params::new(Method::TopK {
        k: K::Count(k as u64),
        values,
    });
    let mut out = vec![0.0f32; n];
    decode_into(frame, &p, &mut out).expect("decode");
    out
}

fn check_bound(grad: &[f32], params: &Params, out: &[f32], kept: u64, frame: &[u8]) {
    let n = grad.len();
    match params.method {
        Method::Dense { values } => {
            assert_eq!(kept, n as u64);
            for (i, (&x, &d)) in grad.iter().zip(out).enumerate() {
                check_plain(values, x, d, &format!("dense {i}"));
            }
        }
        Method::TopK { k, values } => {
            let k = k.resolve(n as u64) as usize;
            assert_eq!(kept, k as u64);
            let set = topk_oracle(grad, k);
            check_sparse(grad, out, &set, values, 1.0);
            // The same frame as encode_selected_into on the oracle's indices.
            let idx: Vec<u32> = set.iter().map(|&i| i as u32).collect();
            let m2 = Method::TopK {
                k: K::Count(k as u64),
                values,
            };
            let mut f2 = vec![0u8; max_frame_len(n, &m2)];
            let mut s2 = vec![0u32; scratch_len(n, &m2)];
            let l2 = encode_selected_into(grad, &idx, values, &mut s2, &mut f2)
                .expect("encode_selected_into");
            assert_eq!(&f2[..l2], frame, "encode_selected_into differs from top-k");
            if idx.len() >= 2 {
                let mut bad = idx.clone();
                bad.swap(0, 1);
                assert_eq!(
                    encode_selected_into(grad, &bad, values, &mut s2, &mut f2),
                    Err(Error::UnsortedIndices { position: 1 })
                );
            }
            check_segmented(grad, &idx, values);
        }
        Method::Threshold { threshold, values } => {
            let set: Vec<usize> = (0..n).filter(|&i| grad[i].abs() > threshold).collect();
            assert_eq!(kept, set.len() as u64);
            check_sparse(grad, out, &set, values, 1.0);
        }
        Method::RandomK {
            k,
            values,
            unbiased,
        } => {
            let k = k.resolve(n as u64);
            assert_eq!(kept, k);
            let key = gradwire_core::rng::key(params.seed, params.step, params.tensor_id);
            let mut set = Vec::new();
            scalar::randomk_for_each(n as u64, k, key, |i| set.push(i as usize));
            assert_eq!(set.len() as u64, k);
            assert!(set.windows(2).all(|w| w[0] < w[1]) && set.iter().all(|&i| i < n));
            let scale = if unbiased && k > 0 {
                (n as f64 / k as f64) as f32
            } else {
                1.0
            };
            check_sparse(grad, out, &set, values, scale);
        }
        Method::Quant {
            bits,
            block,
            rounding,
        } => {
            let l = scalar::quant_levels(bits);
            let steps = match rounding {
                Rounding::NearestEven => 0.5,
                Rounding::Stochastic => 1.0,
            };
            let block = block as usize;
            for (b, (g, o)) in grad.chunks(block).zip(out.chunks(block)).enumerate() {
                let m = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let tol = quant_tol(m, l, steps);
                for (j, (&x, &d)) in g.iter().zip(o).enumerate() {
                    assert!(d.abs() <= m, "quant: |{d}| > absmax {m}");
                    let err = (f64::from(x) - f64::from(d)).abs();
                    assert!(
                        err <= tol,
                        "quant {bits} bits {rounding:?} at {}: {x} -> {d}, error {err} > {tol}",
                        b * block + j
                    );
                }
            }
        }
        Method::Sign { scale, zero_mask } => match scale {
            SignScale::None => {
                for (&x, &d) in grad.iter().zip(out) {
                    let want: f32 = match x {
                        _ if zero_mask && x == 0.0 => 0.0,
                        _ if x < 0.0 => -1.0,
                        _ => 1.0,
                    };
                    assert_eq!(d.to_bits(), want.to_bits(), "sign: {x} -> {d}");
                }
            }
            SignScale::MeanAbs { block } => {
                let block = block as usize;
                for (g, o) in grad.chunks(block).zip(out.chunks(block)) {
                    let s = scalar::sign_block_scale(g);
                    let mean = g.iter().map(|x| f64::from(x.abs())).sum::<f64>() / g.len() as f64;
                    let tol = mean * 1e-4 + f64::from(pow2(-149)) * 2.0;
                    assert!(
                        (f64::from(s) - mean).abs() <= tol,
                        "sign scale {s} far from mean |g| {mean}"
                    );
                    for (&x, &d) in g.iter().zip(o) {
                        let want = match x {
                            _ if zero_mask && x == 0.0 => 0.0,
                            _ if x < 0.0 => -s,
                            _ => s,
                        };
                        assert_eq!(d.to_bits(), want.to_bits(), "sign: {x} -> {d}, scale {s}");
                    }
                }
            }
        },
    }
}

// ---------------------------------------------------------------------------------------------
// no_output_leak: near-valid frames into a sentinel-filled buffer
// ---------------------------------------------------------------------------------------------

/// Input: a gradient and valid parameters (encoded into a real frame), then up to 8 mutations
/// (byte xor, byte set, truncate, append), then whether to repair the CRC and which length to
/// decode into. Decoding into a sentinel-filled buffer must, on success, overwrite every element
/// and, on error, write none; `accumulate_into` on error must leave `acc` untouched.
pub fn no_output_leak(data: &[u8]) {
    let mut inp = Input::new(data);
    let grad: Vec<f32> = gen_grad(&mut inp, 600)
        .into_iter()
        .map(|x| {
            if x.is_finite() && x.abs() < 6e4 {
                x
            } else {
                1.5
            }
        })
        .collect();
    let n = grad.len();
    let params = gen_params(&mut inp, n, &grad);
    if params.method.validate().is_err() {
        return;
    }
    let max = max_frame_len(n, &params.method);
    if max > 1 << 22 {
        return;
    }
    let mut frame = vec![0u8; max];
    let mut scratch = vec![0u32; scratch_len(n, &params.method)];
    let Ok(len) = encode_into(&grad, &params, &mut scratch, &mut frame) else {
        return;
    };
    frame.truncate(len);
    let muts = inp.u8() % 9;
    for _ in 0..muts {
        let op = inp.u8();
        let pos = inp.u16() as usize;
        let byte = inp.u8();
        match op % 4 {
            0 | 1 if !frame.is_empty() => {
                let p = pos % frame.len();
                if op.is_multiple_of(4) {
                    frame[p] ^= byte.max(1);
                } else {
                    frame[p] = byte;
                }
            }
            2 => frame.truncate(pos % (frame.len() + 1)),
            _ => frame.push(byte),
        }
    }
    let flags = inp.u8();
    if flags & 1 == 0
        && let Some(fixed) = with_crc(&frame)
    {
        frame = fixed;
    }
    let n_out = match flags >> 1 & 3 {
        0 => n + 1,
        1 => n.saturating_sub(1),
        _ => n,
    };
    let expected = if flags & 8 != 0 {
        match peek(&frame) {
            Ok(h) if h.n <= MAX_OUT as u64 => h.params,
            _ => params,
        }
    } else {
        params
    };
    let mut out = sentinel_buf(n_out);
    match decode_into(&frame, &expected, &mut out) {
        Ok(info) => {
            assert_eq!(info.n, n_out as u64);
            if let Some(i) = out.iter().position(|v| v.to_bits() == SENTINEL) {
                panic!("decode_into left element {i} of {n_out} unwritten");
            }
            assert!(!out.iter().any(|v| v.is_nan()));
        }
        Err(_) => assert!(
            out.iter().all(|v| v.to_bits() == SENTINEL),
            "output leak on error"
        ),
    }
    let mut acc = sentinel_buf(n_out);
    if accumulate_into(&frame, &expected, &mut acc, 1.0).is_err() {
        assert!(acc.iter().all(|v| v.to_bits() == SENTINEL));
    }
}

// ---------------------------------------------------------------------------------------------
// simd_scalar: the public fast entry points against the scalar specification
// ---------------------------------------------------------------------------------------------

/// Input: a kernel selector, an alignment offset 0..8, a gradient (lengths 0..=600; non-finite
/// values replaced except for the limit checks), then the kernel's parameters. The fast entry
/// point in `select`, `quant`, `sign` or `values` must give byte-identical output to the `scalar` specification (buffers pre-filled with the same junk,
/// compared whole, so writes past the end are caught too).
pub fn simd_scalar(data: &[u8]) {
    let mut inp = Input::new(data);
    let which = inp.u8();
    let offset = (inp.u8() % 8) as usize;
    let raw = gen_grad(&mut inp, MAX_GRAD);
    let grad: Vec<f32> = raw
        .iter()
        .map(|&x| if x.is_finite() { x } else { -0.0 })
        .collect();
    let n = grad.len();
    let mut buf = vec![0.0f32; offset + n];
    buf[offset..].copy_from_slice(&grad);
    let x = &buf[offset..];
    match which % 13 {
        5..=11 => simd_more(which % 13, &raw, x, &mut inp),
        12 => randomk_runs(&mut inp),
        0 => {
            // Exact top-k cut and the kept indices.
            if n == 0 {
                return;
            }
            let k = inp.range(1, n as u64) as usize;
            let mut s1 = vec![0u32; select::topk_scratch_len(n)];
            let mut s2 = vec![0u32; scalar::TOPK_HIST];
            let fast = select::topk_cut(x, k, &mut s1);
            let spec = scalar::topk_cut(x, k, &mut s2);
            assert_eq!(fast, spec, "topk_cut differs (n = {n}, k = {k})");
            let mut a = Vec::new();
            let mut b = Vec::new();
            select::for_each_kept(x, select::topk(x, k, &mut s1), |i| a.push(i));
            scalar::for_each_kept(x, scalar::Selection::TopK(spec), |i| b.push(i));
            if k < n {
                assert_eq!(a, b, "top-k kept indices differ");
            }
            assert_eq!(a.len(), k);
            assert_eq!(a, topk_oracle(x, k), "top-k differs from the sort oracle");
        }
        1 => {
            let bits = 2 + inp.range(0, 6) as u8;
            let block = 1 + inp.range(0, 1100) as usize;
            let stochastic = if inp.bool() {
                Some((inp.u64(), inp.u64(), inp.u64()))
            } else {
                None
            };
            let sl = quant::scales_len(n, block);
            let cl = quant::codes_len(n, bits);
            let junk = inp.u8();
            let (mut s1, mut c1) = (vec![junk; sl + 8], vec![junk; cl + 8]);
            let (mut s2, mut c2) = (s1.clone(), c1.clone());
            quant::encode(x, bits, block, stochastic, &mut s1[..sl], &mut c1[..cl]);
            let key = stochastic.map(|(s, t, i)| gradwire_core::rng::key(s, t, i));
            scalar::quant_encode(x, bits, block, key, &mut s2[..sl], &mut c2[..cl]);
            assert_eq!(s1, s2, "quant scales differ");
            assert_eq!(c1, c2, "quant codes differ (bits {bits}, block {block})");
        }
        2 => {
            let block = if inp.u8().is_multiple_of(4) {
                None
            } else {
                Some(1 + inp.range(0, 1100) as usize)
            };
            let sl = sign::scales_len(n, block);
            let bl = sign::bits_len(n);
            let junk = inp.u8();
            let (mut s1, mut b1) = (vec![junk; sl + 8], vec![junk; bl + 8]);
            let (mut s2, mut b2) = (s1.clone(), b1.clone());
            sign::encode(x, block, &mut s1[..sl], &mut b1[..bl]);
            scalar::sign_encode(x, block, &mut s2[..sl], &mut b2[..bl]);
            assert_eq!(s1, s2, "sign scales differ");
            assert_eq!(b1, b2, "sign bits differ");
        }
        3 => {
            let t = match inp.u8() % 3 {
                0 if n > 0 => x[inp.range(0, n as u64 - 1) as usize].abs(),
                1 => 0.0,
                _ => f32::from(inp.u8()) / 32.0,
            };
            let mut a = Vec::new();
            let mut b = Vec::new();
            select::for_each_kept(x, scalar::Selection::Threshold(t), |i| a.push(i));
            scalar::for_each_kept(x, scalar::Selection::Threshold(t), |i| b.push(i));
            assert_eq!(a, b, "threshold selection differs");
        }
        _ => {
            // Random-k selection and the whole-slice helpers.
            let k = inp.range(0, n as u64);
            let key = inp.u64();
            let mut a = Vec::new();
            let mut b = Vec::new();
            let sel = scalar::Selection::RandomK { key, k };
            select::for_each_kept(x, sel, |i| a.push(i));
            scalar::for_each_kept(x, sel, |i| b.push(i));
            assert_eq!(a, b, "random-k selection differs");
            assert_eq!(a.len() as u64, k);
            let m = scalar::abs_max(x);
            assert_eq!(m, x.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        }
    }
}

/// The frame `encode_kept_into` writes from `kept` is the one `encode_into` writes for `x`.
fn assert_kept_frame(x: &[f32], p: &Params, kept: select::Kept<'_>, what: &str) {
    let n = x.len();
    let mut a = vec![0u8; max_frame_len(n, &p.method)];
    let la = gradwire_core::encode_kept_into(n, p, kept, &mut a).expect("encode_kept_into");
    let mut b = vec![0u8; max_frame_len(n, &p.method)];
    let mut scratch = vec![0u32; scratch_len(n, &p.method)];
    let lb = encode_into(x, p, &mut scratch, &mut b).expect("encode_into");
    assert_eq!(a[..la], b[..lb], "{what} frame from the chunked list");
}

/// The candidates (`|x| >= floor`) of `x` in chunks cut where the input says (lists of a
/// length the input says, grown and scanned again when too short), concatenated in order;
/// `None` when a chunk met a value at or above `limit` (or NaN). With a residual half the time:
/// `x = g + r`, each element in one of the two and -0.0 in the other (`v + -0.0` is `v`, bit
/// for bit, -0.0 included).
fn chunked(x: &[f32], floor: f32, limit: f32, inp: &mut Input<'_>) -> Option<(Vec<u32>, Vec<u32>)> {
    let n = x.len();
    let mut bounds: Vec<usize> = (0..inp.u8() % 5)
        .map(|_| inp.range(0, n as u64) as usize)
        .collect();
    bounds.push(0);
    bounds.push(n);
    bounds.sort_unstable();
    let split = inp.bool();
    let r: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| if split && i % 2 == 1 { v } else { -0.0 })
        .collect();
    let g: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| if split && i % 2 == 1 { -0.0 } else { v })
        .collect();
    let (mut idx, mut bits) = (Vec::new(), Vec::new());
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        let mut cap = inp.u8() as usize % 8;
        loop {
            let (mut i, mut v) = (vec![0u32; cap], vec![0u32; cap]);
            let res = if split { Some(&r[a..b]) } else { None };
            let src = if split { &g[a..b] } else { &x[a..b] };
            let count = select::candidates(src, res, a, floor, limit, &mut i, &mut v).ok()?;
            if count <= cap {
                idx.extend_from_slice(&i[..count]);
                bits.extend_from_slice(&v[..count]);
                break;
            }
            cap = count;
        }
    }
    Some((idx, bits))
}

/// The fast random-k draw against the specification's Algorithm S: `randomk::for_each`, and
/// candidates of runs cut anywhere, scanned with any bound at or above the count still needed
/// (through buffers of any size), resolved in order.
fn randomk_runs(inp: &mut Input<'_>) {
    use gradwire_core::randomk::{self, Candidate};
    let n = inp.range(0, 70_000);
    let k = match inp.u8() % 4 {
        0 => inp.range(0, n + 2),
        1 => n / 100,
        2 => n.saturating_sub(inp.range(0, 10)),
        _ => inp.range(0, 5),
    };
    let key = inp.u64();
    let mut spec = Vec::new();
    scalar::randomk_for_each(n, k, key, |i| spec.push(i));
    let mut fast = Vec::new();
    randomk::for_each(n, k, key, |i| fast.push(i));
    assert_eq!(fast, spec, "randomk::for_each (n = {n}, k = {k})");
    let mut buf = vec![Candidate::default(); 1 + inp.range(0, 300) as usize];
    let (mut needed, mut start, mut got) = (k.min(n), 0u64, Vec::new());
    while start < n && needed > 0 {
        let end = (start + 1 + inp.range(0, 5000)).min(n);
        let bound = needed.saturating_add(inp.range(0, 3) * inp.range(0, 100));
        let (mut i, mut list) = (start, Vec::new());
        while i < end {
            let (count, next) = randomk::candidates(key, n, i, end, bound, &mut buf);
            assert!(next > i || count > 0, "no progress");
            list.extend_from_slice(&buf[..count]);
            i = next;
        }
        randomk::resolve(&list, &mut needed, |i| got.push(i));
        start = end;
    }
    assert_eq!(got, spec, "random-k runs (n = {n}, k = {k})");
}

/// The fast entry points added with the SIMD paths, each against its scalar definition.
/// `raw` is the gradient before non-finite values were replaced (to test the limit checks).
fn simd_more(which: u8, raw: &[f32], x: &[f32], inp: &mut Input<'_>) {
    use gradwire_core::values;
    let n = x.len();
    let vals = [
        None,
        Some(Values::F32),
        Some(Values::F16),
        Some(Values::Bf16),
    ][inp.u8() as usize % 4];
    let limit = values::magnitude_limit(vals);
    // Scalar: the first element that is NaN or not below the limit.
    let first_bad = |g: &[f32]| {
        g.iter()
            .position(|v| v.abs().partial_cmp(&limit) != Some(core::cmp::Ordering::Less))
    };
    match which {
        5 => {
            // topk_kept (and the sampled path) against the scalar cut and selection.
            let k = inp.range(0, n as u64) as usize;
            let sample = if inp.bool() && n > 0 {
                Some(inp.range(1, n as u64) as usize)
            } else {
                None
            };
            let len = match sample {
                Some(s) => select::kept_scratch_len_with(n, k, s),
                None => select::kept_scratch_len(n, k),
            };
            let mut scratch = vec![0u32; len];
            let r = match sample {
                Some(s) => select::topk_kept_with(raw, k, limit, s, &mut scratch),
                None => select::topk_kept(raw, k, limit, &mut scratch),
            };
            match (r, first_bad(raw)) {
                (Err(_), Some(_)) => {}
                (Err(_), None) => panic!("topk_kept refused a valid input (limit {limit})"),
                (Ok(_), Some(i)) => panic!("topk_kept missed {} at {i} (limit {limit})", raw[i]),
                (Ok(kept), None) => {
                    let want = topk_oracle(raw, k.min(n));
                    let idx: Vec<usize> = kept.idx.iter().map(|&i| i as usize).collect();
                    assert_eq!(idx, want, "topk_kept (n = {n}, k = {k}, sample {sample:?})");
                    for (&i, &b) in kept.idx.iter().zip(kept.bits) {
                        assert_eq!(raw[i as usize].to_bits(), b);
                    }
                }
            }
            // The chunked selection: any floor at or below the k-th magnitude (zero, or the
            // k-th magnitude itself), chunks cut where the input says.
            let kth = topk_oracle(raw, k.min(n))
                .iter()
                .map(|&i| raw[i].abs())
                .fold(f32::INFINITY, f32::min);
            let floor = if inp.bool() || !kth.is_finite() {
                0.0
            } else {
                kth
            };
            let cut = chunked(raw, floor, limit, inp);
            match (cut, first_bad(raw)) {
                (None, Some(_)) => {}
                (None, None) => panic!("candidates refused a valid input (limit {limit})"),
                (Some(_), Some(i)) => panic!("candidates missed {} at {i}", raw[i]),
                (Some((mut idx, mut bits)), None) => {
                    // With working space beyond the histogram (the fast cut) or without.
                    let len = match inp.bool() {
                        true => select::candidates_hist_len(idx.len()),
                        false => select::topk_scratch_len(n),
                    };
                    let mut hist = vec![0u32; len];
                    let kept = select::topk_of_candidates(&mut idx, &mut bits, k, &mut hist);
                    let got: Vec<usize> = kept.idx.iter().map(|&i| i as usize).collect();
                    assert_eq!(
                        got,
                        topk_oracle(raw, k.min(n)),
                        "chunked top-k (floor {floor})"
                    );
                    // The frame from the kept list is encode_into's.
                    let p = Params::new(Method::TopK {
                        k: K::Count(k as u64),
                        values: vals.unwrap_or(Values::F32),
                    });
                    assert_kept_frame(raw, &p, kept, "top-k");
                }
            }
        }
        6 => {
            let t = match inp.u8() % 3 {
                0 if n > 0 => x[inp.range(0, n as u64 - 1) as usize].abs(),
                1 => 0.0,
                _ => f32::from(inp.u8()) / 32.0,
            };
            let mut scratch = vec![0u32; select::threshold_scratch_len(n)];
            let r = select::threshold_kept(raw, t, limit, &mut scratch);
            let want: Vec<usize> = (0..n).filter(|&i| raw[i].abs() > t).collect();
            match (r, first_bad(raw)) {
                (Err(_), Some(_)) => {}
                (Err(_), None) => panic!("threshold_kept refused a valid input"),
                (Ok(_), Some(i)) => panic!("threshold_kept missed {} at {i}", raw[i]),
                (Ok(None), None) => assert!(want.len() > select::threshold_capacity(n)),
                (Ok(Some(kept)), None) => {
                    let idx: Vec<usize> = kept.idx.iter().map(|&i| i as usize).collect();
                    assert_eq!(idx, want, "threshold_kept (t = {t})");
                    for (&i, &b) in kept.idx.iter().zip(kept.bits) {
                        assert_eq!(raw[i as usize].to_bits(), b);
                    }
                }
            }
            // The chunked selection and the frame from its list.
            match chunked(raw, select::threshold_floor(t), limit, inp) {
                None => assert!(first_bad(raw).is_some(), "candidates refused a valid input"),
                Some((idx, bits)) => {
                    assert!(first_bad(raw).is_none(), "candidates missed a bad value");
                    let got: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
                    assert_eq!(got, want, "chunked threshold (t = {t})");
                    let p = Params::new(Method::Threshold {
                        threshold: t,
                        values: vals.unwrap_or(Values::F32),
                    });
                    let kept = select::Kept {
                        idx: &idx,
                        bits: &bits,
                    };
                    assert_kept_frame(raw, &p, kept, "threshold");
                }
            }
        }
        7 => {
            assert_eq!(
                quant::block_absmax(x).to_bits(),
                scalar::abs_max(x).to_bits(),
                "block_absmax"
            );
            assert_eq!(values::first_non_finite(raw), scalar::first_non_finite(raw));
            assert_eq!(values::first_at_or_above(raw, limit), first_bad(raw));
        }
        8 => {
            // Quantization sections: validate_fast == validate (offsets too), then
            // decode_slice == decode, overwriting and adding.
            let bits = [4u8, 8, 2 + inp.range(0, 6) as u8][inp.u8() as usize % 3];
            let block = [8usize, 16, 64, 1 + inp.range(0, 100) as usize][inp.u8() as usize % 4];
            let mut scales = vec![0u8; quant::scales_len(n, block)];
            let mut codes = vec![0u8; quant::codes_len(n, bits)];
            quant::encode(x, bits, block, None, &mut scales, &mut codes);
            // Corrupt a few bytes (or not), sometimes change the length.
            for _ in 0..inp.u8() % 3 {
                let all = scales.len() + codes.len();
                if all == 0 {
                    break;
                }
                let p = inp.u16() as usize % all;
                let b = inp.u8();
                if p < scales.len() {
                    scales[p] = b;
                } else {
                    codes[p - scales.len()] = b;
                }
            }
            if inp.u8().is_multiple_of(8) {
                codes.push(inp.u8());
            }
            let fast = quant::validate_fast(n, bits, &scales, &codes);
            let spec = quant::validate(n, bits, &scales, &codes);
            assert_eq!(fast, spec, "validate_fast (bits {bits}, n {n})");
            if spec.is_ok() {
                let mut a = vec![f32::from_bits(SENTINEL); n];
                quant::decode_slice(bits, block, &scales, &codes, &mut a, None);
                let mut b = vec![f32::from_bits(SENTINEL); n];
                quant::decode(n, bits, block, &scales, &codes, |i, v| b[i] = v);
                assert!(
                    same_bits(&a, &b),
                    "quant decode_slice (bits {bits}, block {block})"
                );
                let w = [1.0f32, -1.0, 0.5][inp.u8() as usize % 3];
                let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
                let (mut a2, mut b2) = (base.clone(), base);
                quant::decode_slice(bits, block, &scales, &codes, &mut a2, Some(w));
                quant::decode(n, bits, block, &scales, &codes, |i, v| b2[i] += w * v);
                assert!(same_bits(&a2, &b2), "quant decode_slice with weight {w}");
            }
        }
        9 => {
            // Sign sections: block_scales against the scalar mean, decode_slice == decode.
            let block = if inp.u8().is_multiple_of(4) {
                None
            } else {
                Some([8usize, 32, 1024, 1 + inp.range(0, 100) as usize][inp.u8() as usize % 4])
            };
            let mut scales = vec![0u8; sign::scales_len(n, block)];
            let mut signs = vec![0u8; sign::bits_len(n)];
            sign::encode(x, block, &mut scales, &mut signs);
            if let Some(b) = block {
                let mut s2 = vec![0xeeu8; scales.len()];
                sign::block_scales(x, b, &mut s2);
                assert_eq!(s2, scales, "block_scales");
                for (j, chunk) in x.chunks(b).enumerate() {
                    let want = scalar::sign_block_scale(chunk).to_le_bytes();
                    assert_eq!(scales[4 * j..4 * j + 4], want, "sign scale of block {j}");
                }
            }
            let mut p2 = vec![0xeeu8; signs.len()];
            sign::pack_signs(x, &mut p2);
            assert_eq!(p2, signs, "pack_signs");
            if sign::validate(n, &scales, &signs).is_ok() {
                let mut a = vec![f32::from_bits(SENTINEL); n];
                sign::decode_slice(block, &scales, &signs, &mut a, None);
                let mut b = vec![f32::from_bits(SENTINEL); n];
                sign::decode(n, block, &scales, &signs, |i, v| b[i] = v);
                assert!(same_bits(&a, &b), "sign decode_slice");
                let w = [1.0f32, -1.0, 0.5][inp.u8() as usize % 3];
                let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
                let (mut a2, mut b2) = (base.clone(), base);
                sign::decode_slice(block, &scales, &signs, &mut a2, Some(w));
                sign::decode(n, block, &scales, &signs, |i, v| b2[i] += w * v);
                assert!(same_bits(&a2, &b2), "sign decode_slice with weight {w}");
            }
        }
        10 => {
            // Plain value codecs: encode_plain == write_plain per element (finite values beyond
            // f16 or bf16 saturate alike: the type's largest finite value of their sign),
            // decode_plain == read_plain, first_bad_plain == the first non-finite read_plain.
            let v = [Values::F32, Values::F16, Values::Bf16][inp.u8() as usize % 3];
            let xs: Vec<f32> = x
                .iter()
                .map(|&a| if a.is_finite() { a } else { 1.0 })
                .collect();
            let vb = v.value_bytes();
            let mut a = vec![0x5au8; n * vb + 3];
            values::encode_plain(v, &xs, &mut a);
            let mut b = vec![0x5au8; n * vb + 3];
            for (i, &e) in xs.iter().enumerate() {
                values::write_plain(v, e, &mut b[i * vb..]);
            }
            assert_eq!(a, b, "encode_plain {v:?}");
            for (c, &e) in a[..n * vb].chunks_exact(vb).zip(&xs) {
                let back = values::read_plain(v, c);
                assert!(
                    back.is_some(),
                    "encode_plain {v:?} wrote {e} as a non-finite value"
                );
            }
            // Arbitrary bytes: the first bad value, then a decode of the valid prefix.
            let mut bytes = a[..n * vb].to_vec();
            for _ in 0..inp.u8() % 4 {
                if bytes.is_empty() {
                    break;
                }
                let p = inp.u16() as usize % bytes.len();
                bytes[p] = inp.u8();
            }
            let spec = bytes
                .chunks_exact(vb)
                .position(|c| values::read_plain(v, c).is_none());
            assert_eq!(
                values::first_bad_plain(v, &bytes),
                spec,
                "first_bad_plain {v:?}"
            );
            let good = spec.unwrap_or(n);
            let mut o1 = vec![f32::from_bits(SENTINEL); good];
            values::decode_plain(v, &bytes, &mut o1, None);
            let o2: Vec<f32> = bytes
                .chunks_exact(vb)
                .take(good)
                .map(|c| values::read_plain(v, c).unwrap_or(f32::NAN))
                .collect();
            assert!(same_bits(&o1, &o2), "decode_plain {v:?}");
            let w = [1.0f32, -1.0, 0.5][inp.u8() as usize % 3];
            let mut o3: Vec<f32> = (0..good).map(|i| i as f32 - 3.5).collect();
            let o4: Vec<f32> = o3.iter().zip(&o2).map(|(a, b)| a + w * b).collect();
            values::decode_plain(v, &bytes, &mut o3, Some(w));
            assert!(same_bits(&o3, &o4), "decode_plain {v:?} with weight {w}");
        }
        _ => {
            // Int8 runs of a sparse values section against int8_value per element.
            let count = n;
            let block = 1 + inp.range(0, 40) as usize;
            let blocks = count.div_ceil(block);
            let mut section = Vec::with_capacity(4 * blocks + count);
            for b in 0..blocks {
                let m = scalar::abs_max(&x[b * block..(b * block + block).min(count)]);
                section.extend_from_slice(&m.to_le_bytes());
            }
            for _ in 0..count {
                let c = inp.u8();
                section.push(if c == 0x80 { 0 } else { c });
            }
            let first = inp.range(0, count as u64) as usize;
            let len = inp.range(0, (count - first) as u64) as usize;
            let v = Values::Int8 {
                block: block as u32,
            };
            let mut out = vec![f32::from_bits(SENTINEL); len];
            values::ValueRuns::new(v, &section, count, &[]).read(first, &mut out);
            for (o, j) in out.iter().zip(first..) {
                let b = j / block;
                let m = f32::from_le_bytes(section[4 * b..4 * b + 4].try_into().unwrap());
                let want = values::int8_value(section[4 * blocks + j] as i8, m);
                assert_eq!(o.to_bits(), want.to_bits(), "ValueRuns::read at {j}");
            }
        }
    }
}
