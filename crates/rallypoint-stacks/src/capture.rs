//! Reading a live process's stack from outside it, with py-spy.
//!
//! Python stacks are read without stopping the process (py-spy's non-blocking
//! mode: the interpreter's frames are copied out of its memory while it runs). A
//! hung process does not change under the reader, and a healthy one is not paused
//! by someone looking at it; a stack torn by a process that moved on while it was
//! read fails to parse and is read again. Native frames (`native`) need the process
//! stopped while its registers are unwound: every thread is attached with ptrace for
//! the few milliseconds that takes.
//!
//! Of a Python process's threads, the main thread is shown: it is where a training
//! loop runs and where `torch.distributed` calls block; the threads torch, data
//! loaders and libraries start (watchdogs, pin-memory, gloo's) sleep in their own
//! loops and would only hide it. The thread holding the GIL is second choice, for a
//! process whose main thread runs no Python any more.
//!
//! A worker that is not Python itself (a shell script running python) is looked
//! through: the first Python process among its descendants is read. One that is
//! not Python at all gets its native stack (with `native`) or says so.
//!
//! Reading another process's memory takes ptrace access to it: a parent has it
//! under Yama's default (`kernel.yama.ptrace_scope` 1), not under 2 (only with
//! CAP_SYS_PTRACE) or 3; a refusal says which applies and what to change.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use py_spy::config::LockingStrategy;

use crate::stack::{Captured, Frame, ThreadChoice};

/// How a batch of processes is read.
#[derive(Debug, Clone)]
pub struct Options {
    /// Native frames too (stops each process while they are unwound). Needs the
    /// crate's `native` feature: see [`native_supported`].
    pub native: bool,
    /// How long one process may take; then it is given up ([`Captured::TimedOut`]).
    pub timeout: Duration,
    /// Processes read at once.
    pub parallel: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options { native: false, timeout: Duration::from_secs(3), parallel: 8 }
    }
}

/// Whether this build reads native frames (the `native` feature, which links libunwind).
pub fn native_supported() -> bool {
    cfg!(feature = "native")
}

/// Reads a torn Python stack again this many times before giving up.
const READS: u32 = 3;
/// Descendants of a worker looked at for a Python process, at most.
const MAX_DESCENDANTS: usize = 64;
/// Native frames of one stack, at most (a corrupt stack must not loop).
#[cfg(feature = "native")]
const MAX_NATIVE_FRAMES: usize = 256;

/// Reads the stacks of `pids`, several at once, each within `options.timeout`; the
/// results are in the order of `pids`. A process that hangs the reader (one in
/// uninterruptible sleep being attached for native frames) is given up, and its
/// reading thread left to finish alone.
pub fn capture_all(pids: &[u32], options: &Options) -> Vec<Captured> {
    let mut results: Vec<Option<Captured>> = vec![None; pids.len()];
    let (done_tx, done) = mpsc::channel::<(usize, Captured)>();
    let parallel = options.parallel.max(1);
    let mut next = 0;
    let mut running: Vec<(usize, Instant)> = Vec::new();
    loop {
        while running.len() < parallel && next < pids.len() {
            let (index, pid, native, tx) = (next, pids[next], options.native, done_tx.clone());
            let spawned = std::thread::Builder::new().name("rallypoint-stacks".into()).spawn(move || {
                let _ = tx.send((index, capture(pid, native)));
            });
            match spawned {
                Ok(_) => running.push((index, Instant::now())),
                Err(e) => results[index] = Some(Captured::Failed { error: format!("cannot start a thread: {e}") }),
            }
            next += 1;
        }
        let Some(due) = running.iter().map(|(_, started)| *started + options.timeout).min() else { break };
        match done.recv_timeout(due.saturating_duration_since(Instant::now())) {
            Ok((index, captured)) => {
                running.retain(|(i, _)| *i != index);
                results[index].get_or_insert(captured);
            }
            Err(_) => {
                let now = Instant::now();
                running.retain(|&(index, started)| {
                    let late = now >= started + options.timeout;
                    if late {
                        let after_ms = u64::try_from(options.timeout.as_millis()).unwrap_or(u64::MAX);
                        results[index].get_or_insert(Captured::TimedOut { after_ms });
                    }
                    !late
                });
            }
        }
    }
    results.into_iter().map(|r| r.unwrap_or(Captured::Failed { error: "not read".into() })).collect()
}

/// Reads the stack of process `pid` (blocking: from a few milliseconds to a few
/// hundred for a large program read the first time).
pub fn capture(pid: u32, native: bool) -> Captured {
    if !alive(pid) {
        return Captured::Gone;
    }
    let python = is_python(pid);
    let below = if python { Vec::new() } else { descendants(pid) };
    let target = if python { Some(pid) } else { below.iter().copied().find(|&p| is_python(p)) };
    let read = match target {
        Some(target) => python_stack(target, native),
        None if native && native_supported() => native_stack(pid),
        None => {
            let detail = (native && !native_supported()).then(|| "native frames are not in this build".to_owned());
            let program = program_run_by(pid, &below);
            return Captured::NotPython { pid, program, detail, stopped: stopped(pid) };
        }
    };
    match read {
        Ok(captured) => captured,
        Err(_) if !alive(pid) => Captured::Gone,
        Err(error) => {
            let text = format!("{error:#}");
            if refused(&text) {
                Captured::Refused { reason: refusal() }
            } else {
                Captured::Failed { error: text }
            }
        }
    }
}

fn python_stack(pid: u32, native: bool) -> anyhow::Result<Captured> {
    let native = native && native_supported();
    let blocking = if native { LockingStrategy::Lock } else { LockingStrategy::NonBlocking };
    let config = py_spy::Config { blocking, native, ..py_spy::Config::default() };
    let mut spy = py_spy::PythonSpy::new(pid as py_spy::Pid, &config)?;
    let mut traces = spy.get_stack_traces();
    for _ in 1..READS {
        if traces.is_ok() {
            break;
        }
        traces = spy.get_stack_traces();
    }
    let traces = traces?;
    let threads = u32::try_from(traces.len()).unwrap_or(u32::MAX);
    let main = traces.iter().position(|t| t.os_thread_id == Some(u64::from(pid)));
    let gil = traces.iter().position(|t| t.owns_gil);
    let (index, thread) = match (main, gil) {
        (Some(i), _) => (i, ThreadChoice::Main),
        (None, Some(i)) => (i, ThreadChoice::GilHolder),
        (None, None) => (0, ThreadChoice::Other),
    };
    // No trace only when the process showed no thread at all (`threads` is 0 then).
    let (thread_name, frames) = match traces.into_iter().nth(index) {
        Some(trace) => (trace.thread_name, trace.frames.iter().map(frame).collect()),
        None => (None, Vec::new()),
    };
    Ok(Captured::Python { pid, thread, thread_name, threads, native, frames, stopped: stopped(pid) })
}

fn frame(f: &py_spy::Frame) -> Frame {
    let line = u32::try_from(f.line).ok().filter(|&l| l > 0);
    match &f.module {
        // A native frame: its source file when the library has line tables, else the library.
        Some(module) => {
            let file = match line {
                Some(_) => short_path(&f.filename),
                None => base_name(module),
            };
            Frame { function: f.name.clone(), file: Some(file), line, native: true }
        }
        None => Frame {
            function: f.name.clone(),
            file: Some(f.short_filename.clone().unwrap_or_else(|| f.filename.clone())),
            line,
            native: false,
        },
    }
}

#[cfg(feature = "native")]
fn native_stack(pid: u32) -> anyhow::Result<Captured> {
    let process = remoteprocess::Process::new(pid as remoteprocess::Pid)?;
    let unwinder = process.unwinder()?;
    let symbolicator = process.symbolicator()?;
    let thread = remoteprocess::Thread::new(pid as remoteprocess::Tid)?;
    // Unnamed frames are told as an offset in their file, which is the same in every
    // process running that file; an absolute address differs with each one's layout
    // (ASLR), so identical stacks of two ranks would not fold together.
    let maps = proc_maps::get_process_maps(pid as proc_maps::Pid).unwrap_or_default();
    let unnamed = |ip: u64| {
        let ip = ip as usize;
        maps.iter()
            .find(|m| m.start() <= ip && ip < m.start() + m.size())
            .and_then(|m| Some((base_name(m.filename()?.to_str()?), ip - m.start() + m.offset)))
            .map_or_else(|| format!("0x{ip:x}"), |(file, offset)| format!("{file}+0x{offset:x}"))
    };
    let mut frames = Vec::new();
    {
        let _stopped = process.lock()?;
        for ip in unwinder.cursor(&thread)?.take(MAX_NATIVE_FRAMES) {
            let ip = ip?;
            let mut found = false;
            let _ = symbolicator.symbolicate(ip, true, &mut |f: &remoteprocess::StackFrame| {
                found = true;
                let line = f.line.and_then(|l| u32::try_from(l).ok()).filter(|&l| l > 0);
                let file = match (&f.filename, line) {
                    (Some(file), Some(_)) => short_path(file),
                    _ => base_name(&f.module),
                };
                let function = f.function.clone().unwrap_or_else(|| unnamed(f.addr));
                frames.push(Frame { function, file: Some(file), line, native: true });
            });
            if !found {
                frames.push(Frame { function: unnamed(ip), file: None, line: None, native: true });
            }
        }
    }
    Ok(Captured::Native { pid, program: program(pid), frames })
}

#[cfg(not(feature = "native"))]
fn native_stack(pid: u32) -> anyhow::Result<Captured> {
    let detail = Some("native frames are not in this build".into());
    Ok(Captured::NotPython { pid, program: program(pid), detail, stopped: stopped(pid) })
}

/// The last two components of a source path: `src/gloo/pair.cc`.
fn short_path(path: &str) -> String {
    let mut parts = path.rsplitn(3, '/');
    let (last, parent) = (parts.next().unwrap_or(path), parts.next());
    match parent {
        Some(parent) if !parent.is_empty() => format!("{parent}/{last}"),
        _ => last.to_owned(),
    }
}

fn base_name(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_owned()
}

/// Whether the process exists and has not exited (a zombie has no stack).
fn alive(pid: u32) -> bool {
    !matches!(state(pid), Some(b'Z' | b'X') | None)
}

/// Stopped by a signal or a tracer (`/proc/PID/stat` state `T` or `t`).
fn stopped(pid: u32) -> bool {
    matches!(state(pid), Some(b'T' | b't'))
}

/// The state letter of `/proc/PID/stat`, if the process exists.
fn state(pid: u32) -> Option<u8> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat.get(close + 2).copied()
}

/// A Python interpreter: its executable is one (`python3.11`, a venv's `python`),
/// or it has libpython loaded (a program embedding Python).
fn is_python(pid: u32) -> bool {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let named =
        exe.as_ref().and_then(|p| p.file_name()).and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python"));
    if named {
        return true;
    }
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        // Unreadable: let the reader try, and say why it cannot.
        return exe.is_none() && alive(pid);
    };
    maps.lines().any(|line| line.rsplit('/').next().is_some_and(|name| name.starts_with("libpython")))
}

/// The process's descendants, nearest first (at most [`MAX_DESCENDANTS`]).
fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = std::collections::VecDeque::from([pid]);
    while let Some(parent) = queue.pop_front() {
        for child in children(parent) {
            if found.len() >= MAX_DESCENDANTS {
                return found;
            }
            if !found.contains(&child) {
                found.push(child);
                queue.push_back(child);
            }
        }
    }
    found
}

/// Children of every thread of `pid` (`/proc/PID/task/TID/children`).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut children = Vec::new();
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("children")) else { continue };
        children.extend(text.split_ascii_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    children
}

/// The process's command name (`sleep`), or its pid if that is gone.
/// A wrapper's program with the one it runs (its deepest descendant), `sh → sleep`:
/// what tells apart ranks whose wrapper script runs different programs.
fn program_run_by(pid: u32, descendants: &[u32]) -> String {
    let wrapper = program(pid);
    match descendants.last().map(|&p| program(p)) {
        Some(runs) if runs != wrapper => format!("{wrapper} → {runs}"),
        _ => wrapper,
    }
}

fn program(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map_or_else(|_| format!("pid {pid}"), |c| c.trim().to_owned())
}

fn refused(error: &str) -> bool {
    ["Permission denied", "Operation not permitted", "EPERM", "EACCES"].iter().any(|s| error.contains(s))
}

/// Yama's ptrace restriction (`kernel.yama.ptrace_scope`), if the kernel has Yama.
pub fn ptrace_scope() -> Option<u8> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok()?.trim().parse().ok()
}

/// Why reading a process's memory was refused, and what to change.
fn refusal() -> String {
    match ptrace_scope() {
        Some(3) => "the kernel forbids reading another process's memory (kernel.yama.ptrace_scope is 3, \
                    which only a reboot lifts)"
            .into(),
        Some(2) => "the kernel lets only processes with CAP_SYS_PTRACE read another process's memory \
                    (kernel.yama.ptrace_scope is 2): give the launcher that capability (setcap \
                    cap_sys_ptrace+ep on the rallypoint binary, or --cap-add SYS_PTRACE for its container), \
                    or set kernel.yama.ptrace_scope to 1"
            .into(),
        _ => "the kernel refused its launcher ptrace access to it although it is its parent: a security \
              policy forbids ptrace (a container's seccomp profile without SYS_PTRACE, AppArmor, SELinux), \
              or the process changed its user or made itself undumpable"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_shortened_to_what_a_person_reads() {
        assert_eq!(short_path("/build/gloo/gloo/transport/tcp/pair.cc"), "tcp/pair.cc");
        assert_eq!(short_path("pair.cc"), "pair.cc");
        assert_eq!(short_path("/pair.cc"), "pair.cc");
        assert_eq!(base_name("/usr/lib/x86_64-linux-gnu/libc.so.6"), "libc.so.6");
    }

    #[test]
    fn a_process_that_is_not_python_says_so_and_a_gone_one_is_gone() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id();
        match capture(pid, false) {
            Captured::NotPython { pid: p, program, detail: None, stopped: false } => {
                assert_eq!((p, program.as_str()), (pid, "sleep"))
            }
            other => panic!("{other:?}"),
        }
        // SAFETY: signals this test's own child.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !stopped(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(matches!(capture(pid, false), Captured::NotPython { stopped: true, .. }), "a stopped process says so");
        child.kill().expect("kill");
        child.wait().expect("reap");
        assert_eq!(capture(pid, false), Captured::Gone);
        assert_eq!(capture(u32::MAX, false), Captured::Gone);
    }

    #[test]
    fn a_batch_keeps_its_order_and_a_gone_process_does_not_spoil_the_others() {
        let mut live = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let mut dead = std::process::Command::new("true").spawn().expect("spawn true");
        dead.wait().expect("reap");
        let options = Options { parallel: 1, ..Options::default() };
        let got = capture_all(&[dead.id(), live.id(), u32::MAX], &options);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], Captured::Gone);
        assert!(matches!(&got[1], Captured::NotPython { program, .. } if program == "sleep"), "{got:?}");
        assert_eq!(got[2], Captured::Gone);
        live.kill().expect("kill");
        live.wait().expect("reap");
    }

    #[test]
    fn a_shell_wrapper_is_looked_through_to_its_python() {
        let Some(python) = ["python3", "python"]
            .into_iter()
            .find(|p| std::process::Command::new(p).arg("-c").arg("pass").status().is_ok_and(|s| s.success()))
        else {
            eprintln!("skipped: no python3 on PATH");
            return;
        };
        let dir = std::env::temp_dir().join(format!("rp-stacks-wrapper-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let script = dir.join("waits.py");
        std::fs::write(&script, "import time\n\ndef wait_here():\n    time.sleep(60)\n\nwait_here()\n")
            .expect("script");
        // `; exit` keeps the shell from exec-ing python: the worker is the shell.
        let mut shell = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{python} {} ; exit", script.display()))
            .spawn()
            .expect("spawn sh");
        // Bounded wait for python to be running its function (no timed assertion).
        let mut captured = Captured::Gone;
        for _ in 0..200 {
            captured = capture(shell.id(), false);
            if captured.frames().iter().any(|f| f.function == "wait_here") {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        // The python child by its pid (found below, or among the shell's children).
        for child in descendants(shell.id()) {
            // SAFETY: signals a process this test started (the shell's child).
            unsafe { libc::kill(child as i32, libc::SIGKILL) };
        }
        let _ = shell.kill();
        let _ = shell.wait();
        let _ = std::fs::remove_dir_all(&dir);
        match &captured {
            Captured::Python { pid, thread: ThreadChoice::Main, frames, .. } => {
                assert_ne!(*pid, shell.id(), "the python child, not the shell");
                assert_eq!(frames[0], Frame::python("wait_here", "waits.py", 4), "{captured:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[cfg(feature = "native")]
    #[test]
    fn a_process_that_is_not_python_gives_its_native_stack() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        // Bounded wait for sleep to be sleeping (its stack is its start-up's before).
        let mut captured = Captured::Gone;
        for _ in 0..200 {
            captured = capture(child.id(), true);
            if captured.frames().iter().any(|f| f.function.contains("sleep")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        child.kill().expect("kill");
        child.wait().expect("reap");
        match &captured {
            Captured::Native { program, frames, .. } => {
                assert_eq!(program, "sleep");
                assert!(frames.iter().all(|f| f.native), "{frames:?}");
                assert!(frames.iter().any(|f| f.function.contains("sleep")), "{frames:?}");
            }
            other => panic!("{other:?}"),
        }
    }
}
