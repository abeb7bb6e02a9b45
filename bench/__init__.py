"""spel-mlx benchmarks: ``python -m bench [--quick]`` (see bench/run.py).

B1 kernels (bench/kernels.py), B2 verification cost (b2_verify.py), B3 decode
(b3_decode.py), peers (peers.py), report and plots (report.py).
"""
