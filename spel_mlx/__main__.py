"""``python -m spel_mlx <command>``: see spel_mlx/cli/."""
import sys

from spel_mlx.cli import main

sys.exit(main())
