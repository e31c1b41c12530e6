//! The round that opens a step when a non-finite gradient skips it instead of failing it
//! ([`crate::CompressedAllReduce::with_skip_non_finite`]: mixed-precision training, where a
//! loss scaler such as PyTorch's `GradScaler` expects an overflowing step to come back with
//! infinities on every rank, skips it and lowers its scale).
//!
//! Every rank checks its gradients before anything changes and all-gathers its verdict in one
//! message of [`LEN`] bytes:
//!
//! ```text
//! offset size field
//!  0     4   magic "GWNF"
//!  4     1   version (1)
//!  5     1   verdict: 0 = every value finite (and within the method's value type without
//!            error feedback), 1 = not, 2 = the rank's step failed before its check
//!  6     2   reserved, 0
//!  8     8   step (u64 LE)
//! ```
//!
//! The step is skipped on every rank when some rank says 1, whatever the others say (a skip
//! changes nothing anywhere, so a rank that failed otherwise at that step, which the check may
//! not see on every route, fails at its next step if the cause stays). With no 1, the step
//! runs (a rank that said 2 takes part with its failure, as without this round). A message of
//! another length, magic, version or step is a rank that did not open its step with this
//! round (another configuration, or another step): every rank names it.

use crate::comm::Communicator;
use crate::error::{Error, Result};

/// Bytes of one rank's message.
pub(crate) const LEN: usize = 16;

const MAGIC: [u8; 4] = *b"GWNF";
const VERSION: u8 = 1;

/// One rank's verdict on its own gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every value finite (and within the value type where the method has no error feedback).
    Finite = 0,
    /// Some value is not.
    NonFinite = 1,
    /// The rank's step failed before its check (it takes part, and fails the step itself).
    Failed = 2,
}

/// Runs the round: `Ok(true)` when the step is skipped on every rank. `gathered` holds the
/// messages (kept between steps).
///
/// # Errors
/// [`Error::Comm`] when the all-gather fails; [`Error::Collective`] naming the first rank
/// whose message is not this round's at this step (every rank names the same one).
pub(crate) fn round(
    comm: &mut dyn Communicator,
    verdict: Verdict,
    step: u64,
    gathered: &mut Vec<Vec<u8>>,
) -> Result<bool> {
    let mut msg = [0u8; LEN];
    msg[..4].copy_from_slice(&MAGIC);
    msg[4] = VERSION;
    msg[5] = verdict as u8;
    msg[8..].copy_from_slice(&step.to_le_bytes());
    comm.all_gather(&msg, LEN, gathered)?;
    let mut skip = false;
    for (rank, got) in gathered.iter().enumerate() {
        let reason = if got.len() != LEN || got[..4] != MAGIC || got[4] != VERSION {
            Some(
                "its step did not open with the round of non-finite gradients (every rank \
                  must set the same skip_non_finite)"
                    .to_owned(),
            )
        } else if got[8..] != step.to_le_bytes() {
            let mut word = [0u8; 8];
            word.copy_from_slice(&got[8..]);
            Some(format!(
                "it is at step {}, this rank at step {step}",
                u64::from_le_bytes(word)
            ))
        } else {
            match got[5] {
                0 => None,
                1 => {
                    skip = true;
                    None
                }
                2 => None,
                v => Some(format!("its verdict {v} is not one of the round's")),
            }
        };
        if let Some(reason) = reason {
            return Err(Error::Collective { rank, reason });
        }
    }
    Ok(skip)
}

#[cfg(test)]
mod tests {
    use super::{LEN, Verdict, round};
    use crate::comm::{Communicator, LocalGroup};
    use crate::error::Error;

    /// Rank 0 runs the round at step 7; rank 1 sends `forged` with a raw all-gather.
    fn against(forged: Vec<u8>) -> crate::error::Result<bool> {
        let mut comms = LocalGroup::new(2).into_communicators();
        let mut peer = comms.pop().unwrap();
        let mut me = comms.pop().unwrap();
        let forger = std::thread::spawn(move || {
            let mut out = Vec::new();
            let _ = peer.all_gather(&forged, LEN, &mut out);
        });
        let got = round(&mut me, Verdict::Finite, 7, &mut Vec::new());
        forger.join().unwrap();
        got
    }

    fn message(version: u8, verdict: u8, step: u64) -> Vec<u8> {
        let mut m = b"GWNF".to_vec();
        m.extend_from_slice(&[version, verdict, 0, 0]);
        m.extend_from_slice(&step.to_le_bytes());
        m
    }

    #[test]
    fn verdicts_decide_and_forged_messages_name_their_sender() {
        assert!(!against(message(1, 0, 7)).unwrap());
        assert!(against(message(1, 1, 7)).unwrap());
        // A failed rank: the step goes on (and fails there); beside a non-finite one, skipped.
        assert!(!against(message(1, 2, 7)).unwrap());
        for (forged, says) in [
            (message(1, 3, 7), "verdict 3"),
            (message(1, 1, 8), "step 8"),
            (message(2, 1, 7), "did not open"),
            (
                b"GWNX"
                    .iter()
                    .copied()
                    .chain([1, 1, 0, 0])
                    .chain(7u64.to_le_bytes())
                    .collect(),
                "did not open",
            ),
            (message(1, 1, 7)[..15].to_vec(), "did not open"),
        ] {
            match against(forged) {
                Err(Error::Collective { rank: 1, reason }) => {
                    assert!(reason.contains(says), "{reason}");
                }
                other => panic!("{says}: {other:?}"),
            }
        }
    }
}
