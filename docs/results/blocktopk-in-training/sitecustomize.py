"""One-off probe: every Reducer.compress call's wall and thread CPU time, per process (not part of sparcoll)."""
import atexit, os, threading, time
if os.environ.get("SPARCOLL_PROBE"):
    try:
        from sparcoll.compress import reducer as _r
        _orig = _r.Reducer.compress
        _rows = []
        def _dump():
            if _rows:
                with open(f"/tmp/probe/out/{os.getpid()}.tsv", "a") as f:
                    f.writelines(_rows)
                _rows.clear()
        def compress(self, tensor, key=None):
            c0, t0 = time.thread_time(), time.perf_counter()
            out = _orig(self, tensor, key)
            _rows.append(f"{threading.current_thread().name}\t{self.spec}\t{tensor.numel()}\t"
                         f"{time.perf_counter()-t0:.6f}\t{time.thread_time()-c0:.6f}\t{time.monotonic():.3f}\n")
            if len(_rows) > 300:
                _dump()
            return out
        _r.Reducer.compress = compress
        atexit.register(_dump)
    except Exception as e:
        print("probe failed", e)
