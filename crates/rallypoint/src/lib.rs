//! rallypoint: the coordinator server and its clients.
//!
//! The coordination logic lives in [`rallypoint_core::Engine`], a state machine
//! without I/O. This crate moves bytes between sockets and that engine:
//! [`server`] runs it behind a TCP listener, [`Client`] (async) and
//! [`blocking::Client`] talk to it, and [`env`](mod@env) resolves the usual launcher
//! variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) into connection settings.

pub mod agent;
pub mod blocking;
pub mod client;
pub mod env;
mod fdlimit;
pub mod launch;
pub mod net;
pub mod server;
mod shm;

pub use client::{Client, ConnectOptions, Error};
pub use fdlimit::raise_fd_limit;
pub use rallypoint_core::{
    AbortInfo, CallShape, CollectiveKind, Config, Identity, Limits, LossReason, Members, OpError, OpRef, RankInfo,
    RankState,
};
pub use server::{Server, ServerConfig, ServerHandle};
