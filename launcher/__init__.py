"""launcher: the elastic-run agent, its etcd rendezvous controller and the CLI."""
