//! One worker process: spawned in its own process group, tied to the launcher's
//! life, its output pumped, its exit reported.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::console::{Console, STALL};
use crate::error_file::{self, Raised};
use crate::outcome::Exit;
use crate::output::{pump, tail_lines, Progress, Stream, Tail};
use crate::procs::Family;
use crate::Route;

/// After a worker exited, its pipes are read on as long as output keeps coming, but
/// a pipe that stays silent this long is given up: a process the worker started may
/// hold it open, and the summary must not wait for it. Longer than the console's
/// stall, so that a pump waiting for the console is not taken for an idle one.
const DRAIN_IDLE: Duration = Duration::from_millis(500).saturating_add(STALL);
/// And no longer than this in all.
const DRAIN_MAX: Duration = Duration::from_secs(10);

pub struct Spec {
    pub rank: u32,
    pub local_rank: u32,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(&'static str, OsString)>,
    pub console: Arc<Console>,
    /// What its console lines start with, when not `[rankN]: `.
    pub prefix: Option<String>,
    /// Which of its streams go to the console, and which to files in `log_dir`.
    pub route: Route,
    pub log_dir: Option<PathBuf>,
    /// Its `TORCHELASTIC_ERROR_FILE` ([`crate::error_file`]); `None`: the variable is
    /// set empty, so that one the launcher inherited is not written by its workers.
    pub error_file: Option<PathBuf>,
}

/// A running worker, as the supervisor sees it.
pub struct Running {
    pub local_rank: u32,
    pub pid: u32,
    /// When it last wrote output ([`crate::stacks::mono_ms`]; 0: never).
    pub heard: Arc<AtomicU64>,
}

/// Sent when a worker has exited and its output is drained.
pub struct Exited {
    pub local_rank: u32,
    pub exit: Exit,
    pub stderr_tail: Vec<String>,
    /// What it raised, from its error file, if it failed and wrote one.
    pub raised: Option<Raised>,
}

/// A worker that could not be started: its program, and why (`execve`'s error:
/// not found, not executable, ...).
#[derive(Debug)]
pub struct SpawnError {
    pub program: OsString,
    pub source: io::Error,
}

impl SpawnError {
    /// The exit code a shell gives a command it cannot run: 127 when it is not
    /// found, 126 when it is found but cannot be executed.
    pub fn exit_code(&self) -> i32 {
        match self.source.kind() {
            io::ErrorKind::NotFound => 127,
            _ => 126,
        }
    }

    /// "python3x: No such file or directory", without io::Error's "(os error 2)".
    /// Out of files or processes, it is the launcher's limit, not the program: said so.
    pub fn describe(&self) -> String {
        match self.source.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE) => {
                return format!(
                    "the launcher ran out of open files starting it ({}): raise `ulimit -n`, or start fewer \
                     workers per node",
                    self.source
                )
            }
            Some(libc::EAGAIN) => {
                return format!(
                    "the launcher could not start another process ({}): raise `ulimit -u`, or start fewer \
                     workers per node",
                    self.source
                )
            }
            _ => {}
        }
        let reason = self.source.to_string();
        let reason = match self.source.raw_os_error() {
            Some(code) => reason.strip_suffix(&format!(" (os error {code})")).unwrap_or(&reason).to_owned(),
            None => reason,
        };
        format!("{}: {reason}", self.program.to_string_lossy())
    }
}

/// Starts the worker and a task that reports its exit on `done`.
pub fn spawn(mut spec: Spec, family: &Arc<Family>, done: mpsc::UnboundedSender<Exited>) -> Result<Running, SpawnError> {
    // What cannot be cleared could be taken for this worker's: then it gets none.
    if let Some(path) = &spec.error_file {
        if let Err(error) = error_file::clear(path) {
            tracing::warn!(%error, "cannot remove rank {}'s old error file {}", spec.rank, path.display());
            spec.error_file = None;
        }
    }
    let error_file = spec.error_file.as_ref().map_or_else(OsString::new, |path| path.clone().into_os_string());
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(error_file::VAR, error_file)
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
            // A worker must not outlive its launcher, even one killed with SIGKILL (what
            // the worker starts is the watchdog's: this signal is not inherited).
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
    let mut child = family
        .spawn_worker(|| {
            let child = cmd.spawn()?;
            let pid = child.id().unwrap_or(0);
            Ok((child, pid))
        })
        .map_err(|source| SpawnError { program: spec.program.clone(), source })?;
    let pid = child.id().unwrap_or(0);
    let tail: Tail = Tail::default();
    let progress = Progress::default();
    let start_pump = |stream: Stream, source, tail: Option<Tail>| -> JoinHandle<()> {
        let console =
            spec.route.console.has(stream).then(|| spec.console.for_rank(spec.rank, stream, spec.prefix.clone()));
        let dir = spec.log_dir.clone().filter(|_| spec.route.files.has(stream));
        let progress = progress.clone();
        let rank = spec.rank;
        tokio::spawn(async move { pump(source, rank, stream, console, dir.as_deref(), tail, progress).await })
    };
    let stdout = child.stdout.take().map(|out| start_pump(Stream::Stdout, Box::new(out) as Source, None));
    let stderr = child.stderr.take().map(|err| start_pump(Stream::Stderr, Box::new(err) as Source, Some(tail.clone())));
    let local_rank = spec.local_rank;
    let family = Arc::clone(family);
    let activity = Arc::clone(&progress.activity);
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
        family.worker_reaped(pid);
        drain([stdout, stderr].into_iter().flatten(), &activity).await;
        let raised = match spec.error_file.filter(|_| !exit.success()) {
            Some(path) => error_file::read(path).await,
            None => None,
        };
        let _ = done.send(Exited { local_rank, exit, stderr_tail: tail_lines(&tail), raised });
    });
    Ok(Running { local_rank, pid, heard: progress.heard })
}

type Source = Box<dyn tokio::io::AsyncRead + Unpin + Send>;

/// Waits for the pumps of an exited worker while they make progress (see DRAIN_IDLE).
async fn drain(pumps: impl Iterator<Item = JoinHandle<()>>, activity: &AtomicU64) {
    let deadline = Instant::now() + DRAIN_MAX;
    for mut pump in pumps {
        let mut seen = activity.load(Ordering::Relaxed);
        loop {
            match tokio::time::timeout(DRAIN_IDLE, &mut pump).await {
                Ok(_) => break,
                Err(_) => {
                    let now = activity.load(Ordering::Relaxed);
                    if now == seen || Instant::now() >= deadline {
                        break;
                    }
                    seen = now;
                }
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_the_launchers_limits_stopped_blames_the_launcher() {
        let error = |code| SpawnError { program: "sleep".into(), source: io::Error::from_raw_os_error(code) };
        assert_eq!(error(libc::ENOENT).describe(), "sleep: No such file or directory");
        assert_eq!(error(libc::ENOENT).exit_code(), 127);
        let files = error(libc::EMFILE).describe();
        assert!(files.starts_with("the launcher ran out of open files starting it (") && files.contains("ulimit -n"));
        assert!(error(libc::EAGAIN).describe().contains("ulimit -u"));
    }
}
