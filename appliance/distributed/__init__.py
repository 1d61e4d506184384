"""One model served by several machines (issue 35, docs/distributed.md).

Rank 0 (``appliance serve --distributed HOSTFILE``) keeps everything a single machine has:
the HTTP server, the scheduler, sampling, the database. Its model holds the first layers;
each other machine (``appliance join HOSTFILE --rank N``) holds a later slice and keeps a
copy of the decode batch and of the sequences' caches for its layers. Before each forward
rank 0 sends every other machine a plan on the control channel (plan.py, control.py); the
hidden states go from stage to stage over MLX's ring (stage.py), and the last stage's come
back to rank 0 for the head. group.py forms the group and watches it; link.py is rank 0's
end in the engine; follower.py the other machines' loop; split.py splits the layers by
memory.
"""
