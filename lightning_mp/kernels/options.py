"""The compiled kernels' options and optimizer kinds: one definition, read by the C source (its declarations are
generated from it), the ctypes mirror (:class:`lightning_mp.kernels.native.Options`), the Triton kernel
(:mod:`lightning_mp.kernels.cuda`) and the optimizers' table (:mod:`lightning_mp.master.lean.optimizers`, which
gives each group's options by these names)."""

from __future__ import annotations

import ctypes
from typing import Any

#: The optimizer kinds the kernels run: one definition (the C source's ``LEAN_ADAM``... are generated from it).
KINDS = {"ADAM": 0, "ADAMW": 1, "SGD": 2}
ADAM, ADAMW, SGD = KINDS["ADAM"], KINDS["ADAMW"], KINDS["SGD"]

#: The kernels' options, in order: ``(name, C type, ctypes type, what it is)``. The C source's ``lean_options``
#: struct is generated from it (:func:`c_declarations`), ``native.Options`` mirrors it, the Triton kernel reads its
#: floating options by these names in this order (:data:`FLOAT_OPTIONS`).
OPTION_FIELDS: tuple[tuple[str, str, Any, str], ...] = (
    ("kind", "int", ctypes.c_int, "KINDS: 0 Adam (L2 weight decay), 1 AdamW (decoupled), 2 SGD"),
    ("grad_fp32", "int", ctypes.c_int, "unused by the C kernel: each piece says its gradient's dtype"),
    ("amsgrad", "int", ctypes.c_int, "Adam: the max of the second moments"),
    ("maximize", "int", ctypes.c_int, "ascend the gradient"),
    ("nesterov", "int", ctypes.c_int, "SGD: Nesterov momentum"),
    ("first_step", "int", ctypes.c_int, "SGD: the momentum buffer takes the gradient"),
    ("lr", "double", ctypes.c_double, "learning rate"),
    ("beta1", "double", ctypes.c_double, "Adam"),
    ("beta2", "double", ctypes.c_double, "Adam"),
    ("weight_decay", "double", ctypes.c_double, "L2 (Adam, SGD) or decoupled (AdamW)"),
    ("eps", "double", ctypes.c_double, "Adam"),
    ("momentum", "double", ctypes.c_double, "SGD"),
    ("dampening", "double", ctypes.c_double, "SGD"),
    ("grad_mul", "const float *", ctypes.c_void_p, "clipping factor (clip by norm), NULL: none"),
    ("clamp", "double", ctypes.c_double, "clip by value to [-clamp, clamp]; negative: none"),
    ("clamped", "int", ctypes.c_int, "whether clamp applies"),
    ("vec_size", "int", ctypes.c_int, "torch's Vectorized<float>::size(): where each tensor's tail begins"),
)
#: The floating options, in order (what the Triton kernel's option vector holds).
FLOAT_OPTIONS = tuple(name for name, c_type, _, _ in OPTION_FIELDS if c_type == "double")


def c_declarations() -> str:
    """The C declarations generated from :data:`KINDS` and :data:`OPTION_FIELDS`, put where the source says
    ``LEAN_DECLARATIONS``."""
    lines = [f"#define LEAN_{name} {value}" for name, value in KINDS.items()]
    lines.append("typedef struct {")
    lines += [f"    {c_type} {name}; /* {what} */" for name, c_type, _, what in OPTION_FIELDS]
    lines.append("} lean_options;")
    return "\n".join(lines)
