"""SPELW001 <-> safetensors converters, installed as ``spel_mlx.converters``.

CLI: ``python -m spel_mlx.convert SRC DST`` (see spel_mlx/convert.py).
"""
from .safetensors_io import SafetensorsFile, write_safetensors
from .spelw_safetensors import (CONFIG_FILE, MODEL_FILE, SafetensorsModel, safetensors_to_spelw,
                                spelw_to_safetensors)

__all__ = ["spelw_to_safetensors", "safetensors_to_spelw", "SafetensorsModel", "SafetensorsFile",
           "write_safetensors", "MODEL_FILE", "CONFIG_FILE"]
