"""``python -m spel_mlx.notebank``: the notebank command (spel_mlx/cli/notebank.py)."""
import sys

from spel_mlx.cli.notebank import main

sys.exit(main())
