//! One worker process: spawned in its own process group, tied to the launcher's
//! life, its output pumped, its exit reported.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;
use tokio::sync::mpsc;

use super::outcome::Exit;
use super::output::{pump, tail_lines, Stream, Tail};

/// How long to keep reading a dead worker's pipes: a grandchild that inherited them
/// may keep them open, and the summary must not wait for it.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

pub struct Spec {
    pub rank: u32,
    pub local_rank: u32,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(&'static str, OsString)>,
    pub console: bool,
    pub log_dir: Option<PathBuf>,
}

/// A running worker, as the supervisor sees it.
pub struct Running {
    pub local_rank: u32,
    pub pid: u32,
}

/// Sent when a worker has exited and its output is drained.
pub struct Exited {
    pub local_rank: u32,
    pub exit: Exit,
    pub stderr_tail: Vec<String>,
}

/// Starts the worker and a task that reports its exit on `done`.
pub fn spawn(spec: Spec, done: mpsc::UnboundedSender<Exited>) -> io::Result<Running> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group: the launcher signals the worker and everything it started at once,
        // and a Ctrl-C on the terminal reaches only the launcher, which forwards it once.
        .process_group(0);
    let launcher = std::process::id();
    // SAFETY: only async-signal-safe calls (prctl, getppid, raise) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // A worker must not outlive its launcher, even one killed with SIGKILL.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died before prctl took effect.
            if libc::getppid() as u32 != launcher {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        io::Error::new(e.kind(), format!("cannot start {:?} for rank {}: {e}", spec.program, spec.rank))
    })?;
    let pid = child.id().unwrap_or(0);
    let tail: Tail = Tail::default();
    let stdout = child.stdout.take().map(|out| {
        let dir = spec.log_dir.clone();
        tokio::spawn(async move { pump(out, spec.rank, Stream::Stdout, spec.console, dir.as_deref(), None).await })
    });
    let stderr = child.stderr.take().map(|err| {
        let dir = spec.log_dir.clone();
        let tail = tail.clone();
        tokio::spawn(
            async move { pump(err, spec.rank, Stream::Stderr, spec.console, dir.as_deref(), Some(tail)).await },
        )
    });
    let local_rank = spec.local_rank;
    tokio::spawn(async move {
        let exit = match child.wait().await {
            Ok(status) => match (status.code(), status.signal()) {
                (Some(code), _) => Exit::Code(code),
                (None, Some(sig)) => Exit::Signal(sig),
                (None, None) => Exit::Code(1),
            },
            Err(e) => {
                tracing::error!("waiting for rank {}: {e}", spec.rank);
                Exit::Code(1)
            }
        };
        for pump in [stdout, stderr].into_iter().flatten() {
            let _ = tokio::time::timeout(DRAIN_AFTER_EXIT, pump).await;
        }
        let _ = done.send(Exited { local_rank, exit, stderr_tail: tail_lines(&tail) });
    });
    Ok(Running { local_rank, pid })
}

/// Sends `signal` to the worker's whole process group.
pub fn signal_group(pid: u32, signal: i32) {
    let Ok(pgid) = libc::pid_t::try_from(pid) else { return };
    if pgid <= 0 {
        return;
    }
    // SAFETY: plain syscall; an already-gone group just yields ESRCH.
    unsafe {
        libc::killpg(pgid, signal);
    }
}
