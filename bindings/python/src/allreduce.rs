//! `gradwire.AllReduce`: the library's [`CompressedAllReduce`] over a Python transport
//! ([`PyCommunicator`]), so that the collective rules hold unchanged: every rank returns the
//! same error at the same call (a rank whose own step fails still takes part), size limits are
//! collective, and every rank holds bit-identical results.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gradwire::comm::Communicator;
use gradwire::{
    Collective, CompressedAllReduce, CompressionMethod, NonBlockingAllReduce, Reduction, Tensor,
    TensorMut,
};
use numpy::{
    IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::comm::PyCommunicator;
use crate::compressor::{load_checked, method_from_text};
use crate::errors::{Side, library_error};

/// A tensor as the Python half passes it: name, shape, flat C-contiguous float32 data.
type NamedArray<'py> = (String, Vec<usize>, PyReadonlyArray1<'py, f32>);

/// A tensor reduced in place: name, shape, flat C-contiguous float32 data (writable).
type InPlaceArray<'py> = (String, Vec<usize>, PyReadwriteArray1<'py, f32>);

/// `ValueError` when two of `arrays` share memory (views of one buffer under two names, or
/// overlapping slices of one bucket): each is read as a gradient and overwritten with a
/// result, so they must be apart. numpy's own borrow check sees arrays of one base object;
/// torch tensors turned into arrays each get their own, so the addresses are compared here,
/// before any array is borrowed mutably.
fn refuse_overlaps(names: &[String], arrays: &[PyReadwriteArray1<'_, f32>]) -> PyResult<()> {
    let mut ranges: Vec<(usize, usize, usize)> = arrays
        .iter()
        .enumerate()
        .filter(|(_, a)| a.len() > 0)
        .map(|(i, a)| {
            let start = a.data() as usize;
            (start, start.saturating_add(4 * a.len()), i)
        })
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
        if start < end {
            return Err(PyValueError::new_err(format!(
                "tensors {:?} and {:?} share memory: all_reduce_ overwrites each with its \
                 result, so they must not overlap",
                names[a], names[b]
            )));
        }
    }
    Ok(())
}

/// A result tensor: name, shape, flat float32 data.
type ResultArray<'py> = (String, Vec<usize>, Bound<'py, PyArray1<f32>>);

pub(crate) fn parse_reduction(text: &str) -> PyResult<Reduction> {
    match text {
        "mean" => Ok(Reduction::Mean),
        "sum" => Ok(Reduction::Sum),
        "majority-vote" => Ok(Reduction::MajorityVote),
        other => Err(PyValueError::new_err(format!(
            "unknown reduction {other:?} (expected mean, sum or majority-vote)"
        ))),
    }
}

fn parse_collective(text: &str) -> PyResult<Collective> {
    match text {
        "allgather" => Ok(Collective::AllGather),
        "two-phase" => Ok(Collective::TwoPhase),
        "auto" => Ok(Collective::Auto),
        other => Err(PyValueError::new_err(format!(
            "unknown collective {other:?} (expected allgather, two-phase or auto)"
        ))),
    }
}

/// Where the library's all-reduce is: here between steps, or on its own thread while steps
/// started with `start_` may be in flight.
enum State {
    Idle(Box<CompressedAllReduce>),
    Running(NonBlockingAllReduce),
    /// The thread stopped on a bug in gradwire: the all-reduce is lost.
    Lost,
}

/// Steps in flight at most on the non-blocking thread (`start_` waits beyond that): the DDP
/// hook's overlapped and delayed modes start every bucket of a step before waiting for any
/// (a model of 64 buckets of 25 MB is 1.6 GB of gradients).
const MAX_IN_FLIGHT: usize = 64;

/// The tensors of steps waited for, by name, for `start_` to copy the next step's values into:
/// a model's buckets come back every step under the same names, so the copies in reuse memory
/// already touched instead of a fresh model-sized allocation (and its page faults) every step.
/// It holds at most one tensor per name, the size of what the steps in flight held.
type Reusable = Arc<Mutex<HashMap<String, Tensor>>>;

/// Locks `reusable` (a panic while it was held loses nothing but buffers: taken either way).
fn lock(reusable: &Reusable) -> std::sync::MutexGuard<'_, HashMap<String, Tensor>> {
    reusable
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One rank's compressed all-reduce (see `gradwire/__init__.py` for the Python-facing docs).
#[pyclass(module = "gradwire._native", name = "AllReduce")]
pub(crate) struct AllReduce {
    /// In a mutex only so that the class is `Sync` (the communicator is `Send` only); every
    /// method takes `&mut self` and reaches it with `get_mut`, without locking.
    inner: Mutex<State>,
    rank: usize,
    world_size: usize,
    seed: u64,
    /// Wall time of the library's last step (`all_reduce` or `all_reduce_`), seconds.
    last_step_seconds: f64,
    /// Buffers of steps `start_` ran, for the next ones.
    reusable: Reusable,
}

impl AllReduce {
    /// Where the library's all-reduce is. A panic while the mutex was held cannot happen (it
    /// is never locked); the value is taken either way.
    fn state(&mut self) -> &mut State {
        self.inner
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The all-reduce, after every step started with `start_` finished (the thread stopped
    /// with the GIL released: its transport's calls need it).
    fn inner(&mut self, py: Python<'_>) -> PyResult<&mut CompressedAllReduce> {
        let state = self.state();
        *state = match std::mem::replace(state, State::Lost) {
            State::Running(nb) => State::Idle(Box::new(
                py.detach(|| nb.finish())
                    .map_err(|e| library_error(e, Side::Input))?,
            )),
            other => other,
        };
        match state {
            State::Idle(ar) => Ok(ar),
            _ => Err(thread_lost()),
        }
    }

    /// The non-blocking all-reduce, started from the idle one on first use.
    fn running(&mut self) -> PyResult<&mut NonBlockingAllReduce> {
        let state = self.state();
        *state = match std::mem::replace(state, State::Lost) {
            State::Idle(ar) => State::Running(
                NonBlockingAllReduce::spawn(*ar, MAX_IN_FLIGHT)
                    .map_err(|e| library_error(e, Side::Input))?,
            ),
            other => other,
        };
        match state {
            State::Running(nb) => Ok(nb),
            _ => Err(thread_lost()),
        }
    }
}

/// The error of an all-reduce whose non-blocking thread stopped on a bug in gradwire.
fn thread_lost() -> PyErr {
    library_error(
        gradwire::Error::Internal {
            what: "the non-blocking all-reduce's thread stopped".into(),
        },
        Side::Input,
    )
}

impl Drop for AllReduce {
    /// Steps still in flight finish before the all-reduce goes (every rank's collectives
    /// complete), with the GIL released: the thread's transport calls need it.
    fn drop(&mut self) {
        if let State::Running(nb) = std::mem::replace(self.state(), State::Lost) {
            Python::attach(|py| py.detach(|| drop(nb)));
        }
    }
}

/// A step started by `AllReduce.start_`: `wait` writes its results into the arrays it was
/// started on.
#[pyclass(module = "gradwire._native", name = "PendingAllReduce")]
pub(crate) struct Pending {
    /// `None` once waited for. In a mutex only so that the class is `Sync`.
    handle: Mutex<Option<gradwire::PendingAllReduce>>,
    arrays: Vec<Py<PyArray1<f32>>>,
    rank: usize,
    /// Where `wait` leaves the step's tensors for the all-reduce's next `start_`.
    reusable: Reusable,
}

#[pymethods]
impl Pending {
    /// Waits for the step (the GIL released), then writes each result into its array.
    /// Raises the step's error as `all_reduce_` raises it; `ValueError` when waited for twice.
    fn wait(&mut self, py: Python<'_>) -> PyResult<()> {
        let handle = self
            .handle
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .ok_or_else(|| PyValueError::new_err("this step was waited for already"))?;
        let (tensors, result) = py.detach(|| handle.wait());
        let written = result
            .map_err(|e| library_error(e, Side::Collective { rank: self.rank }))
            .and_then(|()| self.write_results(py, &tensors));
        lock(&self.reusable).extend(tensors);
        written
    }

    /// Whether `wait` was called.
    #[getter]
    fn waited(&mut self) -> bool {
        self.handle
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_none()
    }
}

impl Pending {
    /// Writes each tensor's result into its array.
    fn write_results(&self, py: Python<'_>, tensors: &[(String, Tensor)]) -> PyResult<()> {
        for (array, (name, tensor)) in self.arrays.iter().zip(tensors) {
            let mut array = array.bind(py).try_readwrite().map_err(|e| {
                PyValueError::new_err(format!(
                    "tensor {name:?}: its result cannot be written: {e}"
                ))
            })?;
            let out = array.as_slice_mut().map_err(|_| {
                PyValueError::new_err(format!("tensor {name:?}: the array is not C-contiguous"))
            })?;
            if out.len() != tensor.data().len() {
                return Err(PyValueError::new_err(format!(
                    "tensor {name:?}: the array was resized while its step ran"
                )));
            }
            out.copy_from_slice(tensor.data());
        }
        Ok(())
    }
}

#[pymethods]
impl AllReduce {
    #[new]
    #[pyo3(signature = (method, communicator, error_feedback = true, seed = 0, collective = "allgather", reduction = "mean", skip_non_finite = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        method: &str,
        communicator: Bound<'_, PyAny>,
        error_feedback: bool,
        seed: u64,
        collective: &str,
        reduction: &str,
        skip_non_finite: bool,
    ) -> PyResult<Self> {
        let method = method_from_text(method, error_feedback)?;
        let collective = parse_collective(collective)?;
        let reduction = parse_reduction(reduction)?;
        let comm = PyCommunicator::new(communicator)?;
        let (rank, world_size) = (comm.rank(), comm.world_size());
        let inner = CompressedAllReduce::with_communicator(method, Box::new(comm))
            .with_seed(seed)
            .with_collective(collective)
            .with_reduction(reduction)
            .with_skip_non_finite(skip_non_finite);
        Ok(AllReduce {
            inner: Mutex::new(State::Idle(Box::new(inner))),
            rank,
            world_size,
            seed,
            last_step_seconds: 0.0,
            reusable: Reusable::default(),
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    #[getter]
    fn world_size(&self) -> usize {
        self.world_size
    }

    /// The step the next call runs at.
    #[getter]
    fn step(&mut self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.inner(py)?.compressor().step())
    }

    /// `(sent, received)` bytes this rank's calls moved so far.
    #[getter]
    fn traffic(&mut self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let t = self.inner(py)?.traffic();
        Ok((t.sent, t.received))
    }

    /// Wall time of the library's own last step, in seconds: the Rust call alone, without the
    /// Python half's conversions (a Python transport's calls are inside it).
    #[getter]
    fn last_step_seconds(&self) -> f64 {
        self.last_step_seconds
    }

    /// Whether the last step was skipped for a non-finite gradient on some rank (the library's
    /// `last_step_skipped`).
    #[getter]
    fn last_step_skipped(&mut self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.inner(py)?.last_step_skipped())
    }

    /// Sets the library's `with_skip_non_finite` between steps (every rank alike).
    fn set_skip_non_finite(&mut self, py: Python<'_>, skip: bool) -> PyResult<()> {
        let inner = self.inner(py)?;
        // The setting is a builder of the library's: the all-reduce is moved out and back,
        // a placeholder (no model, no buffers) standing in for the moment.
        let placeholder = CompressedAllReduce::new(CompressionMethod::SignSGD, 1);
        let taken = std::mem::replace(inner, placeholder);
        *inner = taken.with_skip_non_finite(skip);
        Ok(())
    }

    /// Multiplies every residual by `factor` (the library's `scale_residuals`: after a loss
    /// scale changed, `new / old`).
    fn scale_residuals(&mut self, py: Python<'_>, factor: f64) -> PyResult<()> {
        // Checked as given: a factor that f32 cannot hold would read as 0 or infinity.
        let narrowed = factor as f32;
        if !(narrowed.is_finite() && narrowed > 0.0) {
            return Err(PyValueError::new_err(format!(
                "residuals scaled by {factor}: the factor must be finite, positive and within \
                 f32"
            )));
        }
        self.inner(py)?
            .scale_residuals(narrowed)
            .map_err(|e| library_error(e, Side::Input))
    }

    /// Bytes of this rank's message of the last step (its bundle, or its shard messages).
    #[getter]
    fn last_message_bytes(&mut self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.last_message_bytes())
    }

    /// The collective the last step ran (`allgather` or `two-phase`), `None` before one ran.
    #[getter]
    fn collective_in_use(&mut self, py: Python<'_>) -> PyResult<Option<&'static str>> {
        Ok(self.inner(py)?.collective_in_use().map(|c| match c {
            Collective::AllGather => "allgather",
            Collective::TwoPhase => "two-phase",
            Collective::Auto => "auto",
        }))
    }

    /// One step: every rank's gradients compressed, exchanged and reduced; the result on every
    /// rank, bit-identical.
    fn all_reduce<'py>(
        &mut self,
        py: Python<'py>,
        tensors: Vec<NamedArray<'py>>,
    ) -> PyResult<Vec<ResultArray<'py>>> {
        let mut grads = HashMap::with_capacity(tensors.len());
        for (name, shape, array) in &tensors {
            let data = crate::errors::copied(array.as_slice()?, &format!("tensor {name:?}"))?;
            let t = Tensor::new(shape.clone(), data).map_err(|e| library_error(e, Side::Input))?;
            if grads.insert(name.clone(), t).is_some() {
                return Err(PyValueError::new_err(format!(
                    "tensor {name:?} given twice"
                )));
            }
        }
        let side = Side::Collective { rank: self.rank };
        let inner = self.inner(py)?;
        let started = std::time::Instant::now();
        let out = py.detach(|| inner.all_reduce(&grads));
        self.last_step_seconds = started.elapsed().as_secs_f64();
        let out = out.map_err(|e| library_error(e, side))?;
        let mut names: Vec<String> = out.keys().cloned().collect();
        names.sort();
        let mut out = out;
        names
            .into_iter()
            .map(|name| {
                let t = out.remove(&name).expect("listed above");
                let shape = t.shape().to_vec();
                let data = crate::errors::copied(t.data(), &format!("tensor {name:?}"))?;
                Ok((name, shape, data.into_pyarray(py)))
            })
            .collect()
    }

    /// One step in place: each array's values are read as the gradient and overwritten with
    /// the result, bit-identical on every rank, with no copy of the model (the library's
    /// `all_reduce_in_place`, the GIL released while it runs).
    fn all_reduce_(&mut self, py: Python<'_>, tensors: Vec<InPlaceArray<'_>>) -> PyResult<()> {
        let mut names = Vec::with_capacity(tensors.len());
        let mut shapes = Vec::with_capacity(tensors.len());
        let mut arrays = Vec::with_capacity(tensors.len());
        for (name, shape, array) in tensors {
            names.push(name);
            shapes.push(shape);
            arrays.push(array);
        }
        refuse_overlaps(&names, &arrays)?;
        let mut views = Vec::with_capacity(arrays.len());
        for ((name, shape), array) in names.iter().zip(&shapes).zip(&mut arrays) {
            let data = array.as_slice_mut().map_err(|_| {
                PyValueError::new_err(format!("tensor {name:?}: the array is not C-contiguous"))
            })?;
            views.push(TensorMut { name, shape, data });
        }
        let side = Side::Collective { rank: self.rank };
        let inner = self.inner(py)?;
        let started = std::time::Instant::now();
        let result = py.detach(|| inner.all_reduce_in_place(&mut views));
        self.last_step_seconds = started.elapsed().as_secs_f64();
        result.map_err(|e| library_error(e, side))
    }

    /// Starts a step on `tensors` without waiting for it (the library's
    /// `NonBlockingAllReduce` on a thread of its own, at most 64 steps in flight): each
    /// array's values are copied in now (into the buffer of the last step waited for under
    /// that name, when its length is the same), and `wait` on the returned handle writes the
    /// results into the same arrays. `ends_step`: whether these tensors end a model step (the buckets
    /// of one model step carry its step number). Every method that reaches the library's
    /// all-reduce (steps, checkpoints, the step counter, traffic, message sizes) first waits
    /// for every step in flight.
    fn start_(
        &mut self,
        py: Python<'_>,
        tensors: Vec<InPlaceArray<'_>>,
        ends_step: bool,
    ) -> PyResult<Pending> {
        let mut names = Vec::with_capacity(tensors.len());
        let mut arrays = Vec::with_capacity(tensors.len());
        let mut owned = Vec::with_capacity(tensors.len());
        let mut reusable = lock(&self.reusable);
        for (name, shape, array) in tensors {
            let values = array.as_slice().map_err(|_| {
                PyValueError::new_err(format!("tensor {name:?}: the array is not C-contiguous"))
            })?;
            let t = match reusable.remove(&name) {
                // The same length: the copy fills memory the tensor holds already.
                Some(mut t) if t.data().len() == values.len() => {
                    t.assign(&shape, values)
                        .map_err(|e| library_error(e, Side::Input))?;
                    t
                }
                _ => {
                    let data = crate::errors::copied(values, &format!("tensor {name:?}"))?;
                    Tensor::new(shape, data).map_err(|e| library_error(e, Side::Input))?
                }
            };
            owned.push((name.clone(), t));
            names.push(name);
            arrays.push(array);
        }
        drop(reusable);
        refuse_overlaps(&names, &arrays)?;
        let unbound = arrays.iter().map(|a| (***a).clone().unbind()).collect();
        drop(arrays);
        let rank = self.rank;
        let nb = self.running()?;
        // Waits (GIL released: the thread's transport calls need it) while the queue is full.
        let handle = py
            .detach(|| nb.start(owned, ends_step))
            .map_err(|e| library_error(e, Side::Input))?;
        Ok(Pending {
            handle: Mutex::new(Some(handle)),
            arrays: unbound,
            rank,
            reusable: Arc::clone(&self.reusable),
        })
    }

    /// Writes this rank's residual checkpoint to `path`.
    fn save(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let c = self.inner(py)?.compressor_mut();
        py.detach(|| c.save_feedback(&path))
            .map_err(|e| library_error(e, Side::Input))
    }

    /// Restores this rank's residual checkpoint from `path` (made with this method and seed).
    fn load(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let seed = self.seed;
        load_checked(py, self.inner(py)?.compressor_mut(), seed, &path)
    }

    /// Writes this rank's server residuals (two-phase) to `path`.
    fn save_server_residuals(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        // With the GIL held: `&CompressedAllReduce` is not `Send` (its communicator is not
        // `Sync`), and the file is one shard's residuals.
        self.inner(py)?
            .save_server_residuals(&path)
            .map_err(|e| library_error(e, Side::Input))
    }

    /// Restores this rank's server residuals (two-phase) from `path`.
    fn load_server_residuals(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let inner = self.inner(py)?;
        py.detach(|| inner.load_server_residuals(&path))
            .map_err(|e| library_error(e, Side::Payload))
    }

    /// Drops this rank's server residuals (two-phase): the next step starts them at zero (an
    /// elastic restart, or a resume that chooses not to load them).
    fn discard_server_residuals(&mut self, py: Python<'_>) -> PyResult<()> {
        self.inner(py)?.discard_server_residuals();
        Ok(())
    }
}
