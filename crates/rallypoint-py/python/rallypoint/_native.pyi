"""Type stubs of the native module (the Rust client and the embedded coordinator)."""

from types import TracebackType
from typing import List, Optional, Sequence, Tuple, Type, Union, final

from ._scope import Scope

__all__ = ["Client", "_Coordinator"]

#: The version of the crate this module was built from (the package's version).
__version__: str

#: A key or value: str is sent as UTF-8.
_Data = Union[str, bytes, bytearray, memoryview]
#: One key, or several.
_Keys = Union[_Data, Sequence[_Data]]

@final
class Client:
    """A connection to the coordinator as one rank (or as a rank-less tool).

    Every blocking call releases the GIL and can be interrupted with Ctrl-C
    (KeyboardInterrupt within about 50 ms); an interrupted collective has still
    arrived, so the next call of its name is its next generation. Share one client between threads
    freely. Call :meth:`close` when done, or use the client as a context manager:
    a process that exits without closing counts as dead, so its peers fail at once
    with :class:`rallypoint.PeerLost` (intended: that is how a crash is noticed).

    ``timeout`` arguments are seconds; None means the client's default timeout.
    """

    def __new__(
        cls,
        addr: str,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        job: str = "default",
        role: Optional[str] = None,
        timeout: Optional[float] = None,
        token: Optional[str] = None,
        tls_ca: Optional[str] = None,
    ) -> "Client":
        """Connects to the coordinator at ``addr`` ("host:port"), retrying for up to
        ``timeout`` seconds (default 300), which is also the default timeout of every
        blocking call. Without ``rank`` and ``world_size`` only the key-value store and
        :meth:`abort` are usable. ``role`` names the role this client joins as, for
        ``barrier(role=...)``. ``token`` (else the file RALLYPOINT_TOKEN_FILE names,
        else RALLYPOINT_TOKEN) is proven to the coordinator, which must prove it back;
        ``tls_ca`` (else RALLYPOINT_TLS_CA): connect over TLS, trusting the CA
        certificate(s) in that PEM file.

        Raises :class:`rallypoint.ConnectionError` if no connection is made in time,
        :class:`rallypoint.AuthError` if the token or TLS is refused (or the coordinator
        cannot prove the token), :class:`rallypoint.InvalidArgument` for a bad rank,
        world size, timeout, token file or CA file.
        """

    @staticmethod
    def from_env(
        *,
        addr: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        job: Optional[str] = None,
        role: Optional[str] = None,
        timeout: Optional[float] = None,
        token: Optional[str] = None,
        tls_ca: Optional[str] = None,
    ) -> "Client":
        """Connects with the settings a launcher gives (``rallypoint launch``,
        :func:`rallypoint.spawn`; under torchrun, whose MASTER_ADDR:MASTER_PORT is
        torch's own store, set RALLYPOINT_ADDR to a ``rallypoint serve``): address
        from RALLYPOINT_ADDR, else MASTER_ADDR and MASTER_PORT; job from RALLYPOINT_JOB, else TORCHELASTIC_RUN_ID, else
        SLURM_JOB_ID, else "default"; RANK, WORLD_SIZE and LOCAL_RANK, else (outside a
        launcher, e.g. a task started by ``srun``) SLURM_PROCID, SLURM_NTASKS and
        SLURM_LOCALID; role from RALLYPOINT_ROLE, else ROLE_NAME; timeout from
        RALLYPOINT_TIMEOUT, else 300 s; token from the file RALLYPOINT_TOKEN_FILE names
        (it must not be readable by group or others), else RALLYPOINT_TOKEN; TLS CA
        from RALLYPOINT_TLS_CA. Arguments given here win over the environment.
        A bad variable raises :class:`rallypoint.InvalidArgument` naming it.
        """

    @property
    def rank(self) -> Optional[int]:
        """This client's rank, or None for a rank-less client."""
    @property
    def world_size(self) -> Optional[int]:
        """The number of ranks of the job, or None for a rank-less client."""
    @property
    def local_rank(self) -> Optional[int]:
        """This process's index on its node (LOCAL_RANK, or SLURM_LOCALID under srun),
        for choosing a device; None for ``Client(...)`` or when nothing set it."""
    @property
    def job(self) -> str:
        """The job: ranks, keys and barriers of different jobs never meet."""
    @property
    def role(self) -> Optional[str]:
        """The role this client joined as, or None."""
    @property
    def addr(self) -> str:
        """The coordinator's address as given."""
    @property
    def timeout(self) -> float:
        """Default timeout of blocking calls, in seconds."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the context manager exited)."""

    def set(self, key: _Data, value: _Data) -> None:
        """Stores ``value`` under ``key``."""
    def get(self, key: _Data, timeout: Optional[float] = None) -> bytes:
        """The value of ``key``, waiting until it exists. Raises
        :class:`rallypoint.KeyTimeout` (a TimeoutError) after ``timeout`` seconds."""
    def add(self, key: _Data, n: int) -> int:
        """Adds ``n`` to the decimal integer stored at ``key`` (missing counts as 0);
        returns the new value. A value that is not an optional sign and digits
        ("0.001", "12abc") raises :class:`rallypoint.InvalidArgument` and is left as it was."""
    def compare_set(self, key: _Data, expected: _Data, desired: _Data) -> bytes:
        """Sets ``desired`` if the value is ``expected`` (or the key is missing and
        ``expected`` is empty); returns the value now stored. A missing key with a
        non-empty ``expected`` stays missing, and ``expected`` is returned, as torch's
        TCPStore does."""
    def append(self, key: _Data, value: _Data) -> None:
        """Appends ``value`` to the value of ``key`` (missing counts as empty)."""
    def delete(self, key: _Data) -> bool:
        """Deletes ``key``; returns whether it existed."""
    def check(self, keys: _Keys) -> bool:
        """Whether every key exists now, without waiting."""
    def wait(self, keys: _Keys, timeout: Optional[float] = None) -> None:
        """Waits until every key exists; :class:`rallypoint.KeyTimeout` names the missing ones."""
    def multi_get(self, keys: _Keys, timeout: Optional[float] = None) -> List[bytes]:
        """Waits until every key exists; returns their values in the order asked."""
    def multi_set(self, keys: _Keys, values: Sequence[_Data]) -> None:
        """Sets ``keys[i]`` to ``values[i]`` for every i, in one request."""
    def num_keys(self) -> int:
        """Number of keys in this job's store."""
    def list_keys(self, prefix: Optional[_Data] = None) -> List[bytes]:
        """The keys starting with ``prefix``, sorted."""

    def barrier(
        self,
        name: str = "default",
        ranks: Optional[Sequence[int]] = None,
        role: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Waits until every member has called this barrier.

        Members: every rank, or ``ranks``, or the ranks that joined as ``role``. The
        n-th call of a name meets the other members' n-th call (its *generation*);
        a barrier is its name and its members, so groups of one name wait apart.

        Raises :class:`rallypoint.BarrierTimeout` naming every missing rank,
        :class:`rallypoint.PeerLost` as soon as a member dies,
        :class:`rallypoint.Aborted`, or :class:`rallypoint.MismatchError` if members
        called the same generation differently.
        """
    def all_gather(
        self,
        value: _Data,
        name: str = "default",
        ranks: Optional[Sequence[int]] = None,
        role: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> List[bytes]:
        """Every member contributes ``value``; returns all values in rank order.
        Fails as :meth:`barrier` does."""
    def broadcast(
        self,
        value: Optional[_Data],
        root: int = 0,
        name: str = "default",
        ranks: Optional[Sequence[int]] = None,
        role: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> bytes:
        """Returns ``root``'s value on every member. The root must pass a value; the
        others may pass None. The root's call returns as soon as its value is in (it
        waits for nobody); the others wait for the root, and fail as :meth:`barrier`
        does if it is lost, never comes or called with another root (where the root
        came first, only the calls after it learn of a mismatch)."""
    def scope(
        self,
        name: str,
        ranks: Optional[Sequence[int]] = None,
        role: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Scope:
        """A ``with`` block entered and left by all members together: barrier
        ``name + ":enter"`` on entry, ``name + ":exit"`` on exit. If the block raises,
        the exit barrier is skipped and the exception propagates at once."""
    def abort(self, reason: str) -> None:
        """Fails every pending and later operation of the job, on every rank, with
        :class:`rallypoint.Aborted` naming this client and ``reason``."""
    def reset(self, incarnation: int) -> None:
        """Starts job incarnation ``incarnation`` afresh (what ``rallypoint reset`` does):
        the job's keys, barrier generations, abort and lost ranks are gone, and every
        pending and later operation of its processes (this client's too) raises
        :class:`rallypoint.JobReset`. Nothing if the job is at that incarnation already."""
    @property
    def job_incarnation(self) -> Optional[int]:
        """The incarnation the job was at when this client (last) connected, or None
        if it was never reset nor named (``RALLYPOINT_JOB_INCARNATION``)."""
    def _rank_exited(self, rank: int, pid: int, exitcode: int) -> None:
        """Tells the coordinator that worker ``pid`` of ``rank`` ended (for ``spawn``)."""
    def close(self) -> None:
        """Leaves cleanly: the coordinator records that this rank left (it may come
        back) rather than died. Calls still waiting in other threads fail with
        :class:`rallypoint.ConnectionError`. Does nothing the second time. Where the
        coordinator cannot be told (the connection is lost), closes all the same with
        a ``RuntimeWarning``."""
    def __enter__(self) -> "Client":
        """Raises :class:`rallypoint.ConnectionError` if the client is closed."""
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException] = None,
        tb: Optional[TracebackType] = None,
    ) -> None:
        """Closes cleanly if the block ended normally. If it raised, drops the
        connection as a crash would, so that peers waiting for this rank fail at once
        with PeerLost instead of waiting for a rank that merely left."""

@final
class _Coordinator:
    """A coordinator served by this process (used by :func:`rallypoint.spawn`, handy in
    tests) until :meth:`shutdown`, the end of a ``with`` block, or garbage collection.

    ``listen`` ("IP:PORT") is bound exactly; port 0 picks a free port. ``lease``:
    seconds of silence after which a rank counts as lost (default 15; 0 disables).
    ``reconnect_grace``: seconds a rank whose connection dropped is held for its
    process to resume, when its death cannot be seen (default 1, at most the lease).
    ``token``: every client must prove it (and the coordinator proves it back);
    ``tls_cert`` and ``tls_key`` (PEM files): serve native clients over TLS only.
    """

    def __new__(
        cls,
        listen: str = "127.0.0.1:0",
        lease: Optional[float] = None,
        reconnect_grace: Optional[float] = None,
        token: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
    ) -> "_Coordinator": ...
    @property
    def addr(self) -> str:
        """"host:port" it listens on (the real port when 0 was asked)."""
    @property
    def host(self) -> str:
        """The IP address it listens on (MASTER_ADDR)."""
    @property
    def port(self) -> int:
        """The port it listens on (MASTER_PORT)."""
    def worker_env(self, rank: int, nprocs: int, job: str) -> List[Tuple[str, str]]:
        """The environment ``rallypoint launch`` gives a worker of a one-node job served here
        (with this coordinator's token in RALLYPOINT_TOKEN, if it has one)."""
    def shutdown(self) -> None:
        """Stops accepting, closes every connection (their ranks count as lost) and
        waits until the server is done. Does nothing the second time."""
    def __enter__(self) -> "_Coordinator": ...
    def __exit__(self, *exc: object) -> None: ...
