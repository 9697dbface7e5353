"""Process plumbing of the hps processes: usable CPUs, logging and the call context, heap trimming, background
threads, local processes, bound sockets and the serving gate."""
