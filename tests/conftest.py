import os

# Spawned test processes each get one intra-op thread: 2 cores, several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
