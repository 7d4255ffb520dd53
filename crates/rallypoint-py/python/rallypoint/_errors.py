"""The exceptions of rallypoint.

Every error of the Rust client becomes one of these; its message is the Rust
error's text (ranks are named ``rank N``), and its attributes carry the same facts,
to match on rather than parse. All of them pickle, so ``spawn`` can send them
from a worker to the parent.

::

    RallypointError
    ├── BarrierTimeout     (also TimeoutError)  a barrier/all_gather/broadcast timed out
    ├── KeyTimeout         (also TimeoutError)  get/wait/multi_get timed out
    ├── ReplyTimeout       (also TimeoutError)  the coordinator went silent
    ├── PeerLost                                a rank the operation needs died or finished
    ├── ThisRankLost                            this process's own rank was declared lost or finished
    ├── Aborted                                 someone called abort()
    ├── MismatchError                           ranks called one generation differently
    │   └── BadMembers     (also ValueError)    caller not among the members, rank outside the world
    ├── IncarnationRefused                      this process no longer speaks for its rank or job
    │   ├── RankHeld                            another live process holds the rank
    │   ├── RankTakenOver                       another process took this one's rank over
    │   ├── JobReset                            the job was reset; this process belonged to it before
    │   └── StaleIncarnation                    this process belongs to another incarnation of the job
    ├── ConnectionError    (also builtins.ConnectionError)  cannot connect, connection lost, client closed
    ├── AuthError          (also PermissionError)  token or TLS refused, or the coordinator unproven
    ├── InvalidArgument    (also ValueError)    bad argument or environment variable, value too large
    └── WorkerError                             a process of spawn() raised or died
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "RallypointError",
    "BarrierTimeout",
    "KeyTimeout",
    "ReplyTimeout",
    "PeerLost",
    "ThisRankLost",
    "Aborted",
    "MismatchError",
    "BadMembers",
    "IncarnationRefused",
    "RankHeld",
    "RankTakenOver",
    "JobReset",
    "StaleIncarnation",
    "ConnectionError",
    "AuthError",
    "InvalidArgument",
    "WorkerError",
    "RankInfo",
    "ProcessInfo",
]


@dataclass(frozen=True)
class RankInfo:
    """A rank as the coordinator last knew it (in ``BarrierTimeout.missing`` and ``PeerLost.peer``)."""

    rank: int
    #: Host and pid of its latest connection; None if it never connected.
    host: Optional[str]
    pid: Optional[int]
    #: "never_connected", "connected" (but not arrived), "left" (cleanly), "lost", or "finished" (its
    #: launcher saw its worker exit with code 0: it will not arrive again).
    state: str
    #: Why a lost rank is lost ("connection dropped without a clean leave", "no heartbeat for 15.0 s",
    #: "worker pid 4242 was killed by SIGKILL" as its launcher saw), how a finished one finished
    #: ("worker pid 4242 exited with code 0"); else None.
    reason: Optional[str]
    #: Seconds since the coordinator last heard from it; None if never.
    last_seen: Optional[float]


@dataclass(frozen=True)
class ProcessInfo:
    """A process as the coordinator knows it from its hello (in the ``IncarnationRefused`` errors)."""

    pid: int
    host: str
    #: Its incarnation: a random number drawn once per process (None for a TCPStore client).
    incarnation: Optional[int]


class RallypointError(Exception):
    """Base class of every rallypoint error. ``str(e)`` is the full message."""


class BarrierTimeout(RallypointError, TimeoutError):
    """A barrier, all_gather or broadcast reached its timeout.

    Attributes: ``op`` ("barrier", "all-gather", "broadcast"), ``name``, ``generation``
    (1 for a rank's first call of that name), ``waited`` (seconds), ``member_count``,
    ``missing_ranks`` (sorted ranks that had not arrived, the first 64 of them) and
    ``missing`` (a :class:`RankInfo` for each: host, pid, state, last seen),
    ``missing_count`` (every rank that had not arrived) and ``more_ranges`` (the
    ranks missing after those named, as ``(first, last)`` ranges, the first 64 of
    them): a world of a million ranks gives an error of bounded size. ``late_by``:
    for a call that came after its generation had already timed out (this rank was
    among the missing), how many seconds after; ``None`` for a call that waited.
    """

    op: str
    name: str
    generation: int
    waited: float
    member_count: int
    missing_ranks: List[int]
    missing: List[RankInfo]
    missing_count: int
    more_ranges: List[Tuple[int, int]]
    late_by: Optional[float]


class KeyTimeout(RallypointError, TimeoutError):
    """``get``, ``wait`` or ``multi_get`` timed out. ``missing_keys``: the keys that still did not exist; ``waited`` in seconds."""

    waited: float
    missing_keys: List[bytes]


class ReplyTimeout(RallypointError, TimeoutError):
    """No reply within the operation's timeout plus a margin: the coordinator went silent without closing the connection."""

    waited: float


class PeerLost(RallypointError):
    """A rank the operation needs is dead (killed, crashed, or silent for a whole lease), or
    finished (under ``rallypoint launch``, its worker exited with code 0 before the operation
    completed: ``peer.state == "finished"``).

    Attributes: ``rank``, ``host``, ``pid``, ``reason`` (why it is considered lost, or how it finished),
    ``last_seen`` (seconds), ``peer`` (a :class:`RankInfo`), and the failed operation:
    ``op``, ``name``, ``generation``.
    """

    rank: int
    host: Optional[str]
    pid: Optional[int]
    reason: Optional[str]
    last_seen: Optional[float]
    peer: RankInfo
    op: str
    name: str
    generation: int


class ThisRankLost(RallypointError):
    """The coordinator declared this process's own rank lost (it sent nothing for a whole
    lease: the process was stopped, or starved of CPU) or finished (its launcher saw its
    worker exit with code 0 while this process, a child of it, still ran), and told the
    peers so: the operations that needed the rank failed for them with :class:`PeerLost`,
    and for this process with this error.

    Attributes as :class:`PeerLost`'s, with ``this`` (a :class:`RankInfo`) for ``peer``.
    """

    rank: int
    host: Optional[str]
    pid: Optional[int]
    reason: Optional[str]
    last_seen: Optional[float]
    this: RankInfo
    op: str
    name: str
    generation: int


class Aborted(RallypointError):
    """The job was aborted. ``by_rank`` (None for a rank-less client such as a launcher), ``host``, ``pid``, ``reason``, ``job``."""

    by_rank: Optional[int]
    host: str
    pid: int
    reason: str
    job: str


class MismatchError(RallypointError):
    """Two ranks called the same generation of a collective with different world sizes or roots,
    or calls of one name over different members wait for each other (groups of one name that
    do not overlap wait apart).

    ``mine`` and ``theirs`` are dicts with ``rank``, ``members``, ``world_size`` and ``root``;
    ``op``, ``name``, ``generation`` name the collective.
    """

    op: str
    name: str
    generation: int
    mine: Dict[str, Any]
    theirs: Dict[str, Any]


class BadMembers(MismatchError, ValueError):
    """The caller is not among the members it named, or a member is outside the world. ``op``, ``name``, ``reason``;
    ``generation``, ``mine`` and ``theirs`` are None (no generation was joined, no other call is involved)."""

    reason: str
    generation: Optional[int]  # type: ignore[assignment]
    mine: Optional[Dict[str, Any]]  # type: ignore[assignment]
    theirs: Optional[Dict[str, Any]]  # type: ignore[assignment]


class IncarnationRefused(RallypointError):
    """This process no longer speaks for its rank or its job: another process holds the rank
    or took it over, or the job was reset. Retrying cannot help; ``rallypoint`` commands exit 8."""


class RankHeld(IncarnationRefused):
    """Another live process holds this rank. ``rank``, ``holder`` and ``claimant`` (this
    process), each a :class:`ProcessInfo`, and ``since`` (Unix time, seconds)."""

    rank: int
    holder: ProcessInfo
    since: float
    claimant: ProcessInfo


class RankTakenOver(IncarnationRefused):
    """This process held the rank, lost it (or left), and another process took it over.
    ``rank``, ``by`` and ``this`` (:class:`ProcessInfo`), ``at`` (Unix time, seconds)."""

    rank: int
    by: ProcessInfo
    at: float
    this: ProcessInfo


class JobReset(IncarnationRefused):
    """The job was reset to a new incarnation; this operation belonged to the one before.
    ``job``, ``incarnation`` (the new one), ``since`` (Unix time, seconds), ``by`` (:class:`ProcessInfo`)
    and ``by_reset``."""

    job: str
    incarnation: int
    since: float
    by: ProcessInfo
    by_reset: bool


class StaleIncarnation(IncarnationRefused):
    """This process names another incarnation of the job (``mine``) than the current one
    (``incarnation``, since ``since``, set by ``by``: a reset if ``by_reset``, else the first
    process that named it)."""

    job: str
    mine: int
    incarnation: int
    since: float
    by: ProcessInfo
    by_reset: bool


class ConnectionError(RallypointError, builtins.ConnectionError):
    """Cannot connect to the coordinator (after retrying for the timeout; then ``addr`` and
    ``waited`` are set), the connection was lost, the coordinator closed it, or the client is closed."""


class AuthError(RallypointError, PermissionError):
    """The coordinator refused this client's credentials, or could not prove its own. Not retried.

    ``reason`` says which: "token_required" (the coordinator has a token, this
    client none: set RALLYPOINT_TOKEN or RALLYPOINT_TOKEN_FILE), "wrong_token",
    "tls_required" (set RALLYPOINT_TLS_CA), "no_token_here" (this client has a token
    and the coordinator none), "server_unproven" (the server did not prove that it
    knows the token: it may not be the coordinator), "tls" (the TLS handshake failed,
    e.g. a certificate the CA did not sign). ``addr``: the coordinator's address.
    """

    addr: Optional[str]
    reason: str


class InvalidArgument(RallypointError, ValueError):
    """An invalid argument or environment variable, a value over the coordinator's limits,
    ``add`` on a non-integer value, or a collective called by a client without rank."""


class WorkerError(RallypointError):
    """A process started by :func:`rallypoint.spawn` raised or died.

    Attributes: ``rank``, ``pid``, ``exitcode`` (None if it raised), ``exception`` (the
    worker's exception if it could be sent, else None; also the ``__cause__``) and
    ``traceback`` (its traceback as text, or None if it died without one).
    """

    rank: int
    pid: Optional[int]
    exitcode: Optional[int]
    exception: Optional[BaseException]
    traceback: Optional[str]


# Shown (and pickled) as rallypoint.X, where users import them from.
for _cls in [globals()[_name] for _name in __all__]:
    _cls.__module__ = "rallypoint"
del _cls
