//! The blocking client: the same operations as [`crate::Client`], for code without
//! an async runtime (plain threads, FFI bindings).
//!
//! Each client owns a [`CallerRuntime`]: a call drives it in the calling thread while
//! it waits (the reply wakes that thread alone), and a keeper thread drives it between
//! calls, heartbeats included. Calls block the calling thread; many threads may share
//! one client (it is `Clone`). Do not call it from inside an async runtime: that
//! panics, as any `block_on` there does. Dropping the last clone without
//! [`Client::close`] drops the connection abruptly, as for the async client.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rallypoint_core::snapshot::JobSnapshot;
use rallypoint_core::{Exit, Gathered, Identity, Members};

use crate::{client, CallerRuntime, ConnectOptions, Error};

#[derive(Clone)]
pub struct Client {
    inner: client::Client,
    runtime: Arc<CallerRuntime>,
}

/// As the async client's: who it is and where it is connected.
impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.inner, f)
    }
}

impl Client {
    pub fn connect(addr: &str, identity: Identity) -> Result<Client, Error> {
        Client::connect_with(ConnectOptions::new(addr, identity))
    }

    pub fn connect_with(options: ConnectOptions) -> Result<Client, Error> {
        let runtime = CallerRuntime::new("rallypoint-client", Duration::MAX).map_err(|source| Error::Connect {
            addr: options.addr.clone(),
            waited: Duration::ZERO,
            source,
        })?;
        let inner = runtime.block_on(client::Client::connect_with(options))?;
        if let Some(period) = inner.heartbeat_period() {
            runtime.set_idle(period / 2);
        }
        Ok(Client { inner, runtime: Arc::new(runtime) })
    }

    /// Connects with settings from the environment (see [`crate::env::Settings`]).
    pub fn from_env() -> Result<Client, Error> {
        let settings = crate::env::Settings::from_env()?;
        Client::connect_with(settings.connect_options())
    }

    pub fn identity(&self) -> &Identity {
        self.inner.identity()
    }

    pub fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    /// See [`crate::Client::session`].
    pub fn session(&self) -> rallypoint_core::SessionId {
        self.inner.session()
    }

    /// See [`crate::Client::job_incarnation`].
    pub fn job_incarnation(&self) -> Option<u64> {
        self.inner.job_incarnation()
    }

    pub fn set(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<(), Error> {
        self.runtime.block_on(self.inner.set(key, value))
    }

    pub fn get(&self, key: impl AsRef<[u8]>, timeout: Option<Duration>) -> Result<Bytes, Error> {
        self.runtime.block_on(self.inner.get(key, timeout))
    }

    pub fn add(&self, key: impl AsRef<[u8]>, delta: i64) -> Result<i64, Error> {
        self.runtime.block_on(self.inner.add(key, delta))
    }

    pub fn compare_set(
        &self,
        key: impl AsRef<[u8]>,
        expected: impl AsRef<[u8]>,
        desired: impl AsRef<[u8]>,
    ) -> Result<Bytes, Error> {
        self.runtime.block_on(self.inner.compare_set(key, expected, desired))
    }

    pub fn append(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<(), Error> {
        self.runtime.block_on(self.inner.append(key, value))
    }

    pub fn delete(&self, key: impl AsRef<[u8]>) -> Result<bool, Error> {
        self.runtime.block_on(self.inner.delete(key))
    }

    pub fn check(&self, keys: &[impl AsRef<[u8]>]) -> Result<bool, Error> {
        self.runtime.block_on(self.inner.check(keys))
    }

    pub fn wait(&self, keys: &[impl AsRef<[u8]>], timeout: Option<Duration>) -> Result<(), Error> {
        self.runtime.block_on(self.inner.wait(keys, timeout))
    }

    pub fn multi_get(&self, keys: &[impl AsRef<[u8]>], timeout: Option<Duration>) -> Result<Vec<Bytes>, Error> {
        self.runtime.block_on(self.inner.multi_get(keys, timeout))
    }

    pub fn multi_set(&self, entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)]) -> Result<(), Error> {
        self.runtime.block_on(self.inner.multi_set(entries))
    }

    pub fn num_keys(&self) -> Result<i64, Error> {
        self.runtime.block_on(self.inner.num_keys())
    }

    /// See [`crate::Client::status`].
    pub fn status(&self) -> Result<String, Error> {
        self.runtime.block_on(self.inner.status())
    }

    /// See [`crate::Client::jobs`].
    pub fn jobs(&self) -> Result<Vec<String>, Error> {
        self.runtime.block_on(self.inner.jobs())
    }

    /// See [`crate::Client::snapshot`].
    pub fn snapshot(&self) -> Result<JobSnapshot, Error> {
        self.runtime.block_on(self.inner.snapshot())
    }

    pub fn list_keys(&self, prefix: impl AsRef<[u8]>) -> Result<Vec<Bytes>, Error> {
        self.runtime.block_on(self.inner.list_keys(prefix))
    }

    pub fn barrier(&self, name: &str, members: Members, timeout: Option<Duration>) -> Result<(), Error> {
        use crate::InThread;
        // Through a channel seat already held, the whole call runs in this thread:
        // entering the runtime for each round would cost more than the rest.
        match self.inner.barrier_in_thread(name, &members, timeout, None) {
            InThread::Done(outcome) => outcome,
            InThread::Conclude(concluding) => self.runtime.block_on(concluding.finish()),
            InThread::Elsewhere => {
                let waiting = crate::channel::Waiting::Thread;
                self.runtime.block_on(self.inner.barrier_waiting(name, members, timeout, waiting))
            }
            InThread::Interrupted => unreachable!("a wait without an interrupt is never interrupted"),
        }
    }

    pub fn all_gather(
        &self,
        name: &str,
        members: Members,
        value: impl AsRef<[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Gathered, Error> {
        self.runtime.block_on(self.inner.all_gather(name, members, value, timeout))
    }

    pub fn broadcast(
        &self,
        name: &str,
        members: Members,
        root: u32,
        value: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Bytes, Error> {
        self.runtime.block_on(self.inner.broadcast(name, members, root, value, timeout))
    }

    pub fn ping(&self) -> Result<(), Error> {
        self.runtime.block_on(self.inner.ping())
    }

    pub fn abort(&self, reason: &str) -> Result<(), Error> {
        self.runtime.block_on(self.inner.abort(reason))
    }

    /// See [`crate::Client::rank_exited`].
    pub fn rank_exited(&self, rank: u32, host: &str, pid: u32, exit: Exit) -> Result<(), Error> {
        self.runtime.block_on(self.inner.rank_exited(rank, host, pid, exit))
    }

    /// See [`crate::Client::reset`].
    pub fn reset(&self, incarnation: u64) -> Result<(), Error> {
        self.runtime.block_on(self.inner.reset(incarnation))
    }

    /// Leaves cleanly, then closes the connection (see [`crate::Client::close`]).
    pub fn close(self) -> Result<(), Error> {
        self.runtime.block_on(self.inner.clone().close())
    }
}

/// How long dropping the last clone waits for the coordinator to be told.
const ABANDON_WAIT: Duration = Duration::from_secs(1);

impl Drop for Client {
    /// The last clone dropped without `close`: the session is given up as a crash
    /// would, said to the coordinator before the runtime (and the connection task on
    /// it) goes, so that the rank is lost at once rather than after the reconnect
    /// grace. Nothing to say if the client was closed. Waits on a channel rather than
    /// `block_on`, which could not run where a runtime is current (a blocking task).
    fn drop(&mut self) {
        if Arc::strong_count(&self.runtime) != 1 {
            return;
        }
        let (said, told) = std::sync::mpsc::channel();
        let inner = self.inner.clone();
        self.runtime.spawn(async move {
            inner.abandon().await;
            let _ = said.send(());
        });
        self.runtime.drive_now();
        let _ = told.recv_timeout(ABANDON_WAIT);
    }
}
