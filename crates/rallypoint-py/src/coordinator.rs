//! `_Coordinator`: a `rallypoint_server::Server` running inside the Python process, on a
//! runtime of its own, for `rallypoint.spawn` and for tests.

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

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
    /// Required of every client, and given to workers by `worker_env`.
    token: Option<String>,
    handle: Mutex<Option<ServerHandle>>,
    runtime: crate::ParentOnly<Runtime>,
}

/// In a child forked from the process serving it, the coordinator is the parent's:
/// its handle is left alone (and the runtime, see [`crate::ParentOnly`]).
impl Drop for Coordinator {
    fn drop(&mut self) {
        if self.runtime.forked() {
            std::mem::forget(self.handle.get_mut().unwrap_or_else(PoisonError::into_inner).take());
        }
    }
}

#[pymethods]
impl Coordinator {
    /// `token`: clients must prove it (and the coordinator proves it back);
    /// `tls_cert` and `tls_key` (PEM files): serve native clients over TLS only.
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:0", lease = None, reconnect_grace = None, token = None, tls_cert = None, tls_key = None))]
    fn new(
        py: Python<'_>,
        listen: &str,
        lease: Option<f64>,
        reconnect_grace: Option<f64>,
        token: Option<String>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| errors::invalid(py, format!("listen='{listen}' is not an IP:PORT address: {e}")))?;
        let mut engine = Config::default();
        if let Some(lease) = lease {
            let lease = crate::client::duration(py, "lease", lease)?;
            engine.lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        }
        if let Some(grace) = reconnect_grace {
            let grace = crate::client::duration(py, "reconnect_grace", grace)?;
            engine.reconnect_grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        }
        // Two workers: the coordinator of a spawned job serves every rank's requests.
        let runtime = crate::runtime("rallypoint-coordinator", 2).map_err(PyErr::from)?;
        let mut config = ServerConfig::new(listen, engine);
        let invalid = |message: String| errors::invalid(py, message);
        if let Some(token) = &token {
            let token = rallypoint_client::Token::new(token.as_str(), "the token argument")
                .map_err(|e| invalid(e.to_string()))?;
            config.token = Some(std::sync::Arc::new(token));
        }
        config.tls = match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => {
                Some(rallypoint_server::TlsServer::from_pem_files(&cert, &key).map_err(|e| invalid(e.to_string()))?)
            }
            (None, None) => None,
            _ => return Err(invalid("give both tls_cert and tls_key, or neither".to_owned())),
        };
        let server = crate::wait(py, &runtime, Server::bind(config))?.map_err(PyErr::from)?;
        let addr = server.local_addr();
        let handle = {
            let _context = runtime.enter();
            server.spawn()
        };
        Ok(Coordinator { addr, token, handle: Mutex::new(Some(handle)), runtime: crate::ParentOnly::new(runtime) })
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
            // A coordinator of its own per spawn: no earlier run to tell apart.
            job_incarnation: None,
            token_file: None,
        };
        let placement =
            Placement { rank, local_rank: rank, world_size: nprocs, local_world_size: nprocs, node_rank: 0, nnodes: 1 };
        let inherited_omp = std::env::var_os("OMP_NUM_THREADS").is_some();
        let mut env: Vec<(&'static str, String)> = worker_env(&job, &placement, inherited_omp)
            .into_iter()
            .map(|(name, value)| (name, value.to_string_lossy().into_owned()))
            .collect();
        // This coordinator's token, and nothing of another coordinator's from the
        // parent's environment (a token file would win over the token; no TLS here).
        if let Some(token) = &self.token {
            env.retain(|(name, _)| *name != rallypoint_client::TOKEN_VAR);
            env.push((rallypoint_client::TOKEN_VAR, token.clone()));
        }
        env.push((rallypoint_client::TLS_CA_VAR, String::new()));
        env
    }

    /// Stops accepting, closes every connection (their ranks count as lost) and
    /// waits until the server is done. Does nothing the second time, nor in a child
    /// forked from the process serving it (the coordinator is the parent's).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.handle.lock().unwrap_or_else(PoisonError::into_inner).take();
        if self.runtime.forked() {
            std::mem::forget(handle);
            return Ok(());
        }
        match handle {
            Some(handle) => crate::wait(py, &*self.runtime, handle.shutdown()),
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
