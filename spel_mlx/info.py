"""``python -m spel_mlx.info``: the info command (spel_mlx/cli/info.py)."""
import sys

from spel_mlx.cli.info import main

if __name__ == "__main__":
    sys.exit(main())
