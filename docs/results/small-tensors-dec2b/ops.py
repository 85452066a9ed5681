import os, sys, collections, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
t = torch.ones(int(os.environ.get("NUMEL", "1")))
for _ in range(50): comm.allreduce(t)
N = 200
ops = collections.Counter(); ccalls = collections.Counter()
me = sys._getframe()
def tracer(frame, event, arg):
    if event == "call":
        frame.f_trace_opcodes = True
    if event == "opcode":
        ops[frame.f_code.co_filename.rsplit("/", 1)[-1] + ":" + frame.f_code.co_name] += 1
    return tracer
def prof(frame, event, arg):
    if event == "c_call":
        ccalls[getattr(arg, "__qualname__", str(arg))] += 1
import threading
if rank in (0, 1):
    sys.settrace(tracer); sys.setprofile(prof)
for _ in range(N): comm.allreduce(t)
sys.settrace(None); sys.setprofile(None)
if rank in (0, 1):
    tot_o = sum(ops.values()) / N; tot_c = sum(ccalls.values()) / N
    lines = [f"rank {rank}: opcodes/call {tot_o:.0f}, C calls/call {tot_c:.1f}"]
    if os.environ.get("DETAIL"):
        lines += ["  %6.1f %s" % (v / N, k) for k, v in ops.most_common(40)]
        lines += ["  C %5.1f %s" % (v / N, k) for k, v in ccalls.most_common(40)]
    print("\n".join(lines), flush=True)
comm.close(); dist.destroy_process_group()
