"""`sparcoll simulate`: predicted time per allreduce for sparcoll, gloo's ring, gloo's sparse AllGather
and a parameter server, at worker counts and link rates this machine cannot host.

- `costs`: what one allreduce costs on this machine, measured (per-byte CPU of each operation, per
  message CPU, latency, the link's goodput), as `Costs`, stored in calibration.json;
- `calibrate`: the measurements that produce them (`sparcoll simulate --calibrate`);
- `model`: a discrete-event model (simpy) of each algorithm's messages on hosts with full-duplex links
  and CPUs, `predict(point, costs)`;
- `command`: the command line, its table, JSON and plot.
"""
