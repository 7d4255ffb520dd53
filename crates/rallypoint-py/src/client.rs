//! `rallypoint.Client`: the async Rust client on a runtime owned by the Python object,
//! driven by the calling thread while it waits (`rallypoint_client::CallerRuntime`).
//! Every call releases the GIL and waits interruptibly ([`crate::wait`]).

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyMemoryView, PyString};
use rallypoint_client::env::{self, Overrides, Settings};
use rallypoint_client::DEFAULT_TIMEOUT;
use rallypoint_client::{
    CallerRuntime, ConnectOptions, Credentials, Error, Identity, InThread, Interrupt, Members, TlsClient, Token,
};

use crate::errors;

/// A connection to the coordinator as one rank (or as a rank-less tool).
///
/// Share one client between threads freely. Call `close()` when done (or use it as
/// a context manager): a process that exits without closing counts as dead, so its
/// peers fail at once with `PeerLost`.
#[pyclass(module = "rallypoint", frozen)]
pub struct Client {
    addr: String,
    identity: Identity,
    /// From the environment (`from_env`), for choosing a device; not sent to the coordinator.
    local_rank: Option<u32>,
    timeout: Duration,
    /// `None` once closed.
    client: Mutex<Option<rallypoint_client::Client>>,
    runtime: CallerRuntime,
}

/// Bytes of a key or value given as `str` (UTF-8), `bytes` or `bytearray`.
fn blob(what: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = value.cast::<PyBytes>() {
        Ok(bytes.as_bytes().to_vec())
    } else if let Ok(text) = value.cast::<PyString>() {
        Ok(text.to_cow()?.as_bytes().to_vec())
    } else if let Ok(array) = value.cast::<PyByteArray>() {
        Ok(array.to_vec())
    } else if value.is_instance_of::<PyMemoryView>() {
        // Its bytes, in order, whatever its shape (a NumPy array's buffer, a slice).
        let bytes = value.call_method0("tobytes")?;
        Ok(bytes.cast::<PyBytes>().map_err(PyErr::from)?.as_bytes().to_vec())
    } else {
        Err(errors::wrong_type(what, value))
    }
}

/// A list of keys; a single `str` or `bytes` counts as a list of one key (rather
/// than a sequence of characters).
fn blobs(what: &str, values: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    if values.is_instance_of::<PyString>() || values.is_instance_of::<PyBytes>() {
        return Ok(vec![blob(what, values)?]);
    }
    values.try_iter()?.map(|item| blob(what, &item?)).collect()
}

/// Seconds given for a wait: a century at most (`inf` is one: forever, in practice).
pub(crate) fn duration(py: Python<'_>, what: &str, secs: f64) -> PyResult<Duration> {
    env::seconds(secs).ok_or_else(|| errors::invalid(py, env::not_seconds(format_args!("{what}={secs}"))))
}

fn timeout(py: Python<'_>, secs: Option<f64>) -> PyResult<Option<Duration>> {
    secs.map(|secs| duration(py, "timeout", secs)).transpose()
}

fn rank(py: Python<'_>, what: &str, rank: i64) -> PyResult<u32> {
    u32::try_from(rank).map_err(|_| match rank < 0 {
        true => errors::invalid(py, format!("{what}={rank} is not a non-negative integer")),
        false => errors::invalid(py, format!("{what}={rank} is beyond the largest rank, {}", u32::MAX)),
    })
}

/// An integer argument as `T`: a bool or a non-integer is a TypeError; one out of
/// `T`'s range an InvalidArgument saying so (not Python's OverflowError).
fn integer<T: TryFrom<i128>>(py: Python<'_>, what: &str, value: &Bound<'_, PyAny>, range: &str) -> PyResult<T> {
    let int = value.cast::<pyo3::types::PyInt>().ok().filter(|_| !value.is_instance_of::<pyo3::types::PyBool>());
    let Some(int) = int else { return Err(errors::not_of("an int", what, value)) };
    let out_of_range = || errors::invalid(py, format!("{what}={int} is out of range ({range})"));
    let wide: i128 = int.extract().map_err(|_| out_of_range())?;
    T::try_from(wide).map_err(|_| out_of_range())
}

/// The members of a collective: every rank, the listed ranks, or a role's ranks.
fn members(py: Python<'_>, ranks: Option<&Bound<'_, PyAny>>, role: Option<String>) -> PyResult<Members> {
    match (ranks, role) {
        (None, None) => Ok(Members::World),
        (Some(ranks), None) => {
            // Text iterates, by character: not a sequence of ranks either.
            let text = ranks.is_instance_of::<PyString>() || ranks.is_instance_of::<PyBytes>();
            let iter = ranks.try_iter().ok().filter(|_| !text);
            let Some(iter) = iter else { return Err(errors::not_of("a sequence of ints", "ranks", ranks)) };
            let list = iter.map(|r| {
                let r = integer::<i64>(py, "ranks", &r?, "ranks are 0 to 4294967295")?;
                rank(py, "ranks", r)
            });
            Ok(Members::Ranks(list.collect::<PyResult<_>>()?))
        }
        (None, Some(role)) => Ok(Members::Role(role.into())),
        (Some(_), Some(_)) => Err(errors::invalid(py, "give ranks or role, not both".to_owned())),
    }
}

fn list<'py>(py: Python<'py>, values: &[bytes::Bytes]) -> Vec<Bound<'py, PyBytes>> {
    values.iter().map(|v| PyBytes::new(py, v)).collect()
}

/// The credentials of `Client(...)`: the arguments, else the environment (as
/// `Client.from_env()` takes them), so a client made in a launched worker proves
/// the job's token without being told.
fn credentials(py: Python<'_>, token: Option<String>, tls_ca: Option<PathBuf>) -> PyResult<Credentials> {
    let config = |message: String| errors::to_py(py, Error::Config(message));
    let token = match token {
        Some(token) => Some(Token::new(token, "the token argument")),
        None => Token::from_env().transpose(),
    };
    let token = token.transpose().map_err(|e| config(e.to_string()))?.map(Arc::new);
    let tls_ca =
        tls_ca.or_else(|| std::env::var_os(rallypoint_client::TLS_CA_VAR).filter(|v| !v.is_empty()).map(PathBuf::from));
    let tls = tls_ca.map(|ca| TlsClient::from_ca_file(&ca)).transpose().map_err(|e| config(e.to_string()))?;
    Ok(Credentials { token, tls })
}

impl Client {
    fn connect(
        py: Python<'_>,
        addr: String,
        identity: Identity,
        local_rank: Option<u32>,
        timeout: Duration,
        credentials: Credentials,
    ) -> PyResult<Client> {
        let runtime = CallerRuntime::new("rallypoint-client", Duration::MAX).map_err(|source| {
            errors::to_py(py, Error::Connect { addr: addr.clone(), waited: Duration::ZERO, source })
        })?;
        let mut options = ConnectOptions::new(addr.clone(), identity).with_timeout(timeout);
        options.credentials = credentials;
        let client = crate::wait(py, &runtime, rallypoint_client::Client::connect_with(options))?
            .map_err(|e| errors::to_py(py, e))?;
        if let Some(period) = client.heartbeat_period() {
            runtime.set_idle(period / 2);
        }
        // The identity with the host and pid that connect filled in.
        let identity = client.identity().clone();
        Ok(Client { addr, identity, local_rank, timeout, client: Mutex::new(Some(client)), runtime })
    }

    /// A handle on the connection, or an error once the client is closed.
    fn handle(&self, py: Python<'_>) -> PyResult<rallypoint_client::Client> {
        if self.runtime.forked() {
            let (made_by, here) = (self.identity.pid, std::process::id());
            let message = format!(
                "this client of {} was made in process {made_by}, and this process ({here}) was forked from it: \
                 its connection is the parent's; make a new client here",
                self.addr
            );
            return Err(errors::to_py(py, Error::Disconnected(message)));
        }
        let client = self.client.lock().unwrap_or_else(PoisonError::into_inner).clone();
        client.ok_or_else(|| errors::to_py(py, Error::Disconnected(format!("the client for {} is closed", self.addr))))
    }

    /// Runs one operation on this client's runtime, interruptibly, without the GIL.
    fn run<T: Send>(&self, py: Python<'_>, op: impl Future<Output = Result<T, Error>> + Send) -> PyResult<T> {
        crate::wait(py, &self.runtime, op)?.map_err(|e| errors::to_py(py, e))
    }

    /// The connection, taken to be closed or dropped; `None` in a child forked since
    /// the client was made, where it is the parent's: left to the parent, untouched.
    fn take(&self) -> Option<rallypoint_client::Client> {
        let client = self.client.lock().unwrap_or_else(PoisonError::into_inner).take();
        if self.runtime.forked() {
            std::mem::forget(client);
            return None;
        }
        client
    }

    /// Drops the connection as a crash would, telling the coordinator first (see
    /// `rallypoint_client::Client::abandon`): the runtime goes with this object.
    fn abandon(&self, py: Python<'_>) {
        if let Some(client) = self.take() {
            let _ = crate::wait(py, &self.runtime, async move {
                let _ = tokio::time::timeout(ABANDON_WAIT, client.abandon()).await;
            });
        }
    }
}

/// Whether `exc` is a `SystemExit` saying success (`sys.exit()`, `sys.exit(0)`): the
/// process ends as one that returned does.
fn successful_exit(exc: &Bound<'_, PyAny>) -> bool {
    exc.is_instance_of::<pyo3::exceptions::PySystemExit>()
        && exc.getattr("code").is_ok_and(|code| code.is_none() || code.extract::<i64>().is_ok_and(|c| c == 0))
}

/// How long dropping a client waits for the coordinator to be told.
const ABANDON_WAIT: Duration = Duration::from_secs(1);

/// A client garbage-collected without `close()` counts as a crash, told to the
/// coordinator before its runtime goes. Waits on a channel rather than `block_on`,
/// which cannot run where a runtime is current.
impl Drop for Client {
    fn drop(&mut self) {
        if let Some(client) = self.take() {
            let (said, told) = std::sync::mpsc::channel();
            self.runtime.spawn(async move {
                client.abandon().await;
                let _ = said.send(());
            });
            self.runtime.drive_now();
            let _ = told.recv_timeout(ABANDON_WAIT);
        }
    }
}

#[pymethods]
impl Client {
    /// Connects to the coordinator at `addr` ("host:port"), retrying for up to
    /// `timeout` seconds (default 300), which is also the default timeout of every
    /// blocking call. Without `rank` and `world_size` only the key-value store and
    /// `abort` are usable. `token` (else RALLYPOINT_TOKEN_FILE's file, else
    /// RALLYPOINT_TOKEN) is proven to the coordinator, which must prove it back;
    /// `tls_ca` (else RALLYPOINT_TLS_CA): connect over TLS trusting that CA file.
    #[new]
    #[pyo3(signature = (addr, rank = None, world_size = None, job = "default", role = None, timeout = None, token = None, tls_ca = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        addr: String,
        rank: Option<i64>,
        world_size: Option<i64>,
        job: &str,
        role: Option<String>,
        timeout: Option<f64>,
        token: Option<String>,
        tls_ca: Option<PathBuf>,
    ) -> PyResult<Self> {
        let rank = rank.map(|r| crate::client::rank(py, "rank", r)).transpose()?;
        let world_size = world_size.map(env::world_size_of).transpose().map_err(|e| errors::invalid(py, e))?;
        if let (Some(rank), Some(world_size)) = (rank, world_size) {
            if rank >= world_size {
                let message =
                    format!("rank {rank} is not below the world size {world_size} (ranks are 0 to {})", world_size - 1);
                return Err(errors::invalid(py, message));
            }
        }
        let timeout = crate::client::timeout(py, timeout)?.unwrap_or(DEFAULT_TIMEOUT);
        let identity = Identity { rank, world_size, role, ..Identity::anonymous(job) };
        let credentials = credentials(py, token, tls_ca)?;
        Client::connect(py, addr, identity, None, timeout, credentials)
    }

    /// Connects with the settings a launcher gives (`rallypoint launch`,
    /// `rallypoint.spawn`; under torchrun, whose MASTER_ADDR:MASTER_PORT is torch's
    /// own store, set RALLYPOINT_ADDR to a `rallypoint serve`): address from
    /// RALLYPOINT_ADDR, else MASTER_ADDR and MASTER_PORT; job from RALLYPOINT_JOB, else TORCHELASTIC_RUN_ID, else
    /// SLURM_JOB_ID, else "default"; RANK, WORLD_SIZE and LOCAL_RANK, else (outside a
    /// launcher) SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; role from
    /// RALLYPOINT_ROLE, else ROLE_NAME; timeout from RALLYPOINT_TIMEOUT, else 300 s;
    /// token from the file RALLYPOINT_TOKEN_FILE names, else RALLYPOINT_TOKEN; TLS CA
    /// from RALLYPOINT_TLS_CA. Arguments given here win over the environment.
    #[staticmethod]
    #[pyo3(signature = (*, addr = None, rank = None, world_size = None, job = None, role = None, timeout = None, token = None, tls_ca = None))]
    #[allow(clippy::too_many_arguments)]
    fn from_env(
        py: Python<'_>,
        addr: Option<String>,
        rank: Option<i64>,
        world_size: Option<i64>,
        job: Option<String>,
        role: Option<String>,
        timeout: Option<f64>,
        token: Option<String>,
        tls_ca: Option<PathBuf>,
    ) -> PyResult<Self> {
        let overrides =
            Overrides { addr, job, rank, world_size, role, timeout_secs: timeout, token, token_file: None, tls_ca };
        let settings = Settings::resolve(overrides).map_err(|e| errors::to_py(py, e))?;
        let identity = settings.identity();
        let credentials = Credentials { token: settings.token.clone(), tls: settings.tls.clone() };
        Client::connect(py, settings.addr, identity, settings.local_rank, settings.timeout, credentials)
    }

    /// This client's rank, or None for a rank-less client.
    #[getter]
    fn rank(&self) -> Option<u32> {
        self.identity.rank
    }

    #[getter]
    fn world_size(&self) -> Option<u32> {
        self.identity.world_size
    }

    /// This process's index on its node (LOCAL_RANK, or SLURM_LOCALID under srun),
    /// for choosing a device; None for a client made with `Client(...)` or when no
    /// launcher set it.
    #[getter]
    fn local_rank(&self) -> Option<u32> {
        self.local_rank
    }

    #[getter]
    fn job(&self) -> &str {
        &self.identity.job
    }

    /// The role this client joined as (for `barrier(role=...)`), or None.
    #[getter]
    fn role(&self) -> Option<&str> {
        self.identity.role.as_deref()
    }

    /// The coordinator's address as given.
    #[getter]
    fn addr(&self) -> &str {
        &self.addr
    }

    /// Default timeout of blocking calls, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// Whether `close()` was called (or the context manager exited).
    #[getter]
    fn closed(&self) -> bool {
        self.client.lock().unwrap_or_else(PoisonError::into_inner).is_none()
    }

    /// Stores `value` under `key` (each str, bytes, bytearray or memoryview; str is stored as UTF-8).
    fn set(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let (key, value) = (blob("key", key)?, blob("value", value)?);
        let client = self.handle(py)?;
        self.run(py, client.set(key, value))
    }

    /// The value of `key`, waiting until it exists (at most `timeout` seconds).
    #[pyo3(signature = (key, timeout = None))]
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let (key, timeout) = (blob("key", key)?, crate::client::timeout(py, timeout)?);
        let client = self.handle(py)?;
        let value = self.run(py, client.get(key, timeout))?;
        Ok(PyBytes::new(py, &value))
    }

    /// Adds `n` to the decimal integer stored at `key` (missing counts as 0); returns the sum.
    fn add(&self, py: Python<'_>, key: &Bound<'_, PyAny>, n: &Bound<'_, PyAny>) -> PyResult<i64> {
        let key = blob("key", key)?;
        let n = integer::<i64>(py, "n", n, "a signed 64-bit integer")?;
        let client = self.handle(py)?;
        self.run(py, client.add(key, n))
    }

    /// Sets `desired` if the value is `expected` (or the key is missing and
    /// `expected` is empty); returns the value now stored. A missing key with a
    /// non-empty `expected` stays missing, and `expected` is returned (as torch's
    /// TCPStore does).
    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
        expected: &Bound<'_, PyAny>,
        desired: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (key, expected, desired) = (blob("key", key)?, blob("expected", expected)?, blob("desired", desired)?);
        let client = self.handle(py)?;
        let value = self.run(py, client.compare_set(key, expected, desired))?;
        Ok(PyBytes::new(py, &value))
    }

    /// Appends `value` to the value of `key` (a missing key counts as empty).
    fn append(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let (key, value) = (blob("key", key)?, blob("value", value)?);
        let client = self.handle(py)?;
        self.run(py, client.append(key, value))
    }

    /// Deletes `key`; returns whether it existed.
    fn delete(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = blob("key", key)?;
        let client = self.handle(py)?;
        self.run(py, client.delete(key))
    }

    /// Whether every key exists now (no waiting).
    fn check(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<bool> {
        let keys = blobs("key", keys)?;
        let client = self.handle(py)?;
        self.run(py, client.check(&keys))
    }

    /// Waits until every key exists (at most `timeout` seconds).
    #[pyo3(signature = (keys, timeout = None))]
    fn wait(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<()> {
        let (keys, timeout) = (blobs("key", keys)?, crate::client::timeout(py, timeout)?);
        let client = self.handle(py)?;
        self.run(py, client.wait(&keys, timeout))
    }

    /// Waits until every key exists; returns their values in the order asked.
    #[pyo3(signature = (keys, timeout = None))]
    fn multi_get<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let (keys, timeout) = (blobs("key", keys)?, crate::client::timeout(py, timeout)?);
        let client = self.handle(py)?;
        let values = self.run(py, client.multi_get(&keys, timeout))?;
        Ok(list(py, &values))
    }

    /// Sets `keys[i]` to `values[i]` for every i, in one request.
    fn multi_set(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let (keys, values) = (blobs("key", keys)?, blobs("value", values)?);
        if keys.len() != values.len() {
            return Err(errors::invalid(py, format!("multi_set got {} keys but {} values", keys.len(), values.len())));
        }
        let entries: Vec<(Vec<u8>, Vec<u8>)> = keys.into_iter().zip(values).collect();
        let client = self.handle(py)?;
        self.run(py, client.multi_set(&entries))
    }

    /// Number of keys in this job's store.
    fn num_keys(&self, py: Python<'_>) -> PyResult<i64> {
        let client = self.handle(py)?;
        self.run(py, client.num_keys())
    }

    /// The keys starting with `prefix`, sorted.
    #[pyo3(signature = (prefix = None))]
    fn list_keys<'py>(&self, py: Python<'py>, prefix: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let prefix = prefix.map(|p| blob("prefix", p)).transpose()?.unwrap_or_default();
        let client = self.handle(py)?;
        let keys = self.run(py, client.list_keys(prefix))?;
        Ok(list(py, &keys))
    }

    /// Waits until every member has called this barrier. Members: all ranks, or
    /// `ranks`, or the ranks that joined as `role`. The n-th call of a name meets
    /// the other members' n-th call. Raises BarrierTimeout naming every missing
    /// rank, PeerLost as soon as a member dies.
    #[pyo3(signature = (name = "default", ranks = None, role = None, timeout = None))]
    fn barrier(
        &self,
        py: Python<'_>,
        name: &str,
        ranks: Option<&Bound<'_, PyAny>>,
        role: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let (members, timeout) = (members(py, ranks, role)?, crate::client::timeout(py, timeout)?);
        let client = self.handle(py)?;
        // Through the channel seat a rank holds under a node agent, the call waits in
        // this thread on shared memory: the release wakes this thread alone, where
        // through the runtime it would wake a worker that then wakes this thread.
        let mut signalled = None;
        let mut check = || match Python::attach(|py| py.check_signals()) {
            Ok(()) => false,
            Err(raised) => {
                signalled = Some(raised);
                true
            }
        };
        let interrupt = Interrupt { every: crate::SLICE, check: &mut check };
        match py.detach(|| client.barrier_in_thread(name, &members, timeout, Some(interrupt))) {
            InThread::Done(outcome) => outcome.map_err(|e| errors::to_py(py, e)),
            InThread::Conclude(concluding) => self.run(py, concluding.finish()),
            InThread::Elsewhere => self.run(py, client.barrier(name, members, timeout)),
            InThread::Interrupted => Err(signalled
                .unwrap_or_else(|| pyo3::exceptions::PyKeyboardInterrupt::new_err("the barrier was interrupted"))),
        }
    }

    /// Every member contributes `value`; returns all values in rank order.
    #[pyo3(signature = (value, name = "default", ranks = None, role = None, timeout = None))]
    fn all_gather<'py>(
        &self,
        py: Python<'py>,
        value: &Bound<'_, PyAny>,
        name: &str,
        ranks: Option<&Bound<'_, PyAny>>,
        role: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let value = blob("value", value)?;
        let (members, timeout) = (members(py, ranks, role)?, crate::client::timeout(py, timeout)?);
        let client = self.handle(py)?;
        let gathered = self.run(py, client.all_gather(name, members, value, timeout))?;
        // Each value is copied into its Python bytes straight from the reply.
        Ok(gathered.iter().map(|value| PyBytes::new(py, value)).collect())
    }

    /// Returns `root`'s value on every member; the root must pass a value, the
    /// others may pass None.
    #[pyo3(signature = (value, root = 0, name = "default", ranks = None, role = None, timeout = None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: every argument is a keyword
    fn broadcast<'py>(
        &self,
        py: Python<'py>,
        value: Option<&Bound<'_, PyAny>>,
        root: i64,
        name: &str,
        ranks: Option<&Bound<'_, PyAny>>,
        role: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let value = value.map(|v| blob("value", v)).transpose()?;
        let root = crate::client::rank(py, "root", root)?;
        let (members, timeout) = (members(py, ranks, role)?, crate::client::timeout(py, timeout)?);
        let client = self.handle(py)?;
        let value = self.run(py, client.broadcast(name, members, root, value.as_deref(), timeout))?;
        Ok(PyBytes::new(py, &value))
    }

    /// Barrier on entry and on exit of a `with` block (`name + ":enter"`, then
    /// `name + ":exit"`). If the block raises, the exit barrier is skipped.
    #[pyo3(signature = (name, ranks = None, role = None, timeout = None))]
    fn scope<'py>(
        slf: &Bound<'py, Self>,
        name: &str,
        ranks: Option<&Bound<'py, PyAny>>,
        role: Option<String>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let scope = py.import("rallypoint._scope")?.getattr("Scope")?;
        scope.call1((slf, name, ranks, role, timeout))
    }

    /// Fails every pending and later operation of the job, on every rank, with
    /// Aborted naming this client and `reason`.
    fn abort(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        let client = self.handle(py)?;
        self.run(py, client.abort(reason))
    }

    /// Starts job incarnation `incarnation` afresh (what `rallypoint reset` does): the
    /// job's keys, barrier generations, abort and lost ranks are gone, and every
    /// pending and later operation of its processes (this client's too) raises
    /// JobReset. Nothing if the job is at that incarnation already.
    fn reset(&self, py: Python<'_>, incarnation: &Bound<'_, PyAny>) -> PyResult<()> {
        let incarnation = integer::<u64>(py, "incarnation", incarnation, "0 to 2**64 - 1")?;
        let client = self.handle(py)?;
        self.run(py, client.reset(incarnation))
    }

    /// The incarnation the job was at when this client (last) connected, or None if
    /// it was never reset nor named (RALLYPOINT_JOB_INCARNATION).
    #[getter]
    fn job_incarnation(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        Ok(self.handle(py)?.job_incarnation())
    }

    /// Tells the coordinator that the worker process `pid` of `rank` ended with
    /// `exitcode` (multiprocessing's: negative for a signal), as a launcher does:
    /// a collective that still needs a rank done early fails at once, naming it.
    /// For `spawn`.
    fn _rank_exited(&self, py: Python<'_>, rank: i64, pid: u32, exitcode: i32) -> PyResult<()> {
        let rank = crate::client::rank(py, "rank", rank)?;
        let exit = match exitcode {
            code if code < 0 => rallypoint_core::Exit::Signal(-code),
            code => rallypoint_core::Exit::Code(code),
        };
        let client = self.handle(py)?;
        let host = self.identity.host.clone();
        self.run(py, async move { client.rank_exited(rank, &host, pid, exit).await })
    }

    /// Leaves cleanly: the coordinator records that this rank left (it may come
    /// back) rather than died. Does nothing the second time. Closed all the same
    /// when the coordinator cannot be told (the connection is lost, the job
    /// aborted): a RuntimeWarning says so, as cleanup code must not fail on it.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(client) = self.take() else { return Ok(()) };
        match crate::wait(py, &self.runtime, client.close())? {
            Ok(()) => Ok(()),
            Err(error) => {
                let message = format!("rallypoint: closed without telling the coordinator this rank left: {error}");
                let message = std::ffi::CString::new(message.replace('\0', "?")).unwrap_or_default();
                let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
                PyErr::warn(py, &category, &message, 1)
            }
        }
    }

    /// Refuses a closed client, as a closed file does: its block could not use it.
    fn __enter__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, Self>> {
        slf.borrow().handle(slf.py())?;
        Ok(slf)
    }

    /// Closes cleanly when the block ends normally (a `sys.exit(0)` in it included).
    /// When it raises, drops the connection as a crash would, so that peers waiting
    /// for this rank fail at once with PeerLost instead of waiting for a rank that
    /// has merely left.
    #[pyo3(signature = (exc_type, exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if exc_type.is_none() || exc.is_some_and(successful_exit) {
            return self.close(py);
        }
        self.abandon(py);
        Ok(())
    }

    fn __repr__(&self) -> String {
        let Identity { job, rank, world_size, .. } = &self.identity;
        let show = |v: &Option<u32>| v.map_or_else(|| "None".to_owned(), |v| v.to_string());
        let state = if self.closed() { ", closed" } else { "" };
        format!("Client('{}', rank={}, world_size={}, job='{job}'{state})", self.addr, show(rank), show(world_size))
    }
}
