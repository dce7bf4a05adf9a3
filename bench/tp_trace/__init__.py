"""Host timestamps of a served tensor-parallel step on every rank.

``bench.tensor_parallel`` reads each step's delivery and launch lag from the server's
histograms: how late the last rank launched, not where its time went. This traces the
path itself, in a real ``model-executor serve --tensor-parallel-size N`` and its spawned
ranks, without changing their code: run the server (or a bench that starts one) with

    MODEL_EXECUTOR_TP_TRACE=DIR PYTHONPATH=bench/tp_trace:.:$PYTHONPATH ...

and every process that imports the executor writes ``DIR/trace-PID.txt``: monotonic
nanoseconds (one clock for every process of a host) when rank 0 began and ended sending
each step, when another rank had received it, had unpacked it
(``ForwardBatch.from_packed``, its device copy included) and when each rank called and
left its forward (the replay's launch). ``python -m bench.tp_trace DIR`` pairs each rank
0 with its other ranks and prints, per phase and batch size, the medians of those moments
against rank 0's send, and the launch lag per step. The wrappers cost each call about a
microsecond; a thread appends the records to the trace file every half second (taking
the interpreter's lock for that moment) and at exit, so a rank killed loses at most its
last half second.
"""
