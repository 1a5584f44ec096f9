"""Test-only helpers: lunakv's device test double (docs/GPU.md).

Active only when the process runs with ``LUNAKV_DEVICE=fake`` (set before the first transfer);
every call raises ``RuntimeError`` otherwise. ``device_alloc`` returns the address of "device"
memory that the CPU cannot touch (a ``PROT_NONE`` mapping: any CPU access is SIGSEGV), so a test
that hands such addresses to ``mooncake.store`` / ``mooncake.engine`` proves that no path
dereferences a device pointer. ``device_read`` / ``device_write`` reach the bytes through the
double's second mapping, as ``torch.Tensor.cpu()`` / ``copy_`` would on a GPU.
"""

from mooncake._lunakv import (
    _device_alloc as device_alloc,
    _device_free as device_free,
    _device_layer as device_layer,
    _device_read as device_read,
    _device_stats as device_stats,
    _device_write as device_write,
    _host_only_read as host_only_read,
)

__all__ = [
    "device_alloc",
    "device_free",
    "device_layer",
    "device_read",
    "device_stats",
    "device_write",
    "host_only_read",
]
