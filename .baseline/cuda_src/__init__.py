"""CUDA C++ kernel sources (one .cu per kernel family), shipped as package data.

Installed as ``tinyloop.cuda_src``; ``tinyloop.backends.cuda_ops`` compiles them with NVRTC
through ``cupy.RawModule``.
"""
