"""spel-mlx benchmarks: ``python -m bench [--quick]`` (see bench/run.py).

run.py (command line, worker processes, results files) -> protocol.py (levels, jobs),
worker.py (one job's sections in one process) -> regimes.py (configs, weights, prompts);
the sections: B1 kernels (kernels.py), B2 verification cost (b2_verify.py), B3 decode
(b3_decode.py), peers (peers.py), the placement calibration (worker.py); the report
(report.py) of tables (tables.py) and plots (plots.py); common.py under all of them.
"""
