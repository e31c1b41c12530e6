//! Real MiniLM gradients against the reference Python compressor's top-k payload (ratio 0.01):
//! for every tensor, the same kept indices and bit-identical f32 values. Files and provenance:
//! `testdata/README.md`.

mod common;

use common::{decode, encode, testdata, topk_oracle};
use gradwire_core::{K, Method, Params, Values, peek, select, tensor_id};
use safetensors::{Dtype, SafeTensors};

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn topk_matches_the_reference_payload() {
    let grads_bytes = std::fs::read(testdata().join("minilm_small_grads.safetensors")).unwrap();
    let ref_bytes = std::fs::read(testdata().join("ref_topk_0.01_step1.safetensors")).unwrap();
    let grads = SafeTensors::deserialize(&grads_bytes).unwrap();
    let reference = SafeTensors::deserialize(&ref_bytes).unwrap();
    let mut names = grads.names();
    names.sort();
    assert_eq!(names.len(), 12);
    assert_eq!(reference.len(), 24);
    let method = Method::TopK {
        k: K::Ratio(0.01),
        values: Values::F32,
    };
    let mut total = 0usize;
    for name in names {
        let t = grads.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32);
        let g = f32s(t.data());
        let n = g.len();
        assert_eq!(n, t.shape().iter().product::<usize>());

        let idx_view = reference.tensor(&format!("{name}::idx")).unwrap();
        let val_view = reference.tensor(&format!("{name}::val")).unwrap();
        assert_eq!(
            (idx_view.dtype(), val_view.dtype()),
            (Dtype::I64, Dtype::F32)
        );
        // Reference indices come in no particular order: sort them, carrying the values along.
        let mut pairs: Vec<(usize, f32)> = i64s(idx_view.data())
            .into_iter()
            .map(|i| usize::try_from(i).unwrap())
            .zip(f32s(val_view.data()))
            .collect();
        pairs.sort_by_key(|&(i, _)| i);
        let ref_idx: Vec<usize> = pairs.iter().map(|&(i, _)| i).collect();
        let k = method_k(n);
        assert_eq!(ref_idx.len(), k, "{name}: reference k");

        // The selection kernel keeps the reference's indices (and the sorting oracle agrees).
        let mut scratch = vec![0u32; select::topk_scratch_len(n)];
        let sel = select::topk(&g, k, &mut scratch);
        let mut idx = Vec::new();
        select::for_each_kept(&g, sel, |i| idx.push(i));
        assert_eq!(idx, ref_idx, "{name}: kept indices");
        assert_eq!(topk_oracle(&g, k), ref_idx, "{name}: oracle");

        // The frame carries bit-identical values at those indices, zeros elsewhere.
        let params = Params::new(method).for_tensor(tensor_id(name));
        let frame = encode(&g, &params).unwrap();
        assert_eq!(peek(&frame).unwrap().kept, k as u64);
        let out = decode(&frame, &params, n).unwrap();
        let mut want = vec![0.0f32; n];
        for &(i, v) in &pairs {
            assert_eq!(v.to_bits(), g[i].to_bits(), "{name}[{i}]: reference value");
            want[i] = v;
        }
        for i in 0..n {
            assert_eq!(out[i].to_bits(), want[i].to_bits(), "{name}[{i}]");
        }
        total += k;
    }
    assert_eq!(total, 1966 + 7 + 4 * 1474 + 6 * 3);
}

/// k as the reference computes it: max(1, min(n, floor(n * ratio))).
fn method_k(n: usize) -> usize {
    let k = ((n as f64) * 0.01).floor() as usize;
    k.clamp(1, n)
}
