"""`sparserl slurm`: one sbatch script per run, rendered from the validated run config.

layout.py   the job's shape (learner nodes, rollout nodes, GPUs) and the checks against the config
render.py   the script text (header of values, fixed bash body)
servers.py  the command that starts one rollout server (SGLang or the embedded engine)
cli.py      the command: validate, write the script and a config snapshot, submit
"""
