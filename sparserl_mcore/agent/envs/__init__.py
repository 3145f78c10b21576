"""Built-in environments (named in `sparserl_mcore.agent.env.ENVS`)."""
