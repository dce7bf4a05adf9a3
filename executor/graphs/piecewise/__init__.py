"""``tc_piecewise``: torch.compile split at attention, one CUDA graph per piece per shape.

``custom_op`` (attention as an opaque op), ``split`` (FX split at it), ``compile``
(eager/inductor per piece), ``pieces`` (capture/replay per piece), ``cache`` (disk cache),
``backend`` (the ``CaptureBackend``).
"""

from executor.graphs.piecewise.backend import PiecewiseCompileBackend
from executor.graphs.piecewise.compile import CompileStats

__all__ = ["CompileStats", "PiecewiseCompileBackend"]
