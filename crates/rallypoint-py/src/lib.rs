//! `rallypoint._native`: the Rust half of the `rallypoint` Python package.
//!
//! [`client::Client`] wraps the async `rallypoint_client::Client` on a
//! `rallypoint_client::CallerRuntime` of its own; [`coordinator::Coordinator`] runs a
//! `rallypoint_client::Server` in the process (for `rallypoint.spawn` and tests). The
//! public API, the exception classes and `spawn` are in the pure-Python part
//! (`python/rallypoint`).

mod client;
mod coordinator;
mod errors;

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

/// How long a blocking call waits with the GIL released before it runs Python's
/// signal handlers, so that Ctrl-C interrupts any wait within about this long.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// Runs `future` on `runtime` to completion without holding the GIL, in slices of
/// [`SLICE`]; between slices, pending signals are handled, and an exception they
/// raise (KeyboardInterrupt) drops the future and is returned.
fn wait<F>(py: Python<'_>, runtime: &impl BlockOn, future: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let mut future = pin!(future);
    loop {
        // The timer must be made inside the runtime, hence the async block.
        let sliced = py.detach(|| runtime.block_on(async { tokio::time::timeout(SLICE, future.as_mut()).await }));
        match sliced {
            Ok(output) => return Ok(output),
            Err(_elapsed) => py.check_signals()?,
        }
    }
}

/// A value a child forked from the process that made it leaks instead of dropping:
/// a runtime's worker threads are not in the child, and dropping the runtime there
/// waits for them for good.
pub(crate) struct ParentOnly<T> {
    /// `None` only once leaked.
    value: Option<T>,
    made_by: u32,
}

impl<T> ParentOnly<T> {
    pub(crate) fn new(value: T) -> Self {
        ParentOnly { value: Some(value), made_by: std::process::id() }
    }

    /// Whether this process is a child forked since.
    pub(crate) fn forked(&self) -> bool {
        std::process::id() != self.made_by
    }
}

impl<T> std::ops::Deref for ParentOnly<T> {
    type Target = T;

    fn deref(&self) -> &T {
        match &self.value {
            Some(value) => value,
            None => unreachable!("taken only when dropped"),
        }
    }
}

impl<T> Drop for ParentOnly<T> {
    fn drop(&mut self) {
        if self.forked() {
            std::mem::forget(self.value.take());
        }
    }
}

/// What runs a future to completion in the calling thread.
trait BlockOn: Sync {
    fn block_on<F: Future>(&self, future: F) -> F::Output;
}

impl BlockOn for Runtime {
    fn block_on<F: Future>(&self, future: F) -> F::Output {
        Runtime::block_on(self, future)
    }
}

impl BlockOn for rallypoint_client::CallerRuntime {
    fn block_on<F: Future>(&self, future: F) -> F::Output {
        rallypoint_client::CallerRuntime::block_on(self, future)
    }
}

/// A runtime of `threads` worker threads, for the embedded coordinator.
fn runtime(name: &str, threads: usize) -> std::io::Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(threads).thread_name(name).enable_all().build()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::Client>()?;
    m.add_class::<coordinator::Coordinator>()?;
    // The crate's version is the package's (maturin takes it from Cargo.toml), and the
    // `rallypoint` command of the same wheel reports it too.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
