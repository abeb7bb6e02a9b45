"""Training the target model and distilling the quantized draft (QAT against SPEC 3).

corpus    the training text (Debian-packaged prose) and its held-out split
config    TrainConfig, TrainError
data      token files, deterministic batches, held-out windows, on-policy mixing
schedule  the controller: LR schedule, plateau and spike handling, convergence
steps     the compiled AdamW train step and the held-out evaluation
runs      a run directory: checkpoint, lock, logs
loop      train(): start or resume, then the step loop
onpolicy  target-generated windows for on-policy distillation
export    a run -> SPELW001 file + safetensors model folder
pipeline  `train all`: corpus to exported model, resumable
cli       `python -m spel_mlx.train`
report    `python -m spel_mlx.train_report`: held-out loss, alpha, samples

Arrows: cli -> pipeline -> (loop, onpolicy, export) -> (runs, steps, data) -> config.
"""
