//! Every process a launcher starts, found again through `/proc`, so that none
//! outlives its job.
//!
//! Each worker runs in a process group of its own, and the launcher signals whole
//! groups. What leaves its group (`setsid`, a daemon) is still found two ways:
//! - the launcher is a child subreaper (`PR_SET_CHILD_SUBREAPER`): an orphan of the
//!   workers' tree is re-parented to it, not to init, so while the launcher lives
//!   every process started under it is one of its descendants;
//! - each worker's environment carries the launch id ([`LAUNCH_ID_VAR`], random per
//!   launcher), which its descendants inherit: the watchdog
//!   ([`super::watchdog`]) finds them by it after the launcher itself was killed.
//!
//! The subreaper must also reap: orphans that exit become its zombies. The workers
//! themselves are waited for by tokio, so the reaper leaves their pids alone.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

/// The environment variable naming the launch a process belongs to.
pub const LAUNCH_ID_VAR: &str = "RALLYPOINT_LAUNCH_ID";
/// Rounds of "find, kill" at the end of an attempt, for processes that fork while
/// being killed.
const SWEEP_ROUNDS: u32 = 50;
const SWEEP_PAUSE: Duration = Duration::from_millis(20);

/// What `/proc/PID/stat` says of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub pid: i32,
    pub state: u8,
    pub ppid: i32,
    pub pgrp: i32,
}

pub fn stat(pid: i32) -> Option<Stat> {
    parse_stat(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
}

/// `pid (comm) S ppid pgrp ...`; `comm` may hold spaces and parentheses, so the
/// fields are read after its last `)`.
fn parse_stat(text: &[u8]) -> Option<Stat> {
    let open = text.iter().position(|&b| b == b'(')?;
    let close = text.iter().rposition(|&b| b == b')')?;
    let pid = std::str::from_utf8(&text[..open]).ok()?.trim().parse().ok()?;
    let rest = std::str::from_utf8(text.get(close + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(Stat { pid, state, ppid, pgrp })
}

/// How a process is, for a person: "alive, state T (stopped)", "exited, not yet
/// reaped", "gone".
pub fn describe(pid: u32) -> String {
    let Some(stat) = i32::try_from(pid).ok().and_then(stat) else { return "gone".into() };
    let what = match stat.state {
        b'R' => "running",
        b'S' => "sleeping",
        b'D' => "in uninterruptible sleep (usually I/O)",
        b'T' => "stopped",
        b't' => "stopped by a debugger",
        b'Z' => return "exited, not yet reaped".into(),
        b'X' => return "gone".into(),
        b'I' => "idle",
        b'P' => "parked",
        b'W' => "paging",
        _ => "in an unknown state",
    };
    format!("alive, state {} ({what})", char::from(stat.state))
}

/// Whether `pid` is a descendant of this process (so a pid a coordinator reported
/// is ours, not a stranger's that reused the number).
pub fn is_descendant(pid: u32) -> bool {
    let me = std::process::id() as i32;
    let Ok(mut pid) = i32::try_from(pid) else { return false };
    // Bounded: a loop in the (racy) chain must not hang us.
    for _ in 0..256 {
        match stat(pid) {
            Some(s) if s.ppid == me => return true,
            Some(s) if s.ppid > 1 => pid = s.ppid,
            _ => return false,
        }
    }
    false
}

fn all_pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten().filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok())).collect()
}

/// Whether `environ` (NUL-separated `KEY=VALUE` entries) holds exactly `entry`.
fn has_entry(environ: &[u8], entry: &[u8]) -> bool {
    environ.split(|&b| b == 0).any(|e| e == entry)
}

/// Whether this kernel has pidfds (Linux 5.3+). With them, tokio waits for a worker
/// by its pidfd, which becomes readable only when it exits; without, it polls every
/// worker with `waitpid` on each SIGCHLD, which would also take a ptrace stop (a
/// worker's native stack being read) for an exit.
pub fn has_pidfd() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: pidfd_open of this process itself; the descriptor is closed at once.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
        if fd < 0 {
            return false;
        }
        // SAFETY: a descriptor this function just opened.
        unsafe { libc::close(fd as libc::c_int) };
        true
    })
}

/// Makes this process the reaper of its descendants' orphans.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The processes of one launcher: its workers (waited for by tokio) and whatever
/// else it is answerable for.
pub struct Family {
    /// `RALLYPOINT_LAUNCH_ID=<id>`, as it appears in a worker's environment.
    entry: Vec<u8>,
    id: String,
    /// Workers' pids, from just before their spawn until tokio reaped them: the
    /// reaper must not take their exit status.
    workers: Mutex<HashSet<i32>>,
    /// Never killed by a sweep.
    watchdog: Mutex<Option<i32>>,
}

impl Family {
    pub fn new() -> Family {
        let id = format!("{}-{:016x}", std::process::id(), rand::random::<u64>());
        Family {
            entry: format!("{LAUNCH_ID_VAR}={id}").into_bytes(),
            id,
            workers: Mutex::new(HashSet::new()),
            watchdog: Mutex::new(None),
        }
    }

    /// The value of [`LAUNCH_ID_VAR`] for this launcher's workers.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `LAUNCH_ID_VAR=id`, as the watchdog looks for it.
    pub fn entry(&self) -> &[u8] {
        &self.entry
    }

    pub fn set_watchdog(&self, pid: i32) {
        *lock(&self.watchdog) = Some(pid);
    }

    /// Runs `spawn` (which returns the new worker's pid) so that the reaper cannot see
    /// the worker before it is known as one.
    pub fn spawn_worker<T>(&self, spawn: impl FnOnce() -> io::Result<(T, u32)>) -> io::Result<T> {
        let mut workers = lock(&self.workers);
        let (worker, pid) = spawn()?;
        if let Ok(pid) = i32::try_from(pid) {
            workers.insert(pid);
        }
        Ok(worker)
    }

    /// The worker was reaped by tokio: its pid is free again.
    pub fn worker_reaped(&self, pid: u32) {
        if let Ok(pid) = i32::try_from(pid) {
            lock(&self.workers).remove(&pid);
        }
    }

    /// Reaps the exited orphans this launcher adopted as their subreaper.
    pub fn reap_adopted(&self) {
        let me = std::process::id() as i32;
        let workers = lock(&self.workers);
        for pid in all_pids() {
            let Some(s) = stat(pid) else { continue };
            if s.ppid == me && s.state == b'Z' && !workers.contains(&pid) {
                // SAFETY: waits for one exited child of ours that nobody else waits for.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
            }
        }
    }

    /// Live processes this launcher must not leave behind, beyond the process groups
    /// `groups` (signalled as groups): its descendants, and whatever carries its
    /// launch id. Not the watchdog.
    pub fn strays(&self, groups: &[u32]) -> Vec<i32> {
        let me = std::process::id() as i32;
        let watchdog = *lock(&self.watchdog);
        let stats: Vec<Stat> = all_pids().into_iter().filter_map(stat).collect();
        let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
        for s in &stats {
            children.entry(s.ppid).or_default().push(s.pid);
        }
        let mut found = HashSet::new();
        let mut todo = vec![me];
        while let Some(pid) = todo.pop() {
            for &child in children.get(&pid).into_iter().flatten() {
                if found.insert(child) {
                    todo.push(child);
                }
            }
        }
        for s in &stats {
            if s.pid != me && !found.contains(&s.pid) {
                let marked =
                    std::fs::read(format!("/proc/{}/environ", s.pid)).is_ok_and(|e| has_entry(&e, &self.entry));
                if marked {
                    found.insert(s.pid);
                }
            }
        }
        // A process of a signalled group is not signalled twice: to many programs a
        // second SIGINT or SIGTERM means "give up cleaning up".
        let skip: HashSet<i32> = stats
            .iter()
            .filter(|s| s.state == b'Z' || groups.iter().any(|&g| i32::try_from(g) == Ok(s.pgrp)))
            .map(|s| s.pid)
            .collect();
        found.retain(|pid| Some(*pid) != watchdog && *pid != me && !skip.contains(pid));
        let mut strays: Vec<i32> = found.into_iter().collect();
        strays.sort_unstable();
        strays
    }

    /// Sends `sig` to every stray outside `groups`.
    pub fn signal_strays(&self, sig: i32, groups: &[u32]) {
        for pid in self.strays(groups) {
            // SAFETY: plain syscall; a process gone since the scan yields ESRCH.
            unsafe { libc::kill(pid, sig) };
        }
    }

    /// Kills every stray, again until none is left (one may fork while dying), within bounds.
    pub async fn kill_strays(&self) {
        for _ in 0..SWEEP_ROUNDS {
            let strays = self.strays(&[]);
            if strays.is_empty() {
                break;
            }
            tracing::debug!(?strays, "killing what the workers left behind");
            for pid in strays {
                // SAFETY: as in signal_strays.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            tokio::time::sleep(SWEEP_PAUSE).await;
            self.reap_adopted();
        }
        self.reap_adopted();
    }
}

/// Reaps adopted orphans whenever a child exits, until the runtime ends.
pub fn spawn_reaper(family: std::sync::Arc<Family>) -> io::Result<()> {
    let mut children = signal(SignalKind::child())?;
    tokio::spawn(async move {
        while children.recv().await.is_some() {
            family.reap_adopted();
        }
    });
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_the_command_name() {
        let s = parse_stat(b"4242 (my (odd) name) T 17 4242 4242 0 -1").expect("parses");
        assert_eq!(s, Stat { pid: 4242, state: b'T', ppid: 17, pgrp: 4242 });
        assert_eq!(parse_stat(b"garbage"), None);
        let me = stat(std::process::id() as i32).expect("our own stat");
        assert_eq!((me.pid, me.ppid), (std::process::id() as i32, std::os::unix::process::parent_id() as i32));
    }

    #[test]
    fn a_stopped_child_is_described_as_such_and_a_reaped_one_as_gone() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id();
        assert!(is_descendant(pid));
        // SAFETY: signals a child of this test.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while describe(pid) != "alive, state T (stopped)" {
            assert!(std::time::Instant::now() < deadline, "{}", describe(pid));
            std::thread::sleep(Duration::from_millis(5));
        }
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(describe(pid), "gone");
        assert!(!is_descendant(pid));
    }

    #[test]
    fn environment_entries_match_whole() {
        let env = b"A=1\0RALLYPOINT_LAUNCH_ID=7-ab\0B=2";
        assert!(has_entry(env, b"RALLYPOINT_LAUNCH_ID=7-ab"));
        assert!(!has_entry(env, b"RALLYPOINT_LAUNCH_ID=7-a"));
        assert!(!has_entry(b"XRALLYPOINT_LAUNCH_ID=7-ab\0", b"RALLYPOINT_LAUNCH_ID=7-ab"));
    }

    #[test]
    fn strays_are_descendants_and_marked_processes_but_not_the_watchdog() {
        let family = Family::new();
        let plain = std::process::Command::new("sleep").arg("30").spawn().expect("spawn");
        let marked = std::process::Command::new("sh")
            .args(["-c", "setsid sleep 30 >/dev/null 2>&1 & echo $!"])
            .env(LAUNCH_ID_VAR, family.id())
            .stdout(std::process::Stdio::piped())
            .output()
            .expect("spawn a marked process that leaves");
        let escaped: i32 = String::from_utf8_lossy(&marked.stdout).trim().parse().expect("its pid");
        // Its environment reads empty until its `exec` has set it up, and `setsid`
        // (which execs with the environment already there) makes its own group
        // only then: wait for both.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        // SAFETY: getpgid only reads the process table.
        let own_group = || unsafe { libc::getpgid(escaped) } == escaped;
        let mut strays = family.strays(&[]);
        while !(strays.contains(&escaped) && own_group()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            strays = family.strays(&[]);
        }
        assert!(strays.contains(&(plain.id() as i32)), "a child: {strays:?}");
        assert!(strays.contains(&escaped), "a marked orphan re-parented to init: {strays:?}");
        assert!(!family.strays(&[escaped as u32]).contains(&escaped), "a signalled group is left out");
        family.set_watchdog(plain.id() as i32);
        assert!(!family.strays(&[]).contains(&(plain.id() as i32)));
        for pid in [plain.id() as i32, escaped] {
            // SAFETY: processes this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let mut plain = plain;
        let _ = plain.wait();
    }
}
