"""Device functions per role: what a thread block does when it is a compute, intra-node,
send, receive or controller block. Kernels in ``mknumba.kernels`` are assembled from these."""
