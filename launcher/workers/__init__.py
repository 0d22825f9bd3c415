"""One node's workers: their environment, processes, output, warm workers (forked from a zygote) and watchdog."""
