"""The Python side of the C code in neon/: ``clib`` loads the cffi library once,
``cdraft`` wraps the quantized draft engine, its kernels and its worker pool."""
