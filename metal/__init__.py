"""Metal kernel sources, installed with the package as ``spel_mlx.metal``."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def source(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()
