//! `launch --node-agent`: the launcher hosts its node's node agent ([`crate::agent`])
//! on its own runtime, so the coordinator holds one connection per node instead of
//! one per worker. The workers' `RALLYPOINT_ADDR` names the agent's Unix socket, in
//! a directory only this user can enter, removed when the launcher ends.
//!
//! Not to be confused with the launchers' own coordination ([`super::agents`]): that
//! is the launcher process talking to the coordinator directly; the node agent only
//! carries the workers' native-protocol connections.

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tracing::{debug, info, warn};

use crate::agent::{Agent, AgentConfig, AgentError, AgentHandle};

use super::LaunchError;

/// `sun_path` holds 108 bytes on Linux, the terminating NUL included.
const MAX_SOCKET_PATH: usize = 107;
/// Attempts at a fresh directory name before giving up (another process racing for
/// the same name, or a leftover of a launcher with the same pid).
const DIR_ATTEMPTS: u32 = 16;

/// This node's node agent, running until [`NodeAgent::stop`].
pub struct NodeAgent {
    handle: AgentHandle,
    /// Declared after `handle`: on an early drop the agent is told to stop before
    /// its directory goes.
    _dir: SocketDir,
}

impl NodeAgent {
    /// Creates the socket directory, binds the agent there and connects it to the
    /// coordinator at `coordinator` (retrying for `connect_timeout`, as the
    /// launcher itself does).
    pub async fn start(coordinator: &str, host: &str, connect_timeout: Duration) -> Result<NodeAgent, LaunchError> {
        let dir = SocketDir::create()?;
        let socket = dir.path.join("agent.sock");
        let listen = if socket.as_os_str().len() <= MAX_SOCKET_PATH {
            format!("{}{}", crate::net::UNIX_PREFIX, socket.display())
        } else {
            // A long TMPDIR: loopback TCP costs the kernel more per message but works.
            warn!(path = %socket.display(), "socket path too long for a Unix socket; the node agent listens on loopback TCP");
            "127.0.0.1:0".to_owned()
        };
        let mut config = AgentConfig::new(coordinator, listen);
        config.connect_timeout = connect_timeout;
        config.host = host.to_owned();
        let agent = Agent::bind(config).await?;
        info!(addr = agent.local_addr(), coordinator, "node agent for this node's workers started");
        Ok(NodeAgent { handle: agent.spawn(), _dir: dir })
    }

    /// Where this node's workers connect (their `RALLYPOINT_ADDR`).
    pub fn addr(&self) -> &str {
        self.handle.local_addr()
    }

    /// Stops the agent and removes its directory. By now the workers have exited,
    /// so no rank is left behind it; an agent that had already lost the coordinator
    /// is only logged (its workers were told, and failed, when it happened).
    pub async fn stop(self) {
        let NodeAgent { handle, _dir } = self;
        match handle.shutdown().await {
            Ok(()) => debug!("node agent stopped"),
            Err(error) => warn!(%error, "the node agent had stopped before the launcher"),
        }
    }
}

impl From<AgentError> for LaunchError {
    fn from(error: AgentError) -> Self {
        LaunchError::NodeAgent(Box::new(error))
    }
}

/// A directory of this launcher's own (mode 0700, so no other user can connect to
/// or replace the socket in it), removed with everything in it when dropped.
struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    fn create() -> Result<SocketDir, LaunchError> {
        let parent = std::env::temp_dir();
        let pid = std::process::id();
        let mut last = None;
        for attempt in 0..DIR_ATTEMPTS {
            let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
            let path = parent.join(format!("rallypoint-node-agent-{pid}-{nanos:x}{attempt}"));
            // `create`, not `create_all`: a name someone else made first is not ours.
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(SocketDir { path }),
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => last = Some(error),
                Err(source) => return Err(LaunchError::SocketDir { dir: parent, source }),
            }
        }
        let source = last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists));
        Err(LaunchError::SocketDir { dir: parent, source })
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        match std::fs::remove_dir_all(&self.path) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => warn!(path = %self.path.display(), %error, "cannot remove the node agent's socket directory"),
        }
    }
}
