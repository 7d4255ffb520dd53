//! What the integration tests that start launchers and verbs share.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Variables a launcher, a verb or a worker would otherwise inherit from the test's
/// own environment (a test run inside a job, or with a token set): removed from
/// every command a test starts, before the test sets its own.
pub const SCRUB: &[&str] = &[
    "RALLYPOINT_ADDR",
    "RALLYPOINT_JOB",
    "RALLYPOINT_TOKEN",
    "RALLYPOINT_TOKEN_FILE",
    "RALLYPOINT_TLS_CA",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
    "PET_NPROC_PER_NODE",
    "PET_NNODES",
    "PET_RDZV_ID",
    "PET_STANDALONE",
    "PET_HANG_TIMEOUT",
    "OMP_NUM_THREADS",
    "PYTHON_EXEC",
    "RUST_LOG",
    "SLURM_JOB_ID",
];

/// The project's venv Python with torch (scripts/test makes it), if it is there.
#[allow(dead_code)] // not every test file runs torch
pub fn torch_python() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let python = Path::new(&home).join(".cache/rallypoint/venv/bin/python");
    let has_torch = Command::new(&python)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    has_torch.then_some(python)
}

/// Every thread's stack of process `pid` (gdb, where installed), for the message of a
/// test that found the process hung: without it a rare hang in CI says nothing of
/// where it was. Includes the process's children (workers, the watchdog), by pid.
#[allow(dead_code)] // only the tests that wait on launchers use it
pub fn stacks_of(pid: u32) -> String {
    let mut pids = vec![pid];
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    pids.extend(children.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    let mut out = String::new();
    for pid in pids {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default().replace('\0', " ");
        out.push_str(&format!("--- pid {pid}: {}\n", comm.trim()));
        let gdb = Command::new("timeout")
            .args(["20", "gdb", "-p", &pid.to_string(), "-batch", "-nx", "-ex", "thread apply all bt"])
            .stdin(Stdio::null())
            .output();
        match gdb {
            Ok(o) if !o.stdout.is_empty() => {
                let text = String::from_utf8_lossy(&o.stdout);
                // gdb's own chatter (symbol loading) is not the stacks.
                out.extend(
                    text.lines().filter(|l| l.starts_with('#') || l.starts_with("Thread")).map(|l| format!("{l}\n")),
                );
            }
            Ok(_) | Err(_) => out.push_str("(no stacks: gdb is not installed or could not attach)\n"),
        }
    }
    out
}
