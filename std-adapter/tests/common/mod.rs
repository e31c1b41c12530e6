//! Shared helpers of the integration tests: the MiniLM gradients and seeded noise.
#![allow(dead_code)]

use std::collections::HashMap;

use gradwire::tensor::Tensor;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;

/// Path of the real gradients (copied from the project's shared data, see `testdata/`).
pub const MINILM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/minilm_small_grads.safetensors"
);

/// Total elements of the MiniLM gradients.
pub const MINILM_VALUES: usize = 789_504;

/// The 12 real gradient tensors of all-MiniLM-L6-v2 (step 1).
pub fn minilm() -> HashMap<String, Tensor> {
    let bytes = std::fs::read(MINILM).expect("testdata/minilm_small_grads.safetensors");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out = HashMap::new();
    for (name, view) in st.iter() {
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let data: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(
            name.to_owned(),
            Tensor::new(view.shape().to_vec(), data).expect("tensor"),
        );
    }
    out
}

/// SplitMix64: a small seeded generator for test noise.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// `base` plus seeded noise of relative size `scale` (per tensor: `scale * max|g|`).
pub fn noisy(base: &HashMap<String, Tensor>, rng: &mut Rng, scale: f32) -> HashMap<String, Tensor> {
    let mut names: Vec<&String> = base.keys().collect();
    names.sort();
    let mut out = HashMap::new();
    for name in names {
        let t = &base[name];
        let peak = t.data().iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let data: Vec<f32> = t
            .data()
            .iter()
            .map(|&x| x + rng.unit() * scale * peak.max(1e-6))
            .collect();
        out.insert(name.clone(), Tensor::new(t.shape().to_vec(), data).unwrap());
    }
    out
}

/// A map of named tensors from `(name, shape, data)`.
pub fn grads(items: &[(&str, &[usize], Vec<f32>)]) -> HashMap<String, Tensor> {
    items
        .iter()
        .map(|(n, s, d)| ((*n).to_owned(), Tensor::new(s.to_vec(), d.clone()).unwrap()))
        .collect()
}

/// The aggregate of `bundles` on the calling thread, in a new flat buffer (the free function
/// `gradwire::aggregate` was this).
pub fn aggregate<B: AsRef<[u8]> + Sync>(
    manifest: &gradwire::Manifest,
    bundles: &[B],
    step: u64,
    reduction: gradwire::Reduction,
) -> gradwire::Result<Vec<f32>> {
    let mut out = Vec::new();
    gradwire::Aggregator::serial().aggregate_into(manifest, bundles, step, reduction, &mut out)?;
    Ok(out)
}

/// Every rank's bundle of `per_rank[rank]` at step 0, each from a fresh compressor of `method`.
pub fn bundles(
    manifest: &gradwire::Manifest,
    method: &gradwire::CompressionMethod,
    per_rank: &[HashMap<String, Tensor>],
) -> Vec<Vec<u8>> {
    per_rank
        .iter()
        .enumerate()
        .map(|(rank, g)| {
            let mut c = gradwire::GradientCompressor::new(method.clone());
            let mut out = Vec::new();
            c.compress_bundle(manifest, g, rank, &mut out).unwrap();
            out
        })
        .collect()
}

/// Bit-exact equality of two f32 slices.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A communicator that records the largest buffer passed to it in any call, in bytes
/// (`all_gather`'s local buffer, each of `all_to_all`'s, `all_reduce_sum_f32`'s f32 slice),
/// into `largest`, which the test keeps a clone of.
pub struct Recording<C> {
    pub inner: C,
    pub largest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<C: gradwire::comm::Communicator> Recording<C> {
    /// `inner`, recording into a new counter (returned beside it).
    pub fn new(inner: C) -> (Self, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let largest = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let me = Recording {
            inner,
            largest: largest.clone(),
        };
        (me, largest)
    }

    fn note(&self, bytes: usize) {
        self.largest
            .fetch_max(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

impl<C: gradwire::comm::Communicator> gradwire::comm::Communicator for Recording<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), gradwire::comm::CommError> {
        self.note(local.len());
        self.inner.all_gather(local, max_len, out)
    }

    fn all_gather_append(
        &mut self,
        local: &[u8],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), gradwire::comm::CommError> {
        self.note(local.len());
        self.inner.all_gather_append(local, max_len, out)
    }

    fn all_to_all(
        &mut self,
        send: &[Vec<u8>],
        max_len: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), gradwire::comm::CommError> {
        self.note(send.iter().map(Vec::len).max().unwrap_or(0));
        self.inner.all_to_all(send, max_len, out)
    }

    fn traffic(&self) -> gradwire::comm::Traffic {
        self.inner.traffic()
    }

    fn close(&mut self, reason: &str) -> Option<String> {
        self.inner.close(reason)
    }

    fn all_reduce_sum_f32(&mut self, x: &mut [f32]) -> Result<(), gradwire::comm::CommError> {
        self.note(4 * x.len());
        self.inner.all_reduce_sum_f32(x)
    }
}

/// Per-step gradients: `base` plus seeded noise that changes every step, cheap to make in debug
/// builds (one noise table, read at a step-dependent rotation).
pub struct Stepper {
    names: Vec<String>,
    base: Vec<Tensor>,
    peaks: Vec<f32>,
    noise: Vec<f32>,
    scale: f32,
}

impl Stepper {
    pub fn new(base: &HashMap<String, Tensor>, seed: u64, scale: f32) -> Self {
        let mut names: Vec<String> = base.keys().cloned().collect();
        names.sort();
        let tensors: Vec<Tensor> = names.iter().map(|n| base[n].clone()).collect();
        let peaks = tensors
            .iter()
            .map(|t| {
                t.data()
                    .iter()
                    .fold(0.0f32, |m, x| m.max(x.abs()))
                    .max(1e-6)
            })
            .collect();
        let mut rng = Rng(seed);
        let noise = rng.vec(1 << 16, 1.0);
        Stepper {
            names,
            base: tensors,
            peaks,
            noise,
            scale,
        }
    }

    /// The gradients of step `s`.
    pub fn at(&self, s: u64) -> HashMap<String, Tensor> {
        let rot = (s as usize).wrapping_mul(7919);
        let mask = self.noise.len() - 1;
        let mut out = HashMap::new();
        let mut at = 0usize;
        for ((name, t), peak) in self.names.iter().zip(&self.base).zip(&self.peaks) {
            let amp = self.scale * peak;
            let data: Vec<f32> = t
                .data()
                .iter()
                .enumerate()
                .map(|(i, &x)| x + amp * self.noise[(at + i + rot) & mask])
                .collect();
            at += t.data().len();
            out.insert(name.clone(), Tensor::new(t.shape().to_vec(), data).unwrap());
        }
        out
    }
}

/// Safetensors bytes whose header declares eight `U8` tensors of 2^61 - 1 bytes each over a
/// 16-byte data section: safetensors 0.8 adds those offsets to the header length unchecked.
/// `meta`: JSON members put before the tensors (e.g. a `"__metadata__"` entry), or empty.
pub fn safetensors_with_offsets_near_usize_max(meta: &str) -> Vec<u8> {
    let size: u64 = (1 << 61) - 1;
    let mut header = format!("{{{meta}");
    for i in 0..8u64 {
        if header.len() > 1 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"t{i}\":{{\"dtype\":\"U8\",\"shape\":[{size}],\"data_offsets\":[{},{}]}}",
            i * size,
            (i + 1) * size
        ));
    }
    header.push('}');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 16]);
    bytes
}

/// Owned tensors (name, shape, elements) for `CompressedAllReduce::all_reduce_in_place`.
pub type Owned = Vec<(String, Vec<usize>, Vec<f32>)>;

/// The in-place views of `tensors`, in their order.
pub fn views(tensors: &mut [(String, Vec<usize>, Vec<f32>)]) -> Vec<gradwire::TensorMut<'_>> {
    tensors
        .iter_mut()
        .map(|(name, shape, data)| gradwire::TensorMut { name, shape, data })
        .collect()
}
