"""``python -m spel_mlx.train``: the trainer's command (spel_mlx/training/cli.py)."""
import sys

from .training.cli import main

if __name__ == "__main__":
    sys.exit(main())
