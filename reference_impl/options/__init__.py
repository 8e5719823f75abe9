"""The training config's components, each a frozen dataclass that validates its own fields.

`reference_impl.config.TrainConfig` inherits them all. None of these modules imports torch:
the CLI's `--help` and its one-line errors must not pay for it.

- `base`: `ConfigError`, the shared checks, and the reader of each field's docstring.
- `parallel`: `ParallelOptions`, the wrapper and the degree of every mesh axis.
- `capabilities`: what each model can run with, next to the names `--model` accepts.
- `model`: `ModelOptions`, `ExpertOptions`.
- `training`: `RunOptions`, `PrecisionOptions`, `OptimizerOptions`.
- `operations`: `RuntimeOptions`, `CheckpointOptions`, `FaultOptions`.
"""
