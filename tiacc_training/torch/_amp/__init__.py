"""The adaptive mixed-precision policy (``MixedPrecision_TrainingPolicy``).

The decisions are made by a state machine in the Rust engine; this package
checks the arguments, reads the GradScaler, converts values and explains
each decision (``stats()`` and a log line per change, on the
``tiacc_training.torch._amp`` logger), reading the engine's state before
and after the call. It also keeps, when asked, the last finite copy of a
model's floating-point buffers and puts it back when an overflowed forward
pass has written NaN or inf into them (torch work, not a decision: the
engine only hears of it as a guard trip).

One job per module, each importing only those listed before it:

* ``_args``: the argument checks (the two spellings of a parameter,
  counters, numbers, the model, the engine's constructor arguments);
* ``_buffers``: the buffer protection (flat copies per device and dtype,
  the finiteness check, the restore);
* ``_explain``: the explanations (the rule behind each answer with its
  numbers, the buffer findings, ``stats()``'s settings and thresholds);
* ``_policy``: the class itself.
"""

from __future__ import annotations

from tiacc_training.torch._amp._policy import MixedPrecision_TrainingPolicy

__all__ = ["MixedPrecision_TrainingPolicy"]
