//! The runtime of a client whose calls block their thread (the blocking client, the
//! Python package): a current-thread tokio runtime that each call drives itself while
//! it waits, and that a keeper thread drives between calls.
//!
//! Why not a runtime with a worker thread of its own: the worker holds the socket's
//! registration, so a reply wakes the worker in `epoll_wait`, which then wakes the
//! caller: two wake-ups per call. Here the calling thread waits in the runtime's own
//! `epoll`, and the reply wakes it alone.
//!
//! Between calls something must still drive the connection: heartbeats, the reading
//! of what comes unasked, a cut connection's resume, a barrier's outcome while its
//! caller waits on shared memory outside the runtime. The keeper does, once no call
//! has run for a while (under half a heartbeat period); a call that starts while the keeper drives
//! asks it to stop and takes over. Calls in a row never meet the keeper, and a call
//! after a pause pays one hand-over. The keeper sleeps until then: it is not woken
//! per call, only when the first call after its turn ends and at the end of each
//! idle span, so a busy rank's keeper wakes a few times a second at most.

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The longest a connection goes undriven between calls: short against a heartbeat
/// period (heartbeats go out only while someone drives), long against the gaps of a
/// loop that makes calls.
const LONGEST_IDLE: Duration = Duration::from_millis(200);

pub struct CallerRuntime {
    /// `None` only while dropping.
    runtime: Option<Arc<tokio::runtime::Runtime>>,
    turns: Arc<Turns>,
    keeper: Option<JoinHandle<()>>,
    /// The process that made it: a child forked since has its memory but not its
    /// keeper thread, and shares its epoll and sockets ([`CallerRuntime::forked`]).
    made_by: u32,
}

/// Who drives the runtime, between the calls and the keeper.
struct Turns {
    state: Mutex<TurnState>,
    /// The keeper waits on it for the calls to end, and for an idle span to pass.
    changed: Condvar,
    /// Ends the keeper's turn: a call wants the runtime, or it goes.
    give_up: Notify,
}

struct TurnState {
    /// Calls in `block_on` now.
    calls: usize,
    /// When the last call left `block_on`.
    last_call: Instant,
    /// The keeper drives (or is about to): a call that starts must ask it to stop.
    keeping: bool,
    /// The keeper waits for the calls to end: the last one to leave tells it.
    awaited: bool,
    /// The keeper drives now, whatever the idle span ([`CallerRuntime::drive_now`]).
    now: bool,
    stop: bool,
    /// How long the connection may go undriven between calls.
    idle: Duration,
}

impl Turns {
    fn lock(&self) -> MutexGuard<'_, TurnState> {
        rallypoint_net::sync::lock(&self.state)
    }
}

impl CallerRuntime {
    /// A runtime whose keeper thread is named `name`; between calls the connection
    /// goes undriven for at most `idle` (at most `LONGEST_IDLE`).
    pub fn new(name: &str, idle: Duration) -> std::io::Result<CallerRuntime> {
        let runtime = Arc::new(tokio::runtime::Builder::new_current_thread().enable_all().build()?);
        let turns = Arc::new(Turns {
            state: Mutex::new(TurnState {
                calls: 0,
                last_call: Instant::now(),
                keeping: false,
                awaited: false,
                now: false,
                stop: false,
                idle: idle.min(LONGEST_IDLE),
            }),
            changed: Condvar::new(),
            give_up: Notify::new(),
        });
        let keeper = std::thread::Builder::new().name(name.to_owned()).spawn({
            let (runtime, turns) = (Arc::clone(&runtime), Arc::clone(&turns));
            move || keep(&runtime, &turns)
        })?;
        Ok(CallerRuntime { runtime: Some(runtime), turns, keeper: Some(keeper), made_by: std::process::id() })
    }

    /// Whether this process is a child forked from the one that made the runtime:
    /// there it must not be driven (its epoll and sockets are the parent's, its
    /// keeper thread does not exist), and it is left undropped.
    pub fn forked(&self) -> bool {
        std::process::id() != self.made_by
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        match &self.runtime {
            Some(runtime) => runtime,
            // Taken only in drop.
            None => unreachable!("the client runtime is gone"),
        }
    }

    /// Lets the connection go undriven between calls for at most `idle` (at most
    /// `LONGEST_IDLE`): less than half its heartbeat period, once that is known.
    pub fn set_idle(&self, idle: Duration) {
        self.turns.lock().idle = idle.min(LONGEST_IDLE);
    }

    /// Runs `future` to completion in this thread, driving the runtime meanwhile.
    /// Panics inside an async runtime, as any `block_on` there does.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        {
            let mut state = self.turns.lock();
            state.calls += 1;
            if state.keeping {
                self.turns.give_up.notify_one();
            }
        }
        let _left = Left(&self.turns);
        self.runtime().block_on(future)
    }

    /// Spawns `future` on the runtime: it runs whenever a call or the keeper drives.
    pub fn spawn<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime().spawn(future)
    }

    /// Has the keeper drive the runtime at once, idle span or not (for a task spawned
    /// for it to run, such as a last word before the client goes).
    pub fn drive_now(&self) {
        let mut state = self.turns.lock();
        state.now = true;
        self.turns.changed.notify_one();
    }
}

/// A call leaving `block_on`, however it does (a panic included).
struct Left<'a>(&'a Turns);

impl Drop for Left<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.calls -= 1;
        state.last_call = Instant::now();
        if state.calls == 0 && state.awaited {
            state.awaited = false;
            self.0.changed.notify_one();
        }
    }
}

/// The keeper thread: drives the runtime while no call has run for the idle span.
fn keep(runtime: &tokio::runtime::Runtime, turns: &Turns) {
    let mut state = turns.lock();
    loop {
        if state.stop {
            return;
        }
        if state.calls > 0 {
            state.awaited = true;
            state = turns.changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
            continue;
        }
        let since = state.last_call.elapsed();
        if since < state.idle && !std::mem::take(&mut state.now) {
            let left = state.idle - since;
            state = turns.changed.wait_timeout(state, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
            continue;
        }
        state.keeping = true;
        drop(state);
        runtime.block_on(turns.give_up.notified());
        state = turns.lock();
        state.keeping = false;
    }
}

impl Drop for CallerRuntime {
    fn drop(&mut self) {
        if self.forked() {
            // Joining a keeper that is not there panics, and shutting the runtime
            // down waits for it, or for a lock a thread of the parent held at the
            // fork: leaked instead, the parent's connection untouched.
            std::mem::forget(self.keeper.take());
            std::mem::forget(self.runtime.take());
            return;
        }
        {
            let mut state = self.turns.lock();
            state.stop = true;
            self.turns.changed.notify_one();
            if state.keeping {
                self.turns.give_up.notify_one();
            }
        }
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.join();
        }
        let Some(runtime) = self.runtime.take().and_then(Arc::into_inner) else { return };
        // Dropped inside an async context (the last clone of a client dropped in a
        // task), a normal drop would panic.
        if tokio::runtime::Handle::try_current().is_ok() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread::ThreadId;

    use super::*;

    /// The longest any step waits: a bound, not a timing.
    const BOUND: Duration = Duration::from_secs(20);

    /// The thread a task spawned now runs on.
    fn task_thread(runtime: &CallerRuntime) -> mpsc::Receiver<ThreadId> {
        let (sent, ran) = mpsc::channel();
        runtime.spawn(async move {
            let _ = sent.send(std::thread::current().id());
        });
        ran
    }

    /// While a call waits, the calling thread drives: a task it waits for runs there.
    #[test]
    fn a_call_drives_the_runtime_in_its_own_thread() {
        let runtime = CallerRuntime::new("test-keeper", LONGEST_IDLE).expect("a runtime");
        for _ in 0..3 {
            let (sent, ran) = tokio::sync::oneshot::channel();
            runtime.spawn(async move {
                let _ = sent.send(std::thread::current().id());
            });
            let ran = runtime.block_on(async { tokio::time::timeout(BOUND, ran).await });
            assert_eq!(ran.expect("in time").expect("sent"), std::thread::current().id());
        }
    }

    /// Once no call has run for the idle span, the keeper drives: a task spawned
    /// between calls runs on the keeper's thread, without a call.
    #[test]
    fn the_keeper_drives_between_calls() {
        let runtime = CallerRuntime::new("test-keeper", Duration::from_millis(10)).expect("a runtime");
        runtime.block_on(async {});
        let ran = task_thread(&runtime).recv_timeout(BOUND).expect("the task ran without a call");
        assert_ne!(ran, std::thread::current().id());
        // A call takes the runtime back from the keeper, and the keeper takes it again.
        for _ in 0..3 {
            let caller = runtime.block_on(async {
                tokio::time::sleep(Duration::from_millis(1)).await;
                std::thread::current().id()
            });
            assert_eq!(caller, std::thread::current().id());
            assert_eq!(task_thread(&runtime).recv_timeout(BOUND).expect("the keeper drove again"), ran);
        }
    }

    /// Within the idle span the keeper leaves the runtime alone, unless told to drive
    /// now. (It cannot drive earlier than the span, however loaded the machine: the
    /// check below only bounds how long the test looks.)
    #[test]
    fn the_keeper_waits_out_the_idle_span_unless_told_to_drive_now() {
        let runtime = CallerRuntime::new("test-keeper", LONGEST_IDLE).expect("a runtime");
        runtime.block_on(async {});
        let ran = task_thread(&runtime);
        assert!(ran.recv_timeout(LONGEST_IDLE / 4).is_err(), "the keeper drove within the idle span");
        runtime.drive_now();
        ran.recv_timeout(BOUND).expect("the keeper drove when told to");
    }

    /// Calls from several threads at once all complete, each driving in turn.
    #[test]
    fn calls_from_several_threads_complete() {
        let runtime = Arc::new(CallerRuntime::new("test-keeper", Duration::from_millis(1)).expect("a runtime"));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let runtime = Arc::clone(&runtime);
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        runtime.block_on(async { tokio::time::sleep(Duration::from_micros(100)).await });
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("a caller");
        }
    }

    /// Dropping the runtime stops the keeper, also while it drives, and drops the tasks.
    #[test]
    fn dropping_the_runtime_stops_the_keeper_and_drops_its_tasks() {
        let runtime = CallerRuntime::new("test-keeper", Duration::from_millis(1)).expect("a runtime");
        let held = Arc::new(());
        let in_task = Arc::clone(&held);
        runtime.spawn(async move {
            let _held = in_task;
            std::future::pending::<()>().await;
        });
        // The keeper drives by now (or soon): the drop must end its turn.
        std::thread::sleep(Duration::from_millis(20));
        drop(runtime);
        assert_eq!(Arc::strong_count(&held), 1, "the task outlived its runtime");
    }
}
