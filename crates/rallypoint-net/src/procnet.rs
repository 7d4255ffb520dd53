//! Who owns the other end of a TCP connection, when that end is on this machine:
//! the kernel knows every TCP socket of this network namespace and the user that
//! owns it. A coordinator with a token uses it to tell its own user's PyTorch
//! TCPStore clients (which cannot send a token) from another local user's.
//!
//! It asks the kernel for the one socket with the given address pair through its
//! socket diagnostics (netlink `SOCK_DIAG_BY_FAMILY`, as `ss` does), which costs the
//! same however many sockets there are. Where that is not available (a sandbox
//! without netlink), it searches the listings `/proc/net/tcp` and `/proc/net/tcp6`,
//! line by line, stopping at the socket: that costs a share of every socket's line
//! per lookup, so thousands of TCPStore clients connecting at once would take seconds.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

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
    match diag_owner(local, remote) {
        Ok(owner) => Ok(owner),
        // No socket diagnostics here: the listings say the same, more slowly.
        Err(_) => listed_owner(local, remote),
    }
}

/// [`socket_owner`] through the listings in /proc alone.
fn listed_owner(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u32>> {
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

/// How long the kernel's answer may take before the lookup counts as failed.
const DIAG_TIMEOUT: Duration = Duration::from_secs(2);
/// `SOCK_DIAG_BY_FAMILY`, the message type of a socket diagnostics request and reply.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// Bytes of a netlink message header, and of `inet_diag_req_v2` after it.
const NLMSG_HDR: usize = 16;
const DIAG_REQ: usize = 56;
/// Offsets in an `inet_diag_msg` (after the header): the socket's state, its owner.
const MSG_STATE: usize = 1;
const MSG_UID: usize = 64;

/// The owner through one exact lookup of the kernel's socket diagnostics.
fn diag_owner(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u32>> {
    // An IPv4 pair may belong to an IPv6 socket (connected to an IPv4-mapped address).
    let mapped = |addr: SocketAddr| match addr.ip() {
        IpAddr::V4(ip) => SocketAddr::new(IpAddr::V6(ip.to_ipv6_mapped()), addr.port()),
        IpAddr::V6(_) => addr,
    };
    if local.is_ipv4() && remote.is_ipv4() {
        if let Some(owner) = diag_lookup(libc::AF_INET as u8, local, remote)? {
            return Ok(Some(owner));
        }
    }
    diag_lookup(libc::AF_INET6 as u8, mapped(local), mapped(remote))
}

fn diag_lookup(family: u8, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u32>> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    socket2::SockRef::from(&fd).set_read_timeout(Some(DIAG_TIMEOUT))?;
    let request = diag_request(family, local, remote);
    // SAFETY: sockaddr_nl is plain data; zeroed is the kernel as the destination.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: the buffer and address are valid for the lengths given.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reply = [0u8; 8192];
    // SAFETY: `reply` is valid for writes of its length.
    let received = unsafe { libc::recv(fd.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
    if received < 0 {
        return Err(io::Error::last_os_error());
    }
    parse_diag_reply(&reply[..received as usize])
}

/// A netlink message asking for the TCP socket of `family` with exactly this
/// address pair (`inet_diag_req_v2`; addresses and ports in network byte order).
fn diag_request(family: u8, local: SocketAddr, remote: SocketAddr) -> Vec<u8> {
    let mut msg = Vec::with_capacity(NLMSG_HDR + DIAG_REQ);
    msg.extend_from_slice(&((NLMSG_HDR + DIAG_REQ) as u32).to_ne_bytes());
    msg.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    msg.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    msg.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    msg.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    msg.extend_from_slice(&local.port().to_be_bytes());
    msg.extend_from_slice(&remote.port().to_be_bytes());
    for addr in [local, remote] {
        let mut bytes = [0u8; 16];
        match addr.ip() {
            IpAddr::V4(ip) => bytes[..4].copy_from_slice(&ip.octets()),
            IpAddr::V6(ip) => bytes = ip.octets(),
        }
        msg.extend_from_slice(&bytes);
    }
    msg.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    msg.extend_from_slice(&u32::MAX.to_ne_bytes()); // INET_DIAG_NOCOOKIE
    msg.extend_from_slice(&u32::MAX.to_ne_bytes());
    msg
}

/// The owner in the kernel's answer: `None` if it has no such socket (ENOENT), or
/// only one that belongs to no process any more.
fn parse_diag_reply(mut reply: &[u8]) -> io::Result<Option<u32>> {
    let u32_at =
        |buf: &[u8], at: usize| buf.get(at..at + 4).map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed socket diagnostics reply");
    while reply.len() >= NLMSG_HDR {
        let len = u32_at(reply, 0).ok_or_else(malformed)? as usize;
        let kind = u16::from_ne_bytes([reply[4], reply[5]]);
        let message = reply.get(NLMSG_HDR..len).ok_or_else(malformed)?;
        match kind {
            SOCK_DIAG_BY_FAMILY => {
                let state = *message.get(MSG_STATE).ok_or_else(malformed)?;
                let uid = u32_at(message, MSG_UID).ok_or_else(malformed)?;
                return Ok((state != TIME_WAIT && state != NEW_SYN_RECV).then_some(uid));
            }
            kind if kind == libc::NLMSG_ERROR as u16 => {
                let error = u32_at(message, 0).ok_or_else(malformed)? as i32;
                match -error {
                    0 => {}
                    libc::ENOENT => return Ok(None),
                    errno => return Err(io::Error::from_raw_os_error(errno)),
                }
            }
            kind if kind == libc::NLMSG_DONE as u16 => return Ok(None),
            _ => {}
        }
        // Messages are aligned to 4 bytes.
        reply = reply.get(len.div_ceil(4) * 4..).unwrap_or_default();
    }
    Ok(None)
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
        owner_found("127.0.0.1:0");
        // IPv6 loopback, where the machine has it.
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            owner_found("[::1]:0");
        }
    }

    fn owner_found(listen: &str) {
        let listener = std::net::TcpListener::bind(listen).expect("bind");
        let client = std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (server, peer) = listener.accept().expect("accept");
        let here = server.local_addr().expect("address");
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        // Both ways of finding it, where this machine has them both.
        for (how, lookup) in [("diagnostics", diag_owner as fn(_, _) -> _), ("listing", listed_owner)] {
            match lookup(peer, here) {
                Err(error) if how == "diagnostics" => {
                    eprintln!("no socket diagnostics here ({error}); the listings stand in");
                    continue;
                }
                owner => assert_eq!(owner.expect("lookup"), Some(uid), "{how}: the client's socket"),
            }
            assert_eq!(lookup(here, peer).expect("lookup"), Some(uid), "{how}: the server's socket");
            let elsewhere = SocketAddr::new(here.ip(), 9);
            assert_eq!(lookup(elsewhere, here).expect("lookup"), None, "{how}: no such socket");
        }
        drop((client, server));
    }
}
