"""``spawn``: run a function in N processes around an embedded coordinator."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import signal
import time
import traceback
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

from ._errors import Aborted, InvalidArgument, PeerLost, WorkerError
from ._native import Client, _Coordinator

__all__ = ["spawn"]

#: How long to wait for the cause once only echoes of it (PeerLost, Aborted) arrived.
_ECHO_WINDOW = 1.0


def worker_env(coordinator: _Coordinator, rank: int, nprocs: int, job: str) -> Dict[str, str]:
    """The environment `rallypoint launch` gives a worker on one node: torchrun's variables plus RALLYPOINT_*."""
    return dict(coordinator.worker_env(rank, nprocs, job))


@dataclass
class _Failure:
    """How one worker failed, as sent to the parent (always picklable)."""

    rank: int
    #: When it failed, on the machine's monotonic clock (shared by all processes).
    at: float
    #: "ValueError: boom", or what the exit status says for a worker that died.
    summary: str
    traceback: Optional[str] = None
    #: The pickled exception, None if it could not be pickled.
    exception: Optional[bytes] = None
    #: PeerLost or Aborted: most likely a consequence of another rank's failure.
    secondary: bool = False
    pid: Optional[int] = None
    exitcode: Optional[int] = None


def _failure_of(rank: int, error: BaseException) -> _Failure:
    try:
        pickled: Optional[bytes] = pickle.dumps(error)
    except Exception:  # noqa: BLE001 - any pickling problem: send the text only
        pickled = None
    text = str(error)
    summary = type(error).__qualname__ + (f": {text}" if text else "")
    return _Failure(
        rank=rank,
        at=time.monotonic(),
        summary=summary,
        traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)),
        exception=pickled,
        secondary=isinstance(error, (PeerLost, Aborted)),
    )


def _worker(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a spawned process: runs fn, sends ("ok", result) or ("failed", _Failure)."""
    os.environ.update(env)
    try:
        try:
            try:
                result = fn(*args, **kwargs)
            except SystemExit as ended:
                # sys.exit() or sys.exit(0) ends a process as returning does; any other code fails it.
                if ended.code not in (None, 0):
                    raise
                result = None
            message = pickle.dumps(("ok", result))
        except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt and a failing SystemExit too
            # Sent from inside the handler: the traceback still holds fn's frames and so
            # its clients, whose connections would otherwise drop (telling the peers
            # PeerLost) before the parent hears of the cause.
            conn.send_bytes(pickle.dumps(("failed", _failure_of(rank, error))))
            raise SystemExit(1) from None
        conn.send_bytes(message)
    finally:
        conn.close()


def _describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _stop(processes: List[Any], grace: float) -> None:
    """SIGTERM every live process, SIGKILL what is left after `grace` seconds, reap all."""
    for p in processes:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.exitcode is None:
            p.kill()
            p.join(5.0)


def _error(failure: _Failure) -> WorkerError:
    exception: Optional[BaseException] = None
    if failure.exception is not None:
        try:
            exception = pickle.loads(failure.exception)
        except Exception:  # noqa: BLE001 - an exception class the parent cannot rebuild
            exception = None
    who = f"rank {failure.rank}" + (f" (pid {failure.pid})" if failure.pid is not None else "")
    if failure.traceback is not None:
        message = f"{who} raised {failure.summary}\n\nTraceback of rank {failure.rank}:\n{failure.traceback.rstrip()}"
    else:
        message = f"{who} {failure.summary}"
    error = WorkerError(message)
    error.rank = failure.rank
    error.pid = failure.pid
    error.exitcode = failure.exitcode
    error.exception = exception
    error.traceback = failure.traceback
    error.__cause__ = exception
    return error


def _root_cause(failures: List[_Failure]) -> _Failure:
    """The failure that most likely caused the others: a PeerLost or Aborted is the
    consequence of another rank's failure, so the earliest other one wins."""
    primary = [f for f in failures if not f.secondary]
    return min(primary or failures, key=lambda f: f.at)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    job: str = "default",
    grace: float = 5.0,
    start_method: str = "spawn",
) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``nprocs`` processes and returns their results in rank order.

    An embedded coordinator serves the job. Each process gets the environment
    ``rallypoint launch`` gives (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*, RALLYPOINT_ADDR, RALLYPOINT_JOB), so
    ``rallypoint.Client.from_env()`` and torch's ``env://`` work in ``fn``.

    ``fn``, ``args``, ``kwargs`` and the results must pickle (``fn`` defined at the top
    level of a module; under the default "spawn" start method the main module is
    imported again in each process, so guard the call with
    ``if __name__ == "__main__":``).

    If a process raises or dies, the others are stopped (SIGTERM, then SIGKILL after
    ``grace`` seconds) and :class:`WorkerError` is raised naming its rank, with its
    traceback text and its exception as ``__cause__``. A PeerLost or Aborted raised
    by a process because another one failed is not taken for the cause.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise TypeError(f"nprocs must be an int, not {type(nprocs).__name__}")
    if nprocs < 1:
        raise InvalidArgument(f"nprocs={nprocs} is not a positive integer")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        raise TypeError(f"grace must be a number of seconds, not {type(grace).__name__}")
    if not grace >= 0 or grace == float("inf"):  # NaN too
        raise InvalidArgument(f"grace={grace} is not a number of seconds (0 or more, finite)")
    # Refused here, as Client refuses them, rather than in every worker.
    if not job:
        raise InvalidArgument("the job name is empty")
    control = next((c for c in job if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        raise InvalidArgument(f"the job name {job!r} holds a control character (U+{ord(control):04X})")
    kwargs = dict(kwargs or {})
    # Any: typeshed types an arbitrary start method's context as BaseContext, without Process.
    context: Any = multiprocessing.get_context(start_method)
    # A token of its own, which only its workers learn (see worker_env): another
    # user of this machine cannot join or read the job.
    token = secrets.token_hex(32)
    coordinator = _Coordinator(token=token)
    processes: List[Any] = []
    # Tells the coordinator of each worker that returned, as `rallypoint launch` does:
    # a peer still waiting for it in a collective then fails at once, naming it.
    reporter = Client(coordinator.addr, job=job, world_size=nprocs, token=token, timeout=10.0)
    try:
        readers: Dict[Any, int] = {}
        for rank in range(nprocs):
            reader, writer = context.Pipe(duplex=False)
            env = worker_env(coordinator, rank, nprocs, job)
            process = context.Process(
                target=_worker, args=(rank, fn, tuple(args), kwargs, env, writer), name=f"rallypoint-rank{rank}"
            )
            process.start()
            # The parent keeps only the read end, so a dead worker reads as EOF.
            writer.close()
            processes.append(process)
            readers[reader] = rank
        results = _collect(processes, readers, reporter)
        for process in processes:
            process.join()
        return results
    finally:
        _stop(processes, grace)
        reporter.close()
        coordinator.shutdown()


def _collect(processes: List[Any], readers: Dict[Any, int], reporter: Client) -> List[Any]:
    """Waits for every worker's result; raises WorkerError at the first failure."""
    results: List[Any] = [None] * len(processes)
    done: Set[int] = set()
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
    failures: List[_Failure] = []

    def receive(reader: Any, rank: int) -> None:
        del readers[reader]
        try:
            kind, payload = pickle.loads(reader.recv_bytes())
        except (EOFError, OSError):
            return  # died without a message: its sentinel reports it
        finally:
            reader.close()
        if kind == "ok":
            results[rank] = payload
            done.add(rank)
            reporter._rank_exited(rank, processes[rank].pid, 0)
        else:
            payload.pid = processes[rank].pid
            failures.append(payload)

    def exited(sentinel: Any, rank: int) -> None:
        del sentinels[sentinel]
        for reader, r in list(readers.items()):
            if r == rank:
                receive(reader, rank)  # a result or failure sent just before exiting
        if rank not in done and not any(f.rank == rank for f in failures):
            process = processes[rank]
            process.join(1.0)
            summary = f"{_describe_exit(process.exitcode)} before returning"
            failures.append(
                _Failure(rank=rank, at=time.monotonic(), summary=summary, pid=process.pid, exitcode=process.exitcode)
            )

    def handle(ready: List[Any]) -> None:
        # Messages first: a worker that sent its result and exited is done, not dead.
        for obj in ready:
            if obj in readers:
                receive(obj, readers[obj])
        for obj in ready:
            if obj in sentinels:
                exited(obj, sentinels[obj])

    while len(done) < len(processes):
        pending = list(readers) + [s for s, rank in sentinels.items() if rank not in done]
        handle(multiprocessing.connection.wait(pending))
        if failures:
            # A PeerLost or Aborted is the echo of another failure: give the cause a
            # moment to be reported too, then take whatever is ready.
            deadline = time.monotonic() + _ECHO_WINDOW
            while all(f.secondary for f in failures) and (readers or sentinels):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                handle(multiprocessing.connection.wait(list(readers) + list(sentinels), timeout=left))
            handle(multiprocessing.connection.wait(list(readers) + list(sentinels), timeout=0))
            raise _error(_root_cause(failures))
    return results
