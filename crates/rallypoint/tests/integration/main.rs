//! End-to-end tests over real loopback sockets: a coordinator, async and blocking
//! clients, and raw connections sending what a broken or hostile peer would.
//! Every test is bounded in time.

mod common;

mod agent_resume;
mod agents;
mod auth;
mod blocking;
mod collectives;
mod connect;
mod held_records;
mod kv;
mod malformed;
mod memory;
mod resume;
mod scale;
mod tcpstore;
