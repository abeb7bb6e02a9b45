"""SPELW001 <-> safetensors converters, installed as ``spel_mlx.converters``."""
