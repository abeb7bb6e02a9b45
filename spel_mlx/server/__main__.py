"""``python -m spel_mlx.server``: the server command (spel_mlx/cli/server.py)."""
import sys

from spel_mlx.cli.server import main

sys.exit(main())
