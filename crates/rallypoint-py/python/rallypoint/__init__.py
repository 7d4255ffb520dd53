"""rallypoint: coordination for distributed jobs.

Barriers, all-gather, broadcast and a key-value store served by one small
coordinator, with dead or missing ranks named at once::

    import rallypoint as rp

    c = rp.Client.from_env()            # under `rallypoint launch` or rp.spawn
    with c.scope("step"):               # barrier on entry and exit
        losses = c.all_gather(b"0.25")  # every rank's value, in rank order
    c.close()

See ``help(rallypoint.Client)`` and the exceptions in ``rallypoint._errors``.
The wheel also installs the ``rallypoint`` command (``python -m rallypoint`` runs it).
"""

from ._errors import (
    Aborted,
    AuthError,
    BadMembers,
    BarrierTimeout,
    ConnectionError,
    IncarnationRefused,
    InvalidArgument,
    JobReset,
    KeyTimeout,
    MismatchError,
    PeerLost,
    ProcessInfo,
    RallypointError,
    RankHeld,
    RankInfo,
    RankTakenOver,
    ReplyTimeout,
    StaleIncarnation,
    ThisRankLost,
    WorkerError,
)
from ._native import Client, _Coordinator, __version__
from ._scope import Scope
from .spawn import spawn

# Spelled out, not built from _errors.__all__: type checkers read only a literal list.
__all__ = [
    "Client",
    "Scope",
    "spawn",
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
    "_Coordinator",
]
