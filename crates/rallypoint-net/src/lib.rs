//! The connection layer of rallypoint, shared by the coordinator
//! (`rallypoint-server`), the node agent (`rallypoint-agent`) and the client
//! (`rallypoint-client`):
//!
//! - [`stream`]: byte streams over TCP, TLS or a Unix domain socket, and listeners;
//! - [`auth`] and [`tls`]: the token a handshake proves, both ways, and TLS;
//! - [`budget`]: the bytes of unfinished requests all connections may hold together;
//! - [`conn`]: what every connection goes through: reading into its buffer, the
//!   handshake, the frame loop, and how it ends ([`conn::End`]);
//! - [`meter`]: the bytes and connections a server's connections moved, by protocol and job;
//! - [`procnet`]: which user owns the other end of a TCP connection on this machine;
//! - [`shm`]: large replies through shared memory, passed over Unix sockets;
//! - [`shm_barrier`]: barriers of a node's ranks through shared memory with their agent;
//! - [`sync`]: the poison-tolerant lock and the reconnect backoff everyone uses;
//! - [`warn_limit`]: warnings a peer can cause, limited so that it cannot flood the log;
//! - [`hostname`], [`raise_fd_limit`] and [`process`]: facts about this process's machine.

pub mod auth;
pub mod budget;
pub mod conn;
mod fdlimit;
pub mod meter;
pub mod process;
pub mod procnet;
pub mod shm;
pub mod shm_barrier;
pub mod stream;
pub mod sync;
#[cfg(feature = "test-pki")]
pub mod test_pki;
pub mod tls;
pub mod unix_conn;
pub mod warn_limit;

pub use fdlimit::raise_fd_limit;
pub use ipnet::IpNet;
pub use stream::{check_addr, set_keepalive, unix_path, Listener, ReadHalf, Sender, Stream, WriteHalf, UNIX_PREFIX};

/// This machine's hostname, or "unknown" if it cannot be read.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".to_owned();
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match String::from_utf8_lossy(&buf[..len]) {
        name if name.is_empty() => "unknown".to_owned(),
        name => name.into_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn hostname_is_known() {
        let name = super::hostname();
        assert!(!name.is_empty());
        assert!(!name.contains('\0'));
    }
}
