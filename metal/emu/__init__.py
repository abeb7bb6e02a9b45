"""The Metal kernels' Linux twin: their unchanged bodies compiled as C++ against
``metal_emu.h`` (the Metal built-ins on the CPU) by ``build.py``."""
