"""lunakv's drop-in ``mooncake`` package.

Installs in place of upstream Mooncake's wheel so that engines importing ``mooncake.store``
(vLLM's MooncakeStoreConnector) run unchanged on lunakv. The native code is the private module
``mooncake._lunakv``; each public submodule (``store.py``; an ``engine.py`` for
``TransferEngine`` later) re-exports its part of it.
"""

from mooncake._lunakv import __version__

__all__ = ["__version__"]
