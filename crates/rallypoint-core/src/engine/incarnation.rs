//! Who may speak for a rank and for a job (docs/PROTOCOL.md, section 14).
//!
//! Every process states an incarnation: a random number drawn once per process. A
//! rank belongs to the incarnation that claimed it (its *holder*) for as long as that
//! process is alive to the coordinator: a session of it is open and its rank not
//! lost, or its connection dropped less than the reconnect grace ago. Another
//! incarnation claiming the rank meanwhile is refused, naming both processes; once
//! the holder has left or is lost, a new incarnation takes the rank over, and the old
//! one is refused by name should it come back. Sessions that state no incarnation
//! (PyTorch TCPStore clients) are exempt both ways.
//!
//! A job has an incarnation too: the first process naming one sets it, a `Reset`
//! starts a new one (a new `Job`, the old one failing everything of its sessions),
//! and a process naming another incarnation than the current one is refused.

use crate::{Identity, JobIncarnation, Millis, OpError, ProcessInfo, RankState};

use super::job::Job;
use super::Sessions;

/// The process that stated `identity`.
pub(crate) fn process(identity: &Identity) -> ProcessInfo {
    ProcessInfo { pid: identity.pid, host: identity.host.clone(), incarnation: identity.incarnation }
}

/// Whether a process naming job incarnation `mine` may join `job`.
pub(crate) fn check_job(job: &Job, mine: Option<u64>) -> Result<(), OpError> {
    match (mine, &job.incarnation) {
        (Some(mine), Some(current)) if current.incarnation != mine => {
            Err(OpError::StaleIncarnation { job: job.name.clone(), mine, current: current.clone() })
        }
        _ => Ok(()),
    }
}

/// A job with no incarnation yet takes the first one a process names.
pub(crate) fn adopt(job: &mut Job, identity: &Identity, since_unix_ms: u64) {
    if let (None, Some(incarnation)) = (&job.incarnation, identity.job_incarnation) {
        let by = process(identity);
        job.incarnation = Some(Box::new(JobIncarnation { incarnation, since_unix_ms, by, reset: false }));
    }
}

/// Whether the process of `identity` may take its rank in `job`. `Ok(None)`: it may
/// (nobody holds the rank, or this process does, or it states no incarnation);
/// `Ok(Some(rank))`: it may, taking the rank over from a holder that left or is lost;
/// `Err`: the refusal, naming both processes. `unix_ms` turns engine time into
/// wall-clock time.
pub(crate) fn claim(
    job: &Job,
    sessions: &Sessions,
    identity: &Identity,
    unix_ms: impl Fn(Millis) -> u64,
) -> Result<Option<u32>, OpError> {
    let (Some(rank), Some(incarnation)) = (identity.rank, identity.incarnation) else { return Ok(None) };
    let claimant = || Box::new(process(identity));
    if let Some(takeover) = job.ranks.taken_from(rank, incarnation) {
        return Err(OpError::TakenOver {
            rank,
            by: Box::new(takeover.by.clone()),
            at_unix_ms: unix_ms(takeover.at),
            this: claimant(),
        });
    }
    let Some(holder) = job.ranks.holder(rank) else { return Ok(None) };
    if holder.incarnation == incarnation {
        return Ok(None);
    }
    let state = job.ranks.state(rank);
    // Alive to the coordinator: not leaving, and either waiting for a resume or
    // connected with its rank not lost (a rank silent for a whole lease is lost, and
    // may be taken over even while its hung process keeps its connection).
    let live = holder
        .sessions
        .iter()
        .filter_map(|id| sessions.get(id))
        .any(|s| !s.leaving && (s.detached() || matches!(state, RankState::Connected)));
    if live {
        return Err(OpError::RankHeld {
            rank,
            holder: Box::new(holder.process()),
            since_unix_ms: unix_ms(holder.since),
            claimant: claimant(),
        });
    }
    Ok(Some(rank))
}
