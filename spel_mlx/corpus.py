"""``python -m spel_mlx.corpus``: build the training corpus (spel_mlx/training/corpus.py)."""
import sys

from .training.corpus import main

if __name__ == "__main__":
    sys.exit(main())
