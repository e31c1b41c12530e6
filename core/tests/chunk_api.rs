//! The chunk API (`frame::chunk`, `feedback::{step_chunk, sparse_update, sparse_fix_up}`)
//! against the whole-frame API: a frame written chunk by chunk is the frame of `encode_into`;
//! chunks accumulate and check as the whole frame does; a chunked error-feedback step leaves
//! the frame and residual of `feedback_step`; a sparse frame's (index, value) lists add up to
//! `accumulate_into`; and every hostile frame gets `validate`'s error.

mod common;

use common::{Data, Floats, fix_crc, golden, qc, same_bits, testdata};
use gradwire_core::feedback::{self, ResidualBound};
use gradwire_core::frame::chunk::{Sections, SparseFrame};
use gradwire_core::{
    Error, K, Method, Param, Params, Rounding, SignScale, Values, accumulate_into, decode_into,
    encode_into, feedback_step, feedback_step_bounded, max_frame_len, peek, scratch_len, validate,
};

// ---------------------------------------------------------------------------------------------
// Methods and data.

/// Every dense-shaped configuration worth telling apart: plain codecs, every quantization
/// width with blocks that are and are not multiples of 8 (SIMD and scalar paths, whole and
/// partial bytes of codes), both roundings, sign with and without scales.
fn shaped_methods() -> Vec<Method> {
    let mut m: Vec<Method> = [Values::F32, Values::F16, Values::Bf16]
        .into_iter()
        .map(|values| Method::Dense { values })
        .collect();
    for bits in 2..=8 {
        for block in [1, 3, 8, 24, 64] {
            for rounding in [Rounding::NearestEven, Rounding::Stochastic] {
                m.push(Method::Quant {
                    bits,
                    block,
                    rounding,
                });
            }
        }
    }
    m.push(Method::Sign {
        scale: SignScale::None,
        zero_mask: false,
    });
    for block in [1, 3, 8, 16, 40] {
        m.push(Method::Sign {
            scale: SignScale::MeanAbs { block },
            zero_mask: false,
        });
    }
    m
}

/// Every sparse method and value codec, with ratios that keep a few entries or many.
fn sparse_methods() -> Vec<Method> {
    let codecs = [
        Values::F32,
        Values::F16,
        Values::Bf16,
        Values::Int8 { block: 1 },
        Values::Int8 { block: 3 },
        Values::Int8 { block: 64 },
    ];
    let mut m = Vec::new();
    for values in codecs {
        m.push(Method::TopK {
            k: K::Ratio(0.03),
            values,
        });
        m.push(Method::TopK {
            k: K::Ratio(0.6),
            values,
        });
        m.push(Method::Threshold {
            threshold: 0.01,
            values,
        });
        for unbiased in [false, true] {
            m.push(Method::RandomK {
                k: K::Ratio(0.05),
                values,
                unbiased,
            });
        }
    }
    m
}

fn params(method: Method) -> Params {
    Params::new(method)
        .with_seed(0x5eed)
        .at_step(17)
        .for_tensor(0x7e45)
}

/// Lengths around the boundaries that matter for chunks of `align` elements: empty, single,
/// byte and block edges, and past the error-feedback tile.
fn lengths(align: usize) -> Vec<usize> {
    let mut v = vec![0, 1, 2, 7, 8, 9, 63, 65];
    for a in [align, 3 * align] {
        v.extend([a.saturating_sub(1), a, a + 1]);
    }
    v.extend([5 * align + 3, 4096 + 8 * align + 5, 9000]);
    v.sort_unstable();
    v.dedup();
    v
}

/// Chunk boundaries of `n` elements: multiples of `align` drawn from `d`, with 0 and `n`
/// (some chunks empty). `pieces == 0` gives one chunk.
fn cuts(n: usize, align: usize, pieces: usize, d: &mut Data) -> Vec<usize> {
    let slots = n / align;
    let mut c: Vec<usize> = (0..pieces)
        .map(|_| d.below(slots as u64 + 1) as usize * align)
        .collect();
    c.push(0);
    c.push(n);
    c.sort_unstable();
    c
}

/// Cuts of `n` into chunks of `chunk` elements (a multiple of `align`).
fn even_cuts(n: usize, chunk: usize) -> Vec<usize> {
    let mut c: Vec<usize> = (0..n).step_by(chunk.max(1)).collect();
    c.push(n);
    c
}

/// Gradient-like values with some exact zeros of both signs, ties and a constant run.
fn grads(d: &mut Data, n: usize) -> Vec<f32> {
    let mut g = d.grads(n);
    for x in g.iter_mut().step_by(13) {
        *x = if d.below(2) == 0 { 0.0 } else { -0.0 };
    }
    if n > 40 {
        g[20..40].fill(0.25);
    }
    g
}

fn whole_frame(g: &[f32], p: &Params) -> Result<Vec<u8>, Error> {
    let mut out = vec![0xa5u8; max_frame_len(g.len(), &p.method)];
    let mut scratch = vec![0u32; scratch_len(g.len(), &p.method)];
    let len = encode_into(g, p, &mut scratch, &mut out)?;
    out.truncate(len);
    Ok(out)
}

/// The frame of `g` written chunk by chunk between the boundaries `cuts`; with `combine`, the
/// trailer from the CRCs of pieces combined, as a multi-threaded caller computes it.
fn chunked_frame(g: &[f32], p: &Params, cuts: &[usize], combine: bool) -> Result<Vec<u8>, Error> {
    let sec = Sections::of(g.len(), &p.method).expect("a dense-shaped method");
    let mut frame = vec![0x5au8; sec.frame_len()];
    sec.write_header(&mut frame)?;
    for w in cuts.windows(2) {
        let (s, b) = sec.pieces_mut(&mut frame, w[0], w[1])?;
        sec.encode(p, w[0], &g[w[0]..w[1]], s, b)?;
    }
    let crc = combine.then(|| {
        let mut crc = crc32fast::Hasher::new();
        for piece in frame[..sec.checksummed_len()].chunks(37) {
            let mut h = crc32fast::Hasher::new();
            h.update(piece);
            crc.combine(&h);
        }
        crc.finalize()
    });
    let len = sec.finish(&mut frame, crc)?;
    assert_eq!(len, frame.len());
    Ok(frame)
}

// ---------------------------------------------------------------------------------------------
// Sections: encode.

#[test]
fn sections_describe_the_frame_of_encode_into() {
    let mut d = Data(1);
    for method in shaped_methods() {
        for n in [0, 1, 9, 100, 1000] {
            let sec = Sections::of(n, &method).unwrap();
            let p = params(method);
            let frame = whole_frame(&grads(&mut d, n), &p).unwrap();
            assert_eq!(sec.n(), n);
            assert_eq!(sec.frame_len(), frame.len(), "{method:?} n {n}");
            assert_eq!(sec.frame_len(), max_frame_len(n, &method));
            assert_eq!(sec.checksummed_len() + 4, sec.frame_len());
            let (s, b) = sec.ranges(0, n).unwrap();
            assert_eq!(s.end, b.start, "sections follow each other");
            assert_eq!(b.end, sec.checksummed_len());
            // Consecutive chunks' pieces follow each other in each section.
            let c = even_cuts(n, sec.align());
            for w in c.windows(3) {
                let (s0, b0) = sec.ranges(w[0], w[1]).unwrap();
                let (s1, b1) = sec.ranges(w[1], w[2]).unwrap();
                assert_eq!((s0.end, b0.end), (s1.start, b1.start));
            }
            let mut header = vec![0u8; sec.frame_len()];
            sec.write_header(&mut header).unwrap();
            assert_eq!(header[..s.start], frame[..s.start], "{method:?} header");
        }
    }
}

#[test]
fn a_frame_written_in_chunks_is_the_frame_of_encode_into() {
    let mut d = Data(2);
    for method in shaped_methods() {
        let p = params(method);
        let align = Sections::of(1 << 20, &method).unwrap().align();
        for n in lengths(align) {
            let g = grads(&mut d, n);
            let want = whole_frame(&g, &p).unwrap();
            let align = Sections::of(n, &method).unwrap().align();
            let mut plans = vec![vec![0, n], even_cuts(n, align), even_cuts(n, 3 * align)];
            plans.push(cuts(n, align, 5, &mut d));
            for (c, plan) in plans.iter().enumerate() {
                let got = chunked_frame(&g, &p, plan, c % 2 == 1).unwrap();
                assert_eq!(got, want, "{method:?} n {n} cuts {plan:?}");
            }
        }
    }
}

#[test]
fn chunked_encode_names_the_first_bad_element_of_the_tensor() {
    let n = 300;
    for method in shaped_methods() {
        let p = params(method);
        let sec = Sections::of(n, &method).unwrap();
        let plan = even_cuts(n, sec.align());
        for (bad, value) in [(0, f32::NAN), (n - 1, f32::INFINITY), (137, 1.0e6)] {
            let mut g = vec![0.5f32; n];
            g[bad] = value;
            let want = whole_frame(&g, &p);
            assert_eq!(
                chunked_frame(&g, &p, &plan, false),
                want,
                "{method:?} {value}"
            );
            let f16 = matches!(method.values(), Some(Values::F16));
            let expect = match value.is_finite() {
                false => Some(Error::NonFinite { index: bad }),
                true if f16 => Some(Error::ValueOutOfRange { index: bad }),
                true => None,
            };
            assert_eq!(want.err(), expect, "{method:?} {value}");
        }
    }
}

#[test]
fn sections_refuse_what_they_cannot_cut() {
    for method in sparse_methods() {
        assert_eq!(Sections::of(100, &method), None, "{method:?}");
    }
    let invalid = [
        Method::Dense {
            values: Values::Int8 { block: 4 },
        },
        Method::Quant {
            bits: 9,
            block: 8,
            rounding: Rounding::NearestEven,
        },
        Method::Quant {
            bits: 4,
            block: 0,
            rounding: Rounding::NearestEven,
        },
        Method::Sign {
            scale: SignScale::MeanAbs { block: 0 },
            zero_mask: false,
        },
    ];
    for method in invalid {
        assert_eq!(Sections::of(100, &method), None, "{method:?}");
    }
    let huge = Method::Dense {
        values: Values::F32,
    };
    assert_eq!(Sections::of(usize::MAX / 2, &huge), None);

    let method = Method::Quant {
        bits: 4,
        block: 6,
        rounding: Rounding::NearestEven,
    };
    let sec = Sections::of(100, &method).unwrap();
    assert_eq!(sec.align(), 6, "whole blocks, whole bytes of 4-bit codes");
    let sign = Sections::of(
        100,
        &Method::Sign {
            scale: SignScale::MeanAbs { block: 12 },
            zero_mask: false,
        },
    );
    assert_eq!(sign.unwrap().align(), 24);
    // Past n, only 0 and n are boundaries.
    assert_eq!(Sections::of(5, &method).unwrap().align(), 5);
    for (start, end) in [(3, 6), (0, 7), (12, 6), (96, 101), (6, 99)] {
        assert_eq!(sec.ranges(start, end), Err(Error::BadChunk { start, end }));
    }
    assert!(sec.ranges(96, 100).is_ok() && sec.ranges(100, 100).is_ok());

    let p = params(method);
    let g = vec![0.5f32; 100];
    let mut frame = vec![0u8; sec.frame_len()];
    let (s, b) = sec.ranges(0, 12).unwrap();
    let (mut scales, mut body) = (vec![0u8; s.len()], vec![0u8; b.len() - 1]);
    assert_eq!(
        sec.encode(&p, 0, &g[..12], &mut scales, &mut body),
        Err(Error::BufferTooSmall {
            needed: b.len(),
            got: b.len() - 1
        })
    );
    let mut body = vec![0u8; b.len()];
    assert_eq!(
        sec.encode(&p, 3, &g[..12], &mut scales, &mut body),
        Err(Error::BadChunk { start: 3, end: 15 })
    );
    let other = params(Method::Quant {
        bits: 8,
        block: 6,
        rounding: Rounding::NearestEven,
    });
    assert_eq!(
        sec.encode(&other, 0, &g[..12], &mut scales, &mut body),
        Err(Error::InvalidParams {
            param: Param::Method
        })
    );
    let short = sec.header_len() - 1;
    assert_eq!(
        sec.write_header(&mut frame[..short]),
        Err(Error::BufferTooSmall {
            needed: sec.header_len(),
            got: short
        })
    );
    let short = sec.frame_len() - 1;
    assert!(sec.pieces_mut(&mut frame[..short], 0, 6).is_err());
    assert!(sec.finish(&mut frame[..short], None).is_err());
}

#[test]
fn chunked_encode_matches_encode_into_on_arbitrary_floats() {
    fn prop(x: Floats, pick: u8, cut: u8) -> bool {
        let methods = shaped_methods();
        let method = methods[pick as usize % methods.len()];
        let p = params(method);
        let n = x.0.len();
        let sec = Sections::of(n, &method).unwrap();
        let plan = even_cuts(n, sec.align() * (1 + cut as usize % 4));
        whole_frame(&x.0, &p) == chunked_frame(&x.0, &p, &plan, cut.is_multiple_of(2))
    }
    qc(300, prop as fn(Floats, u8, u8) -> bool);
}

// ---------------------------------------------------------------------------------------------
// Sections: decode.

#[test]
fn chunks_accumulate_as_accumulate_into() {
    let mut d = Data(3);
    for method in shaped_methods() {
        let p = params(method);
        for n in [0, 5, 64, 1000, 5003] {
            let frame = whole_frame(&grads(&mut d, n), &p).unwrap();
            let sec = Sections::of(n, &method).unwrap();
            let start_acc = grads(&mut d, n);
            for weight in [1.0f32, -1.0, 0.37] {
                let mut want = start_acc.clone();
                accumulate_into(&frame, &p, &mut want, weight).unwrap();
                let mut got = start_acc.clone();
                for w in cuts(n, sec.align(), 4, &mut d).windows(2) {
                    sec.accumulate(&frame, w[0], &mut got[w[0]..w[1]], weight)
                        .unwrap();
                }
                assert!(same_bits(&got, &want), "{method:?} n {n} w {weight}");
            }
            let mut acc = start_acc.clone();
            assert_eq!(
                sec.accumulate(&frame, 0, &mut acc, f32::NAN),
                Err(Error::InvalidParams {
                    param: Param::Weight
                })
            );
            assert!(same_bits(&acc, &start_acc));
        }
    }
}

/// Every chunk of `frame` checks, by the plan `cuts`.
fn chunks_check(sec: &Sections, frame: &[u8], cuts: &[usize]) -> Result<(), Error> {
    cuts.windows(2)
        .try_for_each(|w| sec.check(frame, w[0], w[1]))
}

#[test]
fn chunks_check_exactly_when_validate_passes() {
    let mut d = Data(4);
    for method in shaped_methods() {
        let p = params(method);
        let n = 150;
        let frame = whole_frame(&grads(&mut d, n), &p).unwrap();
        let sec = Sections::of(n, &method).unwrap();
        let plan = even_cuts(n, sec.align());
        assert_eq!(chunks_check(&sec, &frame, &plan), Ok(()));
        let (s, _) = sec.ranges(0, n).unwrap();
        for at in s.start..sec.checksummed_len() {
            for bit in [0, 3, 6, 7] {
                let mut bad = frame.clone();
                bad[at] ^= 1 << bit;
                fix_crc(&mut bad);
                let whole = validate(&bad, &p, n);
                let chunks = chunks_check(&sec, &bad, &plan);
                assert_eq!(
                    whole.is_ok(),
                    chunks.is_ok(),
                    "{method:?} byte {at} bit {bit}"
                );
                if let (Err(Error::BadValue { offset }), Err(e)) = (whole, chunks) {
                    let Error::BadValue { offset: got } = e else {
                        panic!("{method:?}: chunk error {e:?}")
                    };
                    // The chunk names a byte of its own pieces; for dense frames, the same.
                    assert!(got >= s.start && got < sec.checksummed_len());
                    if let Method::Dense { .. } = method {
                        assert_eq!(got, offset);
                    }
                }
                let mut acc = vec![0.0f32; n];
                if chunks.is_err() {
                    let first_bad = plan
                        .windows(2)
                        .find(|w| sec.check(&bad, w[0], w[1]).is_err())
                        .unwrap();
                    let before = acc.clone();
                    let r = sec.accumulate(
                        &bad,
                        first_bad[0],
                        &mut acc[first_bad[0]..first_bad[1]],
                        1.0,
                    );
                    assert!(r.is_err());
                    assert!(same_bits(&acc, &before), "accumulate wrote on error");
                }
            }
        }
        // A frame of another length is refused whole.
        let long = [&frame[..], &[0]].concat();
        assert_eq!(
            sec.check(&long, 0, n),
            Err(Error::TrailingBytes {
                offset: sec.checksummed_len()
            })
        );
        assert_eq!(
            sec.check(&frame[..frame.len() - 1], 0, n),
            Err(Error::Truncated {
                needed: frame.len(),
                got: frame.len() - 1
            })
        );
    }
}

/// A frame decoded from its pieces as its bytes arrive: the scales section checked first
/// (`check_scales`), then the body's pieces in element order (`decode_pieces`, the first piece
/// written, the others added).
fn decode_by_pieces(
    sec: &Sections,
    frame: &[u8],
    cuts: &[usize],
    out: &mut [f32],
) -> Result<(), Error> {
    let (scales, _) = sec.ranges(0, sec.n())?;
    sec.check_scales(&frame[scales.clone()])?;
    for (i, w) in cuts.windows(2).enumerate() {
        let (_, body) = sec.ranges(w[0], w[1])?;
        let weight = (i % 2 == 1).then_some(1.0);
        sec.decode_pieces(
            &frame[scales.clone()],
            w[0],
            &frame[body],
            &mut out[w[0]..w[1]],
            weight,
        )?;
    }
    Ok(())
}

#[test]
fn pieces_in_byte_order_decode_as_the_frame_and_name_the_fault_validate_names() {
    let mut d = Data(14);
    for method in shaped_methods() {
        let p = params(method);
        for n in [0, 7, 150, 1001] {
            let frame = whole_frame(&grads(&mut d, n), &p).unwrap();
            let sec = Sections::of(n, &method).unwrap();
            let plan = cuts(n, sec.align(), 5, &mut d);
            // Pieces written and added (to zeros) alternately: the whole frame's values.
            let mut want = vec![0.0f32; n];
            decode_into(&frame, &p, &mut want).unwrap();
            let mut got = vec![0.0f32; n];
            decode_by_pieces(&sec, &frame, &plan, &mut got).unwrap();
            for (i, w) in plan.windows(2).enumerate() {
                if i % 2 == 1 {
                    let added: Vec<f32> = want[w[0]..w[1]].iter().map(|x| 0.0 + x).collect();
                    assert!(same_bits(&got[w[0]..w[1]], &added), "{method:?} n {n}");
                } else {
                    assert!(same_bits(&got[w[0]..w[1]], &want[w[0]..w[1]]), "{method:?}");
                }
            }
            if n != 150 {
                continue;
            }
            let (s, _) = sec.ranges(0, n).unwrap();
            for at in s.start..sec.checksummed_len() {
                for bit in [0, 3, 6, 7] {
                    let mut bad = frame.clone();
                    bad[at] ^= 1 << bit;
                    fix_crc(&mut bad);
                    let whole = validate(&bad, &p, n).map(|_| ());
                    let mut out = vec![0.0f32; n];
                    let pieces = decode_by_pieces(&sec, &bad, &plan, &mut out);
                    assert_eq!(pieces, whole, "{method:?} byte {at} bit {bit}");
                }
            }
        }
        // Pieces of another length are refused.
        let n = 150;
        let frame = whole_frame(&grads(&mut d, n), &p).unwrap();
        let (scales, body) = sec_ranges(&method, n);
        let sec = Sections::of(n, &method).unwrap();
        let mut out = vec![0.0f32; n];
        let short = &frame[body.start..body.end - 1];
        assert_eq!(
            sec.decode_pieces(&frame[scales.clone()], 0, short, &mut out, None),
            Err(Error::Truncated {
                needed: body.len(),
                got: body.len() - 1
            })
        );
        let long = &frame[body.start..body.end + 1];
        assert_eq!(
            sec.decode_pieces(&frame[scales.clone()], 0, long, &mut out, None),
            Err(Error::TrailingBytes { offset: body.end })
        );
        assert_eq!(
            sec.decode_pieces(&frame[scales], 0, &frame[body], &mut out, Some(f32::NAN)),
            Err(Error::InvalidParams {
                param: Param::Weight
            })
        );
    }
}

/// The sections' ranges of the whole tensor.
fn sec_ranges(method: &Method, n: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    Sections::of(n, method).unwrap().ranges(0, n).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Error feedback in chunks.

fn feedback_shaped_methods() -> Vec<Method> {
    shaped_methods()
        .into_iter()
        .filter(|m| {
            !matches!(
                m,
                Method::Sign {
                    scale: SignScale::None,
                    zero_mask: false,
                }
            )
        })
        .collect()
}

#[test]
fn step_chunk_leaves_the_frame_and_residual_of_feedback_step() {
    let mut d = Data(5);
    for method in feedback_shaped_methods() {
        let align = Sections::of(1 << 20, &method).unwrap().align();
        for n in [0, 1, 70, 1000, 4096 + 8 * align + 5, 9001] {
            let sec = Sections::of(n, &method).unwrap();
            let plan = match n % 3 {
                0 => even_cuts(n, sec.align()),
                1 => vec![0, n],
                _ => cuts(n, sec.align(), 4, &mut d),
            };
            let mut r_want = vec![0.0f32; n];
            let mut r_got = vec![0.0f32; n];
            for step in 0..3 {
                let p = params(method).at_step(step);
                let g = grads(&mut d, n);
                let mut want = vec![0u8; max_frame_len(n, &method)];
                let mut scratch = vec![0u32; scratch_len(n, &method)];
                let len = feedback_step(&g, &mut r_want, &p, &mut scratch, &mut want).unwrap();
                want.truncate(len);
                let mut got = vec![0u8; sec.frame_len()];
                sec.write_header(&mut got).unwrap();
                for w in plan.windows(2) {
                    let (s, b) = sec.pieces_mut(&mut got, w[0], w[1]).unwrap();
                    let (g, r) = (&g[w[0]..w[1]], &mut r_got[w[0]..w[1]]);
                    feedback::step_chunk(&sec, &p, w[0], g, r, s, b).unwrap();
                }
                sec.finish(&mut got, None).unwrap();
                assert_eq!(got, want, "{method:?} n {n} step {step}");
                assert!(same_bits(&r_got, &r_want), "{method:?} n {n} step {step}");
            }
        }
    }
}

#[test]
fn step_chunk_errors_change_nothing() {
    let n = 200;
    for method in feedback_shaped_methods() {
        let p = params(method);
        let sec = Sections::of(n, &method).unwrap();
        // The chunk from the boundary `a` on; bad elements in it.
        let a = sec.align() * (100 / sec.align());
        let (s, b) = sec.ranges(a, n).unwrap();
        for (bad, gv, rv) in [
            (n - 1, f32::NAN, 0.0),
            (a + 3, 3.0e38, 3.0e38),
            (a, 7.0e4, 0.0),
        ] {
            let mut g = vec![0.25f32; n];
            let mut r = vec![0.5f32; n];
            g[bad] = gv;
            r[bad] = rv;
            let before = r.clone();
            let (mut scales, mut body) = (vec![7u8; s.len()], vec![7u8; b.len()]);
            let res =
                feedback::step_chunk(&sec, &p, a, &g[a..], &mut r[a..], &mut scales, &mut body);
            let mut r_whole = before.clone();
            let mut out = vec![0u8; max_frame_len(n, &method)];
            let whole = feedback_step(&g, &mut r_whole, &p, &mut [], &mut out);
            assert_eq!(res, whole.map(|_| ()), "{method:?} {gv}");
            if res.is_err() {
                assert!(
                    same_bits(&r, &before),
                    "{method:?}: residual changed on error"
                );
                assert!(scales.iter().chain(&body).all(|&x| x == 7));
            }
        }
        let mut r = vec![0.0f32; n];
        let (s, b) = sec.ranges(0, n).unwrap();
        let (mut scales, mut body) = (vec![0u8; s.len()], vec![0u8; b.len()]);
        let g = vec![0.0f32; n];
        assert_eq!(
            feedback::step_chunk(&sec, &p, 0, &g, &mut r[1..], &mut scales, &mut body),
            Err(Error::LengthMismatch {
                expected: n,
                got: n - 1
            })
        );
    }
    let unscaled = Method::Sign {
        scale: SignScale::None,
        zero_mask: false,
    };
    let sec = Sections::of(8, &unscaled).unwrap();
    let (g, mut r) = ([1.0f32; 8], [0.0f32; 8]);
    let (mut s, mut b) = ([0u8; 0], [0u8; 1]);
    assert_eq!(
        feedback::step_chunk(&sec, &params(unscaled), 0, &g, &mut r, &mut s, &mut b),
        Err(Error::InvalidParams {
            param: Param::SignScale
        })
    );
}

// ---------------------------------------------------------------------------------------------
// Sparse frames.

/// The indices and values of a parsed sparse frame, the values decoded in pieces.
fn lists(sf: &SparseFrame<'_>, d: &mut Data) -> (Vec<u32>, Vec<f32>) {
    let mut idx = vec![0u32; sf.kept()];
    sf.indices(&mut idx).unwrap();
    let mut val = vec![f32::NAN; sf.kept()];
    let mut at = 0;
    while at < val.len() {
        let len = (1 + d.below(70) as usize).min(val.len() - at);
        sf.values(at, &mut val[at..at + len]).unwrap();
        at += len;
    }
    (idx, val)
}

#[test]
fn sparse_lists_add_up_to_accumulate_into() {
    let mut d = Data(6);
    for method in sparse_methods() {
        for n in [0, 1, 40, 1000, 70_000] {
            let p = params(method);
            let frame = whole_frame(&grads(&mut d, n), &p).unwrap();
            let sf = SparseFrame::parse(&frame, &p, n).unwrap();
            let info = validate(&frame, &p, n).unwrap();
            assert_eq!(sf.info(), info);
            assert_eq!(sf.kept() as u64, info.kept);
            let (idx, val) = lists(&sf, &mut d);
            assert!(idx.windows(2).all(|w| w[0] < w[1]) && idx.iter().all(|&i| (i as usize) < n));
            let start = grads(&mut d, n);
            for weight in [1.0f32, -1.0, 0.3] {
                let mut want = start.clone();
                accumulate_into(&frame, &p, &mut want, weight).unwrap();
                let mut got = start.clone();
                for (&i, &v) in idx.iter().zip(&val) {
                    got[i as usize] += weight * v;
                }
                assert!(same_bits(&got, &want), "{method:?} n {n} w {weight}");
            }
            let mut want = vec![f32::NAN; n];
            decode_into(&frame, &p, &mut want).unwrap();
            let mut got = vec![0.0f32; n];
            for (&i, &v) in idx.iter().zip(&val) {
                got[i as usize] = v;
            }
            assert!(same_bits(&got, &want), "{method:?} n {n} decode");
        }
    }
}

#[test]
fn sparse_frame_refuses_bad_requests() {
    let p = params(Method::TopK {
        k: K::Count(5),
        values: Values::F32,
    });
    let g: Vec<f32> = (0..50).map(|i| i as f32).collect();
    let frame = whole_frame(&g, &p).unwrap();
    let sf = SparseFrame::parse(&frame, &p, 50).unwrap();
    assert_eq!(
        sf.indices(&mut [0; 4]),
        Err(Error::LengthMismatch {
            expected: 5,
            got: 4
        })
    );
    assert_eq!(
        sf.values(3, &mut [0.0; 3]),
        Err(Error::BadChunk { start: 3, end: 6 })
    );
    assert!(sf.values(5, &mut []).is_ok());
    let dense = params(Method::Dense {
        values: Values::F32,
    });
    let dense_frame = whole_frame(&g, &dense).unwrap();
    assert_eq!(
        SparseFrame::parse(&dense_frame, &dense, 50).err(),
        Some(Error::InvalidParams {
            param: Param::Method
        })
    );
    assert_eq!(
        SparseFrame::parse(&dense_frame, &p, 50).err(),
        validate(&dense_frame, &p, 50).err()
    );
}

/// The sparse frames to attack: the golden ones and fresh ones of every method.
fn sparse_frames() -> Vec<(Params, usize, Vec<u8>)> {
    let mut v = Vec::new();
    for case in golden() {
        if matches!(
            case.params.method,
            Method::TopK { .. } | Method::Threshold { .. } | Method::RandomK { .. }
        ) {
            let path = testdata().join("golden").join(format!("{}.gwf", case.name));
            let frame = std::fs::read(&path).unwrap();
            v.push((case.params, case.grad.len(), frame));
        }
    }
    let mut d = Data(7);
    for method in sparse_methods() {
        let p = params(method);
        let frame = whole_frame(&grads(&mut d, 60), &p).unwrap();
        v.push((p, 60, frame));
    }
    v
}

#[test]
fn hostile_sparse_frames_get_the_errors_of_validate() {
    for (p, n, frame) in sparse_frames() {
        let same = |f: &[u8], what: &str| {
            let got = SparseFrame::parse(f, &p, n).map(|sf| sf.info());
            assert_eq!(got, validate(f, &p, n), "{:?} {what}", p.method);
        };
        same(&frame, "as written");
        for len in 0..frame.len() {
            same(&frame[..len], "truncated");
        }
        for at in 0..frame.len() {
            for bit in 0..8 {
                let mut bad = frame.clone();
                bad[at] ^= 1 << bit;
                same(&bad, "flipped");
                fix_crc(&mut bad);
                same(&bad, "flipped, checksum fixed");
            }
        }
        let head = peek(&frame).unwrap();
        assert_eq!(head.n, n as u64);
    }
}

// ---------------------------------------------------------------------------------------------
// Sparse error feedback in chunks.

fn feedback_sparse_methods() -> Vec<Method> {
    sparse_methods()
        .into_iter()
        .filter(|m| !matches!(m, Method::RandomK { unbiased: true, .. }))
        .collect()
}

/// The frame of an error-feedback step on `g` and `r` (its input `g + r` in f32).
fn frame_of_sum(g: &[f32], r: &[f32], p: &Params) -> Vec<u8> {
    let x: Vec<f32> = g.iter().zip(r).map(|(&g, &r)| g + r).collect();
    whole_frame(&x, p).unwrap()
}

#[test]
fn sparse_update_in_chunks_is_feedback_step() {
    let mut d = Data(8);
    for method in feedback_sparse_methods() {
        for n in [0, 1, 300, 70_000] {
            let mut r_want = grads(&mut d, n);
            let mut r_got = r_want.clone();
            for step in 0..2 {
                let p = params(method).at_step(step);
                let g = grads(&mut d, n);
                let frame = frame_of_sum(&g, &r_got, &p);
                let mut out = vec![0u8; max_frame_len(n, &method)];
                let mut scratch = vec![0u32; scratch_len(n, &method)];
                let len = feedback_step(&g, &mut r_want, &p, &mut scratch, &mut out).unwrap();
                assert_eq!(out[..len], frame[..], "{method:?} n {n}");
                let sf = SparseFrame::parse(&frame, &p, n).unwrap();
                let (idx, val) = lists(&sf, &mut d);
                let mut max = 0.0f32;
                for w in cuts(n, 1, 5, &mut d).windows(2) {
                    let (a, e) = (w[0], w[1]);
                    let m =
                        feedback::sparse_update(&idx, &val, a, &g[a..e], &mut r_got[a..e]).unwrap();
                    assert_eq!(m, ResidualBound::of(&r_got[a..e]).max_abs());
                    max = max.max(m);
                }
                assert!(same_bits(&r_got, &r_want), "{method:?} n {n} step {step}");
                assert_eq!(max, ResidualBound::of(&r_want).max_abs());
            }
        }
    }
}

#[test]
fn sparse_fix_up_in_chunks_is_the_one_pass_step() {
    let mut d = Data(9);
    let methods =
        [Values::F32, Values::F16, Values::Int8 { block: 64 }].map(|values| Method::TopK {
            k: K::Ratio(0.01),
            values,
        });
    for method in methods {
        let n = 70_000;
        let p = params(method);
        let mut r_want = grads(&mut d, n);
        let mut bound = ResidualBound::of(&r_want);
        let mut r_got = r_want.clone();
        let g = grads(&mut d, n);
        let frame = frame_of_sum(&g, &r_got, &p);
        let mut out = vec![0u8; max_frame_len(n, &method)];
        let mut scratch = vec![0u32; scratch_len(n, &method)];
        let len =
            feedback_step_bounded(&g, &mut r_want, &mut bound, &p, &mut scratch, &mut out).unwrap();
        assert_eq!(out[..len], frame[..]);
        let sf = SparseFrame::parse(&frame, &p, n).unwrap();
        let (idx, val) = lists(&sf, &mut d);
        // The one-pass step stores the sums first, then fixes up the kept entries.
        for (r, &g) in r_got.iter_mut().zip(&g) {
            *r += g;
        }
        let mut largest_fixed = 0.0f32;
        for w in cuts(n, 1, 7, &mut d).windows(2) {
            let m = feedback::sparse_fix_up(&idx, &val, w[0], &mut r_got[w[0]..w[1]]).unwrap();
            largest_fixed = largest_fixed.max(m);
        }
        assert!(same_bits(&r_got, &r_want), "{method:?}");
        let kept_max = idx
            .iter()
            .map(|&i| r_got[i as usize].abs())
            .fold(0.0f32, f32::max);
        assert_eq!(largest_fixed, kept_max);
        assert!(bound.max_abs() >= largest_fixed);
    }
    assert_eq!(
        feedback::sparse_fix_up(&[1, 2], &[1.0], 0, &mut [0.0; 4]),
        Err(Error::LengthMismatch {
            expected: 2,
            got: 1
        })
    );
    assert_eq!(
        feedback::sparse_update(&[1], &[1.0], 0, &[0.0; 3], &mut [0.0; 4]),
        Err(Error::LengthMismatch {
            expected: 3,
            got: 4
        })
    );
    // Out of order or out of the chunk: nothing outside it is touched, nothing panics.
    let mut r = [0.0f32; 4];
    let m = feedback::sparse_fix_up(&[9, 2, 1, 7], &[1.0; 4], 4, &mut r).unwrap();
    assert!(m >= 0.0);
}
