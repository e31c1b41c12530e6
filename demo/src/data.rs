//! The digits data set (embedded in `smartcore`), a fixed seeded train/test split and the
//! per-worker shards.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Pixels per image (8 x 8).
pub const FEATURES: usize = 64;
/// Number of classes (the digits 0 to 9).
pub const CLASSES: usize = 10;
/// Seed of the train/test split: fixed, so that every run and every seed sees the same split.
pub const SPLIT_SEED: u64 = 0x6772_6164_7769_7265; // "gradwire"
/// Share of the images that goes to the test set.
pub const TEST_FRACTION: f64 = 0.2;

/// A set of images with their labels, features scaled to [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct Samples {
    /// Row-major features, `len() * FEATURES` values in [0, 1].
    pub x: Vec<f32>,
    /// Labels in `0..CLASSES`.
    pub y: Vec<u32>,
}

impl Samples {
    /// Number of images.
    #[must_use]
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether there are no images.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The images at `indices`, in that order.
    ///
    /// # Panics
    /// If an index is out of range.
    #[must_use]
    pub fn select(&self, indices: &[usize]) -> Samples {
        let mut x = Vec::with_capacity(indices.len() * FEATURES);
        let mut y = Vec::with_capacity(indices.len());
        for &i in indices {
            x.extend_from_slice(&self.x[i * FEATURES..(i + 1) * FEATURES]);
            y.push(self.y[i]);
        }
        Samples { x, y }
    }

    /// Shard `rank` of `world_size`: every `world_size`-th image starting at `rank`.
    ///
    /// # Panics
    /// If `rank >= world_size`.
    #[must_use]
    pub fn shard(&self, rank: usize, world_size: usize) -> Samples {
        assert!(rank < world_size, "rank {rank} out of 0..{world_size}");
        let indices: Vec<usize> = (rank..self.len()).step_by(world_size).collect();
        self.select(&indices)
    }
}

/// The digits data set split into a training and a test set.
#[derive(Debug, Clone, PartialEq)]
pub struct Digits {
    /// The training images (80 %).
    pub train: Samples,
    /// The test images (20 %).
    pub test: Samples,
}

impl Digits {
    /// Loads the 1797 images embedded in `smartcore`, scales the features to [0, 1] (divides by
    /// 16) and splits them with a permutation drawn from [`SPLIT_SEED`]: the same split on every
    /// call, every run and every platform.
    ///
    /// # Panics
    /// If the embedded data set is malformed (it is not).
    #[must_use]
    pub fn load() -> Digits {
        let ds = smartcore::dataset::digits::load_dataset();
        assert_eq!(ds.num_features, FEATURES, "digits have 64 features");
        assert_eq!(ds.data.len(), ds.num_samples * FEATURES);
        let all = Samples {
            x: ds.data.iter().map(|&v| v / 16.0).collect(),
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            y: ds.target.iter().map(|&t| t as u32).collect(),
        };
        assert!(all.y.iter().all(|&c| (c as usize) < CLASSES));
        let mut order: Vec<usize> = (0..all.len()).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(SPLIT_SEED));
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let n_test = (all.len() as f64 * TEST_FRACTION).round() as usize;
        let (test, train) = order.split_at(n_test);
        Digits {
            train: all.select(train),
            test: all.select(test),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_fixed_and_complete() {
        let a = Digits::load();
        let b = Digits::load();
        assert_eq!(a, b);
        assert_eq!(a.train.len() + a.test.len(), 1797);
        assert_eq!(a.test.len(), 359);
        assert!(a.train.x.iter().all(|v| (0.0..=1.0).contains(v)));
        let shards: usize = (0..8).map(|r| a.train.shard(r, 8).len()).sum();
        assert_eq!(shards, a.train.len());
    }
}
