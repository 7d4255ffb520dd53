//! rallypoint's clients: [`Client`] (async, on tokio) and [`blocking::Client`], one
//! connection to the coordinator (or to this node's agent) each, shared by all
//! their clones; and [`env`](mod@env), the contract between a launcher and its workers: the
//! variables a launcher sets ([`env::worker_env`]) and how a client resolves them,
//! with explicit values, into connection settings ([`env::Settings`]).

pub mod blocking;
mod caller_runtime;
mod channel;
mod client;
mod connection;
pub mod env;
mod error;
mod incarnation;

pub use caller_runtime::CallerRuntime;
pub use channel::Interrupt;
pub use client::{
    job_incarnation, reset_job, BarrierConclusion, Client, ConnectOptions, InThread, DEFAULT_TIMEOUT, LEAVE_WAIT,
};
pub use error::Error;
pub use incarnation::{new_job_incarnation, process_incarnation};
// Every type a client's signatures and errors name, so that a user needs no other
// crate to name them (`Members::Role` takes a `Name`, `Client::snapshot` gives a
// `JobSnapshot`, a timeout's `missing` is a `Missing`).
pub use rallypoint_core::snapshot::JobSnapshot;
pub use rallypoint_core::{
    AbortInfo, AuthRefusal, CallShape, CollectiveKind, Exit, Gathered, GatheredIntoIter, GatheredIter, Identity,
    Incarnation, JobIncarnation, LossReason, MalformedGathered, Members, Missing, Name, OpError, OpRef, ProcessInfo,
    RankInfo, RankRanges, RankState, SessionId,
};
pub use rallypoint_net::auth::{Token, TokenError};
pub use rallypoint_net::auth::{TOKEN_FILE_VAR, TOKEN_VAR};
pub use rallypoint_net::check_addr;
pub use rallypoint_net::conn::{AuthFailure, Credentials};
pub use rallypoint_net::tls::{TlsClient, TlsError, TLS_CA_VAR};
