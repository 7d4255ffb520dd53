//! Random interleavings of arrivals, clean leaves, kills (with or without a
//! launcher's report of the process's end, before or after its connection drops),
//! reconnects and clock advances against one reusable world barrier. Checked after
//! every step:
//! - a release is never early: every rank has called that generation;
//! - a release is never late: once every rank called a generation that has not
//!   failed, all its callers are released;
//! - a kill fails every pending call at once, naming exactly the killed rank;
//! - a timeout names exactly the ranks that had not called the generation;
//! - every caller of a generation gets the same outcome.
//!
//! Between them, a rank may call many barriers of its own, each named afresh: the
//! world barrier, idle then, is settled as a collective out of use is, and the
//! properties must hold across that.

mod common;

use std::collections::HashMap;

use common::{barrier, barrier_of, Harness};
use proptest::prelude::*;
use rallypoint_core::{Exit, Members, OpError, Reply, Response, SessionId};

#[derive(Debug, Clone)]
enum Step {
    Arrive {
        rank: u32,
        timeout_ms: Option<u64>,
    },
    Kill(u32),
    /// The rank's launcher reports its process's end (`Request::RankExited`), before
    /// or after its connection drops; a rank that had left is lost by the report alone.
    Exited {
        rank: u32,
        dropped_first: bool,
    },
    Leave(u32),
    Connect(u32),
    Advance(u64),
    /// The rank calls [`ELSEWHERE`] barriers of its own, each with a new name.
    Elsewhere(u32),
}

/// More collectives than the engine's window of those in use: the world barrier is
/// settled while they are called.
const ELSEWHERE: usize = 70;

fn step(world: u32) -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..world, prop_oneof![Just(None), Just(Some(50u64)), Just(Some(200u64))])
            .prop_map(|(rank, timeout_ms)| Step::Arrive { rank, timeout_ms }),
        1 => (0..world).prop_map(Step::Kill),
        1 => (0..world, any::<bool>()).prop_map(|(rank, dropped_first)| Step::Exited { rank, dropped_first }),
        1 => (0..world).prop_map(Step::Leave),
        2 => (0..world).prop_map(Step::Connect),
        2 => prop_oneof![Just(10u64), Just(100), Just(300)].prop_map(Step::Advance),
        1 => (0..world).prop_map(Step::Elsewhere),
    ]
}

struct Model {
    world: u32,
    session: Vec<Option<SessionId>>,
    /// Killed and not reconnected.
    lost: Vec<bool>,
    /// Barrier calls made by each rank so far.
    calls: Vec<u64>,
    /// Outstanding requests: (session, id) -> (rank, generation).
    waiting: HashMap<(SessionId, u64), (u32, u64)>,
    /// First outcome seen per generation.
    outcome: HashMap<u64, Reply>,
    /// Generations pending when a rank was killed: they failed even if nobody was
    /// left waiting to see it, and later callers must be told that rank.
    doomed_by: HashMap<u64, u32>,
}

impl Model {
    /// `rank`, whose session was `s`, is lost: what it waited in goes unread, and
    /// every generation it had not called fails naming it.
    fn lose(&mut self, rank: u32, s: SessionId) {
        self.lost[rank as usize] = true;
        self.waiting.retain(|&(sess, _), _| sess != s);
        let newest = self.calls.iter().copied().max().unwrap_or(0);
        for generation in 1..=newest {
            if !self.all_called(generation) && !self.outcome.contains_key(&generation) {
                self.doomed_by.entry(generation).or_insert(rank);
            }
        }
    }

    fn all_called(&self, generation: u64) -> bool {
        self.calls.iter().all(|&c| c >= generation)
    }

    /// Checks the replies the engine produced, against what the model knows now.
    fn check(&mut self, h: &mut Harness, killed: Option<u32>) -> Result<(), TestCaseError> {
        let keys: Vec<_> = h.replies.keys().copied().collect();
        for key in keys {
            let Some(reply) = h.replies.remove(&key) else { continue };
            let (rank, generation) = self
                .waiting
                .remove(&key)
                .ok_or_else(|| TestCaseError::fail(format!("reply to an unknown request {key:?}")))?;
            // A lost rank's own call is told of its loss as its own: the same outcome.
            let reply = match reply {
                Err(OpError::ThisRankLost { op, this }) => {
                    prop_assert_eq!(this.rank, rank, "rank {} told another rank's loss as its own", rank);
                    Err(OpError::PeerLost { op, peer: this })
                }
                // A call that came after the timeout is told how late: the same timeout.
                Err(OpError::CollectiveTimeout { op, waited_ms, members, missing, .. }) => {
                    Err(OpError::CollectiveTimeout { op, waited_ms, members, missing, before_call_ms: None })
                }
                reply => reply,
            };
            match &reply {
                Ok(Response::Done) => {
                    prop_assert!(
                        self.all_called(generation),
                        "generation {generation} released early; calls {:?}",
                        self.calls
                    );
                    prop_assert!(
                        !self.doomed_by.contains_key(&generation),
                        "generation {generation} released after a kill"
                    );
                }
                Ok(other) => prop_assert!(false, "unexpected success {other:?}"),
                Err(OpError::PeerLost { peer, op }) => {
                    prop_assert_eq!(op.generation, generation);
                    match self.doomed_by.get(&generation) {
                        Some(&dead) => prop_assert_eq!(peer.rank, dead),
                        None if !self.outcome.contains_key(&generation) => {
                            prop_assert!(self.lost[peer.rank as usize], "rank {} named lost but is not", peer.rank)
                        }
                        None => {}
                    }
                }
                Err(OpError::CollectiveTimeout { missing, op, .. }) => {
                    prop_assert_eq!(op.generation, generation);
                    prop_assert!(
                        !self.doomed_by.contains_key(&generation),
                        "generation {generation} timed out after a kill"
                    );
                    if !self.outcome.contains_key(&generation) {
                        let expected: Vec<u32> =
                            (0..self.world).filter(|&r| self.calls[r as usize] < generation).collect();
                        let named: Vec<u32> = missing.iter().map(|m| m.rank).collect();
                        prop_assert_eq!(named, expected);
                    }
                }
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
            match self.outcome.get(&generation) {
                Some(first) => prop_assert_eq!(first, &reply, "callers of generation {} disagree", generation),
                None => {
                    self.outcome.insert(generation, reply);
                }
            }
        }
        // Never late: a generation everyone called, and that did not fail, has released all.
        for (&(_, _), &(rank, generation)) in &self.waiting {
            prop_assert!(
                !self.all_called(generation) || self.outcome.get(&generation).is_some_and(|o| o.is_err()),
                "rank {rank} still waits in generation {generation} that everyone called"
            );
            if let Some(dead) = killed {
                prop_assert!(false, "rank {rank} still waits in generation {generation} after rank {dead} was killed");
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn barrier_outcomes_match_the_model(world in 2u32..=5, steps in prop::collection::vec(step(5), 1..80)) {
        let mut h = Harness::new();
        let mut m = Model {
            world,
            session: (0..world).map(|_| None).collect(),
            lost: vec![false; world as usize],
            calls: vec![0; world as usize],
            waiting: HashMap::new(),
            outcome: HashMap::new(),
            doomed_by: HashMap::new(),
        };
        for r in 0..world {
            m.session[r as usize] = Some(h.rank("j", r, world));
        }
        let mut names = 0;
        for step in steps {
            let mut killed = None;
            match step {
                Step::Arrive { rank, timeout_ms } if rank < world => {
                    let Some(s) = m.session[rank as usize] else { continue };
                    // A process waits in one barrier at a time.
                    if m.waiting.values().any(|&(r, _)| r == rank) { continue }
                    m.calls[rank as usize] += 1;
                    let generation = m.calls[rank as usize];
                    let id = h.send(s, barrier("b", timeout_ms));
                    m.waiting.insert((s, id), (rank, generation));
                }
                Step::Kill(rank) if rank < world => {
                    let Some(s) = m.session[rank as usize].take() else { continue };
                    m.lose(rank, s);
                    h.kill(s);
                    killed = Some(rank);
                }
                Step::Exited { rank, dropped_first } if rank < world => {
                    let session = m.session[rank as usize].take();
                    if let Some(s) = session.filter(|_| dropped_first) {
                        h.kill(s);
                    }
                    let reported = !m.lost[rank as usize];
                    if let Some(s) = session {
                        m.lose(rank, s);
                    } else if reported {
                        // Left cleanly: only the report makes it lost.
                        m.lose(rank, SessionId(u64::MAX));
                    }
                    prop_assert_eq!(h.report_exit("j", rank, "node", 9, Exit::Signal(9)), Ok(Response::Done));
                    if let Some(s) = session.filter(|_| !dropped_first) {
                        h.kill(s);
                    }
                    // The dead rank's own call failed too, with nobody to read it.
                    if let Some(s) = session {
                        h.replies.retain(|&(sess, _), _| sess != s);
                    }
                    killed = Some(rank);
                }
                Step::Leave(rank) if rank < world => {
                    let Some(s) = m.session[rank as usize] else { continue };
                    if m.waiting.keys().any(|&(sess, _)| sess == s) { continue }
                    m.session[rank as usize] = None;
                    h.leave(s);
                }
                Step::Connect(rank) if rank < world => {
                    if m.session[rank as usize].is_some() { continue }
                    m.session[rank as usize] = Some(h.rank("j", rank, world));
                    m.lost[rank as usize] = false;
                }
                Step::Advance(ms) => h.advance(ms),
                Step::Elsewhere(rank) if rank < world => {
                    let Some(s) = m.session[rank as usize] else { continue };
                    if m.waiting.values().any(|&(r, _)| r == rank) { continue }
                    for _ in 0..ELSEWHERE {
                        names += 1;
                        let alone = barrier_of(&format!("elsewhere/{names}"), Members::Ranks(vec![rank]), None);
                        prop_assert_eq!(h.call(s, alone), Ok(Response::Done));
                    }
                }
                _ => continue,
            }
            m.check(&mut h, killed)?;
        }
        // Every call with a timeout is answered once time runs out.
        h.advance(1_000);
        m.check(&mut h, None)?;
    }
}
