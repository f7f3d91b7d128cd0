"""What a piece of code asks of the device, counted without one: :class:`DeviceWork` sees every torch operation
(on a GPU, each is a kernel launch) and every read of values back to the host (on a GPU, each waits for the
queue to drain). Used by ``scripts/gpu_op_count.py`` and the tests of the Triton kernels, which run them on
CPU tensors under Triton's interpreter.
"""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operations that launch nothing (views, allocations)
FREE = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "t",
        "permute", "detach", "alias", "empty", "empty_like", "empty_strided", "lift_fresh"}
# operations that wait for the device: a value read back, or an output sized by the values
READS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
         "is_nonzero", "equal"}


class DeviceWork(TorchDispatchMode):
    """Within ``with DeviceWork() as w:``: ``w.ops`` counts the operations that launch something, by the qwire
    function that made them (``file:function``), leaving out those made inside a Triton launch helper
    (``launch`` of ``kernels/gpu/_common.py``); ``w.reads`` lists the reads back to the host: the operations of
    :data:`READS`, boolean indexing, and ``Tensor.tolist`` (which dispatches no operation)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reads: list[str] = []

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(t, *a, **kw):
            self.reads.append("tolist")
            return self._tolist(t, *a, **kw)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS or (name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                     for i in (args[1] if len(args) > 1 else ()) if i is not None)):
            self.reads.append(name)
        if name not in FREE:
            stack = traceback.extract_stack()
            if not any(f.filename.endswith("_common.py") and f.name == "launch" for f in stack):
                where = [f for f in stack if f"{os.sep}qwire{os.sep}" in f.filename and f.filename != __file__]
                self.ops[f"{where[-1].filename.split(os.sep + 'qwire' + os.sep)[-1]}:{where[-1].name}" if where
                         else "?"] += 1
        return func(*args, **(kwargs or {}))
