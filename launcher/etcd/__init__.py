"""etcd plumbing: the one client module, a private server, watched ranges and kept-alive leases.

gRPC's C core logs every failed TLS handshake and reconnect at INFO, lines that bury elastic-run's own one-line
error. Unless the user asked for gRPC's logs (GRPC_VERBOSITY or GRPC_TRACE), it logs errors only; this runs
before anything here imports grpc, which reads the variable once."""

import os

if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
