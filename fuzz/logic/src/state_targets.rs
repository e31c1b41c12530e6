//! Target `method_state`: the checkpoints of PowerSGD (`PowerSgd::from_bytes`) and DGC
//! (`Dgc::from_bytes`), state files (FORMAT.md 16, 17), from hostile bytes.
//!
//! Input: a byte of flags (which method; which file: fuzzer bytes, the rank's own checkpoint
//! XOR-damaged at fuzzer positions, or the rank's own checkpoint unchanged; PowerSGD's rank),
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

/// The file the input chooses: `mode` 0 fuzzer bytes, 1 `own` damaged, 2 `own`.
fn file(inp: &mut Input<'_>, mode: u8, own: &[u8]) -> Vec<u8> {
    match mode {
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
    let mode = (flags >> 1) % 3;
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
        ..PowerSgdConfig::with_rank(1 + usize::from(flags >> 3 & 1))
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
