//! Criterion benches: every kernel and codec at n = 1e4, 1e6 and 2.5e7 (`Throughput::Bytes` of
//! the f32 input), each next to the read pass, the scalar specification and a naive baseline.
//!
//! `cargo bench -p gradwire-benches` (set `GRADWIRE_BENCH_SIZES=10000,1000000` to pick sizes).

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gradwire_benches::{
    Codec, ef_method, heavy_tailed, int8_plain, methods, read_pass, read_pass_prefetch,
    sign_bitvec, topk_full_sort, topk_select_nth,
};
use gradwire_core::scalar::{self, Selection};
use gradwire_core::{Values, k_from_ratio, quant, select, sign, values};
use std::hint::black_box;

fn sizes() -> Vec<usize> {
    std::env::var("GRADWIRE_BENCH_SIZES")
        .ok()
        .map(|s| {
            s.split(',')
                .filter_map(|v| v.trim().parse::<f64>().ok())
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_else(|| vec![10_000, 1_000_000, 25_000_000])
}

fn kernels(c: &mut Criterion) {
    for n in sizes() {
        let x = heavy_tailed(n, 42);
        let bytes = Throughput::Bytes((4 * n) as u64);
        let mut g = c.benchmark_group("read");
        g.throughput(bytes.clone());
        g.bench_with_input(BenchmarkId::new("read_pass", n), &x, |b, x| {
            b.iter(|| read_pass(black_box(x)))
        });
        g.bench_with_input(BenchmarkId::new("read_pass_prefetch", n), &x, |b, x| {
            b.iter(|| read_pass_prefetch(black_box(x)))
        });
        g.finish();

        // Top-k: the kernel, select_nth_unstable_by, the original module's full sort.
        for (name, ratio) in [("topk_1pct", 0.01), ("topk_0.1pct", 0.001)] {
            let k = k_from_ratio(n as u64, ratio) as usize;
            let mut g = c.benchmark_group(name);
            g.throughput(bytes.clone());
            if n >= 1_000_000 {
                g.sample_size(10);
            }
            let mut scratch = vec![0u32; select::kept_scratch_len(n, k)];
            g.bench_with_input(BenchmarkId::new("topk_kept", n), &x, |b, x| {
                b.iter(|| {
                    select::topk_kept(black_box(x), k, f32::INFINITY, &mut scratch)
                        .map(|kept| kept.idx.len())
                })
            });
            let mut hist = vec![0u32; scalar::TOPK_HIST];
            g.bench_with_input(BenchmarkId::new("scalar_spec", n), &x, |b, x| {
                b.iter(|| {
                    let cut = scalar::topk_cut(black_box(x), k, &mut hist);
                    let mut c = 0usize;
                    scalar::for_each_kept(x, Selection::TopK(cut), |_| c += 1);
                    c
                })
            });
            let mut work = Vec::with_capacity(n);
            g.bench_with_input(BenchmarkId::new("select_nth_unstable_by", n), &x, |b, x| {
                b.iter(|| topk_select_nth(black_box(x), k, &mut work))
            });
            if n <= 1_000_000 {
                g.bench_with_input(BenchmarkId::new("full_sort", n), &x, |b, x| {
                    b.iter(|| topk_full_sort(black_box(x), k).0.len())
                });
            }
            g.finish();
        }

        // Sign packing with per-block scale.
        let mut g = c.benchmark_group("sign");
        g.throughput(bytes.clone());
        let mut scales = vec![0u8; sign::scales_len(n, Some(1024))];
        let mut signs = vec![0u8; sign::bits_len(n)];
        g.bench_with_input(BenchmarkId::new("simd", n), &x, |b, x| {
            b.iter(|| sign::encode(black_box(x), Some(1024), &mut scales, &mut signs))
        });
        g.bench_with_input(BenchmarkId::new("scalar_spec", n), &x, |b, x| {
            b.iter(|| scalar::sign_encode(black_box(x), Some(1024), &mut scales, &mut signs))
        });
        let mut bv = bitvec::vec::BitVec::with_capacity(n);
        g.bench_with_input(BenchmarkId::new("bitvec", n), &x, |b, x| {
            b.iter(|| sign_bitvec(black_box(x), &mut bv))
        });
        g.finish();

        // Quantization, 8 and 4 bits.
        for bits in [8u8, 4] {
            let mut g = c.benchmark_group(format!("quant_{bits}bit"));
            g.throughput(bytes.clone());
            let mut scales = vec![0u8; quant::scales_len(n, 512)];
            let mut codes = vec![0u8; quant::codes_len(n, bits)];
            g.bench_with_input(BenchmarkId::new("simd", n), &x, |b, x| {
                b.iter(|| quant::encode(black_box(x), bits, 512, None, &mut scales, &mut codes))
            });
            g.bench_with_input(BenchmarkId::new("scalar_spec", n), &x, |b, x| {
                b.iter(|| {
                    scalar::quant_encode(black_box(x), bits, 512, None, &mut scales, &mut codes)
                })
            });
            if bits == 8 {
                let mut s = vec![0f32; n.div_ceil(512)];
                let mut cd = vec![0i8; n];
                g.bench_with_input(BenchmarkId::new("int8_plain", n), &x, |b, x| {
                    b.iter(|| int8_plain(black_box(x), 512, &mut s, &mut cd))
                });
            }
            g.finish();
        }

        // f16 / bf16 casts.
        for v in [Values::F16, Values::Bf16] {
            let mut g = c.benchmark_group(format!("{v:?}_cast").to_lowercase());
            g.throughput(bytes.clone());
            let mut out = vec![0u8; 2 * n];
            g.bench_with_input(BenchmarkId::new("simd", n), &x, |b, x| {
                b.iter(|| values::encode_plain(v, black_box(x), &mut out))
            });
            g.bench_with_input(BenchmarkId::new("scalar_spec", n), &x, |b, x| {
                b.iter(|| {
                    for (j, &a) in black_box(x).iter().enumerate() {
                        values::write_plain(v, a, &mut out[2 * j..]);
                    }
                })
            });
            g.finish();
        }

        // Whole codecs through the public API: encode, decode, accumulate.
        let mut out = vec![0.0f32; n];
        let mut acc = vec![0.0f32; n];
        for (name, method) in methods(&x) {
            let mut g = c.benchmark_group(format!("codec_{name}"));
            g.throughput(bytes.clone());
            if n >= 1_000_000 {
                g.sample_size(10);
            }
            let mut codec = Codec::new(method, n);
            g.bench_with_input(BenchmarkId::new("encode_into", n), &x, |b, x| {
                b.iter(|| codec.encode(black_box(x)))
            });
            g.bench_function(BenchmarkId::new("decode_into", n), |b| {
                b.iter(|| codec.decode(&mut out))
            });
            g.bench_function(BenchmarkId::new("accumulate_into", n), |b| {
                b.iter(|| codec.accumulate(&mut acc))
            });
            g.finish();
        }

        // The whole error-feedback step.
        let mut g = c.benchmark_group("ef_step");
        g.throughput(bytes.clone());
        if n >= 1_000_000 {
            g.sample_size(10);
        }
        let mut codec = Codec::new(ef_method(), n);
        let mut residual = vec![0.0f32; n];
        g.bench_with_input(BenchmarkId::new("feedback_step", n), &x, |b, x| {
            b.iter(|| codec.feedback(black_box(x), &mut residual))
        });
        g.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
