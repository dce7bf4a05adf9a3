"""Where a step's time goes: host stages, kernel classes, every rank of a tensor-parallel
step, py-spy samples."""
