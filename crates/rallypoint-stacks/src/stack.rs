//! One process's stack, as data.

use serde::{Deserialize, Serialize};

/// One call of a stack.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    /// The function: `load_batch`, `Trainer.step` (Python 3.11+ qualifies methods),
    /// or a native symbol.
    pub function: String,
    /// Python: the file as imported (`torch/distributed/distributed_c10d.py`, relative
    /// to its entry of `sys.path`, or as the script was named). Native: the source file
    /// when the library has line tables, else the library (`libc.so.6`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    /// A frame of compiled code (C, C++, Rust), not of Python.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub native: bool,
}

impl Frame {
    pub fn python(function: impl Into<String>, file: impl Into<String>, line: u32) -> Frame {
        Frame { function: function.into(), file: Some(file.into()), line: Some(line), native: false }
    }
}

/// Which of a Python process's threads a stack is of: the main thread, where a
/// training loop runs; failing that (it has ended while other threads run on), the
/// thread holding the GIL; failing that, the first one listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThreadChoice {
    Main,
    GilHolder,
    Other,
}

/// What reading one process's stack gave.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Captured {
    /// A Python process: the frames of one thread, innermost first.
    Python {
        /// The process read: the worker, or the Python process it runs (a worker that
        /// is a shell script running python).
        pid: u32,
        thread: ThreadChoice,
        /// The thread's name (`MainThread`, or a `threading.Thread`'s).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        thread_name: Option<String>,
        /// Python threads in the process.
        threads: u32,
        /// Whether native frames are merged in (`--native`).
        #[serde(default)]
        native: bool,
        frames: Vec<Frame>,
        /// The process was stopped (SIGSTOP, a debugger) when read: it is not where
        /// it waits, it is where it was frozen.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        stopped: bool,
    },
    /// A process that is not Python, with its native frames (`--native`).
    Native { pid: u32, program: String, frames: Vec<Frame> },
    /// A process that is not Python (and native frames were not asked for, or could
    /// not be read).
    NotPython {
        pid: u32,
        program: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
        /// As for `Python`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        stopped: bool,
    },
    /// The process ended before its stack could be read.
    Gone,
    /// Reading its stack took longer than the bound given, and was given up.
    TimedOut { after_ms: u64 },
    /// The kernel refused to let this process be read; `reason` says why and what to
    /// change.
    Refused { reason: String },
    /// Reading failed for another reason.
    Failed { error: String },
}

impl Captured {
    /// The frames, if there are any.
    pub fn frames(&self) -> &[Frame] {
        match self {
            Captured::Python { frames, .. } | Captured::Native { frames, .. } => frames,
            _ => &[],
        }
    }
}

/// One rank's stack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankStack {
    pub rank: u32,
    /// The worker process (its launcher's child).
    pub pid: u32,
    pub captured: Captured,
}
