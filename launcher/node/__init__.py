"""The per-node agent: joins the job, follows its rounds, runs this node's workers."""
