"""Run a torch.distributed script on HOSTS emulated hosts whose links run at RATE (network namespaces
on one shaped bridge, as `sparcoll bench` builds them; needs root), one process a host, with the
environment torchrun would give it; print rank 0's output.

    sudo python on_network.py HOSTS RATE SCRIPT [ARGS ...]      e.g. 4 1gbit order.py 10 8 1024 512
"""
import os
import subprocess
import sys

from sparcoll.bench.netem import EmulatedNetwork

hosts, rate, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
with EmulatedNetwork(hosts, rate) as net:
    procs = [net.popen(i, [sys.executable, script, *args], text=True,
                       stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                       env={**os.environ, "RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(hosts),
                            "MASTER_ADDR": net.addresses[0], "MASTER_PORT": "29500",
                            "GLOO_SOCKET_IFNAME": net.interface, "OMP_NUM_THREADS": "1"})
             for i in range(hosts)]
    out, _ = procs[0].communicate(timeout=900)     # the network's teardown stops the rest
    codes = [p.wait(timeout=60) for p in procs]
print(out, end="")
sys.exit(max(codes))
