"""One-off: `sparcoll train --workload ncf --workers 2 --network none --batch-size 8 --workload-option tiny=true
--workload-option sparse_embeddings=true --comm ddp --steps STEPS` again and again in one launcher (its fork
server reused: about a second a run), until SECONDS or COUNT runs; prints each run's exit status and writes
each failed run's output to /tmp/stress/fail-MODE-TAG-RUN.txt.
    python stress.py MODE SECONDS COUNT STEPS
MODE fork: the job's workers forked from the fork server, as sparcoll does; popen: new interpreters.
With PYTHONPATH at a worktree carrying stress-knobs.diff, STRESS_THREADS=N gives gloo N worker threads,
STRESS_NOPROBE=1 drops the gradient probe's hooks and STRESS_NOVIEW=1 gradient_as_bucket_view."""
import io, os, subprocess, sys, time, contextlib
import sparcoll.bench.launch as launch
launch.LOG_TAIL = 400
from sparcoll import cli

class PopenChild(subprocess.Popen):
    def __init__(self, module, args, env, log, pipe_stdout, netns=None):
        f = open(log, "ab")
        super().__init__([sys.executable, "-X", "faulthandler", "-m", module, *args], env=env,
                         stdout=subprocess.PIPE if pipe_stdout else f, stderr=f, stdin=subprocess.DEVNULL)
        f.close()
    def reap(self, timeout):
        try:
            self.wait(timeout); return True
        except subprocess.TimeoutExpired:
            return False

if __name__ == "__main__":
    mode, seconds, count, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if mode == "popen":
        launch.ForkedChild = PopenChild
    argv = ["train", "--workload", "ncf", "--workers", "2", "--network", "none", "--batch-size", "8",
            "--workload-option", "tiny=true", "--workload-option", "sparse_embeddings=true", "--comm", "ddp",
            "--steps", steps]
    end, runs, failures = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end and runs < count:
        out = io.StringIO()
        t = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
        runs += 1
        if rc != 0:
            failures += 1
            with open(f"/tmp/stress/fail-{mode}-{os.environ.get('TAG','x')}-{runs}.txt", "w") as f:
                f.write(out.getvalue())
        print(f"{mode} run {runs} rc {rc} {time.monotonic()-t:.1f}s failures {failures}", flush=True)
    print(f"DONE {mode} runs {runs} failures {failures}")
