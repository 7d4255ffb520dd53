//! Whether a process of this machine is gone: how the coordinator (for a rank on its
//! own host) and a node agent (for the ranks of its node) tell a dead rank from a cut
//! connection at once, instead of waiting out the reconnect grace.

use std::io;
use std::time::Duration;

/// How often [`watch`] looks again.
const WATCH_EVERY: Duration = Duration::from_millis(10);

/// True if process `pid` of this machine no longer runs: there is no such process,
/// or it has exited and only waits for its parent to collect it (a zombie: a killed
/// child of a launcher or a test, whose sockets the kernel closed as it exited).
/// False for pid 0 (unknown) and for a process of another user (it exists).
pub fn process_gone(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill(2) with signal 0 sends nothing; it only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "PID (COMMAND) STATE ...": the command may hold spaces and parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| matches!(state, "Z" | "X")),
        // It exited between the two looks.
        Err(error) => error.kind() == io::ErrorKind::NotFound,
    }
}

/// Waits until process `pid` of this machine is gone, looking every few
/// milliseconds, for at most `limit`: a process whose socket closed is usually
/// still exiting when the close is seen. True if it went.
pub async fn watch(pid: u32, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if process_gone(pid) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(WATCH_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_an_exited_child_is_gone_zombie_or_reaped() {
        assert!(!process_gone(std::process::id()));
        assert!(!process_gone(0));
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        // Not reaped yet: a zombie once it exited.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !process_gone(pid) {
            assert!(std::time::Instant::now() < deadline, "child {pid} never seen gone");
            std::thread::sleep(Duration::from_millis(5));
        }
        child.wait().expect("reap");
        assert!(process_gone(pid));
    }

    #[test]
    fn a_running_child_is_alive_until_killed() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        assert!(!process_gone(child.id()));
        child.kill().expect("kill");
        let gone = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
            .block_on(watch(child.id(), Duration::from_secs(10)));
        assert!(gone);
        child.wait().expect("reap");
    }
}
