"""anyccl: collective communication for any array over any transport.

    import anyccl
    comm = anyccl.init()               # rank and peers from `anyccl run`, torchrun or mpiexec
    comm.all_reduce(x)                 # x: a NumPy array or a PyTorch CPU tensor, in place
"""

from .bootstrap import init
from .communicator import Communicator
from .errors import (
    AnycclError,
    CollectiveMismatchError,
    CommunicatorClosedError,
    InvalidArgumentError,
    NotInitializedError,
    PeerLostError,
    RendezvousError,
    TimeoutError,
    UnsupportedError,
)
from .grow import join
from .ops import ReduceOp
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "init", "join", "Communicator", "ReduceOp", "Work",
    "AnycclError", "InvalidArgumentError", "UnsupportedError", "TimeoutError", "PeerLostError",
    "CollectiveMismatchError", "CommunicatorClosedError", "NotInitializedError",
    "RendezvousError",
]
