"""Host timestamps of a served tensor-parallel step on every rank.

``bench.e2e.tensor_parallel`` reads each step's delivery and launch lag from the server's
histograms: how late the last rank launched, not where its time went. This traces the
path itself, in a real ``model-executor serve --tensor-parallel-size N`` and its ranks,
without changing their code: run the server (or a bench that starts one) with

    MODEL_EXECUTOR_TP_TRACE=DIR PYTHONPATH=bench/profile/tp_trace:.:$PYTHONPATH ...

and every process that imports the executor writes ``DIR/trace-PID.txt``: monotonic
nanoseconds when rank 0 began and ended sending each step, when another rank received and
unpacked it, and when each rank called and left its forward. ``python -m
bench.profile.tp_trace DIR`` prints, per phase and batch size, the medians of those moments
against rank 0's send. A thread appends the records every ``hook.FLUSH_S`` seconds and at
exit, so a rank killed loses at most that much.
"""
