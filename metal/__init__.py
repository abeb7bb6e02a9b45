"""The Metal kernels (``*.metal`` bodies for ``mx.fast.metal_kernel``), their launch
plans and executors, installed with the package as ``spel_mlx.metal``.  The
model's ops built on them are ``spel_mlx.model.metal_ops``."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER_FILE = "spel_common.h"


def source(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def kernel_body(name: str) -> str:
    return source(name + ".metal")


def kernel_header() -> str:
    return source(HEADER_FILE)
