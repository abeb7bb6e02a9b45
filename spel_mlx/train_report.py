"""``python -m spel_mlx.train_report``: the train-report command (spel_mlx/cli/train_report.py)."""
import sys

from spel_mlx.cli.train_report import main

if __name__ == "__main__":
    sys.exit(main())
