"""``python -m spel_mlx.train_report``: quality report of an exported model
(spel_mlx/training/report.py)."""
import sys

from .training.report import main

if __name__ == "__main__":
    sys.exit(main())
