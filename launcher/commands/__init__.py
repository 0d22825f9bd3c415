"""The elastic-run command line: launching, the membership log, purge and the timeline."""
