"""``mooncake.engine``: the P/D transfer engine, as upstream Mooncake names it.

``TransferEngine`` keeps upstream's signatures and return conventions (0 / negative ints),
backed by lunakv's raw registered-memory transfers. vLLM's MooncakeConnector uses
``initialize``, ``get_rpc_port``, ``batch_register_memory`` and ``batch_transfer_sync_write``;
the session id a peer passes as ``target_hostname`` is ``"<host>:<get_rpc_port()>"``.
"""

from enum import IntEnum

from mooncake._lunakv import TransferEngine


class TransferOpcode(IntEnum):
    """Direction for ``transfer_sync`` / ``batch_transfer_sync`` / ``batch_transfer_async``."""

    Read = 0
    Write = 1


class TransferNotify:
    """Upstream's notification record. lunakv has no notification channel: a ``transfer_sync`` /
    ``batch_transfer_sync`` given one returns -1 with an error line instead of moving the bytes
    and leaving the peer waiting for a notification that never comes."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg


SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]
