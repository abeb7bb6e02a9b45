"""``python -m spel_mlx.distributed``: a batch of requests on a pipeline (see batch.py)."""
import sys

from .batch import main

sys.exit(main())
