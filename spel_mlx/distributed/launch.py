"""Starting local pipelines (tests, bench): ``mlx.launch`` on 127.0.0.1, or the ranks
as plain processes with the ring's hostfile (MLX's "distributed without mlx.launch"),
which lets a caller signal one rank and watch the others."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from importlib.metadata import entry_points


def launcher() -> list:
    """The command of ``mlx.launch`` for this interpreter (its console-script entry point,
    so a virtual environment without the script still finds it)."""
    ep = next(iter(entry_points(group="console_scripts", name="mlx.launch")), None)
    if ep is None:
        raise RuntimeError("mlx.launch is not installed with this MLX")
    return [sys.executable, "-c", f"import sys; from {ep.module} import {ep.attr}; sys.exit({ep.attr}())"]


def free_ports(n: int, tries: int = 50) -> int:
    """A base port p with p..p+n-1 free on 127.0.0.1 now (other jobs may share the machine)."""
    for _ in range(tries):
        base = random.randrange(20000, 60000 - n)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports found")


def launch_command(n: int, args: list) -> list:
    """``mlx.launch`` of `args` (arguments to python) on n local ranks, ring backend."""
    return launcher() + ["--backend", "ring", "--hosts", "127.0.0.1", "-n", str(n), "--starting-port",
                         str(free_ports(n)), "--python", sys.executable, "--"] + list(args)


def start_ranks(n: int, args_of_rank, hostfile: str, env=None, **popen) -> list:
    """n ranks as processes of this interpreter: rank r runs `args_of_rank(r)`
    with MLX_RANK and MLX_HOSTFILE set (written to `hostfile`)."""
    base = free_ports(n)
    with open(hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{base + r}"] for r in range(n)], f)
    procs = []
    for r in range(n):
        e = dict(os.environ if env is None else env, MLX_RANK=str(r), MLX_HOSTFILE=hostfile)
        procs.append(subprocess.Popen([sys.executable] + list(args_of_rank(r)), env=e, **popen))
    return procs
