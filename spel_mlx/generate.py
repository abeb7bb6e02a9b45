"""``python -m spel_mlx.generate``: the generate command (spel_mlx/cli/generate.py).

Only for running: ``spel_mlx.generate`` is the API function, which importing this
module would replace, so an import is refused.
"""
if __name__ != "__main__":
    raise ImportError("spel_mlx.generate is the API function (spel_mlx.api.generate); "
                      "the command is spel_mlx.cli.generate")

import sys

from spel_mlx.cli.generate import main

sys.exit(main())
