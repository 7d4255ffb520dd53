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
