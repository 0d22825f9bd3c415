"""The job's state in etcd: its keys and records, the controller's rules, and the controller that applies them."""
