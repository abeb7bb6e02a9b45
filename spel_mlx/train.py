"""``python -m spel_mlx.train``: the train command (spel_mlx/cli/train.py)."""
import sys

from spel_mlx.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
