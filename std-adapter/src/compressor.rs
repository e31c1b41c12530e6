//! [`GradientCompressor`], the original module's compressor: one rank's method, seed, step and
//! error-feedback state, over the engine (`engine`). Frames are real gradwire frames;
//! tensors are processed in sorted name order, so every run is deterministic.
//!
//! ```
//! use std::collections::HashMap;
//! use gradwire::{CompressionMethod, GradientCompressor, Tensor};
//!
//! let mut compressor = GradientCompressor::new(CompressionMethod::TopK { k: 2 });
//! let mut grads = HashMap::new();
//! grads.insert("w".to_string(), Tensor::from_vec(vec![0.1, 0.8, 0.2, -0.9], &[2, 2])?);
//! let compressed = compressor.compress(&grads)?;
//! let restored = compressor.decompress(&compressed)?;
//! assert_eq!(restored["w"].data(), &[0.0, 0.8, 0.0, -0.9]);
//! assert_eq!(restored["w"].shape(), &[2, 2]);
//! # Ok::<(), gradwire::Error>(())
//! ```

use std::collections::HashMap;
use std::path::Path;

use gradwire_core::{Method, Params, max_frame_len, tensor_id};

use crate::engine::dense_stream::DenseStream;
use crate::engine::{Engine, Gradients, Parallelism, Shapes};
use crate::error::{Error, Result};
use crate::feedback::{ErrorFeedback, KeptResidual};
use crate::layout::{self, BucketConfig, Manifest, frame_error};
use crate::method;
use crate::tensor::Tensor;

/// [`crate::CompressionMethod`] at its path before the method moved to [`crate::method`].
#[deprecated(
    since = "0.2.0",
    note = "use `gradwire::CompressionMethod` (defined in `gradwire::method`)"
)]
pub type CompressionMethod = crate::method::CompressionMethod;

/// [`crate::layout::CompressedGradient`] at its path before it moved to [`crate::layout`].
#[deprecated(
    since = "0.2.0",
    note = "use `gradwire::layout::CompressedGradient` (defined in `gradwire::layout`)"
)]
pub type CompressedGradient = crate::layout::CompressedGradient;

/// Compresses named gradients with one [`crate::CompressionMethod`], keeping the residuals of error
/// feedback, the seed and the step counter.
///
/// Frames of step `s` for tensor `name` are made with
/// `Params { method, seed, step: s, tensor_id: tensor_id(name) }`; the step advances after each
/// successful [`GradientCompressor::compress`], [`GradientCompressor::compress_into`] or
/// [`GradientCompressor::compress_bundle`].
#[derive(Debug)]
pub struct GradientCompressor {
    method: method::CompressionMethod,
    seed: u64,
    step: u64,
    feedback: Option<ErrorFeedback>,
    layout: Option<Manifest>,
    engine: Engine,
    parallelism: Parallelism,
    compression_ratio: f32,
}

impl GradientCompressor {
    /// A compressor for `method` with seed 0 at step 0. An invalid method is reported by the
    /// first call that compresses.
    pub fn new(method: method::CompressionMethod) -> Self {
        GradientCompressor {
            method,
            seed: 0,
            step: 0,
            feedback: None,
            layout: None,
            engine: Engine::default(),
            parallelism: Parallelism::Auto,
            compression_ratio: 0.0,
        }
    }

    /// The same compressor with another seed (random-k and stochastic rounding draw from
    /// (seed, step, tensor id)); set it before the first step: residuals kept so far were made
    /// with the old seed and are dropped.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.feedback = None;
        self
    }

    /// The same compressor starting at `step` (see [`GradientCompressor::set_step`]).
    pub(crate) fn with_step(mut self, step: u64) -> Self {
        self.set_step(step);
        self
    }

    /// Sets the next step to run, for example to resume a run without error feedback whose
    /// random draws (random-k, stochastic rounding) depend on the step. With error feedback,
    /// restore a checkpoint instead ([`GradientCompressor::load_feedback`]): it holds the step
    /// with the residuals. The error-feedback state, if any, moves to `step` too.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
        if let Some(fb) = &mut self.feedback {
            fb.set_step(step);
        }
    }

    /// The same compressor using `parallelism` (default [`Parallelism::Auto`]: every core of
    /// rayon's pool when it has more than one thread). Every setting writes the same bytes and
    /// leaves the same residuals.
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Sets how many cores the next calls use (see [`GradientCompressor::with_parallelism`]).
    pub(crate) fn set_parallelism(&mut self, parallelism: Parallelism) {
        self.parallelism = parallelism;
    }

    /// Where compression runs ([`GradientCompressor::with_parallelism`]).
    pub(crate) fn parallelism(&self) -> Parallelism {
        self.parallelism
    }

    /// The method.
    pub(crate) fn method(&self) -> &method::CompressionMethod {
        &self.method
    }

    /// The seed.
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// The next step to run.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The error-feedback state (residuals, seed, step), once a step with error feedback ran
    /// or a checkpoint was loaded.
    pub fn feedback(&self) -> Option<&ErrorFeedback> {
        self.feedback.as_ref()
    }

    /// Copies `name`'s residual state into `into` (see [`ErrorFeedback::keep`]; without error
    /// feedback state yet: that it has no residual).
    pub(crate) fn keep_residual(&self, name: &str, into: &mut KeptResidual) {
        match &self.feedback {
            Some(fb) => fb.keep(name, into),
            None => ErrorFeedback::keep_none(name, into),
        }
    }

    /// Puts back a residual state [`GradientCompressor::keep_residual`] copied.
    pub(crate) fn put_back_residual(&mut self, kept: &KeptResidual) {
        if let Some(fb) = self.feedback.as_mut() {
            fb.put_back(kept);
        }
    }

    /// Multiplies every residual by `factor` (see [`ErrorFeedback::scale`]).
    pub(crate) fn scale_residuals(&mut self, factor: f32) {
        if let Some(fb) = self.feedback.as_mut() {
            fb.scale(factor);
        }
    }

    /// Takes the error-feedback state out (for example to keep it elsewhere between steps);
    /// the next step with error feedback starts from empty residuals at the current step.
    pub(crate) fn take_feedback(&mut self) -> Option<ErrorFeedback> {
        self.feedback.take()
    }

    /// Fraction of the dense bytes the last compression put on the wire, over all tensors
    /// (0 before the first), as the original module defines it: the inverse of the "Nx" ratio
    /// (dense / compressed) that the README, the `gradwire` tool and the demo print.
    pub fn get_compression_ratio(&self) -> f32 {
        self.compression_ratio
    }

    /// Which of the engine's paths this compressor's frames took so far (diagnostics; the bytes
    /// are the same whichever path runs).
    #[cfg(test)]
    pub(crate) fn encode_stats(&self) -> crate::engine::EncodeStats {
        self.engine.stats()
    }

    /// Drops every residual of error feedback (the step counter stays).
    pub fn reset_error_buffer(&mut self) {
        if let Some(fb) = &mut self.feedback {
            fb.clear();
        }
    }

    /// The core method, and the error-feedback state when the method uses it.
    pub(crate) fn prepare(&mut self) -> Result<(Method, Option<&mut ErrorFeedback>)> {
        let method = self.method.core_method()?;
        if !self.method.uses_error_feedback() {
            return Ok((method, None));
        }
        if self.feedback.as_ref().map(|f| *f.method()) != Some(method) {
            let mut fb = ErrorFeedback::new(method, self.seed)?;
            fb.set_step(self.step);
            self.feedback = Some(fb);
        }
        Ok((method, self.feedback.as_mut()))
    }

    /// Compresses every tensor of `gradients` (sorted name order) into its own frame.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method; [`Error::Core`] naming the tensor for NaN/Inf
    /// (with the first bad index) or, without error feedback, a value beyond the range of
    /// f16/bf16 (with error feedback such a sum is sent saturated and the residual keeps the
    /// rest);
    /// [`Error::LengthChanged`] when a tensor with a residual changed its element count,
    /// [`Error::ShapeChanged`] when it kept the count in another shape (a transposed weight:
    /// each residual remembers its tensor's shape, see [`crate::feedback`]);
    /// [`Error::OutOfMemory`] when a new residual cannot be allocated. On error nothing
    /// changes (residuals, step), except that after [`Error::OutOfMemory`] the new residuals of
    /// the tensors before it stay, as zeros.
    pub fn compress(
        &mut self,
        gradients: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, layout::CompressedGradient>> {
        let mut out = HashMap::with_capacity(gradients.len());
        self.compress_into(gradients, &mut out)?;
        Ok(out)
    }

    /// As [`GradientCompressor::compress`], writing into `out` and reusing its buffers: the
    /// entries of `out` are overwritten, entries for tensors not in `gradients` removed. A
    /// second call with the same model allocates nothing on the serial path
    /// ([`Parallelism::Serial`]); the parallel path keeps its own buffers too, and only rayon's
    /// job bookkeeping may allocate.
    ///
    /// # Errors
    /// As [`GradientCompressor::compress`]; on error `out` is unchanged.
    pub fn compress_into(
        &mut self,
        gradients: &HashMap<String, Tensor>,
        out: &mut HashMap<String, layout::CompressedGradient>,
    ) -> Result<()> {
        let (method, _) = self.prepare()?;
        let manifest = Manifest::cached(
            &mut self.layout,
            gradients,
            method,
            self.seed,
            BucketConfig::none(),
        )?;
        let step = self.step;
        let (mut payload, mut dense) = (0usize, 0usize);
        let feedback = self
            .feedback
            .as_mut()
            .filter(|_| self.method.uses_error_feedback());
        let exec = self.parallelism.exec_for(manifest.flat_len());
        self.engine.encode(
            manifest,
            gradients,
            step,
            feedback,
            (exec, Shapes::Checked),
            |e, frame| {
                let entry = &manifest.entries()[e];
                // One tensor per entry: the manifest has no buckets.
                let info = &manifest.tensors()[entry.members[0]];
                payload = payload.saturating_add(frame.len());
                dense = dense.saturating_add(info.numel.saturating_mul(4));
                match out.get_mut(&info.name) {
                    Some(cg) => cg.assign(frame, &info.shape, step),
                    None => {
                        let mut bytes =
                            Vec::with_capacity(max_frame_len(info.numel, &entry.method));
                        bytes.extend_from_slice(frame);
                        let cg = layout::CompressedGradient::new(bytes, info.shape.clone(), step);
                        out.insert(info.name.clone(), cg);
                    }
                }
            },
        )?;
        out.retain(|name, _| gradients.contains_key(name));
        self.step = self.step.wrapping_add(1);
        self.compression_ratio = if dense == 0 {
            1.0
        } else {
            (payload as f64 / dense as f64) as f32
        };
        Ok(())
    }

    /// Compresses `gradients` into one bundle for `manifest` (`FORMAT.md` section 10), written
    /// into `out` (cleared; its capacity is reused). Returns the step the bundle was made at.
    ///
    /// Entries (and chunks of large dense, quantization and sign tensors) are compressed on
    /// every core unless [`GradientCompressor::with_parallelism`] says otherwise; the bundle and
    /// the residuals are the same bytes and bits either way (see `docs/multicore.md`).
    ///
    /// # Errors
    /// [`Error::Config`] when the manifest was made for another method or seed, or `rank` does
    /// not fit a u32; [`Error::MissingTensor`], [`Error::UnexpectedTensor`] or
    /// [`Error::ShapeMismatch`] when `gradients` does not match the manifest; otherwise as
    /// [`GradientCompressor::compress`]. On error nothing changes and `out` is cleared.
    pub fn compress_bundle(
        &mut self,
        manifest: &Manifest,
        gradients: &HashMap<String, Tensor>,
        rank: usize,
        out: &mut Vec<u8>,
    ) -> Result<u64> {
        self.compress_bundle_after(manifest, gradients, rank, out, 0)
    }

    /// As [`GradientCompressor::compress_bundle`], the bundle written after the first `prefix`
    /// bytes of `out` (left as they are, for an envelope), with no copy of a frame: the all-gather
    /// collective sends `out` as it is. `out` is not cleared first (its bytes are overwritten),
    /// so that a step does not write the message twice; on error it is cleared.
    pub(crate) fn compress_bundle_after<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        gradients: &G,
        rank: usize,
        out: &mut Vec<u8>,
        prefix: usize,
    ) -> Result<u64> {
        let result = self.compress_bundle_gated(manifest, gradients, rank, (out, prefix), None);
        match result {
            Ok(Some(step)) => Ok(step),
            Ok(None) => Err(Error::internal("a step without a gate stopped at it")),
            Err(e) => Err(e),
        }
    }

    /// As [`GradientCompressor::compress_bundle_after`], with a `gate` told the outcome of the
    /// bundle's checks before anything changes (the engine's `encode_bundle`): `Ok(None)` when
    /// it stopped the step there (nothing changed, the step not advanced, `out` cleared).
    pub(crate) fn compress_bundle_gated<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        gradients: &G,
        rank: usize,
        (out, prefix): (&mut Vec<u8>, usize),
        gate: Option<crate::engine::Gate<'_>>,
    ) -> Result<Option<u64>> {
        let result = self.try_compress_bundle(manifest, gradients, rank, out, prefix, gate);
        if !matches!(result, Ok(Some(_))) {
            out.clear();
        }
        result
    }

    /// [`GradientCompressor::compress_bundle_gated`], `out` left as it is on error.
    fn try_compress_bundle<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        gradients: &G,
        rank: usize,
        out: &mut Vec<u8>,
        prefix: usize,
        gate: Option<crate::engine::Gate<'_>>,
    ) -> Result<Option<u64>> {
        let (step, rank32) = self.check_bundle_call(manifest, gradients, rank)?;
        let need = prefix + manifest.max_bundle_len();
        if out.capacity() < need {
            out.reserve_exact(need - out.len());
        }
        let feedback = self
            .feedback
            .as_mut()
            .filter(|_| self.method.uses_error_feedback());
        let exec = self.parallelism.exec_for(manifest.flat_len());
        let stopped = self.engine.encode_bundle(
            manifest,
            gradients,
            step,
            feedback,
            (exec, Shapes::Checked),
            (rank32, out, prefix),
            gate,
        )?;
        if stopped {
            return Ok(None);
        }
        self.step = self.step.wrapping_add(1);
        Ok(Some(step))
    }

    /// The message of [`GradientCompressor::compress_bundle_after`] written as it is sent, for
    /// a compressor without error feedback and a manifest whose bundles stream
    /// ([`crate::engine::dense_stream::streams`]): `envelope`, then the bundle, in windows written into
    /// `pending` ([`DenseStream`]). With `check_first`, every gradient is checked before it
    /// returns (else as it is written: [`DenseStream::take_error`]); the step advances as for a
    /// bundle written whole.
    ///
    /// # Errors
    /// As [`GradientCompressor::compress_bundle`]; nothing changes on error.
    pub(crate) fn stream_bundle<'a, G: Gradients + ?Sized>(
        &mut self,
        manifest: &'a Manifest,
        gradients: &G,
        rank: usize,
        envelope: &[u8],
        pending: &'a mut Vec<u8>,
        check_first: bool,
    ) -> Result<DenseStream<'a>> {
        if self.method.uses_error_feedback() {
            return Err(Error::internal("a bundle with error feedback streamed"));
        }
        let (step, rank32) = self.check_bundle_call(manifest, gradients, rank)?;
        let exec = self.parallelism.exec_for(manifest.flat_len());
        let stream = DenseStream::new(
            manifest,
            gradients,
            step,
            rank32,
            envelope,
            pending,
            exec,
            check_first,
        )?;
        self.step = self.step.wrapping_add(1);
        Ok(stream)
    }

    /// The checks of a bundle's compression before any frame is written: the method and seed
    /// against the manifest's, the rank, the gradients against the manifest. Returns the step
    /// and the rank as a u32.
    fn check_bundle_call<G: Gradients + ?Sized>(
        &mut self,
        manifest: &Manifest,
        gradients: &G,
        rank: usize,
    ) -> Result<(u64, u32)> {
        let seed = self.seed;
        let step = self.step;
        let method = self.prepare()?.0;
        if *manifest.method() != method {
            return Err(Error::config(format!(
                "the manifest is for method `{}`, the compressor uses `{}`",
                method::format(manifest.method()),
                method::format(&method)
            )));
        }
        if manifest.seed() != seed {
            return Err(Error::config(format!(
                "the manifest is for seed {}, the compressor uses seed {seed}",
                manifest.seed()
            )));
        }
        let rank32 = u32::try_from(rank)
            .map_err(|_| Error::config(format!("rank {rank} does not fit a u32")))?;
        gradients.check(manifest)?;
        Ok((step, rank32))
    }

    /// The parameters this compressor expects for `name`'s frame at `step`.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method.
    pub(crate) fn params(&self, name: &str, step: u64) -> Result<Params> {
        Ok(Params {
            method: self.method.core_method()?,
            seed: self.seed,
            step,
            tensor_id: tensor_id(name),
        })
    }

    /// Decodes one compressed gradient of tensor `name`, checking the frame against this
    /// compressor's method and seed and the gradient's step and shape.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method; [`Error::ParamsDiffer`] naming the tensor and
    /// both configurations when the frame was made with other parameters; [`Error::Core`]
    /// naming the tensor when the frame is invalid.
    pub(crate) fn decompress_one(
        &self,
        name: &str,
        compressed: &layout::CompressedGradient,
    ) -> Result<Tensor> {
        let shape = compressed.shape();
        let n = crate::tensor::checked_numel(name, shape)?;
        let params = self.params(name, compressed.step())?;
        let frame = compressed.frame();
        // The whole frame is checked against what this side expects before the output is
        // allocated, and the allocation is fallible: a valid frame may still declare more
        // elements than the machine holds.
        gradwire_core::validate(frame, &params, n)
            .map_err(|e| frame_error(name, None, frame, &params, n, e))?;
        let mut data = Vec::new();
        data.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
            tensor: name.to_owned(),
            elements: n,
        })?;
        data.resize(n, 0.0);
        gradwire_core::decode_into(frame, &params, &mut data)
            .map_err(|e| frame_error(name, None, frame, &params, n, e))?;
        Tensor::new(shape.to_vec(), data)
    }

    /// Decodes compressed gradients (from this compressor or a peer with the same method and
    /// seed) into dense tensors with their shapes.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid method; [`Error::ParamsDiffer`] naming the tensor and
    /// both configurations when a frame was made with other parameters; [`Error::Core`] naming
    /// the tensor when a frame is invalid: for the first failing tensor in name order.
    pub fn decompress(
        &self,
        compressed: &HashMap<String, layout::CompressedGradient>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut names: Vec<&String> = compressed.keys().collect();
        names.sort();
        let mut out = HashMap::with_capacity(names.len());
        for name in names {
            out.insert(name.clone(), self.decompress_one(name, &compressed[name])?);
        }
        Ok(out)
    }

    /// Puts what this compressor's own `bundle` of `step` (made by
    /// [`GradientCompressor::compress_bundle`] with `manifest`) sent back into the residuals,
    /// after a collective that failed once the residuals had given those values up: the step's
    /// gradient is then delayed, not lost (`residual + sent` is `gradient + old residual`, up
    /// to the f32 rounding of the error-feedback identity). Nothing to do without error
    /// feedback; `flat` is scratch.
    pub(crate) fn give_back_bundle(
        &mut self,
        manifest: &Manifest,
        bundle: &[u8],
        step: u64,
        flat: &mut Vec<f32>,
    ) -> Result<()> {
        let Some(fb) = self
            .feedback
            .as_mut()
            .filter(|_| self.method.uses_error_feedback())
        else {
            return Ok(());
        };
        manifest.decode_bundle(bundle, None, Some(step), flat)?;
        for t in manifest.tensors() {
            Engine::give_back(fb, &t.name, &flat[t.offset..t.offset + t.numel])?;
        }
        Ok(())
    }

    /// [`GradientCompressor::give_back_bundle`] for the frames of one
    /// [`GradientCompressor::compress`] call.
    pub(crate) fn give_back_frames(
        &mut self,
        sent: &HashMap<String, layout::CompressedGradient>,
    ) -> Result<()> {
        if !self.method.uses_error_feedback() {
            return Ok(());
        }
        for (name, cg) in sent {
            let decoded = self.decompress_one(name, cg)?;
            if let Some(fb) = self.feedback.as_mut() {
                Engine::give_back(fb, name, decoded.data())?;
            }
        }
        Ok(())
    }

    /// Writes the error-feedback checkpoint (residuals, step, seed, method) to `path`.
    ///
    /// # Errors
    /// [`Error::Config`] when the method does not use error feedback; as
    /// [`ErrorFeedback::to_bytes`]; [`Error::Io`] naming the file when writing fails.
    pub fn save_feedback(&mut self, path: impl AsRef<Path>) -> Result<()> {
        match self.prepare()? {
            (_, Some(fb)) => fb.save(path),
            (_, None) => Err(Error::config("the method does not use error feedback")),
        }
    }

    /// Restores an error-feedback checkpoint: residuals, step and seed. The run continues
    /// bit-identically to one that was never interrupted; for that the checkpoint's seed
    /// replaces the compressor's own (one set with [`GradientCompressor::with_seed`]).
    ///
    /// Residuals are matched to gradients by name when the next compression meets them: one
    /// whose length differs from its gradient's is [`Error::LengthChanged`] then, one kept in
    /// another shape of the same length [`Error::ShapeChanged`] (a version 3 checkpoint
    /// stores shapes; the residuals of an older one take the shapes of the next step). The model is
    /// not known here, so a residual whose name never comes (a checkpoint of another model) is
    /// kept and saved again; to check a checkpoint against a model first, read it with
    /// [`ErrorFeedback::from_bytes`] and compare [`ErrorFeedback::residuals`] with the model's
    /// parameter names, as the `gradwire` tool does.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when reading fails; as [`ErrorFeedback::from_bytes`];
    /// [`Error::Checkpoint`] when the checkpoint was made with
    /// another method or the compressor does not use error feedback.
    pub fn load_feedback(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let fb = ErrorFeedback::load(path)?;
        self.restore_feedback(fb)
    }

    /// Takes over an error-feedback state (see [`GradientCompressor::load_feedback`]).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when it was made with another method or the compressor does not
    /// use error feedback; [`Error::Config`] for an invalid method.
    pub fn restore_feedback(&mut self, feedback: ErrorFeedback) -> Result<()> {
        let method = self.method.core_method()?;
        if !self.method.uses_error_feedback() {
            return Err(Error::checkpoint(
                "the compressor's method does not use error feedback",
            ));
        }
        if *feedback.method() != method {
            return Err(Error::checkpoint(format!(
                "made with method `{}`, the compressor uses `{}`",
                method::format(feedback.method()),
                method::format(&method)
            )));
        }
        self.seed = feedback.seed();
        self.step = feedback.step();
        self.feedback = Some(feedback);
        Ok(())
    }
}

/// The chunked selection of large top-k, threshold and random-k tensors runs where it should,
/// and gives way where it should, counted by the compressor's `EncodeStats`. (Its bytes are
/// checked against the core's in `tests/parallel.rs`.)
#[cfg(test)]
mod chunked_path_tests {
    use std::collections::HashMap;

    use gradwire_core::{K, Method, Values};

    use super::GradientCompressor;
    use crate::engine::Parallelism;
    use crate::layout::{BucketConfig, Manifest};
    use crate::method::CompressionMethod;
    use crate::tensor::Tensor;

    /// The integration tests' generator (`tests/common`): SplitMix64.
    struct Rng(u64);

    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }

        fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n).map(|_| self.unit() * scale).collect()
        }
    }

    /// Frames selected in chunks during `steps` compressions of `grads`.
    fn chunked_frames(
        grads: &HashMap<String, Tensor>,
        method: &CompressionMethod,
        parallelism: Parallelism,
        steps: usize,
    ) -> u64 {
        counted(grads, method, parallelism, steps).0
    }

    /// Frames selected in chunks, and error-feedback frames written in one pass, during `steps`
    /// compressions of `grads`.
    fn counted(
        grads: &HashMap<String, Tensor>,
        method: &CompressionMethod,
        parallelism: Parallelism,
        steps: usize,
    ) -> (u64, u64) {
        let manifest = Manifest::for_gradients(grads, method, 0, BucketConfig::none()).unwrap();
        let mut c = GradientCompressor::new(method.clone()).with_parallelism(parallelism);
        let mut bundle = Vec::new();
        for _ in 0..steps {
            c.compress_bundle(&manifest, grads, 0, &mut bundle).unwrap();
        }
        let stats = c.encode_stats();
        (stats.selected_in_chunks, stats.one_pass)
    }

    #[test]
    fn large_sparse_tensors_are_selected_in_chunks_unless_the_sample_cannot_serve() {
        let mut rng = Rng(3);
        let large = HashMap::from([
            ("w".to_owned(), Tensor::vector(rng.vec(300_000, 1.0))),
            ("small".to_owned(), Tensor::vector(rng.vec(1000, 1.0))),
        ]);
        let topk = CompressionMethod::top_k_int8(0.01);
        let threshold = CompressionMethod::Threshold { threshold: 0.99 };
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            // Every step, with or without error feedback; top-k with error feedback in one pass
            // over g and r, from the first step (a new residual is zeros, its bound 0). The small
            // tensor never.
            assert_eq!(counted(&large, &topk, parallelism, 3), (3, 0));
            assert_eq!(counted(&large, &threshold, parallelism, 3), (3, 0));
            let ef = topk.clone().with_error_feedback();
            assert_eq!(counted(&large, &ef, parallelism, 3), (3, 3));
            // A constant tensor: every element is a candidate, more than the selection holds, so
            // the core's selection runs (same frame); with error feedback, on the residual's sums.
            let flat = HashMap::from([("w".to_owned(), Tensor::vector(vec![0.5; 300_000]))]);
            assert_eq!(counted(&flat, &topk, parallelism, 2), (0, 0));
            let flat_ef = topk.clone().with_error_feedback();
            assert_eq!(counted(&flat, &flat_ef, parallelism, 2), (0, 2));
            // f16 values and a gradient at or above 2^127, where two values may sum to infinity:
            // the bound proves nothing. The first step has no residual yet, so the core's step
            // runs (sending 2^127 saturated at 65504) and measures the residual's bound, which
            // keeps about 2^127 (65504 of it goes each step): later steps select in chunks,
            // in two passes. (A value beyond f16 but below 2^127 takes the one pass, as the
            // test `every_collective_sends_saturated_f16_sums_alike` and the core's
            // `feedback_bounded` tests show: any finite sum is sent, saturated.)
            let mut big = rng.vec(300_000, 1.0);
            big[7] = 2.0f32.powi(127);
            let big = HashMap::from([("w".to_owned(), Tensor::vector(big))]);
            let small = HashMap::from([("w".to_owned(), Tensor::vector(rng.vec(300_000, 1.0)))]);
            let f16 = CompressionMethod::Core(Method::TopK {
                k: K::Ratio(0.01),
                values: Values::F16,
            })
            .with_error_feedback();
            let manifest = Manifest::for_gradients(&big, &f16, 0, BucketConfig::none()).unwrap();
            let mut c = GradientCompressor::new(f16.clone()).with_parallelism(parallelism);
            let mut bundle = Vec::new();
            let mut step = |grads: &HashMap<String, Tensor>| {
                let before = c.encode_stats();
                c.compress_bundle(&manifest, grads, 0, &mut bundle).unwrap();
                let after = c.encode_stats();
                (
                    after.selected_in_chunks - before.selected_in_chunks,
                    after.one_pass - before.one_pass,
                )
            };
            assert_eq!(step(&big), (0, 0));
            assert_eq!(step(&small), (1, 0));
            assert_eq!(step(&small), (1, 0));
            // Threshold keeping more than the lists hold: the core's streaming writer.
            let low = CompressionMethod::Threshold { threshold: 0.0 };
            assert_eq!(chunked_frames(&large, &low, parallelism, 1), 0);
            // Random-k: drawn in chunks every step (with error feedback after the first), unless
            // it keeps nothing or everything.
            let randomk = CompressionMethod::RandomK { k: 3000 };
            assert_eq!(chunked_frames(&large, &randomk, parallelism, 3), 3);
            let ef = randomk.clone().with_error_feedback();
            assert_eq!(chunked_frames(&large, &ef, parallelism, 3), 2);
            let all = CompressionMethod::RandomK { k: 300_000 };
            assert_eq!(chunked_frames(&large, &all, parallelism, 1), 0);
        }
    }

    #[test]
    fn crowded_candidates_grow_the_serial_lists_and_give_the_pools_bytes() {
        // 8% of the elements at magnitude 1 (the rest below 0.01): more candidates than the
        // selection's lists first hold (top-k 1%: 2k + n/256; threshold: n/32), fewer than four
        // times that, so a serial scan runs out of room, counts the rest, grows its lists and
        // scans those chunks again (from the stored sums in a one-pass step).
        let n = 300_000;
        let mut rng = Rng(21);
        let data: Vec<f32> = (0..n)
            .map(|i| match i % 25 {
                3 => 1.0,
                7 if i % 50 == 7 => -1.0,
                _ => rng.unit() * 0.01,
            })
            .collect();
        let grads = HashMap::from([("w".to_owned(), Tensor::vector(data))]);
        let threshold = CompressionMethod::Threshold { threshold: 0.5 };
        for method in [
            CompressionMethod::top_k_int8(0.01).with_error_feedback(),
            threshold.clone(),
            threshold.with_error_feedback(),
        ] {
            let manifest =
                Manifest::for_gradients(&grads, &method, 0, BucketConfig::none()).unwrap();
            let runs: Vec<_> = [Parallelism::Serial, Parallelism::Parallel]
                .into_iter()
                .map(|parallelism| {
                    let mut c =
                        GradientCompressor::new(method.clone()).with_parallelism(parallelism);
                    let mut bundles = Vec::new();
                    for _ in 0..3 {
                        let mut bundle = Vec::new();
                        c.compress_bundle(&manifest, &grads, 0, &mut bundle)
                            .unwrap();
                        bundles.push(bundle);
                    }
                    assert!(
                        c.encode_stats().selected_in_chunks >= 2,
                        "{method:?} {parallelism:?}: {:?}",
                        c.encode_stats()
                    );
                    (bundles, c)
                })
                .collect();
            assert!(runs[0].0 == runs[1].0, "{method:?}: bundles");
            assert!(
                runs[0].1.feedback() == runs[1].1.feedback(),
                "{method:?}: residuals"
            );
        }
    }

    #[test]
    fn a_serial_step_keeps_one_selection_scratch_for_every_large_tensor() {
        let mut rng = Rng(13);
        let grads: HashMap<String, Tensor> = (0..3)
            .map(|t| {
                (
                    format!("w{t}"),
                    Tensor::vector(rng.vec(200_000 + t * 70_000, 1.0)),
                )
            })
            .collect();
        let method = CompressionMethod::top_k_int8(0.01).with_error_feedback();
        let manifest = Manifest::for_gradients(&grads, &method, 0, BucketConfig::none()).unwrap();
        for (parallelism, expected) in [
            (Parallelism::Serial, (1, 0)),
            (Parallelism::Parallel, (0, 3)),
        ] {
            let mut c = GradientCompressor::new(method.clone()).with_parallelism(parallelism);
            let mut bundle = Vec::new();
            for _ in 0..3 {
                c.compress_bundle(&manifest, &grads, 0, &mut bundle)
                    .unwrap();
            }
            // Every step in one pass over g and r (a new residual's bound is 0).
            assert_eq!(c.encode_stats().one_pass, 9, "{parallelism:?}");
            assert_eq!(c.engine.selection_sets(), expected, "{parallelism:?}");
            // The sent entries of each one-pass step are in the selection's scratch, not in a
            // list of the entry's own: on one thread one set for every tensor (k x 8 bytes for
            // the largest, not for every large tensor); on the pool each entry's own set.
            assert_eq!(c.engine.own_sent_lists(), 0, "{parallelism:?}");
        }
    }

    /// Each entry grows the core scratch to its own need, not to the largest tensor's: a large
    /// top-k tensor selected in chunks needs none (37,700 elements for 400,000 values), so the
    /// sets hold the small tensor's scratch alone.
    #[test]
    fn the_core_scratch_is_sized_for_the_tensors_that_use_it() {
        let mut rng = Rng(17);
        let method = CompressionMethod::top_k_int8(0.01).with_error_feedback();
        let core = method.core_method().unwrap();
        let small = gradwire_core::scratch_len(3_000, &core);
        let large = gradwire_core::scratch_len(400_000, &core);
        assert!(large > 10 * small);
        let grads: HashMap<String, Tensor> = HashMap::from([
            ("large".to_owned(), Tensor::vector(rng.vec(400_000, 1.0))),
            ("small".to_owned(), Tensor::vector(rng.vec(3_000, 1.0))),
        ]);
        let manifest = Manifest::for_gradients(&grads, &method, 0, BucketConfig::none()).unwrap();
        for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
            let mut c = GradientCompressor::new(method.clone()).with_parallelism(parallelism);
            let mut bundle = Vec::new();
            let mut held = Vec::new();
            for _ in 0..3 {
                c.compress_bundle(&manifest, &grads, 0, &mut bundle)
                    .unwrap();
                held.push(c.engine.core_scratch());
            }
            assert_eq!(c.encode_stats().selected_in_chunks, 3, "{parallelism:?}");
            assert!(
                held.iter().all(|&h| h <= small),
                "{parallelism:?}: {held:?} elements of core scratch after each step, {small} for \
                 the small tensor, {large} for the large one"
            );
        }
    }

    /// The bundle of `compress()`'s frames, written entry by entry as before frames were
    /// written in place.
    fn bundle_of_frames(
        manifest: &Manifest,
        frames: &HashMap<String, crate::layout::CompressedGradient>,
        step: u64,
        rank: u32,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        let entries = manifest.entries().len() as u32;
        let mut w = crate::layout::bundle::BundleWriter::begin(&mut out, rank, entries, step);
        for entry in manifest.entries() {
            w.push(entry.id, frames[&entry.label].frame());
        }
        w.finish();
        out
    }

    #[test]
    fn frames_written_in_place_make_the_bundle_of_the_frames() {
        let mut rng = Rng(11);
        // Large (chunked), middle and small tensors; sparse tensors with few and many kept.
        let mut grads = HashMap::from([
            ("a.large".to_owned(), Tensor::vector(rng.vec(300_000, 1.0))),
            ("b.middle".to_owned(), Tensor::vector(rng.vec(5_000, 1.0))),
            ("c.small".to_owned(), Tensor::vector(rng.vec(7, 1.0))),
        ]);
        // Zeros, for the sign method's zero mask (a frame shorter than its largest).
        if let Some(Tensor { .. }) = grads.get("b.middle") {
            let mut v = rng.vec(5_000, 1.0);
            v[10..2_000].fill(0.0);
            grads.insert("b.middle".to_owned(), Tensor::vector(v));
        }
        let texts = [
            "dense values=bf16",
            "dense values=f16",
            "topk k=ratio:0.01 values=int8:256",
            "topk k=count:3 values=f32",
            "threshold t=0.9 values=f16",
            "randomk k=count:100 values=f32 unbiased=false",
            "quant bits=4 block=256 rounding=nearest-even",
            "sign scale=mean-abs:128 mask=zeros",
        ];
        for text in texts {
            let method = CompressionMethod::Core(crate::method::parse(text).unwrap());
            for (ef, parallelism) in [
                (false, Parallelism::Serial),
                (true, Parallelism::Serial),
                (true, Parallelism::Parallel),
            ] {
                let method = if ef {
                    method.clone().with_error_feedback()
                } else {
                    method.clone()
                };
                let manifest =
                    Manifest::for_gradients(&grads, &method, 5, BucketConfig::none()).unwrap();
                let new = || {
                    GradientCompressor::new(method.clone())
                        .with_seed(5)
                        .with_parallelism(parallelism)
                };
                let (mut in_place, mut by_frames) = (new(), new());
                // A message buffer reused with other bytes in it: the room before the bundle is
                // left alone, the rest overwritten (other gradients every step, so that a byte
                // left unwritten would hold the last step's).
                let mut message = vec![0xa5u8; 9 + manifest.max_bundle_len()];
                for step in 0..3u64 {
                    let grads: HashMap<String, Tensor> = grads
                        .iter()
                        .map(|(name, t)| {
                            let scale = 1.0 + step as f32;
                            let v = t.data().iter().map(|x| x * scale).collect();
                            (name.clone(), Tensor::vector(v))
                        })
                        .collect();
                    let made = in_place
                        .compress_bundle_after(&manifest, &grads, 2, &mut message, 9)
                        .unwrap();
                    assert_eq!(made, step);
                    let frames = by_frames.compress(&grads).unwrap();
                    let expected = bundle_of_frames(&manifest, &frames, step, 2);
                    assert_eq!(&message[..9], &[0xa5; 9], "{text} ef={ef}");
                    assert!(message[9..] == expected[..], "{text} ef={ef} step {step}");
                    if text.starts_with("threshold") || text.starts_with("sign") {
                        // Frames shorter than their largest: the gaps were closed.
                        assert!(expected.len() < manifest.max_bundle_len(), "{text}");
                    }
                    let mut alone = Vec::from([1u8, 2, 3]);
                    let mut again = new();
                    again.set_step(step);
                    if !ef {
                        // Without residuals a step depends on its step number alone.
                        again
                            .compress_bundle(&manifest, &grads, 2, &mut alone)
                            .unwrap();
                        assert!(alone == expected, "{text} step {step}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_bad_value_left_to_the_chunked_encoder_is_named_in_manifest_order() {
        let mut rng = Rng(12);
        let base_a = rng.vec(300_000, 1.0);
        let base_b = rng.vec(100, 1.0);
        let named = |grads: &HashMap<String, Tensor>, text: &str| {
            let method = CompressionMethod::Core(crate::method::parse(text).unwrap());
            let manifest =
                Manifest::for_gradients(grads, &method, 0, BucketConfig::none()).unwrap();
            let mut results = Vec::new();
            for parallelism in [Parallelism::Serial, Parallelism::Parallel] {
                let mut c = GradientCompressor::new(method.clone()).with_parallelism(parallelism);
                let mut bundle = vec![7u8; 40];
                let err = c
                    .compress_bundle(&manifest, grads, 0, &mut bundle)
                    .unwrap_err();
                assert!(bundle.is_empty());
                assert_eq!(c.step(), 0);
                results.push(err.to_string());
            }
            assert_eq!(results[0], results[1]);
            results.swap_remove(0)
        };
        let with = |large: Option<(usize, f32)>, small: Option<(usize, f32)>| {
            let mut a = base_a.clone();
            let mut b = base_b.clone();
            if let Some((i, v)) = large {
                a[i] = v;
            }
            if let Some((i, v)) = small {
                b[i] = v;
            }
            HashMap::from([
                ("a.large".to_owned(), Tensor::vector(a)),
                ("b.small".to_owned(), Tensor::vector(b)),
            ])
        };
        let expect = |tensor: &str, e: gradwire_core::Error| {
            crate::error::Error::core(tensor, None, e).to_string()
        };
        use gradwire_core::Error::{NonFinite, ValueOutOfRange};
        // The large tensor's value comes first in manifest order, though the small tensor's
        // check (pass 1) finds its own before the large tensor's encoder runs.
        let both = with(Some((200_001, f32::NAN)), Some((3, f32::INFINITY)));
        for text in [
            "dense values=bf16",
            "quant bits=4 block=256 rounding=nearest-even",
        ] {
            assert_eq!(
                named(&both, text),
                expect("a.large", NonFinite { index: 200_001 })
            );
        }
        // The first bad value of the tensor, in the check's order: a NaN after a value out of
        // f16 range is named first (non-finite values come first).
        let mut a = base_a.clone();
        a[70_000] = 70_000.0;
        a[250_000] = f32::NEG_INFINITY;
        let grads = HashMap::from([("a.large".to_owned(), Tensor::vector(a))]);
        assert_eq!(
            named(&grads, "dense values=f16"),
            expect("a.large", NonFinite { index: 250_000 })
        );
        let range = with(Some((131_072, 1e6)), None);
        assert_eq!(
            named(&range, "dense values=f16"),
            expect("a.large", ValueOutOfRange { index: 131_072 })
        );
        // Only the small tensor is bad: it is named.
        let small = with(None, Some((3, f32::INFINITY)));
        assert_eq!(
            named(&small, "dense values=bf16"),
            expect("b.small", NonFinite { index: 3 })
        );
    }
}
