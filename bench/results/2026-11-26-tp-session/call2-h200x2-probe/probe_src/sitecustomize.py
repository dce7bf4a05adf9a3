# Probe (not part of the repo's code): host stamps of a served TP step on every rank.
import os
if os.environ.get("PROBE_DIR"):
    import atexit, threading, time
    _ev = []
    _path = os.path.join(os.environ["PROBE_DIR"], f"p{os.getpid()}.txt")
    _now = time.monotonic_ns

    def _flush():
        global _ev
        if _ev:
            with open(_path, "a") as f:
                f.write("".join(f"{n} {t}\n" for n, t in _ev))
            _ev = []

    atexit.register(_flush)

    def _wrap(cls, name, tag):
        fn = getattr(cls, name)

        def w(*a, **k):
            _ev.append((tag + "0", _now()))
            try:
                return fn(*a, **k)
            finally:
                _ev.append((tag + "1", _now()))
                if len(_ev) > int(os.environ.get("PROBE_FLUSH", "400")):
                    _flush()
        setattr(cls, name, w)

    def _install():
        from executor.distributed import channel as ch
        from executor import executor as ex
        from executor import forward_batch as fb
        _wrap(ch.StepChannel, "send", "S")
        _wrap(ch.StepChannel, "confirm", "C")
        _wrap(ch.StepChannel, "_receive_local", "R")
        _wrap(ch.StepChannel, "launched", "L")
        _wrap(ch.StepChannel, "receive_sampled", "Q")
        _wrap(ch.StepChannel, "send_sampled", "Z")
        _wrap(ex.Executor, "_forward", "F")
        _wrap(ex.Executor, "follow", "W")
        _wrap(fb.PinnedStaging, "to_device", "T")
        orig = fb.ForwardBatch.from_packed
        def fp(*a, **k):
            _ev.append(("P0", _now()))
            r = orig(*a, **k)
            _ev.append(("P1", _now()))
            return r
        fb.ForwardBatch.from_packed = staticmethod(fp)
        def threads():
            time.sleep(float(os.environ.get("PROBE_THREADS_S", "60")))
            with open(_path + ".threads", "w") as f:
                f.write("\n".join(f"{t.name} daemon={t.daemon}" for t in threading.enumerate()))
                f.write(f"\ntasks={len(os.listdir('/proc/self/task'))}\n")
        threading.Thread(target=threads, daemon=True).start()

    import importlib.abc, sys
    class _Hook(importlib.abc.MetaPathFinder):
        done = False
        def find_spec(self, name, path, target=None):
            if name == "executor.executor" and not _Hook.done:
                _Hook.done = True
                def later():
                    # install once executor.executor has finished importing
                    for _ in range(6000):
                        if "executor.executor" in sys.modules and hasattr(sys.modules["executor.executor"], "Executor"):
                            _install(); return
                        time.sleep(0.005)
                threading.Thread(target=later, daemon=True).start()
            return None
    sys.meta_path.insert(0, _Hook())
