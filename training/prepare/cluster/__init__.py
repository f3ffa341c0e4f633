"""Running prepare on many processes or machines: datatrove executors, the local pool, cluster plans, Slurm, merging."""
