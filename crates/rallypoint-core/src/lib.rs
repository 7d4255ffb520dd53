//! The sans-I/O heart of rallypoint: a deterministic state machine holding every
//! job's key-value store, barriers, collectives and rank liveness.
//!
//! Inputs are sessions opening ([`Engine::open`]), their requests
//! ([`Engine::handle`], or a node agent's run of calls, [`Engine::handle_calls_from`]),
//! sessions closing ([`Engine::close`]) and clock ticks ([`Engine::tick`]); outputs
//! are replies addressed to sessions ([`Engine::drain_outgoing`]) and the releases of
//! a node agent's calls held together ([`Engine::take_records`]). No sockets, threads
//! or clocks live here: the caller passes the time in, so every behaviour is
//! reproducible in a test.

mod config;
pub mod counters;
mod engine;
mod error;
mod gathered;
mod identity;
mod ranges;
mod rendezvous;
mod request;
mod session_table;
pub mod snapshot;

pub use config::{Config, Limits, ReplyCache};
pub use engine::{Departure, Engine, JobMetrics, Link, Record};
pub use error::{
    signal_name, AbortInfo, AuthRefusal, CallShape, CollectiveKind, Exit, JobIncarnation, LossReason, Missing, OpError,
    OpRef, ProcessInfo, RankInfo, RankRanges, RankState,
};
pub use gathered::{Gathered, GatheredIntoIter, GatheredIter, MalformedGathered};
pub use identity::{Identity, Incarnation, SessionId};
pub use request::{Members, Millis, Name, Outgoing, Reply, Request, Response, Welcome, MAX_JOBS_LISTED};
pub use session_table::{SessionTable, SlotTable, Slotted};
