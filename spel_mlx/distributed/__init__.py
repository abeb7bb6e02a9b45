"""The target split across processes (a pipeline over ``mx.distributed``), for a
model larger than one machine's memory; see docs/distributed.md.

    split.py     which layers each rank holds (balanced by parameter bytes)
    stage.py     StageModel: one rank's layers, read alone from the checkpoint
    link.py      the messages between ranks, the watchdog, PipelineError
    pipeline.py  open_pipeline (collective loading and agreement), Pipeline (rank 0's handle)
    runner.py    PipelineTarget: TargetRunner's interface on rank 0
    worker.py    serve: the loop of every rank after the first
    batch.py     python -m spel_mlx.distributed: a batch of requests, JSON lines (tests, bench)
    launch.py    local pipelines: mlx.launch on 127.0.0.1, or ranks as plain processes
"""
from .link import PipelineError
from .pipeline import Pipeline, open_pipeline, serve
from .split import Stage, split_layers

__all__ = ["Pipeline", "PipelineError", "Stage", "open_pipeline", "serve", "split_layers"]
