//! Who owns the other end of a TCP connection, when that end is on this machine:
//! the kernel lists every TCP socket of this network namespace, with the user that
//! owns it, in `/proc/net/tcp` and `/proc/net/tcp6`. A coordinator with a token
//! uses it to tell its own user's PyTorch TCPStore clients (which cannot send a
//! token) from another local user's.
//!
//! The listing is read line by line and the search stops at the socket, so a
//! lookup costs a share of the listing, not all of it.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// Socket states that belong to no process any more: a TIME_WAIT socket is listed
/// with uid 0, and a NEW_SYN_RECV one is not yet accepted.
const TIME_WAIT: u8 = 0x06;
const NEW_SYN_RECV: u8 = 0x0c;

/// The uid owning the TCP socket of this machine whose local address is `local` and
/// whose remote address is `remote`, or `None` if no such socket is listed (it is
/// on another machine, in another network namespace, or already closed).
///
/// For the peer of a connection this side accepted, pass the peer's address as
/// `local` and this side's local address as `remote`.
pub fn socket_owner(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u32>> {
    let (local, remote) = (canonical(local), canonical(remote));
    // An IPv4 socket is listed in tcp; an IPv6 socket (an IPv4-mapped one too) in tcp6.
    if local.is_ipv4() {
        if let Some(uid) = search(Path::new("/proc/net/tcp"), local, remote)? {
            return Ok(Some(uid));
        }
    }
    search(Path::new("/proc/net/tcp6"), local, remote)
}

fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn search(path: &Path, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u32>> {
    let file = match File::open(path) {
        Ok(file) => file,
        // No IPv6 in this kernel: no socket listed there.
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error),
    };
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut line = String::new();
    // The header.
    reader.read_line(&mut line)?;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        if let Some(entry) = parse_line(&line) {
            if entry.local == local && entry.remote == remote && entry.state != TIME_WAIT && entry.state != NEW_SYN_RECV
            {
                return Ok(Some(entry.uid));
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Entry {
    local: SocketAddr,
    remote: SocketAddr,
    state: u8,
    uid: u32,
}

/// One line of the listing: `sl local_address rem_address st tx:rx tr:when retrnsmt uid ...`.
fn parse_line(line: &str) -> Option<Entry> {
    let mut fields = line.split_ascii_whitespace();
    let _slot = fields.next()?;
    let local = parse_addr(fields.next()?)?;
    let remote = parse_addr(fields.next()?)?;
    let state = u8::from_str_radix(fields.next()?, 16).ok()?;
    let uid = fields.nth(3)?.parse().ok()?;
    Some(Entry { local, remote, state, uid })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6). The kernel prints
/// each 32-bit word of the address as it lies in memory, so the words' bytes come
/// back in this machine's byte order; the port is printed as a number.
fn parse_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(8 * i..8 * i + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip.to_canonical(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_lines_parse() {
        if cfg!(target_endian = "big") {
            return; // the sample lines below are a little-endian machine's
        }
        let v4 = "   3: 0100007F:A3E2 0100007F:7148 01 00000000:00000000 00:00000000 00000000 65534        0 1234 1 0 20 4 30 10 -1";
        assert_eq!(
            parse_line(v4),
            Some(Entry {
                local: "127.0.0.1:41954".parse().expect("address"),
                remote: "127.0.0.1:29000".parse().expect("address"),
                state: 1,
                uid: 65534,
            })
        );
        let v6 = "   0: 00000000000000000000000001000000:A3E2 0000000000000000FFFF00000100007F:7148 01 00000000:00000000 00:00000000 00000000  1000        0 99 1 0 20 4 30 10 -1";
        let entry = parse_line(v6).expect("parses");
        assert_eq!(entry.local, "[::1]:41954".parse().expect("address"));
        assert_eq!(entry.remote, "127.0.0.1:29000".parse().expect("address"), "IPv4-mapped, as IPv4");
        assert_eq!(entry.uid, 1000);
        assert_eq!(parse_line("  sl  local_address rem_address   st tx_queue rx_queue"), None);
    }

    #[test]
    fn the_owner_of_a_loopback_connection_is_found_both_ways() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (server, peer) = listener.accept().expect("accept");
        let here = server.local_addr().expect("address");
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(socket_owner(peer, here).expect("listing"), Some(uid), "the client's socket");
        assert_eq!(socket_owner(here, peer).expect("listing"), Some(uid), "the server's socket");
        let elsewhere: SocketAddr = "127.0.0.1:9".parse().expect("address");
        assert_eq!(socket_owner(elsewhere, here).expect("listing"), None);
        drop((client, server));
    }
}
