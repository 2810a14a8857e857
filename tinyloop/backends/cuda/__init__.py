"""The CUDA backend: the op set of ``backends.base`` as NVRTC-compiled kernels.

Modules: ``compile`` (kernel sources in ``kernels/``, the one GEOMETRY table, NVRTC),
``launch`` (the kernel wrapper and programmatic dependent launch), ``checks`` (argument
checks), ``choice`` (KernelChoice: the kernel variants as an argument), one module per kernel
family (``norms``, ``gemv``, ``gemm``, ``kv``, ``attention``, ``sampling``, ``step``: the
captured decode step) and ``ops`` (CudaOps, composing them). Everything imports without CuPy
(for class facts and source checks); CudaOps itself needs it.
"""

from .choice import KernelChoice
from .ops import CudaOps

__all__ = ["CudaOps", "KernelChoice"]
