"""``Client.scope``: a barrier on entry and on exit of a block."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Optional, Sequence, Type

if TYPE_CHECKING:
    from ._native import Client


class Scope:
    """A ``with`` block that every member enters together and leaves together.

    Entering waits at barrier ``name + ":enter"``, leaving at ``name + ":exit"`` (two
    names, so that an error says which side a rank was missing from). If the block
    raises, the exit barrier is skipped and the exception propagates at once: the
    peers learn of it through the failure itself (``PeerLost`` when this process
    dies, or ``Aborted`` if it calls ``abort``) rather than through a barrier.
    """

    def __init__(
        self,
        client: "Client",
        name: str,
        ranks: Optional[Sequence[int]] = None,
        role: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        self.client = client
        self.name = name
        self.ranks = None if ranks is None else list(ranks)
        self.role = role
        self.timeout = timeout

    def _barrier(self, side: str) -> None:
        self.client.barrier(f"{self.name}:{side}", ranks=self.ranks, role=self.role, timeout=self.timeout)

    def __enter__(self) -> "Scope":
        self._barrier("enter")
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            self._barrier("exit")

    def __repr__(self) -> str:
        return f"Scope({self.name!r}, client={self.client!r})"
