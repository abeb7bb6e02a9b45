"""``python -m spel_mlx.distributed``: the distributed command (spel_mlx/cli/distributed.py)."""
import sys

from spel_mlx.cli.distributed import main

sys.exit(main())
