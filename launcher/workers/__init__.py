"""One node's workers: their environment, processes, output, warm interpreters and watchdog."""
