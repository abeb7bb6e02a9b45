"""Adaptations to the machine under MLX, each switchable by a SPEL_* setting:

    blas.py          load an optimized BLAS before mlx.core (Linux; the LP64 shim _blasshim.c)
    heap.py          glibc's malloc thresholds: MLX's freed buffers stay mapped
    huge_pages.py    2 MB pages under the weights and the KV caches (Linux)
    cpu_features.py  the SIMD cap and the CPU switches of the C and C++ kernels

Nothing here is imported eagerly: spel_mlx/__init__.py runs blas and heap first, before
anything imports mlx.core (huge_pages imports it).
"""
