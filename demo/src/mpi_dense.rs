//! `dense-f32-allreduce` (feature `mpi`): the dense step a user without gradwire would run, a
//! plain `MPI_Allreduce` (sum, f32) of the whole gradient through the `mpi` crate, outside
//! gradwire's collectives; the baseline of the slow-network report (`netsim/`).
//!
//! **Not rank-order bit-identical.** Open MPI chooses the reduction algorithm (and so the order
//! in which the ranks' values are added) from the message size and the world size, so its sums
//! may differ in the last bits from gradwire's rank-order sum (`dense-f32`) and from the same
//! run on the threads transport, which cannot run this method at all. The ranks of one run must
//! still agree with each other: the training loop checks every step's mean and the final
//! parameters on every rank at the end of a run and fails it otherwise. `.ci/mpi-demo.sh`
//! leaves the method out of its threads-vs-MPI comparison (it is not in
//! [`Method::ALL`](crate::codec::Method::ALL)).
//!
//! Bytes: the codec counts what a ring all-reduce (reduce-scatter, then all-gather) moves,
//! `2 (W - 1) / W x 4n` each way per rank; what Open MPI's algorithm actually put on the wire
//! is what the network interfaces count (`netsim/` reports both).

use gradwire::comm::{Communicator, Traffic};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _};

use crate::DemoError;
use crate::codec::{GradientCodec, Method};
use crate::model::ParamSpec;

/// The codec of [`Method::DenseF32Allreduce`]: `MPI_Allreduce` on `MPI_COMM_WORLD`, then a
/// division by W.
#[derive(Debug)]
pub struct MpiAllreduceF32 {
    lens: Vec<usize>,
    rank: usize,
    world_size: usize,
    send: Vec<f32>,
    recv: Vec<f32>,
    traffic: Traffic,
}

impl MpiAllreduceF32 {
    /// The codec for tensors of `specs` (name order), on the world communicator of
    /// `universe` (which proves MPI is initialised; the world communicator is taken afresh
    /// at every call, as it is not `Send`).
    #[must_use]
    pub fn new(universe: &Universe, specs: &[ParamSpec]) -> MpiAllreduceF32 {
        let world = universe.world();
        MpiAllreduceF32 {
            lens: specs.iter().map(ParamSpec::len).collect(),
            rank: usize::try_from(world.rank()).unwrap_or(0),
            world_size: usize::try_from(world.size()).unwrap_or(1).max(1),
            send: Vec::new(),
            recv: Vec::new(),
            traffic: Traffic::default(),
        }
    }

    fn error(message: String) -> DemoError {
        DemoError::Codec {
            method: Method::DenseF32Allreduce,
            message,
        }
    }

    /// Bytes this rank sends (and receives) in one ring all-reduce of `n` f32 values: its
    /// shard (`rank * n / W .. (rank + 1) * n / W`, as gradwire cuts them) to `W - 1` peers,
    /// every other shard to its owner.
    fn ring_bytes(&self, n: usize) -> u64 {
        let (r, w) = (self.rank, self.world_size);
        let own = (r + 1) * n / w - r * n / w;
        4 * (n - own + (w - 1) * own) as u64
    }
}

impl GradientCodec for MpiAllreduceF32 {
    fn method(&self) -> Method {
        Method::DenseF32Allreduce
    }

    fn max_message_len(&self) -> usize {
        self.lens.iter().sum::<usize>() * 4
    }

    fn encode(
        &mut self,
        _step: u64,
        _grads: &[&[f32]],
        _out: &mut Vec<u8>,
    ) -> Result<(), DemoError> {
        Err(Self::error(
            "runs its own collective (MPI_Allreduce)".into(),
        ))
    }

    fn decode_mean(
        &mut self,
        _step: u64,
        _messages: &[Vec<u8>],
        _out: &mut [Vec<f32>],
    ) -> Result<(), DemoError> {
        Err(Self::error(
            "runs its own collective (MPI_Allreduce)".into(),
        ))
    }

    fn runs_own_collective(&self) -> bool {
        true
    }

    fn all_reduce(
        &mut self,
        _comm: &mut dyn Communicator,
        _step: u64,
        grads: &[&[f32]],
        out: &mut [Vec<f32>],
    ) -> Result<usize, DemoError> {
        if grads.len() != self.lens.len()
            || grads.iter().zip(&self.lens).any(|(g, &n)| g.len() != n)
            || out.len() != self.lens.len()
            || out.iter().zip(&self.lens).any(|(o, &n)| o.len() != n)
        {
            return Err(Self::error(
                "gradients or output do not match the model".into(),
            ));
        }
        self.send.clear();
        for g in grads {
            self.send.extend_from_slice(g);
        }
        self.recv.clear();
        self.recv.resize(self.send.len(), 0.0);
        SimpleCommunicator::world().all_reduce_into(
            &self.send[..],
            &mut self.recv[..],
            SystemOperation::sum(),
        );
        #[allow(clippy::cast_precision_loss)]
        let w = self.world_size as f32;
        let mut at = 0;
        for o in out.iter_mut() {
            let n = o.len();
            for (o, s) in o.iter_mut().zip(&self.recv[at..at + n]) {
                *o = *s / w;
            }
            at += n;
        }
        let bytes = self.ring_bytes(self.send.len());
        self.traffic.sent = self.traffic.sent.saturating_add(bytes);
        self.traffic.received = self.traffic.received.saturating_add(bytes);
        Ok(self.max_message_len())
    }

    fn own_traffic(&self) -> Traffic {
        self.traffic
    }
}
