//! [`NonBlockingAllReduce`]: steps of a [`CompressedAllReduce`] started now and waited for
//! later, run in order on a thread of their own (with the communicator the all-reduce owns),
//! so that the caller computes while they run (the next bucket's gradients, the next
//! micro-batch).
//!
//! Buffer ownership, without `unsafe`: the handle owns the buffers. [`NonBlockingAllReduce::start`]
//! moves a step's tensors in (no copy: their vectors travel); the thread runs the blocking
//! step on them in place ([`CompressedAllReduce::all_reduce_in_place`]: encoding, exchange and
//! decoding all on that thread, each chunk-bounded as the blocking step is); and
//! [`PendingAllReduce::wait`] gives them back holding the results. A step's memory is its
//! tensors' (the caller's gradients) plus the all-reduce's own buffers, which the steps share
//! one after the other.
//!
//! A start is a call of the blocking all-reduce, and `ends_step` says whether it ends a model
//! step: every bucket of a model step carries the same step number (the one the all-reduce's
//! counter holds when the step's first bucket runs), and the counter advances once, after the
//! bucket that ends the step (as DDP's `bucket.is_last()` says). A whole-model start passes
//! `true`. Buckets are started in the same order on every rank; each keeps its own residuals
//! (they are keyed by name). On the two-phase collective with error feedback, server residuals
//! belong to one model layout, so buckets of several layouts there fail as the blocking calls
//! do ([`crate::Error::Config`]): start whole-model steps, or use the all-gather.
//!
//! Mixed precision ([`CompressedAllReduce::with_skip_non_finite`]): the verdict is the model
//! step's. The bucket in which some rank's gradient is not finite comes back NaN, as a
//! skipped blocking call does, and so does every later bucket of that model step, without an
//! exchange (every rank knows the verdict); the residuals of the step's earlier buckets are
//! put back to their values before the step (the thread copies the residuals of each bucket
//! but a step's last before its call: about one model's residuals of memory, the buffers
//! reused name by name from step to step, in this mode only), and the step number does not
//! advance. So a skipped step's last bucket always comes back all NaN; the earlier buckets'
//! results, handed back already, are void: a caller fills them with NaN too (the DDP hook
//! does), so that a loss scaler skips the step. [`CompressedAllReduce::last_step_skipped`] of
//! the all-reduce that [`NonBlockingAllReduce::finish`] gives back tells the last bucket's
//! verdict.

use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::{self, JoinHandle};

use super::CompressedAllReduce;
use crate::error::{Error, Result};
use crate::feedback::KeptResidual;
use crate::tensor::{Tensor, TensorMut};

/// The most steps a [`NonBlockingAllReduce`] keeps in flight (the bound of
/// [`NonBlockingAllReduce::spawn`]'s `max_in_flight`).
const MAX_IN_FLIGHT: usize = 1024;

/// One step's tensors, by name, and the step's result: what [`PendingAllReduce::wait`] gives.
type Finished = (Vec<(String, Tensor)>, Result<()>);

/// A step for the thread: its tensors, whether it ends a model step, and where to send the
/// tensors back.
struct Job {
    tensors: Vec<(String, Tensor)>,
    ends_step: bool,
    done: SyncSender<Finished>,
}

/// A [`CompressedAllReduce`] whose calls (whole steps, or buckets of a step) run on a thread
/// of their own, started by [`NonBlockingAllReduce::start`] and waited for with
/// [`PendingAllReduce::wait`] (see the module docs). At most `max_in_flight` calls are started
/// and not yet finished at a time: `start` waits for the oldest to finish beyond that, which
/// bounds the memory the caller lends. Calls run in the order they were started; every rank
/// must start the same calls in the same order, as every rank makes the same blocking calls.
///
/// Errors are the blocking step's, step by step: a rank's local error makes that step fail on
/// every rank (the group stays in step, and later steps run); after a transport error the
/// communicator is closed, and every later step, in flight or started afterwards, fails with
/// [`crate::comm::CommError::Broken`] naming that first failure, without any transport call.
///
/// Under MPI (feature `mpi`) the thread is the only caller of the communicator while steps are
/// in flight: `MpiCommunicator::init` asks for `MPI_THREAD_SERIALIZED`, which allows it (with
/// less, a call from another thread than the one that built the communicator ends the job,
/// naming the thread level MPI provides). A program
/// that also calls MPI elsewhere while steps are in flight needs `MPI_THREAD_MULTIPLE`
/// (`MpiCommunicator::threading` says what MPI provided).
///
/// Dropping it waits for the steps in flight to finish (every rank's collectives complete;
/// their results are dropped with their handles unless waited for).
///
/// ```
/// use gradwire::comm::{Communicator, LocalGroup};
/// use gradwire::{CompressedAllReduce, CompressionMethod, NonBlockingAllReduce, Tensor};
///
/// let comms = LocalGroup::new(2).into_communicators();
/// let ranks: Vec<_> = comms
///     .into_iter()
///     .map(|comm| {
///         std::thread::spawn(move || {
///             let r = comm.rank() as f32;
///             let ar = CompressedAllReduce::with_communicator(
///                 CompressionMethod::TopK { k: 2 },
///                 Box::new(comm),
///             );
///             let mut nb = NonBlockingAllReduce::spawn(ar, 2).unwrap();
///             // Two buckets of one model step in flight at once; `b` ends the step.
///             let a = nb.start(vec![("a".into(), Tensor::vector(vec![1.0 + r, 0.0, -4.0]))], false);
///             let b = nb.start(vec![("b".into(), Tensor::vector(vec![2.0 * r, 6.0]))], true);
///             let (a, ok_a) = a.unwrap().wait();
///             let (b, ok_b) = b.unwrap().wait();
///             ok_a.and(ok_b).unwrap();
///             (a[0].1.data().to_vec(), b[0].1.data().to_vec())
///         })
///     })
///     .collect();
/// for h in ranks {
///     let (a, b) = h.join().unwrap();
///     assert_eq!(a, [1.5, 0.0, -4.0]);
///     assert_eq!(b, [1.0, 6.0]);
/// }
/// ```
pub struct NonBlockingAllReduce {
    jobs: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<CompressedAllReduce>>,
}

/// A step started by [`NonBlockingAllReduce::start`]: [`PendingAllReduce::wait`] gives back
/// its tensors with the step's results. Dropped without a wait, the step still runs (every
/// rank must run it) and its tensors are dropped when it ends.
pub struct PendingAllReduce {
    done: Receiver<Finished>,
}

impl std::fmt::Debug for NonBlockingAllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NonBlockingAllReduce")
            .field("running", &self.thread.is_some())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for PendingAllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingAllReduce").finish_non_exhaustive()
    }
}

impl NonBlockingAllReduce {
    /// Moves `all_reduce` (with its communicator, residuals and step counter) to a new thread
    /// that runs the steps [`NonBlockingAllReduce::start`] hands it, at most `max_in_flight`
    /// at a time.
    ///
    /// # Errors
    /// [`Error::Config`] when `max_in_flight` is 0 or above 1024 (the queue's slots are
    /// allocated at once); [`Error::Io`] when the thread cannot be started
    /// (`all_reduce` is dropped then).
    pub fn spawn(all_reduce: CompressedAllReduce, max_in_flight: usize) -> Result<Self> {
        if !(1..=MAX_IN_FLIGHT).contains(&max_in_flight) {
            return Err(Error::config(format!(
                "max_in_flight {max_in_flight}: a non-blocking all-reduce runs 1 to \
                 {MAX_IN_FLIGHT} steps at a time"
            )));
        }
        // One step runs on the thread while the queue holds the others.
        let (jobs, queue) = mpsc::sync_channel::<Job>(max_in_flight - 1);
        let thread = thread::Builder::new()
            .name("gradwire-all-reduce".into())
            .spawn(move || run(all_reduce, queue))
            .map_err(|source| Error::Io {
                path: "gradwire-all-reduce (thread)".into(),
                source,
            })?;
        Ok(NonBlockingAllReduce {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Starts the next call on `tensors` (name, gradient; any order, names unique), moved in:
    /// [`PendingAllReduce::wait`] gives them back holding the results (the mean, or the
    /// configured reduction), as [`CompressedAllReduce::all_reduce_in_place`] writes them.
    /// `ends_step`: whether these tensors end a model step (a whole model, or a step's last
    /// bucket), after which the step number advances; the buckets before it carry the same
    /// step number (see the module docs). Waits while `max_in_flight` calls are started and
    /// not finished.
    ///
    /// # Errors
    /// [`Error::Internal`] when the thread is gone (it stops only on a bug in gradwire; the
    /// tensors are dropped then). The call's own errors come from [`PendingAllReduce::wait`].
    pub fn start(
        &mut self,
        tensors: Vec<(String, Tensor)>,
        ends_step: bool,
    ) -> Result<PendingAllReduce> {
        let (done, finished) = mpsc::sync_channel(1);
        let stopped = || Error::internal("the non-blocking all-reduce's thread stopped");
        let jobs = self.jobs.as_ref().ok_or_else(stopped)?;
        let job = Job {
            tensors,
            ends_step,
            done,
        };
        jobs.send(job).map_err(|_| stopped())?;
        Ok(PendingAllReduce { done: finished })
    }

    /// Waits for every step started to finish, stops the thread and gives back the
    /// all-reduce (its communicator, residuals and step counter as the last step left them):
    /// to save its residuals, or to go on with blocking calls.
    ///
    /// # Errors
    /// [`Error::Internal`] when the thread stopped on a bug in gradwire (the all-reduce is
    /// lost then).
    pub fn finish(mut self) -> Result<CompressedAllReduce> {
        self.stop()
            .ok_or_else(|| Error::internal("the non-blocking all-reduce's thread stopped"))
    }

    /// Closes the queue and joins the thread: the all-reduce, unless the thread panicked.
    fn stop(&mut self) -> Option<CompressedAllReduce> {
        drop(self.jobs.take());
        self.thread.take()?.join().ok()
    }
}

impl Drop for NonBlockingAllReduce {
    fn drop(&mut self) {
        self.stop();
    }
}

impl PendingAllReduce {
    /// Waits for the step to finish; gives back its tensors (in the order they were started,
    /// holding the results, or unspecified values after an error, as the blocking call leaves
    /// them) and the step's result.
    ///
    /// # Errors
    /// The step's: as [`CompressedAllReduce::all_reduce_in_place`];
    /// [`Error::Internal`] with no tensors when the thread stopped on a bug in gradwire.
    pub fn wait(self) -> (Vec<(String, Tensor)>, Result<()>) {
        self.done.recv().unwrap_or_else(|_| {
            (
                Vec::new(),
                Err(Error::internal(
                    "the non-blocking all-reduce's thread stopped during a step",
                )),
            )
        })
    }
}

/// The thread: each call in order, in place on its tensors, sent back with its result (a
/// handle dropped without a wait drops them). A call that does not end a model step leaves
/// the step number where it found it, on success and failure alike (every rank does the
/// same, so the group stays in step).
///
/// With [`CompressedAllReduce::with_skip_non_finite`] the verdict is the model step's: the
/// residuals of each bucket but the step's last are copied before its call; when a bucket is
/// skipped (on every rank alike), the copies of the step's buckets so far are put back, and
/// the step's later buckets come back NaN without a call (every rank knows the verdict).
fn run(mut all_reduce: CompressedAllReduce, jobs: Receiver<Job>) -> CompressedAllReduce {
    // The residuals of this model step's buckets so far (the first `kept_len` entries, in the
    // order they were copied; the others are spares whose buffers the next copies of their
    // names reuse), whether one of the step's buckets was skipped, and whether error-feedback
    // state existed when the step began.
    let mut kept: Vec<KeptResidual> = Vec::new();
    let mut kept_len = 0;
    let mut step_skipped = false;
    let mut had_feedback = all_reduce.compressor().feedback().is_some();
    for job in jobs {
        let Job {
            mut tensors,
            ends_step,
            done,
        } = job;
        let step = all_reduce.compressor().step();
        let skip_mode = all_reduce.skip_non_finite;
        let result = if skip_mode && step_skipped {
            // No call: the tensors are filled NaN below.
            all_reduce.skipped = true;
            Ok(())
        } else {
            if skip_mode && !ends_step {
                for (name, _) in &tensors {
                    keep_next(&mut kept, kept_len, name);
                    all_reduce
                        .compressor()
                        .keep_residual(name, &mut kept[kept_len]);
                    kept_len += 1;
                }
            }
            let mut views: Vec<TensorMut<'_>> = tensors
                .iter_mut()
                .map(|(name, tensor)| {
                    let (shape, data) = tensor.parts_mut();
                    TensorMut { name, shape, data }
                })
                .collect();
            all_reduce.all_reduce_in_place(&mut views)
        };
        if skip_mode && all_reduce.last_step_skipped() {
            if !step_skipped {
                step_skipped = true;
                // Last copied first: a name in two buckets of the step gets its value from
                // before the first of them.
                for one in kept[..kept_len].iter().rev() {
                    all_reduce.compressor_mut().put_back_residual(one);
                }
                if !had_feedback {
                    // The step's first bucket created the error-feedback state: none again,
                    // as before the step.
                    drop(all_reduce.compressor_mut().take_feedback());
                }
            }
            // Every tensor of a skipped bucket NaN, also on a rank whose own call failed
            // before it could write them (the group's verdict is the skip).
            for (_, tensor) in &mut tensors {
                tensor.parts_mut().1.fill(f32::NAN);
            }
        }
        if ends_step {
            kept_len = 0;
            step_skipped = false;
            had_feedback = all_reduce.compressor().feedback().is_some();
        } else {
            all_reduce.compressor_mut().set_step(step);
        }
        let _ = done.send((tensors, result));
    }
    all_reduce
}

/// Makes `kept[at]` the entry for `name`'s next copy: the spare (at `at` or after) that held
/// `name` before, whose buffer fits it, moved to `at`; else the spare at `at`; else a new
/// entry. So a model's copies keep about one buffer per name when DDP regroups its buckets,
/// not the largest of every layout per position.
fn keep_next(kept: &mut Vec<KeptResidual>, at: usize, name: &str) {
    match kept[at..].iter().position(|k| k.name() == name) {
        Some(i) => kept.swap(at, at + i),
        None if at < kept.len() => {}
        None => kept.push(KeptResidual::default()),
    }
}
