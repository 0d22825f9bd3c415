"""etcd plumbing: the one client module, a private server, watched ranges and kept-alive leases."""
