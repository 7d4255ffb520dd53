//! Who may use a coordinator that has a token, beyond those who prove it.
//!
//! Native clients and node agents prove the token in their handshake
//! ([`rallypoint_net::conn::Gate`]). PyTorch TCPStore clients cannot: their protocol
//! has no room for it. With a token set, a TCPStore connection is therefore served
//! only
//!
//! - from this machine, when the kernel says its socket is owned by the user the
//!   coordinator runs as (socket diagnostics, else `/proc/net/tcp`:
//!   [`rallypoint_net::procnet`]): the workers a launcher started, not another
//!   user's process;
//! - from another machine, when its address is in a network given with
//!   `--tcpstore-allow CIDR` (none by default), or when a native client or node
//!   agent proved the token from that address: the nodes of a multi-node launch,
//!   whose launchers join before their torch workers start, need no network named.
//!
//! A socket of this machine owned by another user is refused whatever its address
//! (a local user cannot slip in through an allowed network's address of this
//! host), and so is a loopback peer whose socket cannot be found. A refused
//! connection is closed without a reply (the TCPStore protocol has no way to say
//! why); the coordinator's log says why, a few times per minute at most.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use rallypoint_net::warn_limit::{admit_shared, WarnLimit};
use rallypoint_net::IpNet;
use tokio::net::TcpStream;
use tracing::{debug, warn};

/// How TCPStore connections are admitted when the coordinator has a token.
#[derive(Debug, Clone)]
pub(crate) struct TcpStoreAccess {
    /// Networks of other machines whose TCPStore clients are served.
    pub(crate) allow: Vec<IpNet>,
    /// The user this coordinator runs as.
    pub(crate) uid: u32,
    /// Addresses of other machines a client proved the token from (shared by clones).
    pub(crate) proven: Arc<Mutex<HashSet<IpAddr>>>,
}

/// Most addresses [`TcpStoreAccess::proven`] holds: past it, one proven later is
/// served only from an allowed network.
const MOST_PROVEN: usize = 4096;

/// Who a TCPStore peer turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    SameUser,
    AllowedNetwork,
    /// Another machine a client proved the token from.
    ProvenHost,
    /// A socket of this machine owned by another user.
    OtherUser(u32),
    /// A loopback peer whose socket is not listed (closed meanwhile, or in another
    /// network namespace): its owner cannot be told.
    UnknownLocal,
    /// Another machine, outside every allowed network.
    NotAllowed,
}

static REFUSALS: Mutex<WarnLimit> = Mutex::new(WarnLimit::new());

impl TcpStoreAccess {
    /// Whether the TCPStore client at `peer`, on `stream`, is served; logs a refusal.
    pub(crate) async fn admits(&self, stream: &TcpStream, peer: SocketAddr) -> bool {
        let verdict = match stream.local_addr() {
            Ok(here) => {
                let access = self.clone();
                // Reading the kernel's listing is file I/O: off the runtime's threads.
                match tokio::task::spawn_blocking(move || access.judge(peer, here)).await {
                    Ok(Ok(verdict)) => verdict,
                    Ok(Err(error)) => {
                        warn!(%peer, %error, "cannot tell who owns a TCPStore client's socket (socket diagnostics, /proc/net/tcp); refusing it");
                        return false;
                    }
                    Err(error) => {
                        warn!(%peer, %error, "the TCPStore access check failed; refusing the client");
                        return false;
                    }
                }
            }
            Err(error) => {
                debug!(%peer, %error, "a TCPStore client's connection failed");
                return false;
            }
        };
        let why = match verdict {
            Verdict::SameUser | Verdict::AllowedNetwork | Verdict::ProvenHost => {
                debug!(%peer, ?verdict, "TCPStore client admitted");
                return true;
            }
            Verdict::OtherUser(uid) => {
                format!("its socket belongs to uid {uid}, and this coordinator (which has a token) serves TCPStore clients of this machine only to its own user, uid {}", self.uid)
            }
            Verdict::UnknownLocal => "it comes over loopback, but the kernel knows no such socket here, so its user cannot be told".to_owned(),
            Verdict::NotAllowed => format!(
                "this coordinator has a token, which TCPStore clients cannot send; clients from other machines are served only from one where a launcher or client proved the token, or from networks given with --tcpstore-allow (now: {})",
                self.allowed()
            ),
        };
        if let Some(held_back) = admit_shared(&REFUSALS) {
            warn!(%peer, held_back, "refused a PyTorch TCPStore client: {why}");
        }
        false
    }

    /// A native client or node agent proved the token from `ip`.
    pub(crate) fn proved(&self, ip: IpAddr) {
        let ip = ip.to_canonical();
        if ip.is_loopback() {
            return;
        }
        let mut proven = rallypoint_net::sync::lock(&self.proven);
        if proven.len() < MOST_PROVEN && proven.insert(ip) {
            debug!(%ip, "TCPStore clients from this host are served: it proved the token");
        }
    }

    fn allowed(&self) -> String {
        if self.allow.is_empty() {
            return "none".to_owned();
        }
        self.allow.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    }

    /// Looks the peer's socket up and judges it.
    fn judge(&self, peer: SocketAddr, here: SocketAddr) -> std::io::Result<Verdict> {
        let owner = rallypoint_net::procnet::socket_owner(peer, here)?;
        Ok(self.verdict(owner, peer.ip()))
    }

    /// The rule itself, given the owner of the peer's socket if it is on this machine.
    pub(crate) fn verdict(&self, owner: Option<u32>, ip: IpAddr) -> Verdict {
        let ip = ip.to_canonical();
        match owner {
            Some(uid) if uid == self.uid => Verdict::SameUser,
            Some(uid) => Verdict::OtherUser(uid),
            None if ip.is_loopback() => Verdict::UnknownLocal,
            None if self.allow.iter().any(|net| net.contains(&ip)) => Verdict::AllowedNetwork,
            None if rallypoint_net::sync::lock(&self.proven).contains(&ip) => Verdict::ProvenHost,
            None => Verdict::NotAllowed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(allow: &[&str]) -> TcpStoreAccess {
        let allow = allow.iter().map(|net| net.parse().expect("CIDR")).collect();
        TcpStoreAccess { allow, uid: 1000, proven: Arc::default() }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("address")
    }

    #[test]
    fn the_owner_decides_on_this_machine_and_the_allowed_networks_elsewhere() {
        let rule = access(&["10.1.0.0/16", "fd00::/8"]);
        assert_eq!(rule.verdict(Some(1000), ip("127.0.0.1")), Verdict::SameUser);
        assert_eq!(rule.verdict(Some(65534), ip("127.0.0.1")), Verdict::OtherUser(65534));
        // Another user's socket on this host, from an address of an allowed network.
        assert_eq!(rule.verdict(Some(65534), ip("10.1.2.3")), Verdict::OtherUser(65534));
        assert_eq!(rule.verdict(None, ip("127.0.0.1")), Verdict::UnknownLocal);
        assert_eq!(rule.verdict(None, ip("::1")), Verdict::UnknownLocal);
        assert_eq!(rule.verdict(None, ip("10.1.2.3")), Verdict::AllowedNetwork);
        assert_eq!(rule.verdict(None, ip("::ffff:10.1.2.3")), Verdict::AllowedNetwork, "IPv4-mapped");
        assert_eq!(rule.verdict(None, ip("fd00::7")), Verdict::AllowedNetwork);
        assert_eq!(rule.verdict(None, ip("10.2.0.1")), Verdict::NotAllowed);
        assert_eq!(access(&[]).verdict(None, ip("10.1.2.3")), Verdict::NotAllowed, "none by default");
    }

    #[test]
    fn a_host_that_proved_the_token_is_served() {
        let rule = access(&[]);
        rule.proved(ip("::ffff:10.3.0.7"));
        rule.proved(ip("127.0.0.1"));
        assert_eq!(rule.clone().verdict(None, ip("10.3.0.7")), Verdict::ProvenHost, "shared by clones, canonical");
        assert_eq!(rule.verdict(None, ip("10.3.0.8")), Verdict::NotAllowed);
        assert_eq!(rule.verdict(Some(65534), ip("10.3.0.7")), Verdict::OtherUser(65534), "this machine: its owner");
        assert_eq!(rule.verdict(None, ip("127.0.0.1")), Verdict::UnknownLocal, "loopback is never proven");
    }
}
