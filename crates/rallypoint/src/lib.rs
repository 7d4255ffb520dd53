//! rallypoint: coordination for distributed training and HPC jobs. The processes of
//! a job connect to one small coordinator to find each other, wait at barriers, swap
//! small payloads, and learn at once, by name, when a peer is missing or dead.
//!
//! This crate re-exports the crates that make rallypoint, so that one dependency
//! gives all of it; depend on a part alone (`rallypoint-client` for a worker) to
//! compile only that part. The parts, each depending only on those above it:
//!
//! ```text
//! rallypoint-core     the engine: a sans-I/O state machine (store, barriers, collectives, liveness)
//! rallypoint-proto    the wire codecs: native frames, node-agent frames, PyTorch TCPStore
//! rallypoint-net      the connection layer: streams, handshake, frame loop, shared memory, locks, backoff
//! rallypoint-client   Client (async), blocking::Client, env (the launcher/worker contract)   -> [`client`]
//! rallypoint-server   the coordinator: listeners, connections, the engine's driver            -> [`server`]
//! rallypoint-http     the live page, its JSON API and Prometheus metrics (`serve --http`)
//! rallypoint-agent    the node agent: one connection per node for that node's ranks           -> [`agent`]
//! rallypoint-stacks   where a process is: its stacks read from outside (py-spy), grouped
//! rallypoint-launch   `rallypoint launch`: workers, fail-fast, the summary                    -> [`launch`]
//! ```
//!
//! The `rallypoint` command (crate `rallypoint-cli`) is a thin binary over these;
//! the benchmarks (`rallypoint-bench`) are a binary of their own; the page and the
//! stacks are the command's, not re-exported here.

/// The byte strings values come as ([`Gathered::value`], [`Client::get`]).
pub use bytes::{self, Bytes};
pub use rallypoint_client::{blocking, env, Client, ConnectOptions, Error, Gathered, DEFAULT_TIMEOUT};
pub use rallypoint_core::snapshot::JobSnapshot;
pub use rallypoint_core::{
    AbortInfo, CallShape, CollectiveKind, Config, Exit, Identity, JobIncarnation, Limits, LossReason, Members, Missing,
    Name, OpError, OpRef, ProcessInfo, RankInfo, RankRanges, RankState, SessionId,
};
pub use rallypoint_net::raise_fd_limit;
pub use rallypoint_server::{Server, ServerConfig, ServerHandle};

/// The async client and its options ([`rallypoint_client`]).
pub mod client {
    pub use rallypoint_client::{
        AuthFailure, AuthRefusal, Client, ConnectOptions, Credentials, Error, Gathered, GatheredIntoIter, GatheredIter,
        MalformedGathered, TlsClient, Token, DEFAULT_TIMEOUT,
    };
}

/// The coordinator ([`rallypoint_server`]).
pub mod server {
    pub use rallypoint_server::*;
}

/// The node agent ([`rallypoint_agent`]).
pub mod agent {
    pub use rallypoint_agent::*;
}

/// The launcher ([`rallypoint_launch`]).
pub mod launch {
    pub use rallypoint_launch::*;
}

/// Addresses of streams: `host:port`, or `unix:PATH` for a node agent's Unix socket.
pub mod net {
    pub use rallypoint_net::{unix_path, UNIX_PREFIX};
}
