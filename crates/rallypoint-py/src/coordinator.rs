//! `_Coordinator`: a `rallypoint_server::Server` running inside the Python process, on a
//! runtime of its own, for `rallypoint.spawn` and for tests.

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;
use rallypoint_client::env::{worker_env, JobEnv, Placement};
use rallypoint_core::Config;
use rallypoint_server::{Server, ServerConfig, ServerHandle};
use tokio::runtime::Runtime;

use crate::errors;

/// A coordinator served by this process until `shutdown()` (or until garbage
/// collected). `listen` is bound exactly; port 0 picks a free port (see `addr`).
#[pyclass(name = "_Coordinator", module = "rallypoint", frozen)]
pub struct Coordinator {
    addr: SocketAddr,
    handle: Mutex<Option<ServerHandle>>,
    runtime: Runtime,
}

#[pymethods]
impl Coordinator {
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:0", lease = None))]
    fn new(py: Python<'_>, listen: &str, lease: Option<f64>) -> PyResult<Self> {
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| errors::invalid(py, format!("listen='{listen}' is not an IP:PORT address: {e}")))?;
        let mut engine = Config::default();
        if let Some(lease) = lease {
            let lease = Duration::try_from_secs_f64(lease)
                .map_err(|_| errors::invalid(py, format!("lease={lease} is not a non-negative number of seconds")))?;
            engine.lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        }
        // Two workers: the coordinator of a spawned job serves every rank's requests.
        let runtime = crate::runtime("rallypoint-coordinator", 2).map_err(PyErr::from)?;
        let server =
            crate::wait(py, &runtime, Server::bind(ServerConfig::new(listen, engine)))?.map_err(PyErr::from)?;
        let addr = server.local_addr();
        let handle = {
            let _context = runtime.enter();
            server.spawn()
        };
        Ok(Coordinator { addr, handle: Mutex::new(Some(handle)), runtime })
    }

    /// `host:port` the coordinator listens on (the real port when 0 was asked).
    #[getter]
    fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// The IP address it listens on (for MASTER_ADDR).
    #[getter]
    fn host(&self) -> String {
        self.addr.ip().to_string()
    }

    /// The port it listens on (for MASTER_PORT).
    #[getter]
    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The environment `rallypoint launch` gives a worker of a one-node job served by
    /// this coordinator: torchrun's variables plus RALLYPOINT_ADDR and RALLYPOINT_JOB.
    /// Taken from the launcher itself, so `spawn` and `launch` cannot drift apart.
    fn worker_env(&self, rank: u32, nprocs: u32, job: &str) -> Vec<(&'static str, String)> {
        let job = JobEnv {
            coordinator: self.addr,
            node_agent: None,
            run_id: job.to_owned(),
            role: "default".to_owned(),
            attempt_job: job.to_owned(),
            restart_count: 0,
            max_restarts: 0,
        };
        let placement =
            Placement { rank, local_rank: rank, world_size: nprocs, local_world_size: nprocs, node_rank: 0, nnodes: 1 };
        let inherited_omp = std::env::var_os("OMP_NUM_THREADS").is_some();
        worker_env(&job, &placement, inherited_omp)
            .into_iter()
            .map(|(name, value)| (name, value.to_string_lossy().into_owned()))
            .collect()
    }

    /// Stops accepting, closes every connection (their ranks count as lost) and
    /// waits until the server is done. Does nothing the second time.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.handle.lock().unwrap_or_else(PoisonError::into_inner).take();
        match handle {
            Some(handle) => crate::wait(py, &self.runtime, handle.shutdown()),
            None => Ok(()),
        }
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.shutdown(py)
    }

    fn __repr__(&self) -> String {
        let state =
            if self.handle.lock().unwrap_or_else(PoisonError::into_inner).is_some() { "serving" } else { "stopped" };
        format!("_Coordinator(addr='{}', {state})", self.addr)
    }
}
