"""Every error anyccl raises. Each one says which rank, which operation and what was expected."""

from __future__ import annotations

import builtins


class AnycclError(Exception):
    """Base class of every error anyccl raises."""


class InvalidArgumentError(AnycclError, ValueError):
    """An argument is wrong: a size, a rank, a tag, a list length, a read-only output.

    Raised on the calling rank before any byte moves; the communicator stays usable.
    """


class UnsupportedError(AnycclError, TypeError):
    """The dtype, array type, device or reduce op is not supported for this operation."""


class TimeoutError(AnycclError, builtins.TimeoutError):  # noqa: A001 - deliberate, like asyncio's
    """A blocking wait passed its deadline. The message names the rank, the op and its peers;
    `waited_for`: the peers that were in no operation at all then (they never arrived), where
    the backend can tell."""

    waited_for: tuple[int, ...] = ()


class PeerLostError(AnycclError, ConnectionError):
    """A peer rank died or left while this rank depended on it."""

    def __init__(self, message: str, lost_rank: int) -> None:
        super().__init__(message, lost_rank)
        self.lost_rank = lost_rank

    def __str__(self) -> str:
        return str(self.args[0])


class CollectiveMismatchError(AnycclError, ValueError):
    """Ranks called different collectives, or the same one with arguments that disagree, or
    one rank refused its arguments (`refused_by`: those ranks). Raised on every rank before any
    byte moves; the communicator stays usable."""

    refused_by: tuple[int, ...] = ()


class CommunicatorClosedError(AnycclError, RuntimeError):
    """The communicator was closed, or broken by an earlier failure, and cannot be used."""


class NotInitializedError(AnycclError, ValueError):
    """A call that needs the default process group came before init_process_group() (a
    ValueError, as torch.distributed raises there)."""


class RendezvousError(AnycclError, RuntimeError):
    """The ranks could not find each other: bad init_method, missing environment, refused store."""


# The errors anyccl raises only before any byte of an operation moves: the communicator stays
# usable after them. Any other error inside an operation (a timeout, a lost peer, an exception
# from a kernel or a library halfway through) breaks the communicator: its ranks may be out of
# step, so every later call raises CommunicatorClosedError naming that first error.
REFUSALS: tuple[type[AnycclError], ...] = (InvalidArgumentError, UnsupportedError,
                                           CollectiveMismatchError)

