"""``python -m spel_mlx.corpus``: the corpus command (spel_mlx/cli/corpus.py)."""
import sys

from spel_mlx.cli.corpus import main

if __name__ == "__main__":
    sys.exit(main())
