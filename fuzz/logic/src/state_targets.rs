//! Target `method_state`: the checkpoints of PowerSGD (`PowerSgd::from_bytes`) and DGC
//! (`Dgc::from_bytes`), state files (FORMAT.md 16, 17), from hostile bytes.
//!
//! Input: a byte of flags (which method; which file: fuzzer bytes, the rank's own checkpoint
//! XOR-damaged at fuzzer positions, the rank's own checkpoint unchanged, or it with up to 8
//! edits of its entries and tensors and a checksum recomputed from FORMAT.md's text; PowerSGD's
//! rank),
//! then the gradients of the three steps before the checkpoint and of the step after it (fuzzer
//! f32 bits: NaN, infinities and huge values included), then the file's bytes or damage.
//!
//! Properties: no panic; a refused file is an error with a message; a rank restored from its
//! own checkpoint gives the next step bit for bit (or the same error) as the uninterrupted rank;
//! a rank restored from any accepted file gives a next step that succeeds with finite values of
//! the model's shapes or fails with an error.

use std::collections::HashMap;

use gradwire::comm::{Communicator, LocalGroup};
use gradwire::dgc::{DensitySchedule, Dgc, DgcConfig, DgcSelection};
use gradwire::powersgd::{PowerSgd, PowerSgdConfig};
use gradwire::tensor::Tensor;
use gradwire::{TensorSpec, core::Values};

use crate::input::Input;

/// The model: a matrix PowerSGD compresses and a vector it does not.
const SHAPES: [(&str, &[usize]); 2] = [("a", &[8, 6]), ("b", &[5])];

fn gradients(inp: &mut Input<'_>) -> HashMap<String, Tensor> {
    SHAPES
        .iter()
        .map(|&(name, shape)| {
            let n: usize = shape.iter().product();
            // Mostly ordinary values, and any bits where the fuzzer says so.
            let data = (0..n)
                .map(|i| {
                    if inp.is_empty() {
                        (i as f32 - 3.0) / 7.0
                    } else if inp.u8() < 16 {
                        inp.f32_bits()
                    } else {
                        f32::from(inp.u8() as i8) / 16.0
                    }
                })
                .collect();
            (
                name.to_owned(),
                Tensor::new(shape.to_vec(), data).expect("shape"),
            )
        })
        .collect()
}

/// The CRC-32 of a state file's entries and tensors as FORMAT.md section 17 defines it,
/// written here from the text: entries (without `crc32`) in key order as key, 0, value, 0;
/// tensors in name order as name, 0, u32 LE dimension count, u64 LE dimensions, f32 LE values.
fn spec_crc(
    entries: &std::collections::BTreeMap<String, String>,
    tensors: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> u32 {
    let mut b = Vec::new();
    for (k, v) in entries.iter().filter(|(k, _)| k.as_str() != "crc32") {
        b.extend_from_slice(k.as_bytes());
        b.push(0);
        b.extend_from_slice(v.as_bytes());
        b.push(0);
    }
    for (name, (shape, values)) in tensors {
        b.extend_from_slice(name.as_bytes());
        b.push(0);
        b.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for &d in shape {
            b.extend_from_slice(&(d as u64).to_le_bytes());
        }
        for x in values {
            b.extend_from_slice(&x.to_le_bytes());
        }
    }
    crate::input::crc32(&b)
}

/// A state file's entries and tensors, read with the safetensors crate.
#[allow(clippy::type_complexity)]
fn contents(
    bytes: &[u8],
) -> (
    std::collections::BTreeMap<String, String>,
    std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).expect("the own file's header");
    let entries = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let file = safetensors::SafeTensors::deserialize(bytes).expect("the own file");
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect();
    (entries, tensors)
}

/// `own` with fuzzer edits of its entries and tensors, its `crc32` recomputed by
/// [`spec_crc`]: hostile contents that pass the checksum. The own file's stored CRC must be
/// [`spec_crc`]'s, so FORMAT.md section 17 and the code agree.
fn edited(inp: &mut Input<'_>, own: &[u8]) -> Vec<u8> {
    let (mut entries, mut tensors) = contents(own);
    assert_eq!(
        entries.get("crc32").map(String::as_str),
        Some(spec_crc(&entries, &tensors).to_string().as_str()),
        "the own file's CRC is not FORMAT.md's"
    );
    let names = ["a", "b", "zz"];
    for _ in 0..8 {
        if inp.is_empty() {
            break;
        }
        let keys: Vec<String> = tensors.keys().cloned().collect();
        let pick = |inp: &mut Input<'_>| -> Option<String> {
            (!keys.is_empty()).then(|| keys[inp.range(0, keys.len() as u64 - 1) as usize].clone())
        };
        match inp.u8() % 6 {
            0 => {
                let key = ["step", "seed", "config", "shapes"][inp.range(0, 3) as usize];
                let value = match inp.u8() % 3 {
                    0 => inp.u64().to_string(),
                    1 => {
                        let len = inp.range(0, 40) as usize;
                        String::from_utf8_lossy(inp.bytes(len)).into_owned()
                    }
                    _ => format!(
                        "{{\"a\":[{},{}],\"b\":[{}]}}",
                        inp.range(0, 9),
                        inp.range(0, 9),
                        inp.range(0, 9)
                    ),
                };
                entries.insert(key.to_owned(), value);
            }
            1 => {
                if let Some(k) = pick(inp)
                    && let Some((_, values)) = tensors.get_mut(&k)
                    && !values.is_empty()
                {
                    let at = inp.range(0, values.len() as u64 - 1) as usize;
                    values[at] = inp.f32_bits();
                }
            }
            2 => {
                if let Some(k) = pick(inp) {
                    let shape: Vec<usize> = (0..inp.range(0, 3))
                        .map(|_| inp.range(0, 9) as usize)
                        .collect();
                    let n = shape.iter().product();
                    let values = (0..n).map(|i| i as f32 / 8.0).collect();
                    tensors.insert(k, (shape, values));
                }
            }
            3 => {
                if let Some(k) = pick(inp) {
                    tensors.remove(&k);
                }
            }
            _ => {
                let prefix = ["q:", "residual:", "velocity:", "x:"][inp.range(0, 3) as usize];
                let name = names[inp.range(0, 2) as usize];
                let shape = vec![inp.range(0, 9) as usize, inp.range(1, 9) as usize];
                let n = shape.iter().product();
                let values = (0..n).map(|i| (i as f32 - 4.0) * 1e3).collect();
                tensors.insert(format!("{prefix}{name}"), (shape, values));
            }
        }
    }
    entries.insert("crc32".into(), spec_crc(&entries, &tensors).to_string());
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, (shape, values))| {
            (
                n,
                shape,
                values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views = data.iter().map(|(n, shape, bytes)| {
        let view = safetensors::tensor::TensorView::new(
            safetensors::tensor::Dtype::F32,
            shape.clone(),
            bytes,
        )
        .expect("a view of whole f32s");
        (n.as_str(), view)
    });
    safetensors::serialize(views, Some(entries.into_iter().collect()))
        .expect("serializing an edited state file")
}

/// The file the input chooses: `mode` 0 fuzzer bytes, 1 `own` damaged, 2 `own`, 3 `own`
/// edited with a valid checksum.
fn file(inp: &mut Input<'_>, mode: u8, own: &[u8]) -> Vec<u8> {
    match mode {
        3 => edited(inp, own),
        0 => inp.rest().to_vec(),
        1 => {
            let mut b = own.to_vec();
            while !inp.is_empty() && !b.is_empty() {
                let at = inp.range(0, b.len() as u64 - 1) as usize;
                b[at] ^= inp.u8() | 1;
            }
            b
        }
        _ => own.to_vec(),
    }
}

/// A successful step's values: the model's shapes, finite.
fn check_values(out: &HashMap<String, Tensor>) {
    for &(name, shape) in &SHAPES {
        let t = out.get(name).expect("a tensor of the model is missing");
        assert_eq!(t.shape(), shape, "{name}");
        assert!(t.data().iter().all(|x| x.is_finite()), "{name}: not finite");
    }
}

fn bits(r: &Result<HashMap<String, Tensor>, gradwire::Error>) -> Result<Vec<u32>, String> {
    match r {
        Ok(out) => Ok(SHAPES
            .iter()
            .flat_map(|(n, _)| out[*n].data().iter().map(|x| x.to_bits()))
            .collect()),
        Err(e) => Err(e.to_string()),
    }
}

/// The target (see the module docs).
pub fn method_state(data: &[u8]) {
    let mut inp = Input::new(data);
    let flags = inp.u8();
    let mode = (flags >> 1) % 4;
    let before: Vec<_> = (0..3).map(|_| gradients(&mut inp)).collect();
    let after = gradients(&mut inp);
    if flags & 1 == 0 {
        powersgd(&mut inp, flags, mode, &before, &after);
    } else {
        dgc(&mut inp, mode, &before, &after);
    }
}

fn powersgd(
    inp: &mut Input<'_>,
    flags: u8,
    mode: u8,
    before: &[HashMap<String, Tensor>],
    after: &HashMap<String, Tensor>,
) {
    let config = || PowerSgdConfig {
        seed: 3,
        ..PowerSgdConfig::with_rank(1 + usize::from(flags >> 4 & 1))
    };
    let mut comm = LocalGroup::new(1)
        .into_communicators()
        .pop()
        .expect("a group of one");
    let comm: &mut dyn Communicator = &mut comm;
    let mut whole = PowerSgd::new(config()).expect("config");
    for g in before {
        let _ = whole.all_reduce_mean(comm, g);
    }
    let own = whole.to_bytes().expect("a checkpoint of the own state");
    let expected = whole.all_reduce_mean(comm, after);
    let bytes = file(inp, mode, &own);
    match PowerSgd::from_bytes(config(), &bytes) {
        Err(e) => {
            assert!(!e.to_string().is_empty());
            assert!(bytes != own, "the own checkpoint is refused: {e}");
        }
        Ok(mut restored) => {
            let next = restored.all_reduce_mean(comm, after);
            if bytes == own {
                assert_eq!(bits(&next), bits(&expected), "the restored rank differs");
            }
            if let Ok(out) = &next {
                check_values(out);
            }
        }
    }
}

fn dgc(
    inp: &mut Input<'_>,
    mode: u8,
    before: &[HashMap<String, Tensor>],
    after: &HashMap<String, Tensor>,
) {
    let config = || DgcConfig {
        values: Values::Int8 { block: 4 },
        clip_norm: Some(4.0),
        ..DgcConfig::new(DgcSelection::TopK, DensitySchedule::warm_up(0.1, 2))
    };
    let specs = || -> Vec<TensorSpec> {
        SHAPES
            .iter()
            .map(|&(n, s)| TensorSpec::new(n, s.to_vec()))
            .collect()
    };
    let step = |d: &mut Dgc, g: &HashMap<String, Tensor>| -> Result<Vec<u8>, String> {
        let manifest = d
            .manifest_at(specs(), d.step())
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        d.compress_bundle(&manifest, g, 0, &mut out)
            .map_err(|e| e.to_string())?;
        Ok(out)
    };
    let mut whole = Dgc::new(config(), 5).expect("config");
    for g in before {
        let _ = step(&mut whole, g);
    }
    let own = whole.to_bytes().expect("a checkpoint of the own state");
    let expected = step(&mut whole, after);
    let bytes = file(inp, mode, &own);
    match Dgc::from_bytes(config(), &bytes) {
        Err(e) => {
            assert!(!e.to_string().is_empty());
            assert!(bytes != own, "the own checkpoint is refused: {e}");
        }
        Ok(mut restored) => {
            let next = step(&mut restored, after);
            if bytes == own {
                assert_eq!(next, expected, "the restored rank differs");
            }
            if let Ok(bundle) = next {
                // The bundle decodes with the step's manifest into finite values.
                let s = restored.step().wrapping_sub(1);
                let manifest = restored.manifest_at(specs(), s).expect("manifest");
                let mut mean = Vec::new();
                gradwire::Aggregator::new()
                    .aggregate_into(
                        &manifest,
                        &[bundle],
                        s,
                        gradwire::Reduction::Mean,
                        &mut mean,
                    )
                    .expect("the rank's own bundle decodes");
                assert!(mean.iter().all(|x| x.is_finite()));
            }
        }
    }
}
