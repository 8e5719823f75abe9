"""Back-of-the-envelope calculators for the interview, each the twin of a browser calculator.

Every calculator here has a JavaScript twin in `docs/javascripts/calculators.js`:
`reference_impl.calc.<name>(**inputs)` and `window.handbookCalc.<name>(inputs)` take the
same inputs, apply the same defaults, and return dicts with the same keys and (to 1e-9)
the same numbers; the browser tests compare them on hundreds of random inputs. Both
reject a bad input the same way: Python raises `ValueError`, JavaScript throws an `Error`
with the same message, which the page shows in place of the result. `memory` is composed of
named parts (`memory_model_state`, `memory_attention_activations`, ... `memory_peak`), each a
function of the checked inputs with a twin of the same name in
`window.handbookCalcMemoryParts`; the browser tests compare them part by part.

Units are SI throughout: bytes (not GiB), seconds, bytes per second, FLOPs and FLOP/s.
The functions use only the standard library, so they run anywhere the handbook does.

The calculators live in one module per topic (`memory_model`, `communication`, `schedules`,
`failures`, `throughput`, sharing `checks`) and are imported here, so that a caller (and the
handbook) names them `calc.<name>`. The planner, the model shapes, the memory grid and the
traces beside them (`plan`, `shapes`, `memory_grid`, `traces`) use these calculators or check
them against what PyTorch does at scale.
"""

from reference_impl.calc.communication import fsdp_comm, moe_all_to_all, pp_comm, ring_allreduce, tp_comm
from reference_impl.calc.failures import checkpoint_interval, goodput
from reference_impl.calc.memory_model import (
    GRAD_SYNCS,
    MODEL_STATES,
    STRATEGIES,
    MemoryInputs,
    memory,
    memory_attention_activations,
    memory_block_moments,
    memory_held_gradients,
    memory_inputs,
    memory_layer_activations,
    memory_loss_activations,
    memory_loss_moments,
    memory_mlp_activations,
    memory_model_state,
    memory_norm_activations,
    memory_parameter_counts,
    memory_peak,
    memory_sharded_states,
    memory_stored_activations,
)
from reference_impl.calc.schedules import PIPELINE_SCHEDULES, pipeline_bubble
from reference_impl.calc.throughput import mfu, step_time

__all__ = [
    "GRAD_SYNCS",
    "MODEL_STATES",
    "MemoryInputs",
    "PIPELINE_SCHEDULES",
    "STRATEGIES",
    "checkpoint_interval",
    "fsdp_comm",
    "goodput",
    "memory",
    "memory_attention_activations",
    "memory_block_moments",
    "memory_held_gradients",
    "memory_inputs",
    "memory_layer_activations",
    "memory_loss_activations",
    "memory_loss_moments",
    "memory_mlp_activations",
    "memory_model_state",
    "memory_norm_activations",
    "memory_parameter_counts",
    "memory_peak",
    "memory_sharded_states",
    "memory_stored_activations",
    "mfu",
    "moe_all_to_all",
    "pipeline_bubble",
    "pp_comm",
    "ring_allreduce",
    "step_time",
    "tp_comm",
]
