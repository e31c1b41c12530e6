//! DGC's recipe (momentum correction, factor masking, local clipping, density warm-up) against
//! a plain re-statement of the paper's algorithm, its bookkeeping (`sent + v_new == u + v_old`),
//! its errors, and checkpoints that resume bit for bit across a change of density.

mod common;

use std::collections::HashMap;

use common::{Rng, same_bits};
use gradwire::dgc::{DensitySchedule, Dgc, DgcConfig, DgcSelection};
use gradwire::{Aggregator, Error, Reduction, Tensor, TensorSpec};

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("a", vec![30, 20]),
        TensorSpec::new("b", vec![77]),
    ]
}

fn gradients(step: u64, scale: f32) -> HashMap<String, Tensor> {
    specs()
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.shape.iter().product();
            let g = Rng(100 * step + i as u64).vec(n, scale);
            (s.name.clone(), Tensor::new(s.shape, g).unwrap())
        })
        .collect()
}

/// One rank's step: the bundle's decoded values by tensor (the mean of one rank).
fn step(
    dgc: &mut Dgc,
    s: u64,
    grads: &HashMap<String, Tensor>,
) -> (Vec<u8>, HashMap<String, Vec<f32>>) {
    let manifest = dgc.manifest_at(specs(), s).unwrap();
    let mut bundle = Vec::new();
    assert_eq!(
        dgc.compress_bundle(&manifest, grads, 0, &mut bundle)
            .unwrap(),
        s
    );
    let mut mean = Vec::new();
    Aggregator::new()
        .aggregate_into(&manifest, &[bundle.clone()], s, Reduction::Mean, &mut mean)
        .unwrap();
    let sent = specs()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                manifest.slice(&mean, &t.name).unwrap().to_vec(),
            )
        })
        .collect();
    (bundle, sent)
}

#[test]
fn the_schedule_warms_up_to_the_target() {
    let s = DensitySchedule::warm_up(0.001, 5);
    let d: Vec<f64> = [0, 4, 5, 10, 15, 20, 25, 1000]
        .iter()
        .map(|&t| s.density(t))
        .collect();
    assert_eq!(
        d,
        [
            0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001, 0.001
        ]
    );
    assert_eq!(DensitySchedule::constant(0.01).density(u64::MAX), 0.01);
    let bad = [
        DensitySchedule {
            target: 0.0,
            ..DensitySchedule::constant(0.1)
        },
        DensitySchedule {
            start: 0.05,
            ..DensitySchedule::warm_up(0.1, 3)
        },
        DensitySchedule {
            factor: 0.5,
            ..DensitySchedule::warm_up(0.01, 3)
        },
        DensitySchedule {
            stage_steps: 0,
            ..DensitySchedule::warm_up(0.01, 3)
        },
        DensitySchedule {
            factor: f64::NAN,
            ..DensitySchedule::warm_up(0.01, 3)
        },
    ];
    for schedule in bad {
        let c = DgcConfig::new(DgcSelection::TopK, schedule.clone());
        assert!(
            matches!(Dgc::new(c, 0), Err(Error::Config { .. })),
            "{schedule:?}"
        );
    }
    for momentum in [1.0, -0.1, f32::NAN] {
        let c = DgcConfig {
            momentum,
            ..DgcConfig::new(DgcSelection::TopK, DensitySchedule::constant(0.1))
        };
        assert!(Dgc::new(c, 0).is_err(), "{momentum}");
    }
    let c = DgcConfig {
        clip_norm: Some(0.0),
        ..DgcConfig::new(DgcSelection::TopK, DensitySchedule::constant(0.1))
    };
    assert!(Dgc::new(c, 0).is_err());
}

/// The paper's algorithm, written out: clip, u = m u + g, v += u, send the top-k of v, clear
/// v where sent and u where a non-zero value was sent. Two choices are gradwire's, not the
/// paper's: k = floor(n d) clamped to [1, n], and u kept where a selected value is exactly 0.
struct Reference {
    u: HashMap<String, Vec<f32>>,
    v: HashMap<String, Vec<f32>>,
}

impl Reference {
    fn step(
        &mut self,
        config: &DgcConfig,
        s: u64,
        grads: &HashMap<String, Tensor>,
    ) -> HashMap<String, Vec<f32>> {
        let mut names: Vec<_> = grads.keys().cloned().collect();
        names.sort();
        let sq: f64 = names
            .iter()
            .flat_map(|n| grads[n].data())
            .map(|&x| f64::from(x) * f64::from(x))
            .sum();
        let scale = match config.clip_norm {
            Some(c) if sq.sqrt() > f64::from(c) => (f64::from(c) / sq.sqrt()) as f32,
            _ => 1.0,
        };
        let density = config.schedule.density(s);
        let mut sent = HashMap::new();
        for name in names {
            let g = grads[&name].data();
            let n = g.len();
            let u = self.u.entry(name.clone()).or_insert(vec![0.0; n]);
            let v = self.v.entry(name.clone()).or_insert(vec![0.0; n]);
            for i in 0..n {
                u[i] = config.momentum * u[i] + scale * g[i];
                v[i] += u[i];
            }
            let k = ((n as f64 * density).floor() as usize).clamp(1, n);
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| v[b].abs().total_cmp(&v[a].abs()).then(a.cmp(&b)));
            let mut out = vec![0.0f32; n];
            for &i in &order[..k] {
                out[i] = v[i];
                v[i] = 0.0;
                if out[i] != 0.0 {
                    u[i] = 0.0;
                }
            }
            sent.insert(name, out);
        }
        sent
    }
}

#[test]
fn top_k_with_the_recipe_is_the_algorithm_written_out_bit_for_bit() {
    for clip_norm in [None, Some(3.0f32)] {
        let config = DgcConfig {
            clip_norm,
            ..DgcConfig::new(DgcSelection::TopK, DensitySchedule::warm_up(0.02, 3))
        };
        let mut dgc = Dgc::new(config.clone(), 1).unwrap();
        let mut reference = Reference {
            u: HashMap::new(),
            v: HashMap::new(),
        };
        for s in 0..12 {
            let grads = gradients(s, 1.0);
            let (_, sent) = step(&mut dgc, s, &grads);
            let want = reference.step(&config, s, &grads);
            for t in specs() {
                let name = &t.name;
                assert!(
                    same_bits(&sent[name], &want[name]),
                    "{clip_norm:?} step {s} {name}: sent"
                );
                assert!(
                    same_bits(dgc.velocity(name).unwrap(), &reference.u[name]),
                    "step {s} {name}: velocity"
                );
                assert!(
                    same_bits(dgc.residual(name).unwrap(), &reference.v[name]),
                    "step {s} {name}: residual"
                );
            }
            // The density of the step: 25 %, 6.25 %, then the 2 % target.
            let kept = sent["a"].iter().filter(|&&x| x != 0.0).count();
            assert_eq!(kept, [150, 37, 12, 12][(s / 3).min(3) as usize], "step {s}");
        }
    }
}

/// Each tensor's velocity and residual (zeros before its first step), by name.
fn velocities_and_residuals(dgc: &Dgc) -> HashMap<String, (Vec<f32>, Vec<f32>)> {
    specs()
        .iter()
        .map(|t| {
            let n = t.shape.iter().product();
            let u = dgc.velocity(&t.name).map_or(vec![0.0; n], <[f32]>::to_vec);
            let v = dgc.residual(&t.name).map_or(vec![0.0; n], <[f32]>::to_vec);
            (t.name.clone(), (u, v))
        })
        .collect()
}

#[test]
fn random_k_with_the_recipe_keeps_what_it_does_not_send() {
    let config = DgcConfig {
        values: gradwire::core::Values::Int8 { block: 16 },
        ..DgcConfig::new(DgcSelection::RandomK, DensitySchedule::warm_up(0.05, 2))
    };
    let m = config.momentum;
    let mut dgc = Dgc::new(config, 9).unwrap();
    for s in 0..8 {
        let grads = gradients(s, 1.0);
        let before = velocities_and_residuals(&dgc);
        let (_, sent) = step(&mut dgc, s, &grads);
        for t in specs() {
            let (u_old, v_old) = &before[&t.name];
            let g = grads[&t.name].data();
            let (u_new, v_new) = (
                dgc.velocity(&t.name).unwrap(),
                dgc.residual(&t.name).unwrap(),
            );
            for i in 0..g.len() {
                let u = m * u_old[i] + g[i];
                let lhs = f64::from(sent[&t.name][i]) + f64::from(v_new[i]);
                let rhs = f64::from(u) + f64::from(v_old[i]);
                assert!(
                    (lhs - rhs).abs() <= 1e-6 * (1.0 + rhs.abs()),
                    "step {s} {} [{i}]",
                    t.name
                );
                let masked = if sent[&t.name][i] != 0.0 { 0.0 } else { u };
                assert_eq!(
                    u_new[i].to_bits(),
                    masked.to_bits(),
                    "step {s} {} [{i}]",
                    t.name
                );
            }
        }
    }
}

#[test]
fn a_bad_step_changes_nothing() {
    let config = DgcConfig::new(DgcSelection::TopK, DensitySchedule::warm_up(0.02, 2));
    let mut dgc = Dgc::new(config, 0).unwrap();
    step(&mut dgc, 0, &gradients(0, 1.0));
    let snapshot = dgc.to_bytes().unwrap();
    let manifest = dgc.manifest_at(specs(), 1).unwrap();
    let mut out = Vec::new();
    let mut bad = gradients(1, 1.0);
    let mut a = bad["a"].data().to_vec();
    a[17] = f32::INFINITY;
    bad.insert("a".into(), Tensor::new(vec![30, 20], a).unwrap());
    match dgc.compress_bundle(&manifest, &bad, 0, &mut out) {
        Err(Error::Core {
            tensor,
            source: gradwire::core::Error::NonFinite { index: 17 },
            ..
        }) => {
            assert_eq!(tensor, "a")
        }
        other => panic!("{other:?}"),
    }
    assert!(out.is_empty());
    // A manifest of another stage's density (step 2 is at 6.25 %).
    let other = dgc.manifest_at(specs(), 2).unwrap();
    assert!(matches!(
        dgc.compress_bundle(&other, &gradients(1, 1.0), 0, &mut out),
        Err(Error::Config { .. })
    ));
    assert_eq!(dgc.step(), 1);
    assert_eq!(dgc.to_bytes().unwrap(), snapshot);
}

#[test]
fn a_restored_checkpoint_continues_bit_for_bit() {
    let config = DgcConfig {
        clip_norm: Some(5.0),
        ..DgcConfig::new(DgcSelection::TopK, DensitySchedule::warm_up(0.02, 3))
    };
    let mut whole = Dgc::new(config.clone(), 4).unwrap();
    let bundles: Vec<Vec<u8>> = (0..10)
        .map(|s| step(&mut whole, s, &gradients(s, 1.0)).0)
        .collect();
    let mut first = Dgc::new(config.clone(), 4).unwrap();
    for s in 0..5 {
        step(&mut first, s, &gradients(s, 1.0));
    }
    let bytes = first.to_bytes().unwrap();
    let mut resumed = Dgc::from_bytes(config.clone(), &bytes).unwrap();
    assert_eq!(resumed.step(), 5);
    for s in 5..10 {
        // Steps 5 (6.25 %) and 6.. (2 %): across a change of density.
        assert_eq!(
            step(&mut resumed, s, &gradients(s, 1.0)).0,
            bundles[s as usize],
            "step {s}"
        );
    }
    assert_eq!(resumed.to_bytes().unwrap(), whole.to_bytes().unwrap());
    let other = DgcConfig {
        momentum: 0.8,
        ..config.clone()
    };
    match Dgc::from_bytes(other, &bytes) {
        Err(Error::Checkpoint { reason }) => assert!(reason.contains("momentum=0.9"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let mut damaged = bytes.clone();
    let at = damaged.len() - 5;
    damaged[at] ^= 1;
    match Dgc::from_bytes(config.clone(), &damaged) {
        Err(Error::Checkpoint { reason }) => assert!(reason.contains("checksum"), "{reason}"),
        other => panic!("{other:?}"),
    }
    for cut in [0, 8, bytes.len() / 3, bytes.len() - 1] {
        assert!(
            Dgc::from_bytes(config.clone(), &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
}

#[test]
fn f16_values_with_momentum_saturate_instead_of_failing() {
    // Issue 48 class 2: DGC with f16 values, momentum 0.9, a constant gradient of 3000. The
    // velocity tends to 30,000 and `velocity + residual` passes 65504 within a few steps;
    // before, every step from step 6 failed. Now the value sent saturates and the residual
    // keeps the rest: `sent + v_new == u + v_old` at every coordinate, to f32 rounding.
    let config = DgcConfig {
        values: gradwire::core::Values::F16,
        ..DgcConfig::new(DgcSelection::TopK, DensitySchedule::constant(0.02))
    };
    let m = config.momentum;
    let mut dgc = Dgc::new(config, 0).unwrap();
    let grads: HashMap<String, Tensor> = specs()
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            (
                t.name.clone(),
                Tensor::new(t.shape.clone(), vec![3000.0; n]).unwrap(),
            )
        })
        .collect();
    let mut saturated = 0usize;
    for s in 0..40 {
        let before = velocities_and_residuals(&dgc);
        let (_, sent) = step(&mut dgc, s, &grads);
        for t in specs() {
            let (u_old, v_old) = &before[&t.name];
            let v_new = dgc.residual(&t.name).unwrap();
            for i in 0..v_new.len() {
                let u = m * u_old[i] + 3000.0;
                let x = u + v_old[i];
                let got = sent[&t.name][i];
                assert!(got.abs() <= 65504.0, "step {s}: {got}");
                saturated += usize::from(got == 65504.0 && x > 65520.0);
                assert_eq!(got + v_new[i], x, "step {s} {} [{i}]", t.name);
            }
        }
    }
    assert!(saturated > 0, "no step sent a saturated value");
}
