//! The watchdog: a small process the launcher forks at start, which outlives a
//! launcher killed with SIGKILL just long enough to kill everything it started.
//!
//! Why a process of its own: nothing in a SIGKILLed process runs, and the kernel's
//! own help falls short. The workers' parent-death signal (`PR_SET_PDEATHSIG`, also
//! set) reaches the workers only, not the trainer a wrapper script started; it is
//! reset by every fork. A PID namespace or a cgroup would take everything down but
//! needs privileges or a delegated cgroup that a launcher cannot count on.
//!
//! How: the launcher holds the write end of a pipe whose read end only the
//! watchdog has. The launcher tells it the process group of each worker (4-byte
//! messages: `+pgid` watch, `-pgid` forget, `0` all is done, exit). When the pipe
//! closes without that `0`, the launcher is dead: the watchdog SIGKILLs every
//! watched group, then every process whose environment carries the launcher's launch
//! id (see [`super::procs`]), which finds what left its group with `setsid` and was
//! re-parented to init; it repeats until several scans in a row find none (bounded),
//! and exits. One empty scan is not enough: a process caught in the middle of `exec`
//! shows an empty environment until the kernel has set the new one up.
//!
//! The watchdog is forked from a multi-threaded process without `exec`, so it may
//! only make async-signal-safe calls: it allocates nothing and uses raw system calls
//! (reading `/proc` with `getdents64`). It runs in a process group of its own and
//! ignores the signals a terminal or a `kill` of the launcher's group sends, so a
//! Ctrl-C or a `kill -9 -PGID` of the launcher leaves it to do its job.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Groups one watchdog can watch at once (a node's workers of one attempt).
const MAX_GROUPS: usize = 1024;
/// The longest `KEY=VALUE` launch id entry the watchdog can look for.
const MAX_ENTRY: usize = 96;
/// Rounds of "find, kill" after the launcher died, at most.
const ROUNDS: u32 = 50;
/// Rounds in a row that find nothing before the watchdog is done.
const QUIET_ROUNDS: u32 = 10;

pub struct Watchdog {
    pipe: OwnedFd,
    pid: i32,
}

impl Watchdog {
    /// Forks the watchdog. `entry` is the launch id as it appears in the workers'
    /// environments (`RALLYPOINT_LAUNCH_ID=...`).
    pub fn start(entry: &[u8]) -> io::Result<Watchdog> {
        if entry.len() > MAX_ENTRY {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "launch id too long"));
        }
        // Everything the child uses is ready before the fork.
        let mut id = [0u8; MAX_ENTRY];
        id[..entry.len()].copy_from_slice(entry);
        let id_len = entry.len();
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors; close-on-exec keeps them out of workers,
        // whose copies would keep the pipe open after the launcher died.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors are fresh and owned here.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the child runs only async-signal-safe code (see `watch`) and never returns.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => unsafe { watch(read.as_raw_fd(), &id[..id_len]) },
            pid => {
                drop(read);
                // Never block the launcher's runtime on a watchdog that stopped reading.
                // SAFETY: fcntl on a descriptor we own.
                unsafe {
                    let flags = libc::fcntl(write.as_raw_fd(), libc::F_GETFL);
                    libc::fcntl(write.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
                }
                Ok(Watchdog { pipe: write, pid })
            }
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Kill this process group if the launcher dies.
    pub fn watch_group(&self, pgid: u32) {
        if let Ok(pgid) = i32::try_from(pgid) {
            self.send(pgid);
        }
    }

    /// The group is gone (its number may be reused): forget it.
    pub fn forget_group(&self, pgid: u32) {
        if let Ok(pgid) = i32::try_from(pgid) {
            self.send(-pgid);
        }
    }

    /// The launcher cleaned up itself: the watchdog exits without killing anything.
    pub fn disarm(self) {
        self.send(0);
    }

    fn send(&self, value: i32) {
        let bytes = value.to_le_bytes();
        // SAFETY: writes 4 bytes (atomic on a pipe) from a live buffer.
        let n = unsafe { libc::write(self.pipe.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
        if n != 4 {
            tracing::warn!(error = %io::Error::last_os_error(), "cannot tell the watchdog about a process group");
        }
    }
}

/// The watchdog's life. Async-signal-safe calls only; no allocation.
unsafe fn watch(pipe: libc::c_int, entry: &[u8]) -> ! {
    libc::setpgid(0, 0);
    for sig in [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGQUIT,
        libc::SIGPIPE,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGTSTP,
        libc::SIGTTIN,
        libc::SIGTTOU,
    ] {
        libc::signal(sig, libc::SIG_IGN);
    }
    // Handlers inherited from the launcher's runtime would write to its descriptors.
    libc::signal(libc::SIGCHLD, libc::SIG_DFL);
    close_all_but(pipe);

    let mut groups = [0i32; MAX_GROUPS];
    let mut buf = [0u8; 4096];
    let mut have = 0usize;
    loop {
        let n = libc::read(pipe, buf.as_mut_ptr().add(have).cast(), buf.len() - have);
        if n == 0 {
            break;
        }
        if n < 0 {
            if *libc::__errno_location() == libc::EINTR {
                continue;
            }
            break;
        }
        have += n as usize;
        let whole = have - have % 4;
        let mut at = 0;
        while at < whole {
            let value = i32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
            at += 4;
            match value {
                0 => libc::_exit(0),
                v if v > 0 => {
                    if let Some(slot) = groups.iter_mut().find(|g| **g == 0) {
                        *slot = v;
                    }
                }
                v => {
                    if let Some(slot) = groups.iter_mut().find(|g| **g == -v) {
                        *slot = 0;
                    }
                }
            }
        }
        buf.copy_within(whole..have, 0);
        have -= whole;
    }
    // The launcher is gone without saying it was done.
    for &group in groups.iter().filter(|g| **g > 0) {
        libc::kill(-group, libc::SIGKILL);
    }
    let mut quiet = 0;
    for _ in 0..ROUNDS {
        quiet = if kill_marked(entry) == 0 { quiet + 1 } else { 0 };
        if quiet == QUIET_ROUNDS {
            break;
        }
        let pause = libc::timespec { tv_sec: 0, tv_nsec: 20_000_000 };
        libc::nanosleep(&pause, std::ptr::null_mut());
    }
    libc::_exit(0)
}

unsafe fn close_all_but(keep: libc::c_int) {
    let close_range = |first: libc::c_uint, last: libc::c_uint| {
        first > last || libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_uint) == 0
    };
    let keep_u = keep as libc::c_uint;
    let below = keep_u == 0 || close_range(0, keep_u - 1);
    let above = close_range(keep_u + 1, libc::c_uint::MAX);
    if !(below && above) {
        // Kernels before 5.9.
        for fd in 0..65_536 {
            if fd != keep {
                libc::close(fd);
            }
        }
    }
}

/// SIGKILLs every process whose environment holds `entry`; returns how many.
unsafe fn kill_marked(entry: &[u8]) -> u32 {
    let proc_dir = libc::open(c"/proc".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC);
    if proc_dir < 0 {
        return 0;
    }
    let me = libc::getpid();
    let mut killed = 0;
    // u64s: linux_dirent64 records are 8-byte aligned.
    let mut dents = [0u64; 2048];
    loop {
        let n = libc::syscall(libc::SYS_getdents64, proc_dir, dents.as_mut_ptr(), std::mem::size_of_val(&dents));
        if n <= 0 {
            break;
        }
        let base = dents.as_ptr().cast::<u8>();
        let mut at = 0usize;
        while at < n as usize {
            // linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, then the name.
            let reclen = u16::from_ne_bytes([*base.add(at + 16), *base.add(at + 17)]) as usize;
            let name = base.add(at + 19);
            at += reclen.max(1);
            let mut path = [0u8; 32];
            let mut len = 0;
            let mut pid: libc::pid_t = 0;
            while *name.add(len) != 0 && len < 12 {
                let c = *name.add(len);
                if !c.is_ascii_digit() {
                    pid = -1;
                    break;
                }
                pid = pid * 10 + libc::pid_t::from(c - b'0');
                path[len] = c;
                len += 1;
            }
            if pid <= 0 || pid == me || *name.add(len) != 0 {
                continue;
            }
            for &c in b"/environ\0" {
                path[len] = c;
                len += 1;
            }
            let fd = libc::openat(proc_dir, path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                continue;
            }
            let marked = environ_has(fd, entry);
            libc::close(fd);
            if marked {
                libc::kill(pid, libc::SIGKILL);
                killed += 1;
            }
        }
    }
    libc::close(proc_dir);
    killed
}

/// Whether the NUL-separated entries read from `fd` include exactly `entry`.
unsafe fn environ_has(fd: libc::c_int, entry: &[u8]) -> bool {
    let mut chunk = [0u8; 4096];
    // How much of `entry` the current entry matched so far; None once it differs.
    let mut matched = Some(0usize);
    loop {
        let n = libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len());
        if n <= 0 {
            return matched == Some(entry.len());
        }
        for &b in &chunk[..n as usize] {
            if b == 0 {
                if matched == Some(entry.len()) {
                    return true;
                }
                matched = Some(0);
            } else {
                matched = match matched {
                    Some(i) if i < entry.len() && entry[i] == b => Some(i + 1),
                    _ => None,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use super::*;

    fn alive(pid: i32) -> bool {
        crate::procs::stat(pid).is_some_and(|s| s.state != b'Z')
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn environ_entries_are_matched_whole_across_reads() {
        let dir = std::env::temp_dir().join(format!("rp-watchdog-environ-{}", std::process::id()));
        let mut env = b"A=1\0".to_vec();
        env.extend(std::iter::repeat_n(b'x', 5000));
        env.extend_from_slice(b"\0ID=42\0B=2");
        std::fs::write(&dir, &env).expect("write");
        let check = |entry: &[u8]| {
            let file = std::fs::File::open(&dir).expect("open");
            // SAFETY: a descriptor of an open file.
            unsafe { environ_has(file.as_raw_fd(), entry) }
        };
        assert!(check(b"ID=42"));
        assert!(check(b"B=2"), "the last entry has no NUL after it");
        assert!(!check(b"ID=4") && !check(b"D=42"));
        std::fs::remove_file(&dir).expect("cleanup");
    }

    #[test]
    fn a_watchdog_whose_launcher_dies_kills_watched_groups_and_marked_processes() {
        let entry = format!("RALLYPOINT_LAUNCH_ID=test-{}", std::process::id());
        // A stand-in for a launcher: a forked process that starts the watchdog, a
        // worker group and a marked escapee, prints their pids, then waits to be killed.
        let launcher = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "watchdog::tests::stand_in_launcher", "--ignored", "--nocapture"])
            .env("RP_STAND_IN", &entry)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the stand-in");
        let mut launcher = launcher;
        let mut out = String::new();
        let stdout = launcher.stdout.take().expect("piped");
        let mut reader = std::io::BufReader::new(stdout);
        use std::io::BufRead;
        while !out.contains("pids ") {
            let mut line = String::new();
            assert!(reader.read_line(&mut line).expect("read") > 0, "the stand-in ended: {out}");
            out.push_str(&line);
        }
        let line = out.lines().find(|l| l.starts_with("pids ")).expect("pids line");
        let pids: Vec<i32> = line[5..].split(' ').map(|p| p.parse().expect("pid")).collect();
        let (watchdog, grouped, escaped) = (pids[0], pids[1], pids[2]);
        assert!(alive(watchdog) && alive(grouped) && alive(escaped));
        launcher.kill().expect("SIGKILL the stand-in");
        launcher.wait().expect("reap it");
        wait_until("the grouped worker outlived the launcher", || !alive(grouped));
        wait_until("the marked escapee outlived the launcher", || !alive(escaped));
        wait_until("the watchdog outlived its work", || !alive(watchdog));
    }

    #[test]
    #[ignore = "run by the test above as a launcher to kill"]
    fn stand_in_launcher() {
        let Ok(entry) = std::env::var("RP_STAND_IN") else { return };
        let watchdog = Watchdog::start(entry.as_bytes()).expect("watchdog");
        let (key, value) = entry.split_once('=').expect("KEY=VALUE");
        let grouped = Command::new("sleep").arg("60").process_group(0).spawn().expect("grouped");
        watchdog.watch_group(grouped.id());
        // Marked, in a group nobody told the watchdog about (as after `setsid`).
        let escaped = Command::new("sleep").arg("60").env(key, value).process_group(0).spawn().expect("escaped");
        println!("pids {} {} {}", watchdog.pid(), grouped.id(), escaped.id());
        // Killed long before this ends.
        std::thread::sleep(Duration::from_secs(60));
        for mut child in [grouped, escaped] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    use std::os::unix::process::CommandExt;
}
