//! Running the ranks of a run: as threads of this process ([`Transport::Threads`], through
//! gradwire's `LocalGroup`) or as MPI processes ([`Transport::Mpi`], feature `mpi`).

use gradwire::comm::{CommError, LocalGroup};
use indicatif::ProgressBar;

use crate::DemoError;
use crate::codec::{CodecContext, GradientCodec, Method, new_codec};
use crate::train::{RankReport, TrainConfig, run_rank_with_codec};

/// Builds one rank's codec (see [`ThreadLauncher::run_all_with`]).
pub type MakeCodec<'a> =
    dyn Fn(&CodecContext<'_>) -> Result<Box<dyn GradientCodec>, DemoError> + Sync + 'a;

/// How the ranks exchange their messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// Every rank is a thread of this process (gradwire's `LocalGroup`).
    Threads,
    /// Every rank is an MPI process (`mpirun -np W ...`; needs the `mpi` feature).
    Mpi,
}

/// Runs the ranks of one run and hands rank 0's report to the caller.
pub trait Launcher {
    /// Whether this process prints the table and writes the files (rank 0 or the thread
    /// launcher).
    fn is_root(&self) -> bool;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Runs one training run on every rank; returns rank 0's report on the root, `None`
    /// elsewhere. `progress` is advanced by rank 0.
    ///
    /// # Errors
    /// The first rank's error that is not a consequence of another rank's failure.
    fn run(
        &mut self,
        config: &TrainConfig,
        method: Method,
        seed: u64,
        progress: Option<&ProgressBar>,
    ) -> Result<Option<RankReport>, DemoError>;

    /// Whether this launcher can run `method` ([`Method::needs_mpi`]: the MPI launcher only),
    /// checked before a sweep starts.
    ///
    /// # Errors
    /// [`DemoError::Config`] naming the method and the transport it needs.
    fn check_method(&self, method: Method) -> Result<(), DemoError> {
        if method.needs_mpi() {
            return Err(DemoError::Config(format!(
                "`{method}` calls MPI_Allreduce itself: it runs only with `--transport mpi`"
            )));
        }
        Ok(())
    }
}

/// W ranks as threads of this process.
#[derive(Debug, Clone, Copy)]
pub struct ThreadLauncher {
    workers: usize,
}

impl ThreadLauncher {
    /// A launcher for `workers` threads.
    ///
    /// # Errors
    /// [`DemoError::Config`] for 0 workers.
    pub fn new(workers: usize) -> Result<ThreadLauncher, DemoError> {
        if workers == 0 {
            return Err(DemoError::Config("at least one worker is needed".into()));
        }
        Ok(ThreadLauncher { workers })
    }

    /// Runs one training run and returns every rank's report, in rank order.
    ///
    /// # Errors
    /// The first error in rank order that is not a peer's broken-group error (a failing rank
    /// drops its communicator, which fails its peers' all-gathers).
    pub fn run_all(
        &self,
        config: &TrainConfig,
        method: Method,
        seed: u64,
        progress: Option<&ProgressBar>,
    ) -> Result<Vec<RankReport>, DemoError> {
        self.run_all_with(config, seed, progress, &|ctx| new_codec(method, ctx))
    }

    /// [`ThreadLauncher::run_all`] with codecs built by `make_codec` (called once per rank,
    /// on that rank's thread): a way to try a codec before [`new_codec`] knows it.
    ///
    /// # Errors
    /// As [`ThreadLauncher::run_all`].
    pub fn run_all_with(
        &self,
        config: &TrainConfig,
        seed: u64,
        progress: Option<&ProgressBar>,
        make_codec: &MakeCodec<'_>,
    ) -> Result<Vec<RankReport>, DemoError> {
        let comms = LocalGroup::new(self.workers).into_communicators();
        let results: Vec<Result<RankReport, DemoError>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    let pb = if rank == 0 { progress } else { None };
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let specs = config.workload.specs()?;
                            let codec = make_codec(&CodecContext {
                                specs: &specs,
                                rank,
                                world_size: self.workers,
                                seed,
                                collective: config.collective,
                                momentum: config.momentum,
                            })?;
                            run_rank_with_codec(&mut comm, config, codec, seed, pb)
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h.join().unwrap_or(Err(DemoError::WorkerPanicked { rank })),
                    Err(e) => Err(DemoError::Transport(format!(
                        "cannot start thread for rank {rank}: {e}"
                    ))),
                })
                .collect()
        });
        if results.iter().any(Result::is_err) {
            let is_peer_failure =
                |e: &DemoError| matches!(e, DemoError::Comm(CommError::Transport(_)));
            let mut errors: Vec<DemoError> = results.into_iter().filter_map(Result::err).collect();
            let root = errors.iter().position(|e| !is_peer_failure(e)).unwrap_or(0);
            return Err(errors.swap_remove(root));
        }
        let reports: Vec<RankReport> = results.into_iter().filter_map(Result::ok).collect();
        if let Some(r) = reports
            .iter()
            .find(|r| r.param_digest != reports[0].param_digest)
        {
            return Err(DemoError::Transport(format!(
                "replicas diverged: rank {} holds other parameters than rank 0",
                r.rank
            )));
        }
        Ok(reports)
    }
}

impl Launcher for ThreadLauncher {
    fn is_root(&self) -> bool {
        true
    }

    fn world_size(&self) -> usize {
        self.workers
    }

    fn run(
        &mut self,
        config: &TrainConfig,
        method: Method,
        seed: u64,
        progress: Option<&ProgressBar>,
    ) -> Result<Option<RankReport>, DemoError> {
        Ok(self
            .run_all(config, method, seed, progress)?
            .into_iter()
            .next())
    }
}

/// This process as one rank of an MPI job (`mpirun -np W`).
#[cfg(feature = "mpi")]
pub struct MpiLauncher {
    comm: gradwire::comm::MpiCommunicator,
}

#[cfg(feature = "mpi")]
impl MpiLauncher {
    /// Initialises MPI and joins the world communicator.
    ///
    /// # Errors
    /// When MPI cannot be initialised.
    pub fn new() -> Result<MpiLauncher, DemoError> {
        let comm = gradwire::comm::MpiCommunicator::init()
            .map_err(|e| DemoError::Transport(format!("MPI: {e}")))?;
        Ok(MpiLauncher { comm })
    }
}

#[cfg(feature = "mpi")]
impl Launcher for MpiLauncher {
    fn check_method(&self, _method: Method) -> Result<(), DemoError> {
        Ok(())
    }

    fn is_root(&self) -> bool {
        use gradwire::comm::Communicator;
        self.comm.rank() == 0
    }

    fn world_size(&self) -> usize {
        use gradwire::comm::Communicator;
        self.comm.world_size()
    }

    fn run(
        &mut self,
        config: &TrainConfig,
        method: Method,
        seed: u64,
        progress: Option<&ProgressBar>,
    ) -> Result<Option<RankReport>, DemoError> {
        let root = self.is_root();
        let progress = if root { progress } else { None };
        let report = if method == Method::DenseF32Allreduce {
            // Outside gradwire's collectives: MPI_Allreduce on the world communicator.
            let codec = crate::mpi_dense::MpiAllreduceF32::new(
                self.comm.universe(),
                &config.workload.specs()?,
            );
            run_rank_with_codec(&mut self.comm, config, Box::new(codec), seed, progress)?
        } else {
            crate::train::run_rank(&mut self.comm, config, method, seed, progress)?
        };
        Ok(root.then_some(report))
    }
}

/// Builds the launcher for `transport`.
///
/// # Errors
/// [`DemoError::Transport`] for MPI in a build without the `mpi` feature, or when MPI fails to
/// start; [`DemoError::Config`] for 0 workers.
pub fn launcher(transport: Transport, workers: usize) -> Result<Box<dyn Launcher>, DemoError> {
    match transport {
        Transport::Threads => Ok(Box::new(ThreadLauncher::new(workers)?)),
        #[cfg(feature = "mpi")]
        Transport::Mpi => {
            let _ = workers; // the MPI world decides the number of ranks
            Ok(Box::new(MpiLauncher::new()?))
        }
        #[cfg(not(feature = "mpi"))]
        Transport::Mpi => Err(DemoError::Transport(
            "this build has no MPI support: build with `--features mpi` and start it with \
             `mpirun -np W`"
                .into(),
        )),
    }
}

/// Runs every method with every seed on `launcher`, one run after the other, with a progress
/// bar per run on the root when `show_progress` is set (and stderr is a terminal). Returns the
/// report on the root, `None` on the other MPI ranks.
///
/// # Errors
/// [`DemoError::NotWired`] (before anything runs) when a method has no codec yet; the first
/// run's error otherwise.
pub fn run_sweep(
    launcher: &mut dyn Launcher,
    config: &TrainConfig,
    methods: &[Method],
    seeds: &[u64],
    show_progress: bool,
) -> Result<Option<crate::report::Report>, DemoError> {
    use crate::codec::dense_f32_bytes;
    use crate::data::Digits;
    use crate::model::ParamSpec;
    use crate::report::{ReportBuilder, SweepConfig};
    use indicatif::ProgressStyle;
    use std::time::Instant;

    config.validate()?;
    if let Some(&m) = methods.iter().find(|m| !m.is_wired()) {
        return Err(DemoError::NotWired(m));
    }
    if let Some(&m) = methods.iter().find(|m| m.needs_mpi()) {
        launcher.check_method(m)?;
    }
    // Refused before any run (each rank's loop refuses it too), so that a sweep does not end
    // in this error after the other methods ran.
    if config.wait_barrier
        && let Some(&m) = methods.iter().find(|m| m.delayed())
    {
        return Err(DemoError::Config(format!(
            "--wait-barrier splits a blocking exchange's time; `{m}` runs its exchange behind the \
             next step: pass --methods without the delayed ones"
        )));
    }
    let specs = config.workload.specs()?;
    let digits = Digits::load();
    let mut builder = ReportBuilder::new(SweepConfig {
        workers: launcher.world_size(),
        train: config.clone(),
        seeds: seeds.to_vec(),
        parameters: specs.iter().map(ParamSpec::len).sum(),
        dense_f32_bytes: dense_f32_bytes(&specs),
        train_images: digits.train.len(),
        test_images: digits.test.len(),
    });
    let root = launcher.is_root();
    let style =
        ProgressStyle::with_template("{prefix:<26} [{bar:30}] {pos:>4}/{len} {elapsed:>4} {msg}")
            .map_err(|e| DemoError::Config(e.to_string()))?
            .progress_chars("=> ");
    for &method in methods {
        for &seed in seeds {
            let pb = if root && show_progress {
                ProgressBar::new(config.steps as u64)
            } else {
                ProgressBar::hidden()
            };
            pb.set_style(style.clone());
            pb.set_prefix(format!("{method} seed {seed}"));
            let start = Instant::now();
            let report = launcher.run(config, method, seed, Some(&pb))?;
            let wall_s = start.elapsed().as_secs_f64();
            if let Some(r) = report {
                let line = format!(
                    "test acc {:.2}%, train loss {:.4}, {wall_s:.1} s",
                    100.0 * r.test_accuracy,
                    r.train_loss
                );
                if pb.is_hidden() {
                    if show_progress {
                        eprintln!("{method} seed {seed}: {line}");
                    }
                } else {
                    pb.finish_with_message(line);
                }
                builder.add(&r, wall_s);
            }
        }
    }
    Ok(root.then(|| builder.finish()))
}
