//! `launch --node-agent`: the launcher hosts its node's agent ([`rallypoint_agent`])
//! on its own runtime, so the coordinator holds one connection per node instead of
//! one per worker. The workers' `RALLYPOINT_ADDR` names the agent's Unix socket, in
//! a directory only this user can enter, removed when the launcher ends. The agent
//! carries only the workers' connections; the launcher itself talks to the
//! coordinator directly ([`crate::rendezvous`]).

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tracing::{debug, info, warn};

use rallypoint_agent::{Agent, AgentConfig, AgentError, AgentHandle};
use rallypoint_server::Token;

use crate::LaunchError;

/// `sun_path` holds 108 bytes on Linux, the terminating NUL included.
const MAX_SOCKET_PATH: usize = 107;
/// Attempts at a fresh directory name before giving up (another process racing for
/// the same name, or a leftover of a launcher with the same pid).
const DIR_ATTEMPTS: u32 = 16;
/// A launcher's private directories (the node agent's socket, the token file, the
/// workers' error files) are named `{DIR_PREFIX}{pid}-{suffix}`.
const DIR_PREFIX: &str = "rallypoint-launcher-";

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
    pub async fn start(
        coordinator: &str,
        host: &str,
        connect_timeout: Duration,
        token: Option<std::sync::Arc<Token>>,
    ) -> Result<NodeAgent, LaunchError> {
        let dir = SocketDir::create()?;
        let socket = dir.path.join("agent.sock");
        let listen = if socket.as_os_str().len() <= MAX_SOCKET_PATH {
            format!("{}{}", rallypoint_net::UNIX_PREFIX, socket.display())
        } else {
            // A long TMPDIR: loopback TCP costs the kernel more per message but works.
            warn!(path = %socket.display(), "socket path too long for a Unix socket; the node agent listens on loopback TCP");
            "127.0.0.1:0".to_owned()
        };
        let mut config = AgentConfig::new(coordinator, listen);
        config.connect_timeout = connect_timeout;
        config.host = host.to_owned();
        config.token = token;
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
/// or replace the socket in it, nor read the job's token file), removed with
/// everything in it when dropped.
pub(crate) struct SocketDir {
    path: PathBuf,
    /// The directory, locked (`flock`) while this launcher lives: what tells another
    /// launcher's sweep it is in use where the pid in its name cannot (a launcher in
    /// another pid namespace sharing the temporary directory). The kernel releases it
    /// however this process ends.
    _lock: Option<std::fs::File>,
}

impl SocketDir {
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn create() -> Result<SocketDir, LaunchError> {
        let parent = std::env::temp_dir();
        sweep_stale(&parent);
        let pid = std::process::id();
        let mut last = None;
        for attempt in 0..DIR_ATTEMPTS {
            let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
            let path = parent.join(format!("{DIR_PREFIX}{pid}-{nanos:x}{attempt}"));
            // `create`, not `create_all`: a name someone else made first is not ours.
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let lock = lock(&path).inspect_err(
                        |error| warn!(path = %path.display(), %error, "cannot lock the launcher's private directory"),
                    );
                    return Ok(SocketDir { path, _lock: lock.ok() });
                }
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

/// Removes the socket directories of launchers killed without a chance to clean up
/// (SIGKILL, a crash): this user's, whose launcher process is gone and whose socket
/// no agent answers. Both are checked because a launcher in another PID namespace
/// sharing this temporary directory looks gone by its pid alone.
fn sweep_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) =
            name.to_str().and_then(|name| name.strip_prefix(DIR_PREFIX)).and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else { continue };
        let path = entry.path();
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|meta| meta.is_dir() && meta.uid() == uid);
        if !ours || process_exists(pid) || agent_answers(&path.join("agent.sock")) {
            continue;
        }
        // Locked: its launcher lives, where its pid is not this namespace's.
        let Ok(_held) = lock(&path) else { continue };
        match std::fs::remove_dir_all(&path) {
            Ok(()) => info!(path = %path.display(), pid, "removed the socket directory of a launcher that is gone"),
            Err(error) => debug!(path = %path.display(), %error, "cannot remove a stale socket directory"),
        }
    }
}

/// Locks directory `path` for this process (`flock`, exclusive, not waiting): fails
/// while another process holds it.
fn lock(path: &Path) -> io::Result<std::fs::File> {
    let dir = std::fs::File::open(path)?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(dir)
}

fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH))
}

/// Something listens on the socket (a refused or missing socket: nothing does).
fn agent_answers(socket: &Path) -> bool {
    match UnixStream::connect(socket) {
        Ok(_) => true,
        Err(error) => !matches!(error.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    fn dead_pid() -> i32 {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as i32;
        child.wait().expect("wait");
        pid
    }

    #[test]
    fn only_directories_of_gone_launchers_with_silent_sockets_are_swept() {
        let parent = std::env::temp_dir().join(format!("rallypoint-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&parent).expect("test directory");
        let dead = dead_pid();
        let make = |name: String| {
            let dir = parent.join(name);
            std::fs::create_dir(&dir).expect("socket directory");
            dir
        };
        // Killed launcher: pid gone, socket file left, nobody listening. Bound without
        // listening: a listener closed here would still answer while a child that
        // another test spawns meanwhile holds a copy of it, until that child execs.
        let stale = make(format!("{DIR_PREFIX}{dead}-a0"));
        let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None).expect("socket");
        socket.bind(&socket2::SockAddr::unix(stale.join("agent.sock")).expect("address")).expect("bind");
        drop(socket);
        // Pid gone (as seen from here) but its agent still answers: kept.
        let answering = make(format!("{DIR_PREFIX}{dead}-b0"));
        let _listener = UnixListener::bind(answering.join("agent.sock")).expect("bind");
        // A live launcher (this process): kept.
        let live = make(format!("{DIR_PREFIX}{}-c0", std::process::id()));
        // Not ours to judge.
        let other = make(format!("unrelated-{dead}-d0"));
        // Pid gone as seen from here, no socket, but locked: a launcher in another pid
        // namespace (a token file's or error files' directory), kept.
        let locked = make(format!("{DIR_PREFIX}{dead}-e0"));
        let _held = lock(&locked).expect("locked");

        sweep_stale(&parent);
        assert!(!stale.exists(), "the stale directory stayed");
        assert!(answering.exists() && live.exists() && other.exists());
        assert!(locked.exists(), "a locked directory was swept");
        std::fs::remove_dir_all(&parent).expect("cleanup");
    }
}
