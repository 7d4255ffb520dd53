//! PyTorch c10d `TCPStore` wire protocol, as torch 2.x clients speak it
//! (facts: `docs/TCPSTORE.md`).
//!
//! There is no framing: each request is a 1-byte query type followed by its
//! arguments (little-endian native integers, strings and byte vectors as a u64
//! length then the bytes). A connection's [`CommandDecoder`] therefore parses the
//! stream incrementally: it returns `Ok(None)`, consuming nothing, until a whole
//! request is buffered, and resumes where it stopped when more bytes arrive. Every
//! length a peer sends is checked against [`TcpLimits`] as soon as it is read,
//! before anything is buffered or allocated for it; a violation, like an unknown
//! type, is fatal for that connection (torch closes it too).
//! Replies have no framing either; [`encode_answer`] writes each one.

mod command;
mod reply;

pub use command::{decode_command, encode_command, Command, CommandDecoder, TcpError, TcpLimits};
pub use reply::{encode_answer, Answer};

/// The u32 a client sends with VALIDATE, right after it connects.
pub const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;

/// Query types (the first byte of every request). Part of torch's protocol.
pub mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;

    /// torch's names of the query types, indexed by type.
    const NAMES: [&str; 19] = [
        "VALIDATE",
        "SET",
        "COMPARE_SET",
        "GET",
        "ADD",
        "CHECK",
        "WAIT",
        "GETNUMKEYS",
        "DELETE_KEY",
        "APPEND",
        "MULTI_GET",
        "MULTI_SET",
        "CANCEL_WAIT",
        "PING",
        "QUEUE_PUSH",
        "QUEUE_POP",
        "QUEUE_LEN",
        "LIST_KEYS",
        "BARRIER",
    ];

    /// torch's name of query type `kind`, for logs; `"UNKNOWN"` for a type torch does not have.
    pub fn name(kind: u8) -> &'static str {
        NAMES.get(usize::from(kind)).copied().unwrap_or("UNKNOWN")
    }
}
